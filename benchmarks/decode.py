"""Decoding throughput with the key/value cache against the model's full
forward pass at every step, on CPU.

For each model preset (default: small and t5-tiny, random weights, a vocabulary
of ``--vocab`` ids) it decodes one batch of ``--batch-size`` prompts of random
lengths up to ``--prompt`` tokens, ``--length`` new tokens each (greedy, no
EOS, so every row runs to the end), with ``seqcache.training.decoding.predict``
twice, alternating, ``--rounds`` times:

  cache:    the prompts in one pass into a key/value cache, then one token per
            step (T5: the encoder and the cross-attention keys and values once);
  no cache: ``use_cache=False``, the model's full forward pass over the whole
            sequence at every step (the reference of the tests).

Reported per model: generated tokens/s of each (B * length over wall time;
medians over rounds, [min, max]), the ratio cache / no cache, whether both gave
the same tokens, and the compile time of each (the first call). Machines here
are shared and noisy: compare the ratios, not the absolute numbers.

Usage: python benchmarks/decode.py [--models small,t5-tiny] [--batch-size 8]
       [--prompt 32] [--length 64] [--vocab 512] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import statistics
import time


def measure(preset: str, args) -> dict:
    """One model's figures (module docstring)."""
    import numpy as np

    from seqcache.training import config as C
    from seqcache.training import decoding
    from seqcache.training.models import common as M

    model = M.create(dataclasses.replace(C.MODEL_PRESETS[preset], vocab_size=args.vocab), seed=0)
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, args.prompt + 1, args.batch_size)
    tokens = rng.integers(2, args.vocab, (args.batch_size, args.prompt))
    inputs = np.where(np.arange(args.prompt)[None, :] < lengths[:, None], tokens, 0).astype(np.int32)
    config = decoding.DecodeConfig(max_decode_length=args.length, eos_id=-1)
    out, compile_s, rates = {}, {}, {True: [], False: []}
    for use_cache in (True, False):
        start = time.perf_counter()
        out[use_cache] = decoding.predict(model, {"inputs": inputs}, config, use_cache=use_cache)
        compile_s[use_cache] = time.perf_counter() - start
    for _ in range(args.rounds):
        for use_cache in (True, False):
            start = time.perf_counter()
            decoding.predict(model, {"inputs": inputs}, config, use_cache=use_cache)
            rates[use_cache].append(args.batch_size * args.length / (time.perf_counter() - start))
    ratios = [a / b for a, b in zip(rates[True], rates[False])]
    return {
        "model": preset, "batch_size": args.batch_size, "prompt": args.prompt, "length": args.length,
        "cache_tokens_per_s": statistics.median(rates[True]),
        "no_cache_tokens_per_s": statistics.median(rates[False]),
        "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
        "same_tokens": bool((out[True] == out[False]).all()),
        "first_call_s": {"cache": compile_s[True], "no_cache": compile_s[False]},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="small,t5-tiny")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for preset in args.models.split(","):
        row = measure(preset, args)
        results.append(row)
        print(f"{preset}: cache {row['cache_tokens_per_s']:.0f} tokens/s, no cache "
              f"{row['no_cache_tokens_per_s']:.0f} tokens/s, ratio {row['ratio']:.1f} "
              f"[{row['ratio_range'][0]:.1f}, {row['ratio_range'][1]:.1f}], same tokens: {row['same_tokens']}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
