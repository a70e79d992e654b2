"""SIGINT and SIGTERM at any moment of a command (``seqcache.cli.interrupts``),
run as a user runs it: the executable (``python -m seqcache.cli``) in a
subprocess; mostly ``seqcache build`` with 2 worker processes started ahead.

What is checked: from the executable's first statement (before click, rich or
Beam are imported) to the pipeline, SIGTERM exits 143 and SIGINT 130, each
with one line on standard error ("interrupted by SIGTERM", "interrupted"),
with no manifest and no worker process left behind, also when the interrupt
is raised inside code that ``exec`` runs (which CPython would turn into an
exit by SIGINT), and when something else fails after the signal came (a
runner that lost its job server to the same Ctrl-C); a build started with
SIGINT ignored (``nohup``, a shell script's background job) keeps it
ignored, in its worker processes too, and finishes when SIGINT reaches its
process group.

Each moment is found by watching the command (its signal handlers, its child
processes, its output, a worker blocked on a FIFO), never by waiting a set
time. Earlier than the first of them is the interpreter's own start-up, where
no seqcache code runs yet. Linux only (reads /proc).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from seqcache import format as fmt
from testsupport import (MULTI_PROCESSING, default_signals, gate_opened, interrupt, kill_if_running, marked_env,
                         processes_with, start_gated_build)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")

# Far above a build's few seconds: reaching it means the command hung.
TIMEOUT_S = 120


def _seqcache(*args: str) -> list[str]:
    return [sys.executable, "-m", "seqcache.cli", *args]


def _signal_mask(pid: int, field: str) -> int:
    """The ``SigCgt`` (caught) or ``SigIgn`` (ignored) mask of process ``pid``; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _has(mask: int, signum: int) -> bool:
    return bool(mask & (1 << (signum - 1)))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    out = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                    out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _wait_for(condition, proc, what: str) -> None:
    """Polls ``condition()`` until it holds; fails if ``proc`` exits first or ``TIMEOUT_S`` passes."""
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        assert proc.poll() is None, f"the command exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} in {TIMEOUT_S} s"
        time.sleep(0.001)


def _handles_sigterm(proc) -> bool:
    return _has(_signal_mask(proc.pid, "SigCgt"), signal.SIGTERM)


# A module whose import never ends (until a signal): the command is then loading
# the build's modules, after Beam's import and before the pipeline.
SLOW_TASKS = "import time\nprint('loading', flush=True)\ntime.sleep(600)\n"


def _moment(proc, moment: str) -> None:
    """Returns once the command ``proc`` is at ``moment``: ``handlers`` (its
    first statement has run: SIGTERM is caught, the command line not yet
    loaded), ``workers`` (a worker process started ahead exists, Beam is still
    loading) or ``module`` (the build's ``--module`` is being imported)."""
    if moment == "handlers":
        _wait_for(lambda: _handles_sigterm(proc), proc, "SIGTERM handler")
    elif moment == "workers":
        _wait_for(lambda: _children(proc.pid), proc, "worker process")
    elif moment == "module":
        assert proc.stdout.readline() == "loading\n"


@pytest.mark.parametrize("signum, moment, to_group", [
    pytest.param(signal.SIGTERM, "handlers", False, id="SIGTERM-first-statement"),
    pytest.param(signal.SIGINT, "handlers", False, id="SIGINT-first-statement"),
    pytest.param(signal.SIGTERM, "workers", False, id="SIGTERM-workers-started"),
    # Ctrl-C reaches the worker processes too, as their interpreters start.
    pytest.param(signal.SIGINT, "workers", True, id="ctrl-c-workers-started"),
    pytest.param(signal.SIGTERM, "module", False, id="SIGTERM-module-loading"),
])
def test_a_signal_during_start_up_exits_with_its_status_and_one_line(tmp_path, signum, moment, to_group):
    """Before its pipeline, a build stopped by SIGTERM exits 143 (SIGINT: 130),
    says "interrupted by SIGTERM" ("interrupted") and nothing else (no worker's
    traceback either), leaves no manifest, and its worker processes started
    ahead are gone when it has exited."""
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "slow_tasks.py").write_text(SLOW_TASKS)
    task = (["--module", "slow_tasks", "slow"] if moment == "module"
            else ["--source", f"text:{tmp_path / 'a.txt'}", "--name", "t"])
    env, marker = marked_env()
    proc = subprocess.Popen(_seqcache("build", "--cache-dir", str(tmp_path / "c"), "--workers", "2", *task),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_signals)
    try:
        _moment(proc, moment)
        stdout, stderr = interrupt(proc, signum, to_group=to_group, timeout_s=TIMEOUT_S)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 128 + signum, stderr  # 143, 130: as a shell reports the signal
    assert stderr == ("interrupted by SIGTERM\n" if signum == signal.SIGTERM else "interrupted\n")
    assert stdout == ""
    assert processes_with(marker) == {}
    assert not list(tmp_path.rglob("manifest.json"))


