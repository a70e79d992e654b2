"""job_server.py: the Flink and Spark job servers a build starts die with it.

Without a JVM: the wrapper that makes a child die with its parent (SIGKILL
of the parent, checked on a child that waits for a signal), a ``JobServer``
whose command is a fake job server (a gRPC server with no service, on
127.0.0.1: started, stopped, and gone with a parent killed with SIGKILL), the
runners that start seqcache's job server instead of Beam's, and a job server
that cannot start (a jar that is no jar: one line, nothing left). The Flink
and Spark job servers of a ``seqcache build`` killed with SIGKILL are in
test_jvm_runners.py (slow).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.runners.portability import spark_uber_jar_job_server

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
# A fake job server: a gRPC server with no service at the address argv[1], until a signal ends it.
FAKE_SERVER = ("import sys\n"
               "from concurrent import futures\n"
               "import grpc\n"
               "server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))\n"
               "server.add_insecure_port(sys.argv[1])\n"
               "server.start()\n"
               "print('serving at', sys.argv[1], flush=True)\n"
               "server.wait_for_termination()\n")
# What a build does with its job server, in a process of its own: a ``JobServer``
# of the fake, started; its pid printed; then a wait for a signal (SIGKILL).
BUILD = ("import signal, sys\n"
         "from seqcache.pipelines import job_server\n"
         "class Fake(job_server.JobServer):\n"
         "    def subprocess_cmd_and_endpoint(self):\n"
         "        return [sys.executable, '-c', sys.argv[1], sys.argv[2]], sys.argv[2]\n"
         "server = Fake()\n"
         "server.start()\n"
         "print(server.process.pid, flush=True)\n"
         "signal.pause()\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeJobServer(job_server.JobServer):
    """seqcache's ``JobServer`` whose command is ``FAKE_SERVER`` on a free port of 127.0.0.1."""

    def __init__(self):
        self.endpoint = f"127.0.0.1:{_free_port()}"
        self.command = [sys.executable, "-c", FAKE_SERVER, self.endpoint]

    def subprocess_cmd_and_endpoint(self):
        return self.command, self.endpoint


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
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child is not None and child.is_running():  # the test failed: leave no process behind
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
    server = FakeJobServer()
    try:
        assert isinstance(server.start(), beam_job_api_pb2_grpc.JobServiceStub)
        proc = psutil.Process(server.process.pid)
        assert isinstance(server.start(), beam_job_api_pb2_grpc.JobServiceStub)  # started once
        assert server.process.pid == proc.pid
        # The wrapper exec'd the command in place: the server itself is this process's child.
        assert proc.ppid() == os.getpid() and proc.cmdline() == server.command
        artifacts = server.local_temp_dir(prefix="artifacts")
        assert os.path.isdir(artifacts) and os.path.dirname(os.path.dirname(artifacts)) == str(temp)
    finally:
        server.stop()
    assert not proc.is_running() and server.process is None
    assert list(temp.iterdir()) == []  # its artifacts folder removed
    assert server.last_output() == f"serving at {server.endpoint}"
    server.stop()  # stopped already: nothing happens


def test_the_job_server_of_a_build_killed_with_sigkill_dies_with_it():
    """A process that started a ``JobServer`` (as a build does) killed with
    SIGKILL: the server, its child, is gone at once (the parent-death
    signal), not left running under init. The same with Flink's and Spark's
    JVMs under ``seqcache build``: test_jvm_runners.py (slow)."""
    _wrapper_linux_only()
    endpoint = f"127.0.0.1:{_free_port()}"
    build = subprocess.Popen([sys.executable, "-c", BUILD, FAKE_SERVER, endpoint], stdout=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True)
    server = None
    try:
        ready, _, _ = select.select([build.stdout], [], [], START_TIMEOUT_S)
        line = build.stdout.readline() if ready else ""
        assert line.strip().isdigit(), f"the build printed no job server pid in {START_TIMEOUT_S} s: {line!r}"
        server = psutil.Process(int(line))
        assert server.ppid() == build.pid and server.cmdline()[-1] == endpoint
        build.kill()
        assert build.wait(timeout=30) == -signal.SIGKILL
        assert ended(server.pid, timeout_s=30), "the job server outlived the build"
    finally:
        if build.poll() is None:
            build.kill()
            build.wait(timeout=30)
        if server is not None and server.is_running():  # the test failed: leave no process behind
            server.kill()


def test_flink_and_spark_start_seqcaches_job_server_unless_beam_submits_an_uber_jar():
    flink = runner_mod.pipeline_runner("FlinkRunner", None)
    spark = runner_mod.pipeline_runner("apache_beam.runners.portability.spark_runner.SparkRunner", None)
    assert type(flink) is job_server.FlinkRunner and type(spark) is job_server.SparkRunner
    assert runner_mod.pipeline_runner("PrismRunner", None) is None
    assert runner_mod.pipeline_runner("DataflowRunner", None) is None
    server = flink.default_job_server(PipelineOptions(["--flink_job_server_jar=/jars/flink.jar"]))
    assert type(server) is job_server.FlinkJobServer and flink.job_server is server and server.process is None
    uber = spark.default_job_server(PipelineOptions(["--spark_submit_uber_jar", "--spark_rest_url=http://h:6066"]))
    assert isinstance(uber, spark_uber_jar_job_server.SparkUberJarJobServer) and spark.job_server is None
    flink.stop_job_server()  # never started: nothing to stop
    assert flink.job_server is None


def test_a_job_server_that_exits_at_start_fails_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    if shutil.which("java") is None:
        pytest.skip("no `java` on the PATH")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the server's artifacts folder goes
    jar = tmp_path / "not-a.jar"
    jar.write_text("not a jar\n")
    server = job_server.FlinkJobServer(PipelineOptions([f"--flink_job_server_jar={jar}"]))
    with pytest.raises(RuntimeError) as info:
        server.start()
    message = str(info.value)
    assert message.startswith("the job server exited with status 1: ") and "\n" not in message, message
    assert "jarfile" in message, message  # java's own words: "Error: Invalid or corrupt jarfile ..."
    assert server.process is None and server.last_output()
    assert not [p for p in psutil.Process().children(recursive=True) if p.name() == "java"]
    assert list(temp.iterdir()) == []
    server.stop()  # stopped already: nothing happens
