"""The Flink and Spark job servers a build starts, and their end with it.

Beam's FlinkRunner and SparkRunner start their Java job server (``java
-jar``, Beam's ``JavaJarJobServer``) through Beam's ``SubprocessServer``,
which stops it only when Python exits normally (``atexit``): a build killed
with SIGKILL left it running, re-parented to init (370-520 MB), and each
Flink build of a process (a mixture's tasks) started one more. A build on
``--runner=flink`` or ``spark`` therefore runs on this module's
``FlinkRunner`` or ``SparkRunner`` (``runner_for``): Beam's, except that the
job server it starts (none when ``--job_endpoint`` names one, or a Flink or
Spark uber jar is submitted) is a ``JobServer`` of this module:

- **Started** with Beam's own command (``subprocess_cmd_and_endpoint``: the
  jar, the master, the ports, ``--job_server_jvm_properties``, Spark's
  ``--add-opens``) behind a wrapper, ``python -I -S -c DIES_WITH_PARENT PID
  java ...``, that asks Linux to SIGKILL it when the build's process dies
  (``prctl(PR_SET_PDEATHSIG)``, which ``exec`` keeps; strictly, when the
  thread that started it ends, which is the thread that runs the pipeline
  and stops the server after it) and then ``exec``s ``java``: the JVM is the
  build's child, in its process group (Ctrl-C reaches it, as before). Its
  output is logged (``-v``), its last lines kept for an error message.
- **Waited for** until its job port answers, at most ``START_TIMEOUT_S``
  seconds; one that exits first or never answers fails the build in one
  line (``runner.run``: "could not start").
- **Stopped** when the pipeline ends, whatever the end (``runner.run``):
  SIGTERM, SIGKILL after ``STOP_WAIT_S`` seconds; its artifacts folder
  removed.

On a system other than Linux there is no parent-death signal: the job
server still stops with the pipeline, but outlives a build killed with
SIGKILL.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import grpc

from seqcache import process

process.import_beam()  # before Beam's modules below: quietly, without pandas
from apache_beam.portability.api import beam_job_api_pb2_grpc  # noqa: E402
from apache_beam.runners.portability import flink_runner, spark_runner  # noqa: E402
from apache_beam.runners.portability import job_server as beam_job_server  # noqa: E402

log = logging.getLogger(__name__)

# Seconds a job server gets to answer on its port after it is started.
START_TIMEOUT_S = 300.0
# Seconds a job server gets to exit after SIGTERM before it is killed.
STOP_WAIT_S = 20.0
# Lines of a job server's output kept for the message when it fails to start.
_KEPT_LINES = 20

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


class JobServer:
    """What Beam's ``JavaJarJobServer`` does (its command, its ports), run
    as the build's child that dies with it (see the module docstring). Mixed
    in before Beam's ``FlinkJarJobServer`` or ``SparkJarJobServer``, which
    give the command. ``start()`` returns the job service's stub (Beam's
    ``JobServer`` contract); ``stop()`` ends the process and may be called
    any number of times."""

    process: subprocess.Popen | None = None
    _channel = None
    _temp_root: str | None = None
    _reader: threading.Thread | None = None

    def local_temp_dir(self, **kwargs) -> str:
        """A folder for Beam's artifacts, under this server's own temporary
        folder (removed by ``stop``)."""
        if self._temp_root is None:
            self._temp_root = tempfile.mkdtemp(prefix="seqcache-job-server-")
        return tempfile.mkdtemp(dir=self._temp_root, **kwargs)

    def start(self):
        """Starts the job server and waits for its port.

        Raises:
          RuntimeError: it exited first, or did not answer within
            ``START_TIMEOUT_S`` seconds (it is stopped); the message is one
            line with its last output.
        """
        if self._channel is not None:
            return beam_job_api_pb2_grpc.JobServiceStub(self._channel)
        command, endpoint = self.subprocess_cmd_and_endpoint()
        command = [str(arg) for arg in command]  # Beam's has ports as ints
        log.info("starting the job server at %s: %s", endpoint, " ".join(command))
        self.process = subprocess.Popen(dies_with_parent(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)
        self._output = collections.deque(maxlen=_KEPT_LINES)
        self._reader = threading.Thread(target=self._log_output, args=(self.process.stdout,),
                                        name="seqcache-job-server-output", daemon=True)
        self._reader.start()
        channel = grpc.insecure_channel(endpoint, options=[("grpc.max_receive_message_length", -1),
                                                           ("grpc.max_send_message_length", -1)])
        ready, deadline = grpc.channel_ready_future(channel), time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                ready.result(timeout=1.0)
                break
            except grpc.FutureTimeoutError:
                pass
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                channel.close()
                self.stop()
                why = (f"exited with status {code}" if code is not None else
                       f"did not answer at {endpoint} within {START_TIMEOUT_S:g} s")
                raise RuntimeError(f"the job server {why}: {self.last_output() or 'no output'}")
        self._channel = channel
        return beam_job_api_pb2_grpc.JobServiceStub(channel)

    def _log_output(self, stream) -> None:
        for raw in iter(stream.readline, b""):
            line = raw.decode(errors="backslashreplace").rstrip()
            self._output.append(line)
            log.info("job server: %s", line)
        stream.close()

    def last_output(self) -> str:
        """The job server's last line of output that says something (an
        error's, when it has one), at most 300 characters."""
        lines = [line.strip() for line in getattr(self, "_output", ()) if line.strip()]
        errors = [line for line in lines if "Exception" in line or "Error" in line]
        return (errors or lines or [""])[-1][:300]

    def stop(self) -> None:
        """Stops the job server (SIGTERM, then SIGKILL after ``STOP_WAIT_S``
        seconds) and removes its temporary folder; nothing when stopped."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        proc, self.process = self.process, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
            proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=STOP_WAIT_S)
            self._reader = None
        root, self._temp_root = self._temp_root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


class FlinkJobServer(JobServer, flink_runner.FlinkJarJobServer):
    """Beam's Flink job server (``--flink_job_server_jar``), as a ``JobServer``."""


