"""The local engine's worker processes (``seqcache.pipelines.workers``): which
arguments ask for them, that the ``seqcache build`` executable's pipeline runs
on the processes it started ahead, that a waiting process that died is
replaced, and that processes a build does not use are stopped.

Linux only (reads /proc).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from seqcache.pipelines import workers

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")

TIMEOUT_S = 180  # far above a build's few seconds: reaching it means a hang


@pytest.mark.parametrize("args, count", [
    (["--workers", "2"], 2),
    (["--workers=3", "--runner=direct"], 3),
    (["--direct_running_mode=multi_processing", "--direct_num_workers=2"], 2),
    (["--direct_running_mode", "multi_processing", "--direct_num_workers", "4"], 4),
    (["--direct_running_mode=multi_processing", "--direct_num_workers=0"], 6),  # 0: every CPU
    (["--direct_running_mode=multi_processing", "--direct_num_workers=1"], 0),
    (["--direct_num_workers=2"], 0),  # in_memory: no processes
    (["--workers", "2", "--runner=dask"], 0),
    (["--workers", "2", "--runner", "apache_beam.runners.dask.dask_runner.DaskRunner"], 0),
    (["--workers", "two"], 0),  # the command refuses it
    (["--source", "text:a.txt", "--name", "t"], 0),
])
def test_the_worker_processes_a_build_asks_for(args, count):
    assert workers.asked(args, cpu_count=6) == count


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


PROBE_TASK = '''
import os
from seqcache import tasks


def probe(example, ctx):
    """Notes, per worker process, what its standard error is and how it was started."""
    with open(os.path.join(os.environ["PROBE_DIR"], str(os.getpid())), "w") as f:
        f.write(os.readlink("/proc/self/fd/2") + "\\n" + open("/proc/self/cmdline").read().replace("\\0", " "))
    return example


tasks.TaskRegistry.add(
    "probed", source=tasks.TextLineSource(os.environ["PROBE_CORPUS"]),
    output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
    preprocessors=[tasks.FunctionPreprocessor(probe, name="probe"),
                   tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
'''


def _probe_build(tmp_path, *extra: str):
    (tmp_path / "probes").mkdir(exist_ok=True)
    corpus = tmp_path / "in"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(4):
            (corpus / f"{i}.txt").write_text("".join(f"file {i} line {j}\n" for j in range(200)))
    (tmp_path / "probe_task.py").write_text(PROBE_TASK)
    marker = f"SEQCACHE_TEST_RUN={uuid.uuid4().hex}"
    env = {**os.environ, "PROBE_DIR": str(tmp_path / "probes"), "PROBE_CORPUS": f"{corpus}/*.txt",
           marker.split("=")[0]: marker.split("=")[1]}
    out = subprocess.run([sys.executable, "-m", "seqcache.cli", "build", "probed", "--module",
                          str(tmp_path / "probe_task.py"), "--cache-dir", str(tmp_path / "c"), "--split-size", "1000",
                          *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr
    assert _processes_with(marker) == []  # no worker outlives the command
    return {int(p.name): p.read_text().split("\n", 1) for p in (tmp_path / "probes").iterdir()}


def test_the_build_runs_on_the_worker_processes_it_started_ahead(tmp_path):
    """``seqcache build --workers 2``: both workers of its pipeline are processes
    started before the command imported Beam, whose standard error is the pipe
    the command relays (a worker started when the pipeline runs inherits the
    command's redirected descriptor 2, /dev/null without -v). Run again on the
    cache it built (reused: no pipeline), the command stops them unused."""
    probes = _probe_build(tmp_path, "--workers", "2")
    assert len(probes) == 2, probes
    for stderr, cmdline in probes.values():
        assert stderr.startswith("pipe:"), probes
        assert f"seqcache.pipelines.worker_main {workers.WAIT_FLAG}" in cmdline, probes
    for p in (tmp_path / "probes").iterdir():
        p.unlink()
    assert _probe_build(tmp_path, "--workers", "2") == {}


def test_a_waiting_process_that_died_is_replaced(tmp_path):
    """A waiting worker process killed before its pipeline runs: the pipeline
    starts another and builds the same bytes as one worker in memory."""
    from seqcache import tasks
    from seqcache.pipelines import BuildConfig, build_task

    corpus = tmp_path / "in"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text("".join(f"file {i} line {j}\n" for j in range(300)))
    task = tasks.Task("waiting", source=tasks.TextLineSource(f"{corpus}/*.txt"),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    config = BuildConfig(num_shards=2)
    assert workers.start_ahead(["--workers", "2"]) == 2
    try:
        victim = workers._waiting[0]
        victim.kill()
        victim.wait()
        build_task(task, cache_dir=str(tmp_path / "w"), config=config, split_size=1000,
                   pipeline_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    finally:
        workers.stop_waiting()
    assert workers._waiting == []
    build_task(task, cache_dir=str(tmp_path / "m"), config=config, split_size=1000)
    sums = [(tmp_path / d / "waiting" / "train" / "shard-checksums.json").read_bytes() for d in ("w", "m")]
    assert sums[0] == sums[1]


class _Stuck:
    """A worker process that never exits by itself: records what ``reap`` asks
    of it; a wait moves ``clock`` on by its timeout."""

    def __init__(self, clock):
        self.clock, self.timeouts, self.killed = clock, [], False

    def wait(self, timeout=None):
        if self.killed:
            return -9
        self.timeouts.append(timeout)
        self.clock[0] += timeout
        raise subprocess.TimeoutExpired("worker", timeout)

    def kill(self):
        self.killed = True


def test_the_workers_of_an_interrupted_pipeline_are_killed_at_once(monkeypatch):
    """An interrupted or failed pipeline's workers may never see their control
    channel close (one still importing missed the Ctrl-C): they are killed
    without a wait; an ended pipeline's get ``EXIT_WAIT_S`` in all, not each."""
    clock = [1000.0]
    monkeypatch.setattr(workers.time, "monotonic", lambda: clock[0])
    procs = [_Stuck(clock) for _ in range(3)]
    workers.reap(procs, kill=True)
    assert all(p.killed for p in procs) and [p.timeouts for p in procs] == [[0.0]] * 3
    procs = [_Stuck(clock) for _ in range(3)]
    workers.reap(procs)
    assert all(p.killed for p in procs)
    assert [p.timeouts for p in procs] == [[workers.EXIT_WAIT_S], [0.0], [0.0]]


def test_a_grpc_error_is_named_by_its_code_and_details():
    from seqcache.pipelines import runner

    class Unavailable(Exception):
        def code(self):
            return type("Code", (), {"name": "UNAVAILABLE"})()

        def details(self):
            return "failed to connect to all addresses"

    assert runner.first_line(Unavailable("<_InactiveRpcError of RPC that terminated with:\n\tstatus = ...")) == \
        "UNAVAILABLE: failed to connect to all addresses"
    assert runner.first_line(ValueError("one\ntwo")) == "one"
