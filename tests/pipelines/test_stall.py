"""stall.py: the bound on waiting for a job that makes no progress, the steps'
heartbeats, and ``runner.run`` giving up a stalled job in one line. No job
server here: a fake ``PipelineResult`` and a fake clock (each reading 10 s
later than the one before), so that no test waits for the bound; the Flink
and Spark jobs whose workers die or never start are in test_jvm_runners.py."""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import threading
from typing import Any

import pytest

from seqcache.pipelines import BuildConfig, BuildError, build_task, stall
from seqcache.pipelines import runner as runner_mod
from testsupport import lines_task, write_lines


class FakeResult:
    """A job that runs until ``finished`` is set (by ``cancel`` too), in a
    state that does not change; its end raises ``error`` when given."""

    def __init__(self, error: BaseException | None = None):
        self.finished, self.cancelled, self.error = threading.Event(), threading.Event(), error

    def wait_until_finish(self):
        if not self.finished.wait(60):
            raise AssertionError("the fake job was neither finished nor cancelled in 60 s")
        if self.error is not None:
            raise self.error
        return "DONE"

    @property
    def state(self):
        return "CANCELLED" if self.cancelled.is_set() else "RUNNING"

    def cancel(self):
        self.cancelled.set()
        self.finished.set()


def _clock():
    """A clock each of whose readings is 10 s after the one before."""
    ticks = itertools.count(0, 10)
    return lambda: next(ticks)


def test_a_job_without_progress_stalls_once_the_bound_has_passed():
    result, calls = FakeResult(), []
    with pytest.raises(stall.Stalled) as info:
        stall.wait(result, timeout_s=15, progress=lambda: calls.append(1) or "same", clock=_clock(), poll_s=0.001)
    assert info.value.seconds == 15 and str(info.value) == "no progress for 15 s"
    # Read at 0 s, 10 s (10 s without progress) and 20 s (20 s: over the bound).
    assert len(calls) == 3
    assert not info.value.finished.is_set()  # Beam's wait still waits: the caller cancels the job
    result.cancel()
    assert info.value.finished.wait(30)


def test_progress_puts_the_stall_off_until_it_stops():
    """The heartbeats change at the first 5 looks, then stay: the stall comes
    2 looks (20 s of the fake clock) after the last change, never before."""
    result, calls = FakeResult(), []

    def progress():
        calls.append(1)
        return min(len(calls), 6)

    with pytest.raises(stall.Stalled):
        stall.wait(result, timeout_s=15, progress=progress, clock=_clock(), poll_s=0.001)
    assert len(calls) == 8
    result.cancel()


def test_a_job_that_ends_returns_and_one_that_fails_raises_its_own_error():
    done = FakeResult()
    done.finished.set()
    assert stall.wait(done, timeout_s=15, progress=lambda: "same", clock=_clock(), poll_s=0.001) is None
    error = RuntimeError("Pipeline x failed in state FAILED: a step raised")
    failed = FakeResult(error)
    failed.finished.set()
    with pytest.raises(RuntimeError) as info:
        stall.wait(failed, timeout_s=15, progress=lambda: "same", clock=_clock(), poll_s=0.001)
    assert info.value is error


def test_cancel_cancels_the_job_and_waits_for_beams_wait_to_end():
    result = FakeResult()
    with pytest.raises(stall.Stalled) as info:
        stall.wait(result, timeout_s=15, progress=lambda: "same", clock=_clock(), poll_s=0.001)
    stall.cancel(result, info.value)
    assert result.cancelled.is_set() and info.value.finished.is_set()


def test_the_bound_sets_how_often_workers_beat_and_the_driver_looks():
    assert stall.beat_interval(300) == 10 and stall.beat_interval(30) == 5 and stall.beat_interval(2) == 1
    assert stall.poll_seconds(300) == 5 and stall.poll_seconds(30) == 3 and stall.poll_seconds(1) == 0.5