class SparkJobServer(JobServer, spark_runner.SparkJarJobServer):
    """Beam's Spark job server (``--spark_job_server_jar``), as a ``JobServer``."""


class _OwnJobServer:
    """Mixed in before Beam's FlinkRunner or SparkRunner: the ``java -jar``
    job server that Beam would start (its ``StopOnExitJobServer``) is a
    ``job_server_class`` instead, kept until ``stop_job_server``."""

    job_server_class: type = JobServer

    def __init__(self):
        super().__init__()
        self.job_server = None

    def default_job_server(self, options):
        server = super().default_job_server(options)  # Beam's choice: a jar here, or an uber jar submitted
        if isinstance(server, beam_job_server.StopOnExitJobServer):
            server = self.job_server = self.job_server_class(options)
        return server

    def stop_job_server(self) -> None:
        """Stops the job server this runner started, if any."""
        server, self.job_server = self.job_server, None
        if server is not None:
            server.stop()


class FlinkRunner(_OwnJobServer, flink_runner.FlinkRunner):
    """Beam's FlinkRunner, whose job server dies with the build."""

    job_server_class = FlinkJobServer


class SparkRunner(_OwnJobServer, spark_runner.SparkRunner):
    """Beam's SparkRunner, whose job server dies with the build."""

    job_server_class = SparkJobServer


def runner_for(runner: str):
    """A ``FlinkRunner`` or ``SparkRunner`` of this module for Beam's runner
    named ``runner`` (its class name, or a dotted path ending in it), else
    None."""
    kind = {"flinkrunner": FlinkRunner, "sparkrunner": SparkRunner}.get(runner.rsplit(".", 1)[-1].lower())
    return kind() if kind is not None else None


def stop_job_server(beam_runner) -> None:
    """Stops the job server ``beam_runner`` (a pipeline's runner object)
    started, when it is one of this module's runners; nothing otherwise."""
    if isinstance(beam_runner, _OwnJobServer):
        beam_runner.stop_job_server()
