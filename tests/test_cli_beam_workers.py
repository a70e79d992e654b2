"""``seqcache build`` on Beam's multi-worker DirectRunner modes, run as a user
runs it: the CLI in a subprocess, ``--direct_running_mode=multi_processing
--direct_num_workers=2``.

What is checked: without ``-v`` the output is the command's own lines only
(the same as the default in-memory mode, which runs in this process through
click's test runner; no worker tracebacks or Beam logs); a
failing build whose standard error is a pipe nobody reads any more (``2>&1 |
head``) exits instead of waiting forever; Ctrl-C exits 130, SIGTERM 143. Every
case also checks that no worker process outlives the command: each run gets a
marker in its environment, which the worker processes inherit, and no process
may still carry it once the command has exited.

Linux only (reads /proc). A hang fails through the subprocess timeout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

import seqcache
from testsupport import (default_signals, gate_opened, interrupt, kill_if_running, marked_env, processes_with,
                         start_gated_build, write_files)

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc (Linux)")

# Far above a build's few seconds: reaching it means the command hung.
TIMEOUT_S = 120
MULTI_PROCESSING = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
A_TXT = b"ok\nbad \xff byte\nfine\n"
# A line's record id is the byte offset of its first byte: line 2 starts after "ok\n".
BAD_RECORD = f"line 2 (byte {A_TXT.index(b'bad')}) is not valid UTF-8"


def _seqcache(*args: str) -> list[str]:
    return [sys.executable, "-m", "seqcache.cli", *args]


def _run(args, *, cwd, env):
    return subprocess.run(_seqcache(*args), cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _run_in_this_process(args) -> subprocess.CompletedProcess:
    """The command in this process (click's test runner), as a ``subprocess.run`` result:
    the in-memory mode needs no process of its own."""
    from click.testing import CliRunner

    from seqcache.cli.main import main

    out = CliRunner().invoke(main, args)
    return subprocess.CompletedProcess(args, out.exit_code, out.stdout, out.stderr)


@pytest.fixture
def bad_corpus(tmp_path):
    """Two text files; line 2 of a.txt is not UTF-8 (raised on by default)."""
    return str(write_files(tmp_path / "in", {"a.txt": A_TXT, "b.txt": b"more\n"}) / "*.txt")


def test_failing_build_prints_the_same_one_line_error_as_in_memory_mode(tmp_path, bad_corpus):
    env, marker = marked_env()
    args = ["build", "--cache-dir", str(tmp_path / "c"), "--source", f"text:{bad_corpus}", "--name", "mp"]
    workers = _run([*args, *MULTI_PROCESSING], cwd=tmp_path, env=env)
    assert processes_with(marker) == {}
    in_memory = _run_in_this_process(args)

    assert workers.returncode == 1, workers.stderr
    assert "Traceback" not in workers.stderr
    lines = workers.stderr.splitlines()
    assert len(lines) == 2, workers.stderr  # the error, and where to see every kind at once
    assert lines[0].startswith(f"error: {tmp_path / 'in' / 'a.txt'}: {BAD_RECORD}")
    assert "--on-error invalid_utf8=" in lines[0] and "seqcache scan" in lines[1]
    assert workers.stdout == ""
    assert (in_memory.returncode, in_memory.stderr, in_memory.stdout) == (1, workers.stderr, "")


@pytest.mark.parametrize("verbose", [
    pytest.param(False, id="quiet"),
    pytest.param(True, id="verbose", marks=pytest.mark.slow),
])
def test_failing_build_exits_when_the_reader_of_its_output_is_gone(tmp_path, bad_corpus, verbose):
    """``seqcache build ... 2>&1 | head -3``: the pipe's reader exits early; a
    worker that fails to write its traceback must not stall the build."""
    env, marker = marked_env()
    proc = subprocess.Popen(
        _seqcache("build", *(["-v"] if verbose else []), "--cache-dir", str(tmp_path / "c"), "--source",
                  f"text:{bad_corpus}", "--name", "mp", *MULTI_PROCESSING),
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    proc.stdout.close()  # the reader is gone: every later write to the pipe fails with EPIPE
    try:
        returncode = proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert returncode == 1
    assert processes_with(marker) == {}
    assert not (tmp_path / "c" / "mp" / "train" / "manifest.json").exists()


@pytest.mark.parametrize("signum, to_group", [
    # Ctrl-C: the terminal sends SIGINT to the whole process group, workers included.
    pytest.param(signal.SIGINT, True, id="ctrl-c"),
    # kill, timeout: SIGTERM to the command alone.
    pytest.param(signal.SIGTERM, False, id="SIGTERM", marks=pytest.mark.slow),
])
def test_interrupted_build_exits_130_or_143_and_leaves_no_worker(tmp_path, signum, to_group):
    env, marker = marked_env()
    # The module is imported by name from the working folder, by the command and by its workers.
    proc, gate = start_gated_build(tmp_path, _seqcache(), build_args=MULTI_PROCESSING, env=env,
                                   start_new_session=to_group, preexec_fn=default_signals)
    try:
        with gate_opened(gate, timeout_s=TIMEOUT_S):  # a worker has opened it: the build runs there
            running = processes_with(marker)
            # A worker: a process of the command's other than the command (forked ones share its command line).
            assert set(running) - {proc.pid}, running
            # The worker stays blocked reading the gate: the command has to stop it.
            stdout, stderr = interrupt(proc, signum, to_group=to_group, timeout_s=TIMEOUT_S)
    finally:
        kill_if_running(proc)
    assert proc.returncode == 128 + signum, stderr  # 130, 143: as a shell reports the signal
    said = "interrupted" if signum == signal.SIGINT else "interrupted by SIGTERM"
    assert stderr == (f"{said}: gated/train has no manifest, so it is not a cache; "
                      "run the same command again to finish it (the work done so far is kept, unless --work off)\n")
    assert stdout == ""
    assert processes_with(marker) == {}
    assert not (tmp_path / "c" / "gated" / "train" / "manifest.json").exists()


def test_a_task_file_given_by_path_reaches_the_workers_and_success_prints_only_its_summary(tmp_path):
    """``--module my_tasks.py`` imports the file under a made-up module name that
    worker processes cannot import: its functions must travel by value. The
    successful build prints its one summary line on standard error, and nothing else."""
    (tmp_path / "a.txt").write_text("one\ntwo\nthree\n")
    (tmp_path / "defs").mkdir()
    (tmp_path / "defs" / "my_tasks.py").write_text(textwrap.dedent(f"""
        from seqcache import tasks

        def shout(example, ctx):  # a preprocessor defined in the file itself
            return dict(example, text=example["text"].upper())

        tasks.TaskRegistry.add(
            "shouted", source=tasks.TextLineSource({str(tmp_path / 'a.txt')!r}),
            output_features={{"targets": tasks.Feature(tasks.ByteVocabulary())}},
            preprocessors=[tasks.FunctionPreprocessor(shout, name="shout"),
                           tasks.preprocessors.rekey({{"targets": "text"}}), tasks.preprocessors.tokenize()])
    """))
    env, marker = marked_env()
    out = _run(["build", "shouted", "--module", str(tmp_path / "defs" / "my_tasks.py"), "--cache-dir",
                str(tmp_path / "c"), *MULTI_PROCESSING], cwd=tmp_path, env=env)
    assert processes_with(marker) == {}
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rf"shouted/train: 3 examples in 1 shard, built in \d+\.\d s -> "
                        rf"{re.escape(str(tmp_path))}/c/shouted/train\n", out.stderr), out.stderr
    assert out.stdout == ""
    from seqcache.feeders.reader import CacheReader
    from seqcache.tasks import ByteVocabulary

    with CacheReader(str(tmp_path / "c" / "shouted" / "train")) as r:
        texts = sorted(ByteVocabulary().decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
    assert texts == ["ONE", "THREE", "TWO"]


def test_a_mistyped_beam_option_is_refused_before_anything_runs(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("one line\n", encoding="utf-8")
    for typo in ("--runnr=dask", "--dask_client_adress=127.0.0.1:1", "--s3_endpoint_ur=http://127.0.0.1:1"):
        out = _run_in_this_process(["build", "--source", f"text:{corpus}", "--name", "t", "--cache-dir",
                                    str(tmp_path / "c"), typo])
        assert out.returncode == 2 and f"no such option: {typo}" in out.stderr, out.stderr
        assert not (tmp_path / "c").exists()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_workers_started_from_the_repository_root_give_the_bytes_of_an_in_memory_build(tmp_path):
    """From a source checkout's root, which comes first on sys.path and holds
    no ``seqcache/`` folder (the core is ``core/``, mapped by package-dir):
    importing the feeder there, and a build whose worker processes start
    there, see the installed package, the one the tests import.
    That build, with multi_processing workers (started through
    ``seqcache.pipelines.worker_main``), writes the same cache bytes as the
    in-memory mode, logs with ``-v``, and leaves no process behind."""
    env, marker = marked_env()
    probe = subprocess.run([sys.executable, "-c", "import seqcache, seqcache.feeders, seqcache.tasks; "
                            "from seqcache.feeders import Feeder; print(seqcache.__file__)"],
                           cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == seqcache.__file__  # the package this process imported, not a folder of the root
    src = write_files(tmp_path / "in", {"a.txt": "".join(f"line {i}\n" for i in range(3000)).encode(),
                                        "b.txt": b"three\nfour\n"})
    common = ["--source", f"text:{src}/*.txt", "--name", "mp", "--num-shards", "3"]
    workers = _run(["build", "-v", "--cache-dir", str(tmp_path / "w"), *common, "--json", *MULTI_PROCESSING],
                   cwd=REPO_ROOT, env=env)
    assert not processes_with(marker)
    assert workers.returncode == 0, workers.stderr
    assert json.loads(workers.stdout)[0]["num_examples"] == 3002
    assert "INFO seqcache.pipelines.build: building mp:" in workers.stderr  # -v logs, with Beam options too
    in_memory = _run_in_this_process(["build", "--cache-dir", str(tmp_path / "m"), *common])
    assert in_memory.returncode == 0, in_memory.stderr
    sums = [(tmp_path / d / "mp" / "train" / "shard-checksums.json").read_bytes() for d in ("w", "m")]
    assert sums[0] == sums[1]
