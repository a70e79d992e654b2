"""The compile of a resumed run, with and without the persistent compilation
cache (``seqcache train --compilation-cache``), on this machine's devices.

For each model preset: a build of tinyshakespeare (from ../shared/data, byte
vocabulary, packed to ``--length`` tokens), a run of ``seqcache train`` stopped
after one step (``--stop-at-step 1``, which writes the cache), then the same
command resumed in a fresh process twice, alternating ``--rounds`` times:

  cache: ``--compilation-cache DIR``, the train step read from DIR;
  off:   ``--compilation-cache off``, compiled again (the peer).

Reported per model (medians over rounds): the summary's ``compile_time_s``
(lowering and compiling the train step, or lowering and reading it) of each,
their ratio cache/off, the programs read (``hits``) and the wall time of the
whole resumed command. On a CPU the programs are small (JAX writes every
program here: ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0``); the gain is
the chip's compile time (docs/training.md), which only a chip can measure.

Usage: python benchmarks/compile_cache.py [--models tiny,small,t5-tiny]
       [--batch-size 8] [--length 256] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(os.path.dirname(HERE), "..", "shared", "data")


def seqcache(*args: str, env: dict | None = None) -> tuple[dict | None, float]:
    """(the last JSON line of ``seqcache ARGS``, wall seconds); exits on failure."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "seqcache.cli", *args], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"seqcache {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else None), wall


def build(root: str, model: str, length: int) -> tuple[str, str]:
    """(caches root, task): a byte LM cache of tinyshakespeare, or for a T5
    preset a span-corruption cache of the C4 sample."""
    if model.startswith("t5"):
        source = f"parquet:{os.path.join(DATA, 'c4', '*.parquet')}#text"
        extra = ["--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", f"inputs={length}"]
    else:
        source = f"text:{os.path.join(DATA, 'tinyshakespeare', 'input.txt')}"
        extra = ["--sequence-length", str(length)]
    name = "t5" if model.startswith("t5") else "lm"
    if not os.path.isdir(os.path.join(root, name)):
        seqcache("build", "--source", source, "--vocabulary", "byte", "--name", name, "--cache-dir", root,
                 "--pack", "--num-shards", "2", *extra)
    return root, name


def measure(model: str, *, root: str, task: str, batch_size: int, rounds: int, work: str) -> dict:
    env = {**os.environ, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    folder = os.path.join(work, f"jax-{model}")
    stopped = os.path.join(work, f"run-{model}")
    common = ["train", "--cache-dir", root, "--task", task, "--model", model, "--batch-size", str(batch_size),
              "--steps", "2", "--no-tensorboard", "--set", "progress=false"]
    seqcache(*common, "--checkpoint-dir", stopped, "--stop-at-step", "1", "--compilation-cache", folder, env=env)
    out = {"cache": [], "off": [], "cache_wall": [], "off_wall": [], "hits": []}
    for _ in range(rounds):
        for kind in ("cache", "off"):
            run = os.path.join(work, f"resume-{model}-{kind}")
            shutil.rmtree(run, ignore_errors=True)
            shutil.copytree(stopped, run)
            summary, wall = seqcache(*common, "--checkpoint-dir", run, "--compilation-cache",
                                     folder if kind == "cache" else "off", env=env)
            out[kind].append(summary["compile_time_s"])
            out[f"{kind}_wall"].append(wall)
            if kind == "cache":
                out["hits"].append(summary["compilation_cache"]["hits"])
    med = {k: statistics.median(v) for k, v in out.items()}
    return {"model": model, "compile_s_cache": round(med["cache"], 3), "compile_s_off": round(med["off"], 3),
            "ratio": round(med["cache"] / med["off"], 3), "hits": int(med["hits"]),
            "wall_s_cache": round(med["cache_wall"], 2), "wall_s_off": round(med["off_wall"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,small,t5-tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="seqcache-compile-cache-") as work:
        for model in args.models.split(","):
            root, task = build(os.path.join(work, "caches"), model, args.length)
            row = measure(model, root=root, task=task, batch_size=args.batch_size, rounds=args.rounds, work=work)
            rows.append(row)
            print(f"{model:10s} compile {row['compile_s_cache']:7.3f} s with the cache, {row['compile_s_off']:7.3f} s "
                  f"without (x{row['ratio']:.3f}; {row['hits']} read); whole resumed command {row['wall_s_cache']:.1f} s"
                  f" against {row['wall_s_off']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
