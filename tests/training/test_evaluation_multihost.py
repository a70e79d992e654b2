"""``seqcache eval`` on one process and on two (jax.distributed on 127.0.0.1,
CPU devices, as tests/training/test_multihost.py): the predictions of an eval
split are exactly one per example either way, and the same ones.

The run is trained for two steps on the copy task in this process (8 CPU
devices); the single-process evaluation runs here too, the two-process one in
two fresh processes of 4 devices each. The eval split (40 examples, batches of
16) ends with a partial batch: 8 padding rows, on process 1 only. Process
0's standard output is its one JSON line, and process 1's is empty: what
Gloo prints to file descriptor 1 goes to the standard error."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import pipelines
from seqcache.cli.main import main
from seqcache.training import distributed

HERE = pathlib.Path(__file__).resolve().parent
MODULE = str(HERE / "copy_tasks.py")
RUN_TIMEOUT_S = 300
B = 16
EVAL_LINES = 40
LENGTH = 8


def _copy_tasks():
    spec = importlib.util.spec_from_file_location("seqcache_eval_copy_tasks", MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _lines(rng, n):
    return ["".join(rng.choice(list("0123456789abcdefghijklmnopqrstuvwxyz"), size=6, replace=False))
            for _ in range(n)]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("evalmh")
    rng = np.random.default_rng(1)
    for split, n in (("train", 64), ("validation", EVAL_LINES)):
        (root / f"{split}.txt").write_text("\n".join(_lines(rng, n)) + "\n")
        task = _copy_tasks().copy_task("copy", str(root / f"{split}.txt"))
        pipelines.build_task(task, cache_dir=str(root / "caches"), config=pipelines.BuildConfig(split=split,
                                                                                                num_shards=2))
    run = root / "run"
    res = CliRunner().invoke(main, [
        "train", "--module", MODULE, "--cache-dir", str(root / "caches"), "--task", "copy",
        "--model", "tiny", "--steps", "2", "--batch-size", str(B), "--sequence-length", str(LENGTH),
        "--checkpoint-dir", str(run), "--set",
        f"inputs_sequence_length={LENGTH} progress=false checkpoint.async_save=false tensorboard=false"],
        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return root, run


def _eval_args(root, run, out):
    return ["eval", "--checkpoint-dir", str(run), "--module", MODULE, "--cache-dir",
            str(root / "caches"), "--task", "copy", "--output-dir", str(out), "--max-decode-length", "6"]


def _rows(out):
    path = out / "eval" / "copy" / "validation" / "step_2" / "predictions.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_two_processes_predict_each_example_once_like_one(small_run, tmp_path, compilation_cache_env):
    root, run = small_run
    res = CliRunner().invoke(main, _eval_args(root, run, tmp_path / "one"), catch_exceptions=False)
    assert res.exit_code == 0, res.output
    one = _rows(tmp_path / "one")

    port = distributed.free_port()
    base = {**os.environ, **compilation_cache_env, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "seqcache.cli", *_eval_args(root, run, tmp_path / "two")]
    procs = [subprocess.Popen(argv, env=distributed.local_process_env(index=i, count=2, port=port,
                                                                      devices_per_process=4, base=base),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for i in range(2)]
    try:
        outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [e.decode()[-3000:] for _, e in outs]
    # Only process 0 prints the summary and writes the files. Its standard
    # output is that one JSON line and nothing else: what Gloo and JAX print
    # while the processes connect goes to standard error.
    stdout = [out.decode() for out, _ in outs]
    assert stdout[0].count("\n") == 1 and stdout[0].endswith("\n"), stdout[0][:2000]
    assert json.loads(stdout[0])["examples"] == {"copy": EVAL_LINES}
    assert stdout[1] == "", stdout[1][:2000]
    two = _rows(tmp_path / "two")
    # Exactly one prediction per example, in cache order, on 1 and on 2 processes.
    assert [r["cache_index"] for r in one] == [r["cache_index"] for r in two] == list(range(EVAL_LINES))
    for a, b in zip(one, two):
        assert (a["source"], a["line"], a["targets"]) == (b["source"], b["line"], b["targets"])
        assert a["prediction"] == b["prediction"]


def test_what_a_library_prints_to_descriptor_1_goes_to_stderr_and_print_to_stdout():
    """``stdout_for_output_only``, as ``seqcache train`` and ``eval`` call it
    before JAX starts: a write to descriptor 1 (as Gloo's C++ makes) goes to
    the standard error, ``print`` and ``click.echo`` to the standard output,
    and so does a child process's descriptor 1 (it inherits the standard error)."""
    code = ("import os, subprocess, sys, click; from seqcache.cli.commands import common; "
            "common.stdout_for_output_only(); os.write(1, b'native\\n'); print('printed'); click.echo('echoed'); "
            "subprocess.run(['echo', 'child'], check=True)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("printed\nechoed\n", "native\nchild\n")
