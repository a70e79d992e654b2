"""t5x's own train.py (python -m t5x.train) on the two caches of make_caches.sh,
through seqcache.feeders.trainers.t5x: at every step the cache indices of the rows t5x
consumed are the Feeder's for the same seed and global batch, in a run that
stops at step K on one process and resumes on two through t5x's own checkpoint,
and its losses equal those of the uninterrupted run.

Runs in the t5x venv of run.sh (t5x, seqio, clu, TensorFlow, JAX on CPU)."""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from seqcache.feeders import Feeder
from seqcache.feeders.trainers import t5x as seqcache_t5x

WORK = os.environ["SEQCACHE_TRAINER_WORK"]
B = 8  # global batch (rows)
K = 3  # the step the interrupted run stops at
TOTAL = 6  # steps
SEED = 0
TIMEOUT = 600  # seconds, per t5x process

CASES = {
    # cache line in caches.txt, gin file, the Feeder's sequence length of "targets"
    "decoder_only": ("shakespeare_lm", "seqcache_decoder_only_tiny.gin", 64),
    "t5_1_1_tiny": ("c4_span", "seqcache_t5_1_1_tiny.gin", 16),
}


def cache_of(name: str) -> str:
    with open(os.path.join(WORK, "caches.txt")) as f:
        for line in f:
            if f"/{name}/" in line:
                return line.strip()
    raise AssertionError(f"{WORK}/caches.txt names no {name} cache (run tests/trainers/make_caches.sh)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(gin_file: str, cache: str, model_dir: str, record: str, steps: int, processes: int, log: str) -> None:
    """Runs t5x's train.py to ``steps`` in ``processes`` processes (JAX
    distributed on 127.0.0.1, one CPU device each); raises with the log's tail
    if one fails or runs past TIMEOUT."""
    args = [sys.executable, "-m", "t5x.train",
            f"--gin_search_paths={seqcache_t5x.gin_dir()}", f"--gin_file={gin_file}",
            f"--gin.CACHE='{cache}'", f"--gin.MODEL_DIR='{model_dir}'", f"--gin.TRAIN_STEPS={steps}",
            f"--gin.BATCH_SIZE={B}", f"--gin.SEED={SEED}",
            f"--gin.utils.SaveCheckpointConfig.period={K}",
            "--gin.train.stats_period=1",
            f"--gin.get_deterministic_dataset.record_path='{record}'",
            "--alsologtostderr"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    port = free_port()
    procs, logs = [], []
    for i in range(processes):
        extra = [] if processes == 1 else [
            "--multiprocess_gpu", "--coordinator_address=127.0.0.1:%d" % port,
            f"--process_count={processes}", f"--process_index={i}"]
        out = open(f"{log}.{i}", "w")
        logs.append(out)
        procs.append(subprocess.Popen(args + extra, stdout=out, stderr=subprocess.STDOUT, env=env))
    failed = []
    try:
        for i, p in enumerate(procs):
            try:
                rc = p.wait(timeout=TIMEOUT)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            if rc != 0:
                failed.append((i, rc))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for out in logs:
            out.close()
    if failed:
        tails = "\n".join(f"--- process {i} (exit {rc}):\n" + open(f"{log}.{i}").read()[-4000:] for i, rc in failed)
        raise AssertionError(f"t5x.train failed: {tails}")


def consumed(record: str) -> dict[int, list[int]]:
    """step -> the cache indices of the global batch t5x consumed at that step
    (the hosts' rows in host order), from the iterator's record; a step
    recorded twice by one host fails."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for line in open(record):
        r = json.loads(line)
        hosts = by_step.setdefault(r["step"], {})
        assert r["shard_id"] not in hosts, f"step {r['step']} consumed twice by host {r['shard_id']}"
        hosts[r["shard_id"]] = r["cache_index"]
    return {s: sum((h[i] for i in sorted(h)), []) for s, h in sorted(by_step.items())}


def losses(model_dir: str) -> dict[int, float]:
    """step -> t5x's training loss summary (model_dir/train event files)."""
    import tensorflow as tf

    out = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "train", "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for v in event.summary.value:
                if v.tag == "loss":
                    out[int(event.step)] = float(tf.make_ndarray(v.tensor)) if v.HasField("tensor") else v.simple_value
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_t5x_consumes_the_feeders_rows_and_resumes_on_two_processes(case, tmp_path):
    name, gin_file, length = CASES[case]
    cache = cache_of(name)
    with Feeder(cache=cache, global_batch_size=B, sequence_length=length, seed=SEED,
                host_index=0, host_count=1) as feeder:
        want = {s: feeder.get_batch(s)["cache_index"].tolist() for s in range(TOTAL)}

    # Uninterrupted: one process, steps 0..TOTAL-1.
    a_dir, a_rec = str(tmp_path / "a"), str(tmp_path / "a.jsonl")
    train(gin_file, cache, a_dir, a_rec, TOTAL, 1, str(tmp_path / "a.log"))
    # Interrupted: one process to step K (t5x saves checkpoint_K), then two
    # processes resume from t5x's checkpoint in the same model folder.
    b_dir, b1_rec, b2_rec = str(tmp_path / "b"), str(tmp_path / "b1.jsonl"), str(tmp_path / "b2.jsonl")
    train(gin_file, cache, b_dir, b1_rec, K, 1, str(tmp_path / "b1.log"))
    assert seqcache_t5x.latest_checkpoint_step(b_dir) == K
    train(gin_file, cache, b_dir, b2_rec, TOTAL, 2, str(tmp_path / "b2.log"))

    a, b1, b2 = consumed(a_rec), consumed(b1_rec), consumed(b2_rec)
    la, lb = losses(a_dir), losses(b_dir)
    print(f"\n{case}: cache {cache}, global batch {B}, stop at step {K} on 1 process, resume on 2")
    for s in range(TOTAL):
        resumed = b1.get(s) if s < K else b2.get(s)
        print(f"  step {s}: rows {a.get(s) == want[s]} uninterrupted, {resumed == want[s]} "
              f"{'1 process' if s < K else '2 processes'}; loss {la.get(s + 1)!r} vs {lb.get(s + 1)!r}")
    assert a == want, "uninterrupted run: consumed rows differ from the Feeder's"
    assert b1 == {s: want[s] for s in range(K)}, "1-process run to step K: rows differ"
    assert b2 == {s: want[s] for s in range(K, TOTAL)}, "2-process resume: rows differ"
    steps = list(range(1, TOTAL + 1))  # t5x writes the loss of step s's batch at step s + 1
    assert sorted(la) == steps and sorted(lb) == steps, (la, lb)
    for s in range(1, K + 1):
        assert la[s] == lb[s], f"loss at step {s}: {la[s]} != {lb[s]} (same 1-process run)"
    diff = max(abs(la[s] - lb[s]) / abs(la[s]) for s in steps)
    print(f"  largest relative loss difference: {diff:.3g}")
    np.testing.assert_allclose([lb[s] for s in steps], [la[s] for s in steps], rtol=1e-5, atol=0)