def test_a_heartbeat_is_a_file_per_process_rewritten_at_most_every_every_s(tmp_path):
    folder = tmp_path / "beats"
    folder.mkdir()
    assert stall.progress_of(str(folder)) == ()
    name = folder / f"{socket.gethostname()}-{os.getpid()}"
    every = stall.Heartbeat(str(folder), every_s=0)
    every.beat()
    first = stall.progress_of(str(folder))
    assert [(os.path.basename(f.path), f.num_bytes) for f in first] == [(name.name, 1)]
    for _ in range(9):
        every.beat()
    assert name.read_bytes() == b"10" and stall.progress_of(str(folder)) != first
    # A beat within every_s of the last one writes nothing.
    rare_folder = tmp_path / "rare"
    rare_folder.mkdir()
    rare = stall.Heartbeat(str(rare_folder), every_s=3600)
    rare.beat()
    rare.beat()
    assert (rare_folder / name.name).read_bytes() == b"1"


def test_a_heartbeat_travels_with_the_steps_and_never_fails_one(tmp_path):
    beat = pickle.loads(pickle.dumps(stall.Heartbeat(str(tmp_path / "gone"), every_s=0)))
    assert beat.folder == str(tmp_path / "gone") and beat.every_s == 0
    beat.beat()  # its folder removed (the build gave up): passed over
    stall.Heartbeat(None).beat()
    assert list(tmp_path.iterdir()) == []


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(stall.TIMEOUT_VARIABLE, raising=False)
    assert runner_mod.stall_timeout() == stall.DEFAULT_TIMEOUT_S == 300
    monkeypatch.setenv(stall.TIMEOUT_VARIABLE, "42.5")
    assert runner_mod.stall_timeout() == 42.5
    for bad in ("0", "-3", "soon", "inf", "nan"):
        monkeypatch.setenv(stall.TIMEOUT_VARIABLE, bad)
        with pytest.raises(runner_mod.RunnerError) as info:
            runner_mod.stall_timeout()
        assert str(info.value) == (f"$SEQCACHE_STALL_TIMEOUT={bad!r}: expected the seconds a job may go without "
                                   "progress, a number above 0 (unset: 300)")


@pytest.mark.parametrize("runner", ["flink", "spark"])
def test_a_bad_bound_fails_the_build_in_one_line_before_anything_is_written(tmp_path, monkeypatch, runner):
    monkeypatch.setenv(stall.TIMEOUT_VARIABLE, "5m")
    corpus = write_lines(tmp_path / "corpus" / "a.txt", ["one", "two"])
    with pytest.raises(BuildError) as info:
        build_task(lines_task(str(corpus)), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1),
                   pipeline_args=[f"--runner={runner}"])
    assert str(info.value) == ("$SEQCACHE_STALL_TIMEOUT='5m': expected the seconds a job may go without progress, "
                               "a number above 0 (unset: 300)")
    assert not (tmp_path / "c").exists()


def test_the_runners_of_a_job_service_are_watched():
    assert [name for name in ("FlinkRunner", "SparkRunner", "PortableRunner", "PrismRunner", "FnApiRunner",
                              runner_mod.DASK_RUNNER, "DataflowRunner") if runner_mod.watches_stalls(name)] == \
        ["FlinkRunner", "SparkRunner", "PortableRunner"]


class _FakeServer:
    """What ``runner.run`` uses of a ``job_server.JobServer``: counted starts and stops."""

    def __init__(self):
        self.starts = self.stops = 0

    def start(self):
        self.starts += 1

    def stop(self):
        self.stops += 1


class _FakePipeline:
    """What ``runner.run`` uses of a Beam pipeline: ``run()``, ``options``."""

    def __init__(self, result):
        self.result, self.options = result, None

    def run(self):
        return self.result


def _a_server(monkeypatch):
    """The job server (a fake) that ``runner.run`` starts for a Flink build."""
    server = _FakeServer()
    monkeypatch.setattr(runner_mod, "job_server_for", lambda runner, options: server)
    return server


