"""Feeder throughput against the raw ArrayRecord read bound and grain, in one run.

On one cache (built here with ``seqcache.pipelines.writer.write_cache``: synthetic
token records of ``--length`` int32 tokens, ``--shards`` shards), with the same
global batch size and the same number of threads everywhere, it measures per host
(this process is host 0 of 1):

  feeder: ``Feeder`` iteration (mixing, permutation, batched reads, decoding into
          the (B, L) arrays with segment ids, positions and loss weights);
  raw:    ``ArrayRecordReader.read(offsets)`` per shard for exactly the cache
          indices the feeder reads, already grouped by shard and sorted outside the
          timing, on a thread pool of the same size with the same prefetch depth
          and the same head start (the window is submitted before the warm-up
          step is read, as the feeder's first ``next`` does); records are read,
          nothing else (the bound: it does not decode). The work it leaves out
          (locating the step's indices, ordering the records, decoding them) is
          measured alone, on one thread with the records read beforehand, as
          CPU ms per step against the step's reads;
  raw one by one: the same records, each read with ``seek(offset)`` and
          ``read()`` on the step's thread (a lock per shard reader, as the
          feeder holds): the cheapest way ArrayRecord reads records in memory,
          about 4x less CPU than its batched read, which hands each record to a
          pool of 64 threads. The feeder reads this way by default
          (``CacheReader`` read_mode "auto"); it is the tighter bound;
  raw+decode: raw one by one, each step also decoding its records into (B, L)
          int32 tokens with the feeder's ``decode_batch`` on its read thread
          (the bound for decoded batches: the feeder's machinery against it);
  grain:  ``grain.python.DataLoader`` over ``CacheDataSource`` (the same cache)
          with a shuffling ``IndexSampler`` and a ``Batch`` operation of the same
          batch size, ``ReadOptions(num_threads=threads)``, in-process;
  ttfb:   time to first batch after ``Feeder.restore`` at position 0 and at
          position 10^12 (opening the cache included), median of 7, interleaved;
  memory: RSS growth of a fresh process that opens the feeder and reads one
          batch, for this cache and for one 10x smaller;
  mixture: a mixture of 3 task caches (a third of the records and, by default,
          of the shards each, equal rates) against the single-task cache, same batch and threads,
          alternating, as a ratio of examples/s per round (median), in
          wall-clock time and in CPU time of the process (on a shared machine
          the mixture's extra read threads get a larger share of the cores, which
          the CPU-time ratio does not reward);
  open:   time to first batch (Feeder construction + a first batch of
          ``--open-batch`` rows, which reads at most that many shards) on caches of
          16, 1,000 and 10,000 tiny shards, median of 7, interleaved, as ratios to
          16 shards; also the construction alone and json.loads of the manifest;
  trace:  ``Feeder.trace`` of 1,000 steps (``--trace-batch`` rows each) at
          position 0 and at 10^12: rows/s and seconds, median of 3.

``--only mixture,open,trace`` runs only those sections.

Rounds run raw, raw one by one, feeder, raw+decode (reversing the order every round) to share
the machine's noise; the medians over rounds are reported, and feeder/raw is the median
of the per-round ratios, in wall-clock time and in CPU time of the process. Machines here are shared and noisy: compare the ratios, not the
absolute numbers.

Usage: python benchmarks/feeder.py [--records 300000] [--length 512]
       [--batch-size 1024] [--threads 2] [--steps 60] [--rounds 3]
       [--cache-dir DIR (kept and reused)] [--json out.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from seqcache import format as fmt
from seqcache.feeders import CacheDataSource, Feeder
from seqcache.feeders.reader import READER_OPTIONS


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and its threads so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build_cache(path: str, *, records: int, length: int, shards: int) -> None:
    if os.path.exists(os.path.join(path, fmt.MANIFEST_NAME)):
        m = fmt.read_manifest(path)
        if m.num_examples == records and (m.fingerprint_inputs or {}).get("length") == length:
            print(f"reusing {path} ({records:,} records)")
            return
    from seqcache.pipelines.writer import write_cache

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    per = [records // shards + (1 if s < records % shards else 0) for s in range(shards)]

    def shard(count: int, first: int):
        block = rng.integers(3, 32_000, size=(count, length), dtype=np.int32)
        for j in range(count):
            yield {"targets": block[j]}, [(0, first + j, 0)]

    starts = np.concatenate([[0], np.cumsum(per)])
    write_cache(
        path,
        task="bench",
        split="train",
        features=(fmt.FeatureSpec("targets", "int32"),),
        shards=[shard(c, int(s)) for c, s in zip(per, starts)],
        sources=[{"path": "synthetic"}],
        fingerprint_inputs={"records": records, "length": length, "shards": shards},
    )
    size = sum(s.num_bytes for s in fmt.read_manifest(path).shards)
    print(f"built {path}: {records:,} records x {length} tokens, {size / 1e6:,.0f} MB, "
          f"{time.perf_counter() - t0:.1f} s")


def run_feeder(path, *, batch_size, length, threads, first_step, steps) -> tuple[float, float]:
    """(wall seconds, CPU seconds) for ``steps`` batches after the first one."""
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=length, host_index=0, host_count=1,
                num_threads=threads, prefetch=threads, start_step=first_step) as f:
        next(f)  # open every shard reader and fill the prefetch window (steps + 1 .. steps + threads)
        c0, t0 = cpu_seconds(), time.perf_counter()
        for _ in range(steps):
            next(f)
        return time.perf_counter() - t0, cpu_seconds() - c0


def raw_plan(path, *, batch_size, first_step, steps):
    """Per step: [(shard, sorted offsets)] of the cache indices the feeder reads."""
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=1, host_index=0, host_count=1,
                prefetch=0) as f:
        starts = f.readers[0].shard_starts
        plan = []
        for s in range(first_step, first_step + steps):
            p = s * batch_size + np.arange(batch_size)
            idx = np.sort(f.stream.locate(p).cache_index)
            bounds = np.searchsorted(idx, starts)
            plan.append([(int(k), (idx[bounds[k]:bounds[k + 1]] - starts[k]).tolist())
                         for k in range(len(starts) - 1) if bounds[k + 1] > bounds[k]])
    return plan


def run_raw(path, plan, *, threads, steps, length: int | None = None, one_by_one: bool = False) -> tuple[float, float]:
    """Reads plan[0] (warm-up), then times ``steps`` steps with ``threads`` steps
    in flight ahead of the consumer, as the feeder's prefetch does; ``plan`` has
    ``steps + 1 + threads`` entries so the window stays full to the end. As in
    the feeder's first ``next``, the window (plan[1 .. threads]) is submitted
    before plan[0] is read, so both start the timing with the same head start.
    Each shard's records are read with one batched ``read(offsets)``, or with
    ``one_by_one`` by ``seek`` and ``read`` per record under the shard
    reader's lock. With ``length``, each step also decodes its records (in
    shard order) into (B, length) int32 tokens with the feeder's
    ``decode_batch``, on the same thread."""
    import threading

    from array_record.python.array_record_module import ArrayRecordReader

    from seqcache.feeders.decode import decode_batch

    m = fmt.read_manifest(path)
    readers = [ArrayRecordReader(os.path.join(path, s.file), READER_OPTIONS) for s in m.shards]
    locks = [threading.Lock() for _ in readers]
    outputs = {m.features[0].name: np.int32}

    def read_one_by_one(k, offsets):
        reader, out = readers[k], []
        with locks[k]:
            for off in offsets:
                reader.seek(off)
                out.append(reader.read())
        return out

    def step(groups):
        if one_by_one:
            got = [read_one_by_one(k, offsets) for k, offsets in groups]
        else:
            got = [readers[k].read(offsets) for k, offsets in groups]
        if length is not None:
            return decode_batch(m.features, [r for records in got for r in records], length=length, outputs=outputs)
        return got

    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="raw") as pool:
        futures = {j: pool.submit(step, plan[j]) for j in range(1, min(len(plan), 1 + threads))}
        step(plan[0])
        c0, t0 = cpu_seconds(), time.perf_counter()
        for j in range(1, min(len(plan), steps + 1)):
            futures.pop(j).result()
            if j + threads < len(plan):
                futures[j + threads] = pool.submit(step, plan[j + threads])
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        for fut in futures.values():
            fut.cancel()
    for r in readers:
        r.close()
    return dt, cpu


def feeder_own_work(path, *, batch_size, length, first_step, steps, repeats: int = 5) -> tuple[float, float, float]:
    """(feeder CPU ms, raw CPU ms, raw one-by-one CPU ms) per step on this
    thread, best of ``repeats``: the feeder's ``_compute`` with its shard reads
    answered from records read beforehand (what the feeder does beyond the
    reads: locate, order, decode), and the raw reads of the same steps
    (``run_raw``'s per-step work, one thread, batched and one by one). The raw
    bounds do not decode: this is the work they leave out."""
    from array_record.python.array_record_module import ArrayRecordReader

    plan = raw_plan(path, batch_size=batch_size, first_step=first_step, steps=steps)
    m = fmt.read_manifest(path)
    readers = [ArrayRecordReader(os.path.join(path, s.file), READER_OPTIONS) for s in m.shards]
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=length, host_index=0, host_count=1,
                prefetch=0) as f:
        cache = f.readers[0]
        records = [cache.read_sorted(f.stream.locate(s * batch_size + np.arange(batch_size)).cache_index)
                   for s in range(first_step, first_step + steps)]
        f._read_sorted = lambda task, cache_index: records[f._own_work_step]  # the reads, already done
        own, raw, one = [], [], []
        for _ in range(repeats):
            c0 = cpu_seconds()
            for j in range(steps):
                f._own_work_step = j
                f._compute(first_step + j)
            own.append((cpu_seconds() - c0) / steps * 1e3)
            c0 = cpu_seconds()
            for groups in plan:
                [readers[k].read(offsets) for k, offsets in groups]
            raw.append((cpu_seconds() - c0) / steps * 1e3)
            c0 = cpu_seconds()
            for groups in plan:
                for k, offsets in groups:
                    for off in offsets:
                        readers[k].seek(off)
                        readers[k].read()
            one.append((cpu_seconds() - c0) / steps * 1e3)
    for r in readers:
        r.close()
    return min(own), min(raw), min(one)


def run_grain(path, *, batch_size, threads, steps) -> float:
    import grain.python as grain

    src = CacheDataSource(path)
    sampler = grain.IndexSampler(num_records=len(src), shard_options=grain.NoSharding(), shuffle=True,
                                 num_epochs=None, seed=0)
    loader = grain.DataLoader(data_source=src, sampler=sampler, operations=[grain.Batch(batch_size=batch_size)],
                              worker_count=0,
                              read_options=grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * batch_size))
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    dt = time.perf_counter() - t0
    src.close()
    return dt


def time_to_first_batch(path, *, batch_size, length, threads, position) -> float:
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=length, host_index=0, host_count=1,
                prefetch=0) as f:
        state = f.state()
    state["position"] = position
    t0 = time.perf_counter()
    f = Feeder.restore(state, host_index=0, host_count=1, num_threads=threads)
    batch = next(f)
    dt = time.perf_counter() - t0
    assert batch["targets"].shape == (batch_size, length)
    f.close()
    return dt


def build_tiny_cache(path: str, *, shards: int, per_shard: int = 2, length: int = 16) -> None:
    """A cache of ``shards`` shards of ``per_shard`` records each (for open time)."""
    if os.path.exists(os.path.join(path, fmt.MANIFEST_NAME)):
        return
    from seqcache.pipelines.writer import write_cache

    t0 = time.perf_counter()

    def shard(s: int):
        for j in range(per_shard):
            yield {"targets": np.full(length, 3 + (s * per_shard + j) % 1000, np.int32)}, [(0, s * per_shard + j, 0)]

    write_cache(path, task="tiny", split="train", features=(fmt.FeatureSpec("targets", "int32"),),
                shards=[shard(s) for s in range(shards)], sources=[{"path": "synthetic"}],
                fingerprint_inputs={"tiny": shards, "per_shard": per_shard, "length": length})
    print(f"built {path}: {shards:,} shards x {per_shard} records, {time.perf_counter() - t0:.1f} s")


def open_to_first_batch(path: str, *, batch_size: int) -> tuple[float, float]:
    """(seconds to construct the Feeder, seconds to construct it and get its first batch)."""
    t0 = time.perf_counter()
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=16, host_index=0, host_count=1,
                prefetch=0) as f:
        opened = time.perf_counter() - t0
        f.get_batch(0)
        return opened, time.perf_counter() - t0


def manifest_parse_seconds(path: str) -> float:
    """json.loads of the cache's manifest.json alone (the text already read)."""
    with open(os.path.join(path, fmt.MANIFEST_NAME), encoding="utf-8") as f:
        text = f.read()
    t0 = time.perf_counter()
    json.loads(text)
    return time.perf_counter() - t0


def bench_open(root: str, *, batch_size: int = 16, repeats: int = 7) -> dict:
    """Open time and time to first batch at 16, 1,000 and 10,000 shards.

    The first batch has ``batch_size`` rows (default 16): it reads at most that
    many shards in every cache, so the caches differ only in their shard count
    (a larger batch over tiny shards also opens more shards, a cost of the batch,
    not of the open). Medians of ``repeats``, interleaved."""
    counts = (16, 1000, 10_000)
    paths = {n: os.path.join(root, f"tiny-{n}") for n in counts}
    for n, p in paths.items():
        build_tiny_cache(p, shards=n)
    opened = {n: [] for n in paths}
    first = {n: [] for n in paths}
    parse = {n: [] for n in paths}
    for _ in range(repeats):
        for n, p in paths.items():
            o, b = open_to_first_batch(p, batch_size=batch_size)
            opened[n].append(o)
            first[n].append(b)
            parse[n].append(manifest_parse_seconds(p))
    med = {n: statistics.median(t) for n, t in first.items()}
    med_open = {n: statistics.median(t) for n, t in opened.items()}
    med_parse = {n: statistics.median(t) for n, t in parse.items()}
    res = {"open_batch_size": batch_size}
    for n in counts:
        res[f"open_first_batch_{n}_shards_s"] = med[n]
        res[f"open_{n}_shards_s"] = med_open[n]
        res[f"manifest_json_parse_{n}_shards_s"] = med_parse[n]
    for n in counts[1:]:
        res[f"open_first_batch_{n}_over_16"] = med[n] / med[16]
        res[f"open_{n}_over_16"] = med_open[n] / med_open[16]
    print(f"time to first batch (open + batch of {batch_size} rows): " + ", ".join(
        f"{n:,} shards {v * 1e3:.1f} ms" for n, v in med.items())
        + f"; 1,000/16 = {med[1000] / med[16]:.2f}, 10,000/16 = {med[10_000] / med[16]:.2f}")
    print("open alone (Feeder constructed): " + ", ".join(f"{n:,} shards {v * 1e3:.1f} ms" for n, v in med_open.items())
          + "; of which json.loads of manifest.json: "
          + ", ".join(f"{n:,} shards {v * 1e3:.1f} ms" for n, v in med_parse.items()))
    return res


def bench_mixture(big: str, root: str, *, records: int, length: int, batch_size: int, threads: int, steps: int,
                  rounds: int, part_shards: int) -> dict:
    """The 3 task caches hold a third of the records each, in ``part_shards``
    shards each (by default a third of the single cache's shards, as a build
    whose shard count follows the content size gives them): the mixture then
    reads as many shards per step as the single task, and the ratio measures
    the mixing, not a larger number of shard reads (with 3x the shards, the raw
    ArrayRecord reads alone run at about 0.8x on this machine)."""
    parts = [os.path.join(root, f"part{k}-{records // 3}x{length}-{part_shards}shards") for k in range(3)]
    for p in parts:
        build_cache(p, records=records // 3, length=length, shards=part_shards)
    mixture = {p: 1.0 for p in parts}

    def run(**kw):
        with Feeder(global_batch_size=batch_size, sequence_length=length, host_index=0, host_count=1,
                    num_threads=threads, prefetch=threads, start_step=7, **kw) as f:
            next(f)
            c0, t0 = cpu_seconds(), time.perf_counter()
            for _ in range(steps):
                next(f)
            return time.perf_counter() - t0, cpu_seconds() - c0

    ratios, cpu_ratios = [], []
    for r in range(rounds):
        order = ("one", "mix") if r % 2 == 0 else ("mix", "one")
        t = {name: run(cache=big) if name == "one" else run(mixture=mixture) for name in order}
        ratios.append(t["one"][0] / t["mix"][0])
        cpu_ratios.append(t["one"][1] / t["mix"][1])
        print(f"round {r}: single task {steps * batch_size / t['one'][0]:,.0f} ex/s, 3-task mixture "
              f"{steps * batch_size / t['mix'][0]:,.0f} ex/s, mixture/single {ratios[-1]:.3f} "
              f"(CPU time: {cpu_ratios[-1]:.3f})")
    res = {"mixture3_over_single": statistics.median(ratios), "mixture3_over_single_rounds": ratios,
           "mixture3_over_single_cpu_time": statistics.median(cpu_ratios),
           "mixture3_over_single_cpu_time_rounds": cpu_ratios}
    print(f"3-task mixture / single task {res['mixture3_over_single']:.3f} (median of {rounds} rounds, range "
          f"{min(ratios):.3f}..{max(ratios):.3f}); in CPU time per example "
          f"{res['mixture3_over_single_cpu_time']:.3f} (range {min(cpu_ratios):.3f}..{max(cpu_ratios):.3f})")
    return res


def bench_trace(path: str, *, batch_size: int, steps: int = 1000, repeats: int = 3) -> dict:
    far_step = 10**12 // batch_size
    times = {0: [], far_step: []}
    rows = {}
    with Feeder(cache=path, global_batch_size=batch_size, sequence_length=1, host_index=0, host_count=1,
                prefetch=0) as f:
        f.trace(range(0, 2))  # opens the provenance shards
        for _ in range(repeats):
            for first in times:
                t0 = time.perf_counter()
                table = f.trace(range(first, first + steps))
                times[first].append(time.perf_counter() - t0)
                rows[first] = table.num_rows
    t0, tf = statistics.median(times[0]), statistics.median(times[far_step])
    res = {"trace_steps": steps, "trace_batch_size": batch_size, "trace_rows": rows[0],
           "trace_position_0_s": t0, "trace_position_1e12_s": tf, "trace_rows_per_s": rows[0] / t0,
           "trace_ratio_1e12_over_0": tf / t0}
    print(f"trace of {steps:,} steps x {batch_size} rows ({rows[0]:,} table rows): position 0 {t0:.2f} s "
          f"({rows[0] / t0:,.0f} rows/s), position 10^12 {tf:.2f} s, ratio {tf / t0:.2f}")
    return res


RSS_CHILD = r"""
import sys, psutil
from seqcache.feeders import Feeder
proc = psutil.Process()
before = proc.memory_info().rss
f = Feeder(cache=sys.argv[1], global_batch_size=int(sys.argv[2]), sequence_length=int(sys.argv[3]),
           host_index=0, host_count=1, prefetch=0)
f.get_batch(0)
print(proc.memory_info().rss - before)
f.close()
"""


def rss_growth(path, *, batch_size, length) -> int:
    """RSS growth (bytes) of a fresh process that opens a feeder and reads one batch.

    The child imports the seqcache this process imported, from any working
    directory: it gets this process's ``sys.path`` and runs in a neutral folder."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(os.path.abspath(p) for p in sys.path))
    done = subprocess.run([sys.executable, "-c", RSS_CHILD, os.path.abspath(path), str(batch_size), str(length)],
                          capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode:
        raise RuntimeError(f"the RSS child process failed (exit {done.returncode}):\n{done.stderr}")
    return int(done.stdout.strip())


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=300_000)
    ap.add_argument("--length", type=int, default=512, help="tokens per record (and sequence length)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--grain-steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--cache-dir", help="where to build (or reuse) the cache; default: a temporary folder")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--trace-batch", type=int, default=256, help="global batch of the trace benchmark")
    ap.add_argument("--mixture-part-shards", type=int,
                    help="shards of each of the mixture benchmark's 3 task caches (default: a third of --shards)")
    ap.add_argument("--open-batch", type=int, default=16, help="global batch of the open benchmark's first batch")
    ap.add_argument("--only", help="comma-separated sections: throughput, mixture, open, trace (default: all)")
    args = ap.parse_args(argv)
    unknown = set(args.only.split(",")) - set(SECTIONS) if args.only else set()
    if unknown:
        ap.error(f"--only: no section {', '.join(sorted(unknown))} (sections: {', '.join(SECTIONS)})")
    return args


SECTIONS = ("throughput", "mixture", "open", "trace")


def bench_sections(big: str, root: str, only: set[str], args: argparse.Namespace) -> dict:
    """The results of the mixture, open and trace sections named in ``only``."""
    extra = {}
    if "mixture" in only:
        extra.update(bench_mixture(big, root, records=args.records, length=args.length, batch_size=args.batch_size,
                                   threads=args.threads, steps=args.steps, rounds=args.rounds,
                                   part_shards=args.mixture_part_shards or max(1, round(args.shards / 3))))
    if "open" in only:
        extra.update(bench_open(root, batch_size=args.open_batch))
    if "trace" in only:
        extra.update(bench_trace(big, batch_size=args.trace_batch))
    return extra


def bench_feeder_and_raw(big: str, args: argparse.Namespace) -> dict[str, list]:
    """Per round of ``args.steps`` steps from step 7 (after one read of the whole
    cache that warms the page cache): seconds of "feeder", "raw" (batched
    reads), "raw_one" (one by one) and "raw_decode" (one by one, decoding its
    records too), and bound/feeder ratios in wall-clock and CPU time ("wall",
    "cpu"; "one_wall", "one_cpu"; "decode_wall", "decode_cpu")."""
    B, T = args.batch_size, args.threads
    first_step = 7
    plan = raw_plan(big, batch_size=B, first_step=first_step, steps=args.steps + 1 + T)
    # Read the whole cache once so that every method starts from a warm page cache.
    warm = -(-args.records // B)
    run_raw(big, raw_plan(big, batch_size=B, first_step=0, steps=warm), threads=T, steps=warm)

    # Reverse the order each round so that drift in the machine's load hits all
    # of them; the feeder runs in the middle.
    bounds = {"raw": {}, "raw_one": {"one_by_one": True}, "raw_decode": {"one_by_one": True, "length": args.length}}
    keys = {"raw": "", "raw_one": "one_", "raw_decode": "decode_"}
    out = {k: [] for k in ("feeder", *bounds, *(p + m for p in keys.values() for m in ("wall", "cpu")))}
    order = ("raw", "raw_one", "feeder", "raw_decode")
    for r in range(args.rounds):
        timed = {}
        for name in (order if r % 2 == 0 else order[::-1]):
            if name == "feeder":
                timed[name] = run_feeder(big, batch_size=B, length=args.length, threads=T, first_step=first_step,
                                         steps=args.steps)
            else:
                timed[name] = run_raw(big, plan, threads=T, steps=args.steps, **bounds[name])
        for name in ("feeder", *bounds):
            out[name].append(timed[name][0])
        for bound, key in keys.items():
            out[key + "wall"].append(timed[bound][0] / timed["feeder"][0])
            out[key + "cpu"].append(timed[bound][1] / timed["feeder"][1])
        eps = {name: args.steps * B / out[name][-1] for name in ("feeder", *bounds)}
        print(f"round {r}: feeder {eps['feeder']:,.0f} ex/s; raw {eps['raw']:,.0f} ex/s, feeder/raw "
              f"{out['wall'][-1]:.3f} (CPU time: {out['cpu'][-1]:.3f}); raw one by one {eps['raw_one']:,.0f} ex/s, "
              f"feeder/that {out['one_wall'][-1]:.3f} (CPU time: {out['one_cpu'][-1]:.3f}); "
              f"raw+decode {eps['raw_decode']:,.0f} ex/s, feeder/(raw+decode) {out['decode_wall'][-1]:.3f} "
              f"(CPU time: {out['decode_cpu'][-1]:.3f})")
    return out


def bench_ttfb(big: str, *, batch_size: int, length: int, threads: int, repeats: int = 7) -> tuple[float, float]:
    """(seconds, seconds): median time to first batch after ``Feeder.restore`` at
    position 0 and at position 10^12 (rounded down to a whole step)."""
    far = 10**12 // batch_size * batch_size
    ttfb = {0: [], far: []}
    for _ in range(repeats):  # interleaved, so that both positions see the same machine
        for position in ttfb:
            ttfb[position].append(time_to_first_batch(big, batch_size=batch_size, length=length, threads=threads,
                                                      position=position))
    return statistics.median(ttfb[0]), statistics.median(ttfb[far])


def bench_throughput(big: str, small: str, args: argparse.Namespace, extra: dict) -> dict:
    """The throughput section (feeder, raw, grain, time to first batch, RSS
    growth) and ``extra`` in one dict, keys as written by --json."""
    B, L, T = args.batch_size, args.length, args.threads
    print(f"global batch {B} x {L} tokens = {B * L:,} tokens/step; {args.records:,} examples = "
          f"{args.records / B:,.1f} steps/epoch; {T} threads; this host reads all {B} rows")
    rounds = bench_feeder_and_raw(big, args)
    feeder_s, raw_s, ratios, cpu_ratios = rounds["feeder"], rounds["raw"], rounds["wall"], rounds["cpu"]
    own_ms, raw_ms, one_ms = feeder_own_work(big, batch_size=B, length=L, first_step=7, steps=args.steps)
    grain_s = run_grain(big, batch_size=B, threads=T, steps=args.grain_steps)
    ttfb0, ttfb_far = bench_ttfb(big, batch_size=B, length=L, threads=T)
    rss_big = rss_growth(big, batch_size=B, length=L)
    rss_small = rss_growth(small, batch_size=B, length=L)

    feeder_eps = args.steps * B / statistics.median(feeder_s)
    raw_eps = args.steps * B / statistics.median(raw_s)
    grain_eps = args.grain_steps * B / grain_s
    return {
        "records": args.records, "length": L, "shards": args.shards, "batch_size": B, "threads": T,
        "feeder_examples_per_s": feeder_eps, "feeder_tokens_per_s": feeder_eps * L,
        "raw_examples_per_s": raw_eps, "raw_tokens_per_s": raw_eps * L,
        "grain_examples_per_s": grain_eps, "grain_tokens_per_s": grain_eps * L,
        "feeder_over_raw": statistics.median(ratios), "feeder_over_raw_cpu_time": statistics.median(cpu_ratios),
        "feeder_over_raw_rounds": ratios, "feeder_over_raw_cpu_time_rounds": cpu_ratios,
        "raw_one_by_one_examples_per_s": args.steps * B / statistics.median(rounds["raw_one"]),
        "feeder_over_raw_one_by_one": statistics.median(rounds["one_wall"]),
        "feeder_over_raw_one_by_one_cpu_time": statistics.median(rounds["one_cpu"]),
        "feeder_over_raw_one_by_one_rounds": rounds["one_wall"],
        "feeder_over_raw_one_by_one_cpu_time_rounds": rounds["one_cpu"],
        "raw_decode_examples_per_s": args.steps * B / statistics.median(rounds["raw_decode"]),
        "feeder_over_raw_decode": statistics.median(rounds["decode_wall"]),
        "feeder_over_raw_decode_cpu_time": statistics.median(rounds["decode_cpu"]),
        "feeder_over_raw_decode_rounds": rounds["decode_wall"],
        "feeder_over_raw_decode_cpu_time_rounds": rounds["decode_cpu"],
        "feeder_own_work_cpu_ms_per_step": own_ms, "raw_read_cpu_ms_per_step": raw_ms,
        "raw_one_by_one_read_cpu_ms_per_step": one_ms,
        "feeder_over_grain": feeder_eps / grain_eps,
        "ttfb_position_0_s": ttfb0, "ttfb_position_1e12_s": ttfb_far, "ttfb_ratio_1e12_over_0": ttfb_far / ttfb0,
        "rss_growth_bytes": rss_big, "rss_growth_bytes_10x_smaller_cache": rss_small, **extra,
    }


def print_throughput(res: dict) -> None:
    print()
    print(f"{'':10}{'examples/s':>14}{'tokens/s':>16}")
    for name in ("feeder", "raw", "grain"):
        print(f"{name:10}{res[name + '_examples_per_s']:>14,.0f}{res[name + '_tokens_per_s']:>16,.0f}")
    wall, cpu = res["feeder_over_raw_rounds"], res["feeder_over_raw_cpu_time_rounds"]
    print(f"feeder/raw   {res['feeder_over_raw']:.3f} [{min(wall):.3f}, {max(wall):.3f}] (median [range] of "
          f"per-round ratios; raw CPU time / feeder CPU time {res['feeder_over_raw_cpu_time']:.3f} "
          f"[{min(cpu):.3f}, {max(cpu):.3f}])")
    wall, cpu = res["feeder_over_raw_one_by_one_rounds"], res["feeder_over_raw_one_by_one_cpu_time_rounds"]
    print(f"feeder/(raw one by one) {res['feeder_over_raw_one_by_one']:.3f} [{min(wall):.3f}, {max(wall):.3f}]; "
          f"CPU time {res['feeder_over_raw_one_by_one_cpu_time']:.3f} [{min(cpu):.3f}, {max(cpu):.3f}] "
          f"(raw one by one {res['raw_one_by_one_examples_per_s']:,.0f} ex/s)")
    wall, cpu = res["feeder_over_raw_decode_rounds"], res["feeder_over_raw_decode_cpu_time_rounds"]
    print(f"feeder/(raw+decode) {res['feeder_over_raw_decode']:.3f} [{min(wall):.3f}, {max(wall):.3f}]; "
          f"CPU time {res['feeder_over_raw_decode_cpu_time']:.3f} [{min(cpu):.3f}, {max(cpu):.3f}] "
          f"(raw+decode {res['raw_decode_examples_per_s']:,.0f} ex/s)")
    own, raw, one = (res[k] for k in ("feeder_own_work_cpu_ms_per_step", "raw_read_cpu_ms_per_step",
                                      "raw_one_by_one_read_cpu_ms_per_step"))
    print(f"work the raw bounds leave out (locate, order, decode), one thread: {own:.2f} ms CPU per step against "
          f"{raw:.2f} ms for the step's batched reads ({own / raw:.1%}) and {one:.2f} ms one by one ({own / one:.1%})")
    print(f"feeder/grain {res['feeder_over_grain']:.2f}")
    print(f"time to first batch: position 0 {res['ttfb_position_0_s'] * 1e3:.1f} ms, "
          f"position 10^12 {res['ttfb_position_1e12_s'] * 1e3:.1f} ms, ratio {res['ttfb_ratio_1e12_over_0']:.2f}")
    print(f"RSS growth (open + one batch): {res['rss_growth_bytes'] / 2**20:.1f} MiB for {res['records']:,} records, "
          f"{res['rss_growth_bytes_10x_smaller_cache'] / 2**20:.1f} MiB for {res['records'] // 10:,}")


def main(argv=None):
    args = parse_args(argv)
    only = set(args.only.split(",")) if args.only else set(SECTIONS)

    tmp = None
    root = args.cache_dir
    if root is None:
        tmp = tempfile.TemporaryDirectory(prefix="seqcache-bench-")
        root = tmp.name
    big = os.path.join(root, f"bench-{args.records}x{args.length}")
    small = os.path.join(root, f"bench-{args.records // 10}x{args.length}")
    build_cache(big, records=args.records, length=args.length, shards=args.shards)
    build_cache(small, records=args.records // 10, length=args.length, shards=args.shards)

    res = bench_sections(big, root, only, args)
    if "throughput" in only:
        res = bench_throughput(big, small, args, res)
        print_throughput(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return res


if __name__ == "__main__":
    main()
