"""torchtitan's own trainer (``python -m torchtitan.train --module seqcache_torchtitan
--config llama3_seqcache``) reads the packed LM cache through
seqcache.feeders.trainers.torch.TorchtitanDataLoader on CPU.

A run of 6 steps saves torchtitan's DCP checkpoint after step 3; a second run in
a fresh process resumes from that checkpoint. At every step of both runs the
cache indices consumed (recorded by the loader's rows_log as it serves them)
equal the Feeder's for the same seed and global batch, and the resumed steps'
losses equal the uninterrupted run's.

The resume is 1 rank to 1 rank: torchtitan's FSDP on two CPU ranks fails inside
torch. The loader's 1-rank to 2-rank resume is proved in a plain gloo loop
(tests/feeders/test_torch.py), through the same DCP "dataloader" state.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from seqcache.feeders import Feeder
from seqcache.feeders.trainers.torch import STATE_KEY

HERE = pathlib.Path(__file__).resolve().parent
WORK = pathlib.Path(os.environ["SEQCACHE_TRAINER_WORK"]).resolve()
B, L, STEPS, K = 8, 64, 6, 3  # the config module's global batch, sequence length, steps, checkpoint interval
LOG_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")


ROOT = HERE.parents[2]


def lm_cache() -> str:
    """The packed LM cache of caches.txt (a relative path there is from the repository root)."""
    caches = (WORK / "caches.txt").read_text().split()
    return str((ROOT / next(c for c in caches if "shakespeare_lm" in c)).resolve())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train_py(dump: pathlib.Path, cache: str, *extra: str) -> subprocess.CompletedProcess:
    """torchtitan's train.py on one rank (loopback only, 15 minutes at most)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "2"}
    cmd = [sys.executable, "-m", "torchtitan.train", "--module", "seqcache_torchtitan", "--config",
           "llama3_seqcache", "--dataloader.cache", cache, "--dump_folder", str(dump), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)


def train(dump: pathlib.Path, cache: str) -> dict:
    """Runs torchtitan's train.py on one rank; returns its losses and grad norms
    by step (1-based) and the loader's rows log."""
    rows_log = dump / "rows.jsonl"
    proc = run_train_py(dump, cache, "--dataloader.rows_log", str(rows_log))
    (dump / "train.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)
    metrics = {int(s): (float(loss), float(norm)) for s, loss, norm in LOG_LINE.findall(text)}
    rows = [json.loads(line) for line in rows_log.read_text().splitlines()]
    print(f"\n{dump.name}: " + ", ".join(f"step {s} loss {m[0]}" for s, m in sorted(metrics.items())))
    return {"metrics": metrics, "rows": rows, "log": text}


def rows_by_step(rows) -> dict[int, list[int]]:
    """Feeder step -> the cache indices served for it, microbatches in order."""
    out: dict[int, list[int]] = {}
    for r in sorted(rows, key=lambda r: (r["step"], r["rank"], r["microbatch"])):
        out.setdefault(r["step"], []).extend(r["cache_index"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = lm_cache()
    first = tmp_path_factory.mktemp("first")
    whole = train(first, cache)
    resumed_dir = tmp_path_factory.mktemp("resumed")
    # A preempted job's folder: the checkpoint of step K and nothing after it.
    shutil.copytree(first / "checkpoint" / f"step-{K}", resumed_dir / "checkpoint" / f"step-{K}")
    resumed = train(resumed_dir, cache)
    return cache, first, whole, resumed


def feeder_rows(cache: str, steps) -> dict[int, list[int]]:
    with Feeder(cache=cache, global_batch_size=B, sequence_length=L, seed=0, host_index=0, host_count=1) as f:
        return {s: f.get_batch(s)["cache_index"].tolist() for s in steps}


def test_every_step_consumed_the_feeders_rows(runs):
    cache, _, whole, _ = runs
    assert sorted(whole["metrics"]) == list(range(1, STEPS + 1))
    got = rows_by_step(whole["rows"])
    # torchtitan's step s (from 1) is the Feeder's step s - 1, in 2 microbatches of 4 rows.
    assert got == feeder_rows(cache, range(STEPS))
    assert {(r["step"], r["microbatch"]) for r in whole["rows"]} == {(s, m) for s in range(STEPS) for m in (0, 1)}
    assert all(len(r["cache_index"]) == 4 for r in whole["rows"])


def test_the_checkpoint_holds_the_feeders_position_under_dataloader(runs, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    _, first, _, _ = runs
    dcp_to_torch_save(str(first / "checkpoint" / f"step-{K}"), str(tmp_path / "ckpt.pt"))
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    state = json.loads(saved["dataloader"][STATE_KEY])
    assert state["position"] == K * B and state["global_batch_size"] == B and state["seed"] == 0
    assert saved["train_state"]["step"] == K


def test_the_resumed_run_continues_the_stream_with_equal_losses(runs):
    cache, _, whole, resumed = runs
    assert f"step-{K}" in resumed["log"]
    assert sorted(resumed["metrics"]) == list(range(K + 1, STEPS + 1))
    got = rows_by_step(resumed["rows"])
    assert got == feeder_rows(cache, range(K, STEPS))
    assert got == {s: v for s, v in rows_by_step(whole["rows"]).items() if s >= K}
    # CPU, deterministic mode, one rank: the same numbers, as printed.
    for s in range(K + 1, STEPS + 1):
        assert resumed["metrics"][s] == whole["metrics"][s], s
    assert len({whole["metrics"][s][0] for s in whole["metrics"]}) == STEPS  # it trains: the loss moves


@pytest.mark.parametrize("loader_batch,match", [
    ("-1", "dataloader.global_batch_size = -1: set it to training.global_batch_size"),
    # 16 rows = 4 microbatches of 4 per step; torchtitan (B = 8: 2 per step)
    # checkpoints every 3 x 2 = 6 microbatches, mid-way through a loader step.
    ("16", "dataloader.global_batch_size = 16 is 4 microbatches of 4 rows per step on 1 rank(s), but torchtitan "
           "checkpoints every 6 microbatches"),
])
def test_a_loader_global_batch_other_than_torchtitans_is_refused(tmp_path, loader_batch, match):
    """The loader cannot read training.global_batch_size (8 here): it requires
    its own, and refuses one that torchtitan's checkpoint interval shows to differ."""
    proc = run_train_py(tmp_path, lm_cache(), "--dataloader.global_batch_size", loader_batch)
    assert proc.returncode != 0
    assert match in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-4000:]