def test_a_stalled_job_is_cancelled_its_job_server_stopped_and_the_build_fails_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(stall.TIMEOUT_VARIABLE, "0.01")
    result, server = FakeResult(), _a_server(monkeypatch)
    with pytest.raises(runner_mod.RunnerError) as info:
        runner_mod.run(_FakePipeline(result), "FlinkRunner", heartbeats=str(tmp_path))
    assert str(info.value) == (
        "runner FlinkRunner: the job made no progress for 0.01 s (no step of the build "
        "did any work): an SDK worker died or never connected (one that cannot start: a worker pool whose "
        "python lacks Beam or seqcache, a container that exits); nothing was published, run the build again once "
        "its workers start ($SEQCACHE_STALL_TIMEOUT sets the bound, in seconds)")
    assert result.cancelled.is_set() and (server.starts, server.stops) == (1, 1)


def _failed_job(monkeypatch, error: Exception) -> tuple[str, Any]:
    """The one line of ``runner.run``'s ``RunnerError`` for a Flink job whose
    ``wait_until_finish`` raised ``error``, and the fake job server it started."""
    result, server = FakeResult(error), _a_server(monkeypatch)
    result.finished.set()
    with pytest.raises(runner_mod.RunnerError) as info:
        runner_mod.run(_FakePipeline(result), "FlinkRunner", heartbeats=None)
    return str(info.value), server


def test_a_job_failed_by_a_lost_worker_connection_is_one_line_naming_the_runner(monkeypatch):
    text = ("Pipeline BeamApp-x failed in state FAILED: org.apache.beam.vendor.grpc.v1p60p1.io.grpc."
            "StatusRuntimeException: CANCELLED: client cancelled")
    message, server = _failed_job(monkeypatch, RuntimeError(text))
    assert message == (f"runner FlinkRunner: the job failed when an SDK worker's connection ended: a worker "
                               f"that died ({text}); nothing was published, run the build again")
    assert server.stops == 1
    # A step's own error, with the worker's traceback in it, is handed on as it is.
    step = RuntimeError(text + " Traceback (most recent call last): ValueError: bad record")
    result = FakeResult(step)
    result.finished.set()
    with pytest.raises(RuntimeError) as info:
        runner_mod.run(_FakePipeline(result), "FlinkRunner")
    assert info.value is step


def test_a_job_that_cannot_reach_its_worker_pool_is_one_line_naming_the_runner(monkeypatch):
    """Flink with an EXTERNAL environment and no worker pool listening fails
    its job at once (the text Beam 2.x's job service gives, seen on Flink)."""
    text = ("Pipeline BeamApp-root-1206164229-de96c079 failed in state FAILED: java.net.ConnectException: "
            "java.net.ConnectException: finishConnect(..) failed: Connection refused")
    message, server = _failed_job(monkeypatch, RuntimeError(text))
    assert message.startswith("runner FlinkRunner: the job failed as its SDK workers could not be reached: no "
                              "worker pool listening at --environment_config") and "\n" not in message, message
    assert "nothing was published" in message and server.stops == 1


def test_ctrl_c_while_the_job_is_watched_cancels_it_stops_the_job_server_and_is_raised(tmp_path, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C, SIGTERM: cli/interrupts.py) while the
    driver waits for a watched job is raised as it is (the command says
    "interrupted" and exits 130), after the job was cancelled; the job
    server is stopped."""
    monkeypatch.setenv(stall.TIMEOUT_VARIABLE, "300")
    looks = []

    def interrupted_at_the_third_look():
        looks.append(1)
        if len(looks) == 3:
            raise KeyboardInterrupt
        return len(looks)

    monkeypatch.setattr(stall, "progress_of", lambda folder: interrupted_at_the_third_look())
    monkeypatch.setattr(stall, "poll_seconds", lambda timeout_s: 0.001)
    result, server = FakeResult(), _a_server(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        runner_mod.run(_FakePipeline(result), "FlinkRunner", heartbeats=str(tmp_path))
    assert len(looks) == 3 and result.cancelled.is_set() and server.stops == 1
