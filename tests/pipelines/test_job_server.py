"""job_server.py: the Flink and Spark job servers a build starts die with it.

Without a job server: the wrapper that makes a child die with its parent
(SIGKILL of the parent, checked on a child that waits for a signal), the
runners that start seqcache's job server instead of Beam's, and a job server
that cannot start (a jar that is no jar: one line, nothing left). The Flink
and Spark job servers of a ``seqcache build`` killed with SIGKILL are in
test_jvm_runners.py.
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
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability import spark_uber_jar_job_server

from seqcache.pipelines import job_server
from seqcache.pipelines import runner as runner_mod

# A process that waits for a signal, without end.
WAITS = [sys.executable, "-c", "import signal; signal.pause()"]
# A parent that starts WAITS behind the wrapper, prints the child's pid, and waits for a signal.
PARENT = ("import json, signal, subprocess, sys\n"
          "from seqcache.pipelines.job_server import dies_with_parent\n"
          "child = subprocess.Popen(dies_with_parent(json.loads(sys.argv[1])))\n"
          "print(child.pid, flush=True)\n"
          "signal.pause()\n")
START_TIMEOUT_S = 120


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
        gone, alive = psutil.wait_procs([child], timeout=30)
        assert [p.pid for p in gone] == [child.pid] and not alive
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


def test_flink_and_spark_start_seqcaches_job_server_unless_beam_submits_an_uber_jar():
    flink = runner_mod.pipeline_runner("FlinkRunner", None)
    spark = runner_mod.pipeline_runner("apache_beam.runners.portability.spark_runner.SparkRunner", None)
    assert type(flink) is job_server.FlinkRunner and type(spark) is job_server.SparkRunner
    assert runner_mod.pipeline_runner("PrismRunner", None) is None and runner_mod.pipeline_runner("DataflowRunner", None) is None
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
