"""The Flink and Spark job servers a build starts, and their end with it.

A build on ``--runner=flink`` or ``spark`` starts Beam's job server jar
itself (``runner.job_server_for``: none when ``--job_endpoint`` names one, or
a Flink or Spark uber jar is submitted), then runs the pipeline on Beam's
public FlinkRunner or SparkRunner with ``--job_endpoint`` set to it, so that
Beam starts none (``runner.run``). Beam's own launcher (its job-server
classes, not public API, which a Beam release may change without notice)
stopped the JVM only when Python exits normally: a build killed with SIGKILL
left it running under init (370-520 MB), and each Flink build of a process (a
mixture's tasks) started one more. A ``JobServer`` here is:

- **Started** with the command line Beam documents for its job server jars
  (``command``): ``java`` (``--job_server_java_launcher``), the
  ``--job_server_jvm_properties``, Spark's ``--add-opens`` flags, ``-jar`` the
  jar, the master (``--flink-master``, with ``http://`` added to an address
  without a scheme; ``--spark-master-url``) and ``--artifacts-dir``,
  ``--job-port``, ``--artifact-port``, ``--expansion-port`` (``--job_port``
  and the others when given, else a free port, 0 and 0). It runs behind a
  wrapper, ``python -I -S -c DIES_WITH_PARENT PID java ...``, that asks Linux
  to SIGKILL it when the build's process dies (``prctl(PR_SET_PDEATHSIG)``,
  which ``exec`` keeps; strictly, when the thread that started it ends, which
  is the thread that runs the pipeline and stops the server after it) and
  then ``exec``s ``java``: the JVM is the build's child, in its process group
  (Ctrl-C reaches it). Its output is logged (``-v``), its last lines kept for
  an error message.
- **Waited for** until its job port answers, at most ``START_TIMEOUT_S``
  seconds; one that exits first or never answers fails the build in one
  line (``runner.run``: "could not start"). Then the options' ``job_endpoint``
  is ``localhost:PORT``.
- **Stopped** when the pipeline ends, whatever the end (``runner.run``):
  SIGTERM, SIGKILL after ``STOP_WAIT_S`` seconds; its artifacts folder removed
  (unless ``--artifacts_dir`` named one) and ``job_endpoint`` unset again, as
  a mixture's tasks share one options object.

The jar is the one ``runner.job_server`` names (``--flink_job_server_jar``,
``--spark_job_server_jar``, else the one ``make jars`` builds): seqcache
downloads no job server, so Beam's default download of the jar (a private
helper of its job-server classes) is not used. Of Beam, this module uses only
its public options classes. On a system other than Linux there is no
parent-death signal: the job server still stops with the pipeline, but
outlives a build killed with SIGKILL.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from seqcache import process

process.import_beam()  # before Beam's modules below: quietly, without pandas
from apache_beam.options import pipeline_options as po  # noqa: E402

log = logging.getLogger(__name__)

# Seconds a job server gets to answer on its port after it is started.
START_TIMEOUT_S = 300.0
# Seconds a job server gets to exit after SIGTERM before it is killed.
STOP_WAIT_S = 20.0
# Lines of a job server's output kept for the message when it fails to start.
_KEPT_LINES = 20
# Flink masters that name no address: Flink embedded in the job server, or chosen by it.
FLINK_LOCAL_MASTERS = ("[local]", "[auto]")
# The JVM flags Beam's SparkRunner gives its job server (Spark reads these packages of Java 17).
SPARK_JVM_FLAGS = ("--add-opens=java.base/sun.nio.ch=ALL-UNNAMED", "--add-opens=java.base/java.nio=ALL-UNNAMED",
                   "--add-opens=java.base/java.util=ALL-UNNAMED",
                   "--add-opens=java.base/java.lang.invoke=ALL-UNNAMED")

# The wrapper a job server is started through (``python -I -S -c DIES_WITH_PARENT
# PID COMMAND...``): on Linux, SIGKILL when the parent dies (prctl option 1,
# PR_SET_PDEATHSIG), and an exit at once when the parent ``PID`` died before
# that was set; then ``exec`` of the command, which keeps the setting.
DIES_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    "if sys.platform.startswith('linux'):\n"
    "    if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:\n"
    "        sys.exit('cannot set the parent-death signal: errno %d' % ctypes.get_errno())\n"
    "    if os.getppid() != int(sys.argv[1]):\n"
    "        sys.exit('the build that started this job server has ended')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def dies_with_parent(command: list[str], parent_pid: int | None = None) -> list[str]:
    """``command`` behind the ``DIES_WITH_PARENT`` wrapper, to be started by
    the process ``parent_pid`` (default: this one)."""
    pid = os.getpid() if parent_pid is None else int(parent_pid)
    return [sys.executable, "-I", "-S", "-c", DIES_WITH_PARENT, str(pid), *command]


def starts_one(kind: str, options) -> bool:
    """Whether a build on ``kind`` (``"flink"``, ``"spark"``) with ``options``
    starts a job server: not when ``--job_endpoint`` names one, nor when Beam
    submits an uber jar (``--flink_submit_uber_jar`` to a Flink master at an
    address, ``--spark_submit_uber_jar``), which needs none."""
    if options.view_as(po.PortableOptions).job_endpoint:
        return False
    if kind == "flink":
        flink = options.view_as(po.FlinkRunnerOptions)
        return not (flink.flink_submit_uber_jar and flink.flink_master.strip() not in FLINK_LOCAL_MASTERS)
    return not options.view_as(po.SparkRunnerOptions).spark_submit_uber_jar


def command(kind: str, options, jar: str, *, job_port: int, artifacts_dir: str) -> list[str]:
    """The command line of Beam's ``kind`` (``"flink"``, ``"spark"``) job
    server jar ``jar`` for ``options``, serving on ``job_port`` (see the
    module docstring)."""
    server = options.view_as(po.JobServerOptions)
    jvm = list(server.job_server_jvm_properties or [])
    if kind == "flink":
        master = options.view_as(po.FlinkRunnerOptions).flink_master.strip()
        master = master if master in FLINK_LOCAL_MASTERS or "://" in master else "http://" + master
        args = ["--flink-master", master]
    else:
        jvm += [flag for flag in SPARK_JVM_FLAGS if flag not in jvm]
        args = ["--spark-master-url", options.view_as(po.SparkRunnerOptions).spark_master_url]
    return [server.job_server_java_launcher, *jvm, "-jar", jar, *args, "--artifacts-dir", artifacts_dir,
            "--job-port", str(job_port), "--artifact-port", str(server.artifact_port or 0),
            "--expansion-port", str(server.expansion_port or 0)]


def free_port() -> int:
    """A TCP port of localhost that nothing listens on now (as Beam picks its job server's)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class JobServer:
    """A Flink or Spark job server jar, run as the build's child that dies
    with it (see the module docstring). ``start()`` returns its endpoint;
    ``stop()`` ends it and may be called any number of times. ``options``:
    the build's ``PipelineOptions``, whose ``job_endpoint`` names the server
    while it runs (None: set nothing)."""

    def __init__(self, kind: str, options, jar: str):
        self.kind, self.options, self.jar = kind, options, jar
        self.process: subprocess.Popen | None = None
        self.endpoint: str | None = None
        self._temp_root: str | None = None
        self._reader: threading.Thread | None = None
        self._output = collections.deque(maxlen=_KEPT_LINES)

    def command(self, port: int, artifacts_dir: str) -> list[str]:
        """The job server's command line (``command``)."""
        return command(self.kind, self.options, self.jar, job_port=port, artifacts_dir=artifacts_dir)

    def start(self) -> str:
        """Starts the job server, waits for its port and sets the options'
        ``job_endpoint`` to it; returns the endpoint (``localhost:PORT``).

        Raises:
          RuntimeError: it exited first, or did not answer within
            ``START_TIMEOUT_S`` seconds (it is stopped); the message is one
            line with its last output.
        """
        if self.process is not None:
            return self.endpoint
        server = self.options.view_as(po.JobServerOptions) if self.options is not None else None
        port = (server and server.job_port) or free_port()
        artifacts = server and server.artifacts_dir
        if not artifacts:
            artifacts = self._temp_root = tempfile.mkdtemp(prefix="seqcache-job-server-")
        command = [str(arg) for arg in self.command(port, artifacts)]
        self.endpoint = endpoint = f"localhost:{port}"
        log.info("starting the job server at %s: %s", endpoint, " ".join(command))
        self.process = subprocess.Popen(dies_with_parent(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        self._reader = threading.Thread(target=self._log_output, args=(self.process.stdout,),
                                        name="seqcache-job-server-output", daemon=True)
        self._reader.start()
        with grpc.insecure_channel(endpoint) as channel:
            ready, deadline = grpc.channel_ready_future(channel), time.monotonic() + START_TIMEOUT_S
            while True:  # bounded: the deadline, or the server's exit
                try:
                    ready.result(timeout=1.0)
                    break
                except grpc.FutureTimeoutError:
                    pass
                code = self.process.poll()
                if code is not None or time.monotonic() > deadline:
                    self.stop()
                    why = (f"exited with status {code}" if code is not None else
                           f"did not answer at {endpoint} within {START_TIMEOUT_S:g} s")
                    raise RuntimeError(f"the job server {why}: {self.last_output() or 'no output'}")
        if self.options is not None:
            self.options.view_as(po.PortableOptions).job_endpoint = endpoint  # Beam's runner then starts none
        return endpoint

    def _log_output(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="backslashreplace").rstrip()
            self._output.append(line)
            log.info("job server: %s", line)
        stream.close()

    def last_output(self) -> str:
        """The job server's last line of output that says something (an
        error's, when it has one), at most 300 characters."""
        lines = [line.strip() for line in self._output if line.strip()]
        errors = [line for line in lines if "Exception" in line or "Error" in line]
        return (errors or lines or [""])[-1][:300]

    def stop(self) -> None:
        """Stops the job server (SIGTERM, then SIGKILL after ``STOP_WAIT_S``
        seconds), removes its artifacts folder and unsets the options'
        ``job_endpoint``; nothing when stopped."""
        proc, self.process = self.process, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()
            if self.options is not None:
                self.options.view_as(po.PortableOptions).job_endpoint = None
        if self._reader is not None:
            self._reader.join(timeout=STOP_WAIT_S)
            self._reader = None
        root, self._temp_root = self._temp_root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
