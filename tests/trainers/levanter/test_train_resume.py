"""levanter trains on the packed LM cache through ``seqcache.feeders.trainers.levanter``:
at every step the rows it consumed are the Feeder's, and a run stopped at step K
on 1 process resumes on 2 processes (jax.distributed on 127.0.0.1) through
levanter's own checkpoint, from the step alone, with the uninterrupted run's rows
and losses.

Three runs of train.py (this folder), each in fresh processes:
  uninterrupted  1 process (2 CPU devices), steps 0 .. N-1
  stopped        1 process (2 CPU devices), the same N-step job stopped after
                 step K-1 with levanter's checkpoint (as a preempted job)
  resumed        2 processes (1 CPU device each), restores that checkpoint, steps K .. N-1
Both layouts have a data axis of 2 devices, so the programs are the same and
the losses can be compared exactly.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from seqcache.feeders import Feeder

HERE = pathlib.Path(__file__).resolve().parent
WORK = pathlib.Path(os.environ.get("SEQCACHE_TRAINER_WORK", "build/trainers")).resolve()
B, L, SEED, N, K = 8, 64, 0, 6, 3
TIMEOUT = 900  # seconds for one run (compiling on a shared 2-core machine)


def _lm_cache() -> str:
    lines = (WORK / "caches.txt").read_text().split()
    return next(line for line in lines if "shakespeare_lm" in line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, *, checkpoints: pathlib.Path, processes: int, tmp: pathlib.Path,
         stop_after: int | None = None) -> list[list[dict]]:
    """Runs train.py on ``processes`` processes; returns each process's records."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={2 // processes}")
    procs, outs = [], []
    for p in range(processes):
        out = tmp / f"{name}-{p}.jsonl"
        log = open(tmp / f"{name}-{p}.log", "w")
        cmd = [sys.executable, str(HERE / "train.py"), "--cache", _lm_cache(), "--steps", str(N),
               "--checkpoints", str(checkpoints), "--out", str(out), "--batch", str(B), "--seed", str(SEED),
               "--sequence-length", str(L)]
        if stop_after is not None:
            cmd += ["--stop-after", str(stop_after)]
        if processes > 1:
            cmd += ["--processes", str(processes), "--process-id", str(p), "--port", str(port)]
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env), log))
        outs.append(out)
    try:
        for proc, _ in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for p, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (tmp / f"{name}-{p}.log").read_text()[-4000:]
    return [[json.loads(line) for line in out.read_text().splitlines()] for out in outs]


def _sha(tokens) -> str:
    return hashlib.sha1(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


def _summary(records: list[list[dict]]) -> dict:
    """{start, processes, rows: {(step, row): (cache index, sha)}, losses: {step: loss}}."""
    served, consumed, losses, starts = {}, {}, {}, set()
    for per_process in records:
        for r in per_process:
            if r["kind"] == "served":
                assert served.setdefault(r["index"], (r["cache_index"], r["sha"])) == (r["cache_index"], r["sha"])
            elif r["kind"] == "consumed":
                assert (r["step"], r["row"]) not in consumed, f"row consumed twice: {r}"
                consumed[(r["step"], r["row"])] = r["sha"]
            elif r["kind"] == "loss":
                losses[r["step"]] = r["loss"]  # every process logs the same global loss
            elif r["kind"] == "start":
                starts.add((r["step"], r["processes"], r["devices"]))
    assert len(starts) == 1, starts
    (start, processes, devices), = starts
    rows = {}
    for (step, row), sha in consumed.items():
        cache_index, served_sha = served[step * B + row]  # levanter asks for index step * B + row
        assert served_sha == sha, f"step {step} row {row}: consumed another row than index {step * B + row}"
        rows[(step, row)] = (cache_index, sha)
    return {"start": start, "processes": processes, "devices": devices, "rows": rows, "losses": losses}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("levanter")
    uninterrupted = _run("uninterrupted", checkpoints=tmp / "ckpt-u", processes=1, tmp=tmp)
    stopped = _run("stopped", checkpoints=tmp / "ckpt", processes=1, tmp=tmp, stop_after=K)
    resumed = _run("resumed", checkpoints=tmp / "ckpt", processes=2, tmp=tmp)
    return {name: _summary(r) for name, r in
            (("uninterrupted", uninterrupted), ("stopped", stopped), ("resumed", resumed))}


def _feeder_rows(steps) -> dict:
    with Feeder(cache=_lm_cache(), global_batch_size=B, sequence_length=L, seed=SEED, host_index=0,
                host_count=1) as f:
        out = {}
        for s in steps:
            batch = f.get_batch(s)
            for r in range(B):
                out[(s, r)] = (int(batch["cache_index"][r]), _sha(batch["targets"][r]))
        return out


def test_every_step_consumes_the_feeders_rows(runs):
    want = _feeder_rows(range(N))
    u, a, b = runs["uninterrupted"], runs["stopped"], runs["resumed"]
    assert (u["start"], u["processes"], u["devices"]) == (0, 1, 2)
    assert (a["start"], a["processes"], a["devices"]) == (0, 1, 2)
    assert (b["start"], b["processes"], b["devices"]) == (K, 2, 2)  # restored levanter's step-K checkpoint
    assert u["rows"] == want
    assert a["rows"] == {key: v for key, v in want.items() if key[0] < K}
    assert b["rows"] == {key: v for key, v in want.items() if key[0] >= K}
    print("\nstep  cache indices consumed (uninterrupted = stopped | resumed on 2 processes = Feeder)")
    for s in range(N):
        run = a if s < K else b
        print(f"{s:4d}  {[run['rows'][(s, r)][0] for r in range(B)]}  "
              f"{'stopped' if s < K else 'resumed'}")


def test_losses_equal_the_uninterrupted_run(runs):
    u, a, b = runs["uninterrupted"], runs["stopped"], runs["resumed"]
    assert sorted(u["losses"]) == list(range(N))
    assert sorted(a["losses"]) == list(range(K))
    assert sorted(b["losses"]) == list(range(K, N))
    print("\nstep  uninterrupted  stopped/resumed  difference")
    for s in range(N):
        other = a["losses"][s] if s < K else b["losses"][s]
        print(f"{s:4d}  {u['losses'][s]:.9f}  {other:.9f}  {other - u['losses'][s]:+.3e}")
    assert [a["losses"][s] for s in range(K)] == [u["losses"][s] for s in range(K)]
    # The same program on a data axis of 2 devices: the resumed run's all-reduce
    # crosses processes (gloo) and adds the same two values, so bit for bit.
    assert [b["losses"][s] for s in range(K, N)] == [u["losses"][s] for s in range(K, N)]
    assert u["losses"][N - 1] < u["losses"][0]  # it trains
