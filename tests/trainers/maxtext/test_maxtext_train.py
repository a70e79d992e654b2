"""MaxText 0.2.5, for real, on the packed LM cache exported by `seqcache export
--format maxtext` (run.sh writes the export with the project's own seqcache).

Four MaxText launches of its own pre-training entry point (tests/trainers/maxtext/
maxtext_run.py records, per process, the token ids of every batch its train loop
takes, with grain's global_next_index):

  A  1 process, steps 0..7, uninterrupted;
  B  1 process, stopped after step 4 (steps=5), checkpoint at step folder 4;
  C' 2 processes resuming B's checkpoint as MaxText wrote it: refused (the
     upstream bug: grain's elastic state saved as one file per process);
  C  2 processes resuming B's checkpoint after the workaround (the state file
     copied to one per new process), steps 5..7.

What is observed is the token ids of the rows each process fed to the train
step. A row's cache index is identified by its tokens: every consumed row must
equal exactly one row of the exported stream. At every step the cache indices
consumed equal the Feeder's for the same seed and global batch, and on 2
processes each process holds the Feeder's host slice.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest

from seqcache.feeders import Feeder
from seqcache.feeders.trainers.export import position_of_record, read_export

HERE = pathlib.Path(__file__).resolve().parent
WORK = pathlib.Path(os.environ["SEQCACHE_TRAINER_WORK"])
OUT = WORK / "maxtext"
EXPORT = OUT / "export"
B, L, STEPS, K, H = 4, 64, 8, 5, 2  # K: steps of the stopped run B; H: the export's host count
TIMEOUT_S = 900
# A tiny decoder on CPU; the data flags come from the export (export.json: maxtext_flags).
MODEL = [
    "hardware=cpu", "dtype=float32", "attention=dot_product", "vocab_size=1024", "base_emb_dim=32",
    "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64", "base_num_decoder_layers=2", "head_dim=16",
    f"learning_rate_schedule_steps={STEPS}", "enable_checkpointing=true", "async_checkpointing=false",
    "checkpoint_period=4", "enable_tensorboard=false", "grain_worker_count=0",
]


def _config() -> str:
    import maxtext

    return str(pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tag: str, *, run_name: str, processes: int, steps: int, tokenizer: str) -> dict:
    """Runs MaxText on ``processes`` CPU processes (one device each); returns the
    return codes, the records of consumed batches and the per-process logs."""
    export = read_export(EXPORT)
    record = OUT / f"{tag}.jsonl"
    record.unlink(missing_ok=True)
    port = _free_port()
    procs, logs = [], []
    for p in range(processes):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   SEQCACHE_MAXTEXT_RECORD=str(record))
        args = [_config(), f"run_name={run_name}", f"base_output_directory={OUT / 'runs'}",
                f"tokenizer_path={tokenizer}", f"steps={steps}", f"per_device_batch_size={B // processes}",
                f"metrics_file={OUT / f'{tag}.metrics.{p}.jsonl'}", *export["maxtext_flags"], *MODEL]
        if processes > 1:
            env.update(SEQCACHE_MAXTEXT_PROCESSES=str(processes), SEQCACHE_MAXTEXT_PROCESS_ID=str(p),
                       SEQCACHE_MAXTEXT_COORDINATOR=f"127.0.0.1:{port}")
        else:
            args.append("skip_jax_distributed_system=true")
        (OUT / f"{tag}.metrics.{p}.jsonl").unlink(missing_ok=True)
        log = open(OUT / f"{tag}.log.{p}.txt", "w")
        logs.append(OUT / f"{tag}.log.{p}.txt")
        procs.append(subprocess.Popen([sys.executable, str(HERE / "maxtext_run.py"), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=OUT))
        log.close()
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append("timeout")
    lines = [json.loads(x) for x in record.read_text().splitlines()] if record.exists() else []
    return {"codes": codes, "batches": lines, "logs": logs, "processes": processes, "tag": tag}


def _tail(run: dict) -> str:
    return "\n".join(f"--- {p}\n" + "\n".join(p.read_text().splitlines()[-25:]) for p in run["logs"])


def _losses(tag: str) -> dict[int, float]:
    path = OUT / f"{tag}.metrics.0.jsonl"
    return {int(d["step"]): d["learning/loss"] for d in map(json.loads, path.read_text().splitlines())}


@pytest.fixture(scope="module")
def runs():
    caches = (WORK / "caches.txt").read_text().split()
    tokenizer = str(WORK / "spm-1k.model")
    export = read_export(EXPORT)
    assert (export["global_batch_size"], export["sequence_length"], export["host_count"]) == (B, L, H)
    assert export["steps"] >= STEPS
    shutil.rmtree(OUT / "runs", ignore_errors=True)
    out = {"cache": caches[0]}
    out["A"] = _launch("A", run_name="uninterrupted", processes=1, steps=STEPS, tokenizer=tokenizer)
    out["B"] = _launch("B", run_name="stopped", processes=1, steps=K, tokenizer=tokenizer)
    iter_dir = OUT / "runs" / "stopped" / "checkpoints" / str(K - 1) / "iter"
    out["saved_files"] = sorted(p.name for p in iter_dir.glob("*.json")) if iter_dir.exists() else []
    out["saved_state"] = (json.loads((iter_dir / "process_0-of-1.json").read_text())
                          if (iter_dir / "process_0-of-1.json").exists() else None)
    # The checkpoint exactly as MaxText wrote it: refused on 2 processes.
    out["C_as_saved"] = _launch("C_as_saved", run_name="stopped", processes=2, steps=STEPS, tokenizer=tokenizer)
    # The workaround: grain's elastic state is one global scalar, the same for
    # every process; give each new process its file, and leave no other.
    if out["saved_state"] is not None:
        src = iter_dir / "process_0-of-1.json"
        for p in range(2):
            shutil.copyfile(src, iter_dir / f"process_{p}-of-2.json")
        src.unlink()
    out["C"] = _launch("C", run_name="stopped", processes=2, steps=STEPS, tokenizer=tokenizer)
    return out


@pytest.fixture(scope="module")
def stream(runs):
    """The Feeder's global stream of the export: tokens (STEPS*B, L) and cache indices, by global position."""
    with Feeder(cache=runs["cache"], global_batch_size=B, sequence_length=L, seed=0, host_index=0,
                host_count=1) as f:
        batches = [f.get_batch(s) for s in range(STEPS)]
    tokens = np.concatenate([b["targets"] for b in batches])
    cache_index = np.concatenate([b["cache_index"] for b in batches])
    assert len({r.tobytes() for r in tokens}) == len(tokens)  # rows are distinct: tokens identify a row
    return tokens, cache_index