# A module that sends SIGTERM to its own process from code that ``exec`` runs from
# a string, as a dataclass's methods are made while a module imports.
SELF_TERMINATING = "import os, signal, time\nexec('os.kill(os.getpid(), signal.SIGTERM)\\ntime.sleep(600)')\n"


def test_sigterm_inside_code_run_by_exec_still_exits_143(tmp_path):
    """The interrupt raised inside code that ``exec`` runs from a string: CPython
    would end the process by SIGINT (status -2) after it exited with 143; the
    executable ends it itself."""
    (tmp_path / "self_terminating.py").write_text(SELF_TERMINATING)
    done = subprocess.run([*_seqcache(), "tasks", "--module", "self_terminating"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=TIMEOUT_S, preexec_fn=default_signals)
    assert (done.returncode, done.stderr, done.stdout) == (143, "interrupted by SIGTERM\n", "")


def test_sigterm_while_the_pipeline_runs_in_memory_exits_143_and_says_what_is_left(tmp_path):
    """SIGTERM while the pipeline runs (in this process: the default in-memory
    mode): 143, and the one line names the signal and what is left of the cache."""
    proc, gate = start_gated_build(tmp_path, _seqcache(), preexec_fn=default_signals)
    try:
        with gate_opened(gate, timeout_s=TIMEOUT_S):  # the record is being read: the pipeline runs
            proc.send_signal(signal.SIGTERM)
        # The gate closes: the kernel may hand a process's signal to a thread other
        # than the main one, whose read of the gate it then does not cut short;
        # Python runs the handler in the main thread once that read returns.
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, stderr
    assert stderr == ("interrupted by SIGTERM: gated/train has no manifest, so it is not a cache; "
                      "run the same command again to finish it (the work done so far is kept, unless --work off)\n")
    assert stdout == ""
    assert not (tmp_path / "c" / "gated" / "train" / "manifest.json").exists()


# A module for ``build --module``: the task ``lost`` (one record) and a runner
# whose job server is lost to the signal that reached the command, as on Flink
# and Spark, where Ctrl-C reaches the job server's JVM too (the terminal's
# process group), without JVMs: the signal ``LOST_SIGNAL`` comes first (the
# command's handler records it and raises KeyboardInterrupt, which the runner
# loses, as Beam's clean-up does when it raises an error of its own in its
# place), then the job service's connection fails (gRPC UNAVAILABLE), which
# seqcache.pipelines.runner.run reports as "lost its job server".
LOST_JOB_SERVER = textwrap.dedent(
    """
    import os
    import signal

    import grpc

    from seqcache import tasks
    from seqcache.pipelines import runner


    def records():
        yield {"text": "one"}


    tasks.TaskRegistry.add(
        "lost",
        source=tasks.FunctionSource(records, name="lost"),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )


    class Closed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Socket closed"


    class Result:
        def wait_until_finish(self):
            try:
                signal.raise_signal(getattr(signal, os.environ["LOST_SIGNAL"]))
            except KeyboardInterrupt:
                pass
            raise Closed()


    real_run = runner.run


    def run(pipeline, name, **kwargs):
        pipeline.run = Result
        return real_run(pipeline, name, **kwargs)


    runner.run = run
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_a_runner_that_fails_after_the_signal_still_exits_as_interrupted(tmp_path, signum):
    """The runner reports its lost job server after the signal came: the build
    says "interrupted" (with what is left of its cache), not the runner's
    error, and exits 130 (143), as for any interrupt."""
    (tmp_path / "lost_job_server.py").write_text(LOST_JOB_SERVER)
    done = subprocess.run(_seqcache("build", "--cache-dir", str(tmp_path / "c"), "--module", "lost_job_server", "lost"),
                          cwd=tmp_path, env={**os.environ, "LOST_SIGNAL": signum.name}, capture_output=True,
                          text=True, timeout=TIMEOUT_S, preexec_fn=default_signals)
    said = "interrupted" if signum == signal.SIGINT else "interrupted by SIGTERM"
    assert (done.returncode, done.stdout) == (128 + signum, ""), done.stderr
    assert done.stderr == (f"{said}: lost/train has no manifest, so it is not a cache; run the same command again "
                           "to finish it (the work done so far is kept, unless --work off)\n")
    assert not list(tmp_path.rglob("manifest.json"))


# A --module whose import receives the signal, loses the KeyboardInterrupt and then raises.
FAILS_AFTER_THE_SIGNAL = ("import os, signal\ntry:\n    signal.raise_signal(getattr(signal, os.environ['LOST_SIGNAL']))\n"
                          "except KeyboardInterrupt:\n    pass\nraise RuntimeError('broken after the signal')\n")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "SIGTERM"])
def test_any_command_that_fails_after_the_signal_exits_130_or_143_saying_interrupted(tmp_path, signum):
    """Whatever command fails after the signal came, the executable ends it
    with the signal's status and the line "interrupted", after the command's
    own error line."""
    (tmp_path / "fails_after_the_signal.py").write_text(FAILS_AFTER_THE_SIGNAL)
    done = subprocess.run(_seqcache("tasks", "--module", "fails_after_the_signal"), cwd=tmp_path,
                          env={**os.environ, "LOST_SIGNAL": signum.name}, capture_output=True, text=True,
                          timeout=TIMEOUT_S, preexec_fn=default_signals)
    assert (done.returncode, done.stdout) == (128 + signum, ""), done.stderr
    error, said = done.stderr.splitlines()
    assert error.startswith("error: --module fails_after_the_signal: importing it raised RuntimeError: broken after "
                            "the signal"), done.stderr
    assert said == ("interrupted" if signum == signal.SIGINT else "interrupted by SIGTERM")


def _ignore_sigint() -> None:
    """``preexec_fn``: the command starts with SIGINT ignored, as under ``nohup``
    or in a shell script's background job, and SIGTERM at its default."""
    default_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def test_a_build_started_with_sigint_ignored_ignores_it_in_its_workers_too_and_finishes(tmp_path):
    """SIGINT to the process group of a build started with SIGINT ignored
    reaches the command and its worker processes while a worker runs the
    pipeline: each of them ignores it, and the build finishes with its cache."""
    env, marker = marked_env()
    proc, gate = start_gated_build(tmp_path, _seqcache(), build_args=MULTI_PROCESSING, env=env,
                                   start_new_session=True, preexec_fn=_ignore_sigint)
    try:
        with gate_opened(gate, timeout_s=TIMEOUT_S):  # a worker reads the record: the pipeline runs there
            running = processes_with(marker)
            assert set(running) - {proc.pid}, running  # the command and its workers
            ignoring = {pid: _has(_signal_mask(pid, "SigIgn"), signal.SIGINT) for pid in running}
            assert all(ignoring.values()), {running[pid]: ignored for pid, ignored in ignoring.items()}
            os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)  # the gate is closed: the record goes on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert re.fullmatch(r"gated/train: 1 example in 1 shard, built in \d+\.\d s -> .*/c/gated/train\n", stderr), stderr
    assert stdout == ""
    assert processes_with(marker) == {}
    manifest = fmt.read_manifest(str(tmp_path / "c" / "gated" / "train"))
    assert manifest.num_examples == 1
