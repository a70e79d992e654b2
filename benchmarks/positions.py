"""Should a packed cache store positions? Bytes per token against the feeder's
cost of deriving them, on one real packed cache.

  bytes:  the cache's shard bytes per token as built (tokens and segment ids),
          and what storing ``<feature>_positions`` would add: per record a uint32
          count and one element per token, uint16 when the sequence length is
          below 2^16 (the segment ids' rule), else int32; also with int32.
  time:   ``Feeder.get_batch`` of ``--steps`` steps, one reader thread, no
          prefetch (the whole per-batch read: locate, read, decode, positions,
          loss weights), against ``positions_from_segment_ids`` on each batch's
          segment ids; medians in microseconds per batch, and their ratio (the
          share of the feeder's time that deriving positions takes). For the
          other side, the decode of one stored feature of that size (the batch's
          segment ids decoded alone from its records, already read): a lower
          bound on what reading stored positions would cost, before their bytes.

Without ``--cache`` the cache is built first with the CLI (byte vocabulary,
``--pack lm``) from ``--text``, into ``--cache-dir`` (kept; a built cache is
reused).

Usage: python benchmarks/positions.py [--cache DIR | --text FILE --cache-dir DIR]
       [--sequence-length 512] [--batch-size 64] [--steps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

DEFAULT_TEXT = "/work/shared/data/tinyshakespeare/input.txt"


def build_cache(text: str, cache_dir: str, sequence_length: int) -> str:
    """The packed byte-vocabulary cache of ``text`` (``seqcache build``)."""
    from seqcache.cli.main import main

    try:
        main(["build", "--cache-dir", cache_dir, "--source", f"text:{text}", "--vocabulary", "byte",
              "--name", "positions_bench", "--sequence-length", str(sequence_length), "--pack", "lm"],
             standalone_mode=False)
    except SystemExit as e:
        if e.code:
            raise
    return os.path.join(cache_dir, "positions_bench", "train")


def bytes_per_token(cache: str, feature: str) -> dict:
    """Shard bytes per token now, and with stored positions (uint16 and int32)."""
    from seqcache.feeders import CacheReader

    with CacheReader(cache) as reader:
        m = reader.manifest
        records = m.num_examples
        tokens = 0
        for start in range(0, records, 4096):
            indices = np.arange(start, min(records, start + 4096))
            for i, rec in zip(indices.tolist(), reader.read(indices)):
                tokens += len(reader.decode(rec, i)[feature])
        shard_bytes = sum(s.num_bytes for s in m.shards)
        length = int((m.sequence_length or {}).get(feature) or 1 << 31)
    small = 2 if length < 1 << 16 else 4
    out = {"records": records, "tokens": tokens, "shard_bytes": shard_bytes,
           "bytes_per_token": shard_bytes / tokens,
           "positions_dtype": "uint16" if small == 2 else "int32"}
    for name, size in (("with_positions", small), ("with_int32_positions", 4)):
        extra = records * 4 + tokens * size
        out[f"{name}_bytes_per_token"] = (shard_bytes + extra) / tokens
        out[f"{name}_increase"] = extra / shard_bytes
    return out


def timings(cache: str, *, feature: str, batch_size: int, sequence_length: int, steps: int) -> dict:
    """Median microseconds per batch: ``get_batch`` and the positions derivation."""
    from seqcache.feeders import Feeder, positions_from_segment_ids
    from seqcache.feeders.decode import decode_batch

    with Feeder(cache=cache, global_batch_size=batch_size, sequence_length=sequence_length, host_index=0,
                host_count=1, num_threads=1, prefetch=0, feature=feature) as feeder:
        for s in range(min(steps, 20)):  # warm the page cache and the readers
            feeder.get_batch(s)
        read, derive, decode = [], [], []
        reader = feeder.readers[0]
        for s in range(steps):
            t0 = time.perf_counter()
            batch = feeder.get_batch(s)
            read.append(time.perf_counter() - t0)
            seg = batch[f"{feature}_segment_ids"]
            t0 = time.perf_counter()
            pos = positions_from_segment_ids(seg)
            derive.append(time.perf_counter() - t0)
            assert np.array_equal(pos, batch[f"{feature}_positions"])
            records = reader.read(batch["cache_index"])
            t0 = time.perf_counter()
            decode_batch(reader.features, records, length=sequence_length,
                         outputs={f"{feature}_segment_ids": np.int32})
            decode.append(time.perf_counter() - t0)
    read_us, derive_us = statistics.median(read) * 1e6, statistics.median(derive) * 1e6
    decode_us = statistics.median(decode) * 1e6
    return {"batch_size": batch_size, "sequence_length": sequence_length, "steps": steps,
            "get_batch_us": read_us, "positions_us": derive_us, "positions_share": derive_us / read_us,
            "stored_decode_us": decode_us}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", help="a packed cache folder (CACHE_DIR/<task>/<split>)")
    ap.add_argument("--text", default=DEFAULT_TEXT, help="text file to build the cache from (without --cache)")
    ap.add_argument("--cache-dir", default="/tmp/seqcache-positions-bench")
    ap.add_argument("--feature", default="targets")
    ap.add_argument("--sequence-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    cache = args.cache or build_cache(args.text, args.cache_dir, args.sequence_length)
    b = bytes_per_token(cache, args.feature)
    t = timings(cache, feature=args.feature, batch_size=args.batch_size, sequence_length=args.sequence_length,
                steps=args.steps)
    print(f"cache {cache}: {b['records']:,} records, {b['tokens']:,} tokens, {b['shard_bytes']:,} shard bytes")
    print(f"bytes/token: {b['bytes_per_token']:.3f} now; {b['with_positions_bytes_per_token']:.3f} with "
          f"{b['positions_dtype']} positions (+{b['with_positions_increase']:.1%}); "
          f"{b['with_int32_positions_bytes_per_token']:.3f} with int32 positions "
          f"(+{b['with_int32_positions_increase']:.1%})")
    print(f"per batch of {t['batch_size']} x {t['sequence_length']}: get_batch {t['get_batch_us']:.0f} us, "
          f"positions_from_segment_ids {t['positions_us']:.0f} us = {t['positions_share']:.1%} of the feeder's time; "
          f"decoding one stored feature of that size {t['stored_decode_us']:.0f} us")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cache": cache, "bytes": b, "time": t}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
