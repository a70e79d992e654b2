"""Several real JAX processes on this machine: the trainer and the feeder across
hosts, checked against one process.

Each run is ``seqcache train`` (through child_multihost.py, which records the
cache indices every process's feeder returned) in fresh processes: a single
process with 8 CPU devices, or P processes with 8 / P devices each, joined by
``jax.distributed.initialize`` on 127.0.0.1 (a free port) with gloo collectives.
The default suite's single-process reference runs the same command line with the
same recorder in the test process itself, which has the same 8 CPU devices.
The mesh is the same in every run (fsdp = 8, rules fsdp: parameters, optimizer
state and the batch sharded over all 8 devices, across the processes).

What is proven:
- the union of the rows the P processes read at every step is the global batch
  of the single-process run, row for row (cache indices and epochs), and each
  process reads exactly its own rows [h * B / P, (h + 1) * B / P);
- per-step losses equal the single-process run's within LOSS_RTOL (measured:
  about 1e-7 relative; not bit-exact, because the cross-process all-reduces sum
  in another order than the in-process ones);
- a finite eval split over 2 processes reads every example exactly once, the
  padding rows carry zero weight, and the metrics equal the single-process run's;
- only process 0 writes metrics.jsonl and config.json;
- (slow) a 2-process run stopped by SIGTERM at step N, through the local
  launcher, saves one checkpoint whose feeder state equals a single-process
  run's at step N; it resumes on 1 process x 8 devices and on 4 processes x 2
  devices with the data stream continuing exactly (no example lost or repeated
  over the whole run), and on 2 processes x 4 devices with bit-identical
  parameters; ``seqcache which`` reads the checkpoint's feeder state.

Every process is started in its own session with a deadline; all of them are
killed at the end of each run, whatever happened.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.training import distributed
from seqcache.training.metrics import read_metrics, read_tensorboard
from testsupport import SMALL_MODEL

HERE = pathlib.Path(__file__).resolve().parent
CHILD = str(HERE / "child_multihost.py")
DEVICES = 8
B = 16  # global batch: 8 batch shards, 8 / 4 / 2 / 1 rows per host
L = 32
# Per-step losses of P processes against 1 process (same mesh, same shardings):
# measured differences are about 1e-7 relative (float32 all-reduce order).
LOSS_RTOL = 1e-5
EVAL_RTOL = 1e-6
RUN_TIMEOUT_S = 300

WORDS = "the king is dead long live queen a horse my kingdom for to be or not that question".split()
TRAIN_EXAMPLES = 100  # the 8 steps of 16 rows of the slow test cross into epoch 1
EVAL_EXAMPLES = 50  # 4 eval batches of 16 rows, the last with 14 padding rows


def _write_cache(path, n, split, seed):
    """A byte-level, unpacked cache of ``n`` short sentences (vocabulary 259)."""
    from seqcache.pipelines.writer import write_cache

    rng = np.random.default_rng(seed)
    shards = [[], []]
    for i in range(n):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 9))))
        tokens = np.frombuffer(text.encode(), np.uint8).astype(np.int32) + 3
        shards[i * 2 // n].append(({"targets": tokens}, [(0, i, 0)]))
    write_cache(str(path), task="toy", split=split, features=(fmt.FeatureSpec("targets", "int32"),), shards=shards,
                sources=[{"path": f"corpus/{split}.txt"}], vocabularies={"targets": {"vocab_size": 259}},
                fingerprint_inputs={"split": split, "n": n, "seed": seed})


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    pytest.importorskip("seqcache.pipelines")
    root = tmp_path_factory.mktemp("caches")
    _write_cache(root / "toy" / "train", TRAIN_EXAMPLES, "train", 0)
    _write_cache(root / "toy" / "validation", EVAL_EXAMPLES, "validation", 1)
    return root


def _args(caches, ckpt, steps, *extra):
    # The tiny model shrunk to one layer (SMALL_MODEL): every parameter is still
    # sharded over the 8 devices, and each process compiles a smaller program.
    return ["train", "--cache-dir", str(caches), "--task", "toy", "--model", "tiny", "--steps", str(steps),
            "--batch-size", str(B), "--sequence-length", str(L), "--mesh", "data=1,fsdp=-1", "--rules", "fsdp",
            "--checkpoint-dir", str(ckpt), "--set", SMALL_MODEL, "--set", "progress=false checkpoint.async_save=false",
            *extra]


class _Run:
    """The processes of one run: started together, stopped together."""

    def __init__(self, argv, envs, rows_dir, pause_at=None):
        rows_dir.mkdir(parents=True, exist_ok=True)
        self.rows_dir = rows_dir
        self.procs = []
        self.stderr_files = []
        for i, env in enumerate(envs):
            env = {**env, "ROWS_DIR": str(rows_dir)}
            if pause_at is not None:
                env["PAUSE_AT"] = str(pause_at)
            err = open(rows_dir / f"stderr-{i}.txt", "w")
            self.stderr_files.append(err)
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               stderr=err, start_new_session=True))
        # A deadline for the whole run: a process stuck in a collective is killed,
        # which ends the reads below with EOF and fails the test.
        self.timer = threading.Timer(RUN_TIMEOUT_S, self.kill)
        self.timer.start()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def finish(self):
        """Waits for every process; returns [(exit status, summary JSON)]."""
        try:
            out = []
            for p in self.procs:
                stdout, _ = p.communicate()
                lines = [x for x in stdout.decode().splitlines() if x.startswith("{")]
                out.append((p.returncode, json.loads(lines[-1]) if lines else None))
            return out
        finally:
            self.timer.cancel()
            self.kill()
            for p in self.procs:
                p.wait()
            for f in self.stderr_files:
                f.close()

    def stderr(self):
        return "\n".join(f.name + ":\n" + pathlib.Path(f.name).read_text()[-3000:] for f in self.stderr_files)


def _envs(num_processes, cache_env):
    base = {**os.environ, **cache_env}
    if num_processes == 1:
        flags = [f for f in base.get("XLA_FLAGS", "").split() if "device_count" not in f]
        return [{**base, "XLA_FLAGS": " ".join(flags + [f"--xla_force_host_platform_device_count={DEVICES}"])}]
    port = distributed.free_port()
    return [distributed.local_process_env(index=i, count=num_processes, port=port,
                                          devices_per_process=DEVICES // num_processes, base=base)
            for i in range(num_processes)]


def _run(args, rows_dir, num_processes, cache_env, *, expect=0):
    run = _Run([sys.executable, CHILD, *args], _envs(num_processes, cache_env), rows_dir)
    results = run.finish()
    assert [code for code, _ in results] == [expect] * num_processes, run.stderr()
    return [summary for _, summary in results]


def _run_here(args, rows_dir):
    """``_run(args, rows_dir, 1, ...)`` in this process: the real command line on
    this process's 8 CPU devices, with child_multihost.py's recorder in place of
    ``Feeder.__next__`` for the run."""
    import importlib.util

    from seqcache.cli.main import main
    from seqcache.feeders import Feeder

    assert jax.device_count() == DEVICES
    spec = importlib.util.spec_from_file_location("seqcache_multihost_child", CHILD)
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    rows_dir.mkdir(parents=True, exist_ok=True)
    original = Feeder.__next__
    Feeder.__next__ = child.recording_next(str(rows_dir), "0")
    try:
        result = CliRunner().invoke(main, args, catch_exceptions=False)
    finally:
        Feeder.__next__ = original
    assert result.exit_code == 0, result.output
    return [json.loads([x for x in result.output.splitlines() if x.startswith("{")][-1])]


def _rows(rows_dir, kind, num_processes, steps=None):
    """{step: (cache indices, epochs, row weights) of the global batch}, put
    together from every process's record of its own rows."""
    per_step: dict[int, dict[int, dict]] = {}
    for i in range(num_processes):
        path = rows_dir / f"{kind}-{i}.jsonl"
        for line in path.read_text().splitlines():
            r = json.loads(line)
            assert r["hosts"] == num_processes and r["host"] == i
            assert r["first_row"] == i * B // num_processes and len(r["cache_index"]) == B // num_processes
            assert r["first_row"] not in per_step.setdefault(r["step"], {}), f"step {r['step']} read twice"
            per_step[r["step"]][r["first_row"]] = r
    out = {}
    for step, parts in per_step.items():
        if steps is not None and step not in steps:
            continue
        assert sorted(parts) == [i * B // num_processes for i in range(num_processes)], (step, sorted(parts))
        rows = [parts[k] for k in sorted(parts)]
        out[step] = tuple(np.concatenate([r[key] for r in rows]) for key in ("cache_index", "epoch", "weight"))
    return out


def _same_rows(a, b):
    assert sorted(a) == sorted(b)
    for step in a:
        for x, y in zip(a[step], b[step]):
            np.testing.assert_array_equal(x, y, err_msg=f"step {step}")


def _train_losses(path):
    return [m["loss"] for m in read_metrics(str(path)) if "loss" in m]


# -- default suite: 2 processes x 4 devices against 1 process x 8 devices -------------

STEPS = 3


@pytest.fixture(scope="module")
def one_and_two(caches, tmp_path_factory, compilation_cache_env):
    tmp = tmp_path_factory.mktemp("multihost")
    out = {}
    for n in (1, 2):
        args = _args(caches, tmp / f"ckpt{n}", STEPS, "--eval-split", "validation")
        summaries = (_run_here(args, tmp / "rows1") if n == 1 else
                     _run(args, tmp / f"rows{n}", n, compilation_cache_env))
        out[n] = (tmp / f"ckpt{n}", tmp / f"rows{n}", summaries)
    return out


def test_two_processes_read_their_rows_and_train_like_one(one_and_two):
    (ckpt1, rows1, (s1,)), (ckpt2, rows2, s2) = one_and_two[1], one_and_two[2]
    # Union of the rows the two processes read = the single process's global batch.
    single, multi = _rows(rows1, "train", 1), _rows(rows2, "train", 2)
    assert sorted(single) == list(range(STEPS))
    _same_rows(single, multi)
    # Per-step losses within the stated tolerance (measured: ~1e-7 relative).
    l1, l2 = _train_losses(ckpt1 / "metrics.jsonl"), _train_losses(ckpt2 / "metrics.jsonl")
    assert len(l1) == len(l2) == STEPS  # one line per step: only process 0 writes
    # Only process 0 writes TensorBoard events too: one file, the same losses.
    (events,) = (ckpt2 / "tensorboard").glob("events.out.tfevents.*")
    tb = read_tensorboard(str(ckpt2 / "tensorboard"))["train/loss"]
    assert [step for step, _ in tb] == list(range(STEPS)) and [v for _, v in tb] == [float(np.float32(x)) for x in l2]
    np.testing.assert_allclose(l2, l1, rtol=LOSS_RTOL)
    # Both processes end with the same parameters (the digest gathers the shards).
    assert s2[0]["params_sha256"] == s2[1]["params_sha256"]
    assert [s["process"] for s in s2] == [0, 1] and s2[0]["end_step"] == STEPS
    c1, c2 = (json.loads((c / "config.json").read_text()) for c in (ckpt1, ckpt2))
    for c in (c1, c2):
        c["checkpoint"].pop("directory")
    assert c1 == c2  # the config does not depend on the process count
    assert not list(ckpt2.glob("*.tmp-*"))


def test_eval_over_two_processes_reads_every_example_once(one_and_two):
    (ckpt1, rows1, (s1,)), (ckpt2, rows2, s2) = one_and_two[1], one_and_two[2]
    single, multi = _rows(rows1, "eval", 1), _rows(rows2, "eval", 2)
    _same_rows(single, multi)
    index = np.concatenate([multi[s][0] for s in sorted(multi)])
    weight = np.concatenate([multi[s][2] for s in sorted(multi)])
    real = index >= 0
    assert sorted(index[real].tolist()) == list(range(EVAL_EXAMPLES))  # every example, exactly once
    assert (~real).sum() == len(multi) * B - EVAL_EXAMPLES and len(multi) == -(-EVAL_EXAMPLES // B)
    assert np.all(weight[~real] == 0) and np.all(weight[real] > 0)  # padding rows weigh nothing
    assert s2[0]["eval_tokens"] == s1["eval_tokens"] == float(weight.sum())
    assert s2[0]["eval_batches"] == s1["eval_batches"] == len(multi)
    for key in ("eval_loss", "eval_accuracy"):
        assert s2[0][key] == s2[1][key]
        assert s2[0][key] == pytest.approx(s1[key], rel=EVAL_RTOL)


def test_settings_from_flags_and_environment():
    s = distributed.settings_from(environ={"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "4",
                                           "JAX_PROCESS_ID": "3"})
    assert (s.coordinator_address, s.num_processes, s.process_id, s.enabled) == ("10.0.0.2:1234", 4, 3, True)
    s = distributed.settings_from(process_id=1, environ={"JAX_PROCESS_ID": "3"})
    assert s.process_id == 1
    assert not distributed.settings_from(environ={}).enabled
    with pytest.raises(distributed.DistributedError, match="missing: --num-processes, --process-id"):
        distributed.Settings(coordinator_address="h:1").validate()
    with pytest.raises(distributed.DistributedError, match=r"--process-id must be in \[0, 2\)"):
        distributed.Settings(coordinator_address="h:1", num_processes=2, process_id=2).validate()
    with pytest.raises(distributed.DistributedError, match="HOST:PORT"):
        distributed.Settings(coordinator_address="h", num_processes=2, process_id=0).validate()
    env = distributed.local_process_env(index=1, count=2, port=555, devices_per_process=4,
                                        base={"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --foo"})
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=4"
    assert (env["JAX_COORDINATOR_ADDRESS"], env["JAX_NUM_PROCESSES"], env["JAX_PROCESS_ID"]) == (
        "127.0.0.1:555", "2", "1")


def test_cli_refuses_inconsistent_process_settings(caches, tmp_path):
    from seqcache.cli.commands.train import train

    result = CliRunner().invoke(train, _args(caches, tmp_path, 1, "--process-id", "0")[1:])
    assert result.exit_code == 2 and "missing: --coordinator-address, --num-processes" in result.output
    result = CliRunner().invoke(train, _args(caches, tmp_path, 1, "--local-processes", "2", "--num-processes",
                                             "2")[1:])
    assert result.exit_code == 2 and "--local-processes starts its own processes" in result.output


# -- slow: preempted on 2 processes, resumed on 1, 2 and 4 ---------------------------------

N = 4  # stop after N steps; the whole run is 2N (128 rows: all of epoch 0, 28 of epoch 1)


@pytest.mark.slow
def test_preempted_on_two_processes_resumes_on_one_two_and_four(caches, tmp_path, compilation_cache_env):
    steps = 2 * N
    env = {**os.environ, **compilation_cache_env}
    # The uninterrupted references: 1 process x 8 devices and 2 processes x 4 devices.
    _run(_args(caches, tmp_path / "straight1", steps, "--set", f"checkpoint.every_steps={N}"),
         tmp_path / "rows-straight1", 1, compilation_cache_env)
    straight2 = _run(_args(caches, tmp_path / "straight2", steps), tmp_path / "rows-straight2", 2,
                     compilation_cache_env)
    reference = _rows(tmp_path / "rows-straight1", "train", 1)
    ref_losses = _train_losses(tmp_path / "straight1" / "metrics.jsonl")

    # 2 processes through the local launcher; SIGTERM to the launcher while both wait
    # before step N: it passes the signal on, both save checkpoint N, status 143.
    pre_dir, pre_rows = tmp_path / "preempted", tmp_path / "rows-preempted"
    pre_rows.mkdir()
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from seqcache.training.distributed import launch_local; "
         f"sys.exit(launch_local(sys.argv[1:], num_processes=2, devices_per_process={DEVICES // 2}))",
         sys.executable, CHILD, *_args(caches, pre_dir, steps)],
        env={**env, "ROWS_DIR": str(pre_rows), "PAUSE_AT": str(N)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    timer = threading.Timer(RUN_TIMEOUT_S, lambda: os.killpg(launcher.pid, signal.SIGKILL))
    timer.start()
    stderr_tail = []
    try:
        paused = []
        for line in launcher.stdout:  # (gloo prints its connections to stderr: stdout_for_output_only)
            if line.startswith(b"PAUSED"):
                paused.append(line.decode().strip())
                if len(paused) == 2:
                    break
        assert paused == [f"PAUSED {N}"] * 2
        launcher.send_signal(signal.SIGTERM)
        for line in launcher.stderr:  # the launcher says when the signal is passed on
            stderr_tail.append(line.decode())
            if "sent SIGTERM to 2 processes" in stderr_tail[-1]:
                break
        launcher.stdin.write(b"\n\n")  # one byte for each process
        launcher.stdin.flush()
        rest, err = launcher.communicate()
        stderr_tail.append(err.decode()[-4000:])
        assert launcher.returncode == 143, "".join(stderr_tail)[-4000:]
    finally:
        timer.cancel()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        # The launcher names its processes ("... pids A B"); none may outlive the test.
        for line in stderr_tail:
            if "started 2 processes" in line:
                for pid in line.split("pids", 1)[1].split():
                    try:
                        os.killpg(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    summaries = [json.loads(x) for x in rest.decode().splitlines() if x.startswith("{")]
    assert sorted(s["process"] for s in summaries) == [0, 1]
    assert all(s["end_step"] == N and s["stopped_by_signal"] for s in summaries)
    assert sorted(p.name for p in pre_dir.iterdir() if p.name.isdigit()) == [str(N)]
    # The feeder state in the checkpoint is the same as a single process saves.
    state = json.loads((pre_dir / str(N) / "feeder" / "metadata").read_text())
    assert state == json.loads((tmp_path / "straight1" / str(N) / "feeder" / "metadata").read_text())
    first = _rows(pre_rows, "train", 2, steps=range(N))

    # `seqcache which` reads it: row 5 of step N - 1 is what the processes read.
    from seqcache.cli.main import main

    for row in (0, 5, B - 1):  # rows of process 0 and of process 1
        which = CliRunner().invoke(main, ["which", str(pre_dir / str(N)), "--step", str(N - 1), "--row", str(row),
                                          "--json", "--no-tokens"])
        assert which.exit_code == 0, which.output
        shown = json.loads(which.output)
        assert (shown["cache_index"], shown["epoch"]) == (int(first[N - 1][0][row]), int(first[N - 1][1][row]))

    # Resume elsewhere: 1 process x 8 devices, 4 processes x 2, and 2 x 4 (unchanged).
    for n in (1, 4, 2):
        ckpt = tmp_path / f"resumed{n}"
        shutil.copytree(pre_dir, ckpt)
        summary = _run(_args(caches, ckpt, steps), tmp_path / f"rows-resumed{n}", n, compilation_cache_env)
        assert all(s["start_step"] == N and s["end_step"] == steps for s in summary)
        second = _rows(tmp_path / f"rows-resumed{n}", "train", n)
        assert sorted(second) == list(range(N, steps))
        whole = {**first, **second}
        _same_rows(whole, reference)
        # No example lost or repeated over the whole run: (epoch, cache index) pairs
        # are all distinct, and epoch 0 holds every example once.
        pairs = [(int(e), int(i)) for s in sorted(whole) for i, e in zip(whole[s][0], whole[s][1])]
        assert len(set(pairs)) == len(pairs) == steps * B
        assert sorted(i for e, i in pairs if e == 0) == list(range(TRAIN_EXAMPLES))
        losses = _train_losses(ckpt / "metrics.jsonl")
        assert len(losses) == steps
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        if n == 2:  # same mesh, same processes and devices: bit-identical parameters
            assert [s["params_sha256"] for s in summary] == [s["params_sha256"] for s in straight2]
            assert losses == _train_losses(tmp_path / "straight2" / "metrics.jsonl")