def _consumed(run: dict, tokens: np.ndarray) -> dict[int, dict]:
    """Per step: MaxText's global rows -> (process, global position whose tokens they are)."""
    by_step: dict[int, dict] = {}
    for line in run["batches"]:
        g = line["global_next_index"]
        assert g % B == 0
        step = g // B - 1
        for j, row in enumerate(line["inputs"]):
            matches = np.flatnonzero((tokens == np.asarray(row)).all(axis=1))
            assert len(matches) == 1, f"{run['tag']} step {step}: a row that is not exactly one exported row"
            by_step.setdefault(step, {})[line["first_row"] + j] = (line["process"], int(matches[0]))
    return by_step


def _check_steps(run: dict, steps: range, tokens: np.ndarray, cache_index: np.ndarray) -> None:
    assert run["codes"] == [0] * run["processes"], _tail(run)
    consumed = _consumed(run, tokens)
    assert sorted(consumed) == list(steps)
    n = run["processes"]
    for s in steps:
        rows = consumed[s]
        assert sorted(rows) == list(range(B))
        positions = [rows[r][1] for r in range(B)]
        # The cache indices MaxText consumed at step s are the Feeder's of step s.
        assert sorted(cache_index[positions].tolist()) == sorted(cache_index[s * B:(s + 1) * B].tolist()), s
        for r in range(B):
            p, j = divmod(r, B // n)
            assert rows[r][0] == p
            # grain's ElasticIterator: process p reads records s*B + p + j*n; the export's layout maps them.
            assert positions[r] == position_of_record(s * B + p + j * n, B, H), (s, r)
        per_process = {p: cache_index[[pos for q, pos in (rows[r] for r in range(B)) if q == p]].tolist()
                       for p in range(n)}
        print(f"maxtext {run['tag']} ({n} process{'es' if n > 1 else ''}) step {s}: cache indices consumed "
              f"{per_process}; Feeder step {s}: {cache_index[s * B:(s + 1) * B].tolist()}")


def test_uninterrupted_run_reads_the_feeder_stream(runs, stream):
    _check_steps(runs["A"], range(STEPS), *stream)


def test_stopped_run_checkpoints_the_feeder_position(runs, stream):
    _check_steps(runs["B"], range(K), *stream)
    # Step folder K-1 holds grain's state after K steps: the Feeder's position K*B,
    # in a per-process file (the elastic iterator's state is saved as a plain one).
    assert runs["saved_files"] == ["process_0-of-1.json"]
    assert runs["saved_state"] == {"global_next_index": K * B}
    with Feeder(cache=runs["cache"], global_batch_size=B, sequence_length=L, seed=0, host_index=0, host_count=1,
                start_step=K) as f:
        assert f.position == runs["saved_state"]["global_next_index"]
    assert _losses("B") == {s: _losses("A")[s] for s in range(K)}  # the same steps, the same losses


def test_resume_on_two_processes_is_refused_without_the_workaround(runs):
    run = runs["C_as_saved"]
    assert all(c != 0 for c in run["codes"]), _tail(run)
    assert run["batches"] == []
    logs = "".join(p.read_text() for p in run["logs"])
    assert "The number of stored checkpoint files (1) is incompatible with the number of JAX processes (2)" in logs


def test_resume_on_two_processes_reads_the_feeder_host_slices(runs, stream):
    tokens, cache_index = stream
    _check_steps(runs["C"], range(K, STEPS), tokens, cache_index)
    for line in runs["C"]["batches"]:
        s, p = line["global_next_index"] // B - 1, line["process"]
        with Feeder(cache=runs["cache"], global_batch_size=B, sequence_length=L, seed=0, host_index=p,
                    host_count=2) as f:
            want = f.get_batch(s)
        assert line["first_row"] == p * B // 2
        assert np.array_equal(np.asarray(line["inputs"]), want["targets"]), (s, p)


def test_resumed_losses_equal_the_uninterrupted_run(runs):
    a, c = _losses("A"), _losses("C")
    assert sorted(c) == list(range(K, STEPS))
    print(f"maxtext losses: uninterrupted (1 process) {a}; resumed (2 processes) {c}")
    for s in range(K, STEPS):
        # One process against two: the same rows and parameters; only the order of
        # the floating-point reductions differs.
        assert c[s] == pytest.approx(a[s], rel=1e-5), (s, a[s], c[s])
