"""job_server.py: the Flink and Spark job servers a build starts die with it.

Without a JVM: the wrapper that makes a child die with its parent (SIGKILL
of the parent, checked on a child that waits for a signal), a ``JobServer``
whose command is a fake job server (a gRPC server with no service, on
localhost: started, stopped, and gone with a parent killed with SIGKILL), the
builds that start one and the command line of Beam's jars, and a job server
that cannot start (a jar that is no jar: the build fails in one line, nothing
left). The Flink and Spark job servers of a ``seqcache build`` killed with
SIGKILL are in test_jvm_runners.py (slow).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions, PortableOptions, StandardOptions

from seqcache.pipelines import job_server
from seqcache.pipelines import runner as runner_mod
from testsupport import ended

# A process that waits for a signal, without end.
WAITS = [sys.executable, "-c", "import signal; signal.pause()"]
# A parent that starts WAITS behind the wrapper, prints the child's pid, and waits for a signal.
PARENT = ("import json, signal, subprocess, sys\n"
          "from seqcache.pipelines.job_server import dies_with_parent\n"
          "child = subprocess.Popen(dies_with_parent(json.loads(sys.argv[1])))\n"
          "print(child.pid, flush=True)\n"
          "signal.pause()\n")
START_TIMEOUT_S = 120
# A fake job server: a gRPC server with no service at localhost:argv[1], until a signal ends it.
FAKE_SERVER = ("import sys\n"
               "from concurrent import futures\n"
               "import grpc\n"
               "server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))\n"
               "server.add_insecure_port('localhost:' + sys.argv[1])\n"
               "server.start()\n"
               "print('serving on', sys.argv[1], flush=True)\n"
               "server.wait_for_termination()\n")
# What a build does with its job server, in a process of its own: a ``JobServer``
# of the fake, started; its pid printed; then a wait for a signal (SIGKILL).
BUILD = ("import signal, sys\n"
         "from seqcache.pipelines import job_server\n"
         "class Fake(job_server.JobServer):\n"
         "    def command(self, port, artifacts_dir):\n"
         "        return [sys.executable, '-c', sys.argv[1], str(port)]\n"
         "server = Fake('flink', None, 'no.jar')\n"
         "server.start()\n"
         "print(server.process.pid, flush=True)\n"
         "signal.pause()\n")


class FakeJobServer(job_server.JobServer):
    """seqcache's ``JobServer`` whose command is ``FAKE_SERVER`` (its
    artifacts folder kept in ``artifacts_dir``)."""

    artifacts_dir = None

    def command(self, port, artifacts_dir):
        self.artifacts_dir = artifacts_dir
        return [sys.executable, "-c", FAKE_SERVER, str(port)]


def _wrapper_linux_only():
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")


def test_a_child_behind_the_wrapper_dies_when_its_parent_is_killed():
    _wrapper_linux_only()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, json.dumps(WAITS)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], START_TIMEOUT_S)
        assert ready, f"the parent printed no pid in {START_TIMEOUT_S} s"
        child = psutil.Process(int(parent.stdout.readline()))
        assert child.ppid() == parent.pid
        # The wrapper execs the command in place (same pid): wait for it, bounded, before the kill.
        deadline = time.monotonic() + START_TIMEOUT_S
        while child.cmdline() != WAITS:  # bounded: the deadline
            assert time.monotonic() < deadline, child.cmdline()
            time.sleep(0.05)
        parent.kill()
        parent.wait(timeout=30)
        assert ended(child.pid, timeout_s=30)
    finally:
        _leave_nothing(parent, child)


def _leave_nothing(parent: subprocess.Popen, child) -> None:
    """Kills ``parent`` (and waits for it) and ``child`` (a ``psutil.Process``
    or None) where a failed test left them running."""
    if parent.poll() is None:
        parent.kill()
        parent.wait(timeout=30)
    if child is not None and child.is_running():
        child.kill()


def test_the_wrapper_starts_nothing_when_its_parent_is_already_gone():
    _wrapper_linux_only()
    gone_parent = 1 if os.getpid() != 1 else 2  # a pid that is not the wrapper's parent
    done = subprocess.run(job_server.dies_with_parent(WAITS, parent_pid=gone_parent), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip() == "the build that started this job server has ended"


def test_a_job_server_starts_as_a_child_behind_the_wrapper_and_stops_leaving_nothing(tmp_path, monkeypatch):
    _wrapper_linux_only()
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the server's artifacts folder goes
    options = PipelineOptions(["--runner=FlinkRunner"])
    server = FakeJobServer("flink", options, "no.jar")
    try:
        endpoint = server.start()
        assert endpoint.startswith("localhost:") and options.view_as(PortableOptions).job_endpoint == endpoint
        proc = psutil.Process(server.process.pid)
        assert server.start() == endpoint and server.process.pid == proc.pid  # started once
        # The wrapper exec'd the command in place: the server itself is this process's child.
        assert proc.ppid() == os.getpid() and proc.cmdline()[-1] == endpoint.split(":")[1]
        assert os.path.isdir(server.artifacts_dir) and os.path.dirname(server.artifacts_dir) == str(temp)
    finally:
        server.stop()
    assert not proc.is_running() and server.process is None
    assert options.view_as(PortableOptions).job_endpoint is None  # the options serve the next task as they were
    assert list(temp.iterdir()) == []  # its artifacts folder removed
    assert server.last_output() == f"serving on {endpoint.split(':')[1]}"
    server.stop()  # stopped already: nothing happens


def test_the_job_server_of_a_build_killed_with_sigkill_dies_with_it():
    """A process that started a ``JobServer`` (as a build does) killed with
    SIGKILL: the server, its child, is gone at once (the parent-death
    signal), not left running under init. The same with Flink's and Spark's
    JVMs under ``seqcache build``: test_jvm_runners.py (slow)."""
    _wrapper_linux_only()
    build = subprocess.Popen([sys.executable, "-c", BUILD, FAKE_SERVER], stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True)
    server = None
    try:
        ready, _, _ = select.select([build.stdout], [], [], START_TIMEOUT_S)
        line = build.stdout.readline() if ready else ""
        assert line.strip().isdigit(), f"the build printed no job server pid in {START_TIMEOUT_S} s: {line!r}"
        server = psutil.Process(int(line))
        assert server.ppid() == build.pid and server.cmdline()[:3] == [sys.executable, "-c", FAKE_SERVER]
        build.kill()
        assert build.wait(timeout=30) == -signal.SIGKILL
        assert ended(server.pid, timeout_s=30), "the job server outlived the build"
    finally:
        _leave_nothing(build, server)


def test_flink_and_spark_builds_start_a_job_server_unless_one_is_named_or_an_uber_jar_is_submitted(monkeypatch):
    monkeypatch.setenv(runner_mod.JARS_ENV, "/jars")
    flink = runner_mod.job_server_for("FlinkRunner", PipelineOptions(["--flink_job_server_jar=/mine/flink.jar"]))
    assert (flink.kind, flink.jar, flink.process) == ("flink", "/mine/flink.jar", None)
    spark = runner_mod.job_server_for("apache_beam.runners.portability.spark_runner.SparkRunner", PipelineOptions([]))
    assert (spark.kind, spark.jar) == ("spark", "/jars/spark/spark-job-server.jar")  # `make jars`'s
    for runner, args in [("PrismRunner", []), ("DataflowRunner", []), ("FlinkRunner", ["--job_endpoint=h:8099"]),
                         ("FlinkRunner", ["--flink_submit_uber_jar", "--flink_master=h:8081"]),
                         ("SparkRunner", ["--spark_submit_uber_jar", "--spark_rest_url=http://h:6066"])]:
        assert runner_mod.job_server_for(runner, PipelineOptions(args)) is None, (runner, args)
    assert runner_mod.job_server_for("FlinkRunner", None) is None
    # An uber jar for an embedded Flink is not submitted (Beam's FlinkRunner would start its job server).
    assert runner_mod.job_server_for("FlinkRunner", PipelineOptions(["--flink_submit_uber_jar"])) is not None
    assert runner_mod.pipeline_runner("FlinkRunner", None) is None  # Beam's own, from its name


def test_the_command_line_is_the_one_beam_documents_for_its_job_server_jars():
    def command(kind, *args):
        return job_server.command(kind, PipelineOptions(list(args)), "s.jar", job_port=8099, artifacts_dir="/a")

    ports = ["--artifacts-dir", "/a", "--job-port", "8099", "--artifact-port", "0", "--expansion-port", "0"]
    assert command("flink") == ["java", "-jar", "s.jar", "--flink-master", "[auto]", *ports]
    assert command("flink", "--flink_master=h:8081", "--job_server_jvm_properties=-Xmx1g")[:5] == [
        "java", "-Xmx1g", "-jar", "s.jar", "--flink-master"]
    assert command("flink", "--flink_master= h:8081")[4] == "http://h:8081"
    assert command("flink", "--flink_master=https://h:8081")[4] == "https://h:8081"
    assert command("flink", "--flink_master=[local]")[4] == "[local]"
    spark = command("spark", "--spark_master_url=spark://h:7077", "--job_server_java_launcher=/jdk/bin/java",
                    "--artifact_port=7000", "--job_server_jvm_property=--add-opens=java.base/java.nio=ALL-UNNAMED")
    assert spark == ["/jdk/bin/java", "--add-opens=java.base/java.nio=ALL-UNNAMED",
                     *[f for f in job_server.SPARK_JVM_FLAGS if "java.nio=" not in f], "-jar", "s.jar",
                     "--spark-master-url", "spark://h:7077", *ports[:5], "7000", *ports[6:]]


class _NeverRun:
    """A pipeline that must not run (its job server did not start)."""

    def __init__(self, options):
        self.options = options

    def run(self):
        raise AssertionError("the pipeline ran without its job server")


def test_a_job_server_that_exits_at_start_fails_the_build_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    if shutil.which("java") is None:
        pytest.skip("no `java` on the PATH")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the server's artifacts folder goes
    jar = tmp_path / "not-a.jar"
    jar.write_text("not a jar\n")
    options = PipelineOptions([f"--flink_job_server_jar={jar}"])
    with pytest.raises(runner_mod.RunnerError) as info:
        runner_mod.run(_NeverRun(options), "FlinkRunner")
    message = str(info.value)
    assert message.startswith("runner FlinkRunner could not start: the job server exited with status 1: ") \
        and "\n" not in message, message
    assert "jarfile" in message, message  # java's own words: "Error: Invalid or corrupt jarfile ..."
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "java"]
    assert list(temp.iterdir()) == [] and options.view_as(PortableOptions).job_endpoint is None


class _ClearsTheRunner:
    """A pipeline whose run clears its options' runner, as Beam's portable runner does."""

    def __init__(self, options):
        self.options = options

    def run(self):
        self.options.view_as(StandardOptions).runner = None
        raise RuntimeError("the job service is not there")


def test_a_run_leaves_the_runner_named_in_its_options_for_the_next_task():
    options = PipelineOptions(["--runner=FlinkRunner", "--job_endpoint=localhost:1"])  # nothing to start
    with pytest.raises(runner_mod.RunnerError, match="^runner FlinkRunner could not start: the job service"):
        runner_mod.run(_ClearsTheRunner(options), "FlinkRunner")
    assert options.view_as(StandardOptions).runner == "FlinkRunner"
    assert runner_mod.pipeline_options(options)[1] == "FlinkRunner"  # a mixture's next task runs there too
