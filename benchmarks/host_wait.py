"""The host's share of a training step: the time a trainer's loop spends in
``next(feeder)`` and ``feeder.state()`` while a sleep of one step's length
stands in for the accelerator (which runs the step asynchronously, so any time
the loop spends here beyond that is time the chip may wait).

Compared in one run, alternating: the feeder reading ahead on its threads
(the default) against the same feeder reading nothing ahead (every step read
and converted by the caller: its whole cost, the peer). A ``ConvertedFeeder``
for a cache with ``inputs`` and ``targets`` (``encdec``), a ``Feeder`` of
``targets`` otherwise.

    python benchmarks/host_wait.py --cache build/tpu/caches/wiki_c4_span128/train --batch-size 32 --step-ms 56
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from seqcache.feeders import ConvertedFeeder, Feeder
from seqcache.format import CacheError, read_manifest


def make_feeder(cache: str, batch_size: int, prefetch: int | None):
    features = read_manifest(cache).features
    common = dict(cache=cache, global_batch_size=batch_size, seed=0, num_epochs=None, host_index=0, host_count=1,
                  prefetch=prefetch)
    if "inputs" in features and "targets" in features:
        return ConvertedFeeder(converter="encdec", **common)
    return Feeder(**common)


def host_times(cache: str, *, batch_size: int, prefetch: int | None, step_s: float, steps: int, warmup: int):
    """Seconds per step in next() + state(), after ``warmup`` steps."""
    times = []
    with make_feeder(cache, batch_size, prefetch) as feeder:
        it = iter(feeder)
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            next(it)
            feeder.state()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            time.sleep(step_s)
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--cache", required=True, help="a task cache folder (with manifest.json)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=56.0, help="the device step the sleep stands in for")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    for name in ("batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.step_ms < 0:
        ap.error("--warmup and --step-ms must not be negative")
    step_s = args.step_ms / 1e3
    try:
        make_feeder(args.cache, args.batch_size, 0).close()
    except (CacheError, ValueError, OSError) as e:
        ap.exit(1, f"error: {e}\n")
    rows: dict[str, list[float]] = {"read ahead": [], "on the caller": []}
    for _ in range(args.rounds):
        for name, prefetch in (("read ahead", None), ("on the caller", 0)):
            t = host_times(args.cache, batch_size=args.batch_size, prefetch=prefetch, step_s=step_s,
                           steps=args.steps, warmup=args.warmup)
            rows[name].append(statistics.mean(t))
    print(f"cache {args.cache}, B = {args.batch_size}, a {args.step_ms:g} ms step slept, {args.steps} steps a round")
    print("| feeder | host ms a step (median of the rounds' means; each round's) | share of the step |")
    print("|---|---|---|")
    out = {}
    for name, means in rows.items():
        m = statistics.median(means)
        out[name] = {"ms": [round(x * 1e3, 3) for x in means], "share": m / step_s}
        print(f"| {name} | {m * 1e3:.3f}; {', '.join(f'{x * 1e3:.3f}' for x in means)} | {100 * m / step_s:.2f}% |")
    ratio = statistics.median(rows["read ahead"]) / statistics.median(rows["on the caller"])
    print(f"read ahead / on the caller: {ratio:.3f}")
    out["ratio"] = ratio
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
