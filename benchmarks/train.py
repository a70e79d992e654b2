"""Training throughput with the feeder, and the share of step time spent waiting
for data, on CPU.

On a real cache (tinyshakespeare from ../shared/data, built here by the pipeline:
byte vocabulary, language-model packing to ``--length`` tokens; for the T5
presets, span corruption of the C4 sample with first-fit packing to ``--length``
input tokens and the targets length T5 derives from it, read through
``ConvertedFeeder("encdec")``), for each model preset (default: tiny, small and
t5-tiny) it trains ``--steps`` steps with ``seqcache train``'s Trainer twice,
alternating, ``--rounds`` times:

  feeder:    batches from ``seqcache.feeders.Feeder`` (reader threads, prefetch);
  in-memory: the same batches, read beforehand and replayed from memory (the
             bound: no data loading at all).

Reported per model (medians over rounds, the first ``--warmup`` steps of each run
left out): tokens/s (B * L tokens per step over wall time between completed
steps), the fraction of step time the host spent inside the feeder's ``next``
(``data_wait_s / step_time_s``; the fetch overlaps the device's computation of the
previous step, so this is an upper bound on the time the device waits), and
feeder/in-memory throughput. Compile time is excluded (the step is compiled ahead
of time, once per model). Machines here are shared and noisy: compare the
ratios, not the absolute numbers.

Usage: python benchmarks/train.py [--models tiny,small,t5-tiny] [--batch-size 16]
       [--length 128] [--steps 12] [--warmup 2] [--rounds 2]
       [--cache-dir DIR (kept and reused)] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import tempfile
import time

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"
C4 = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "c4" / "c4_validation_2k.parquet"


def build_cache(root: str, length: int) -> str:
    from seqcache import format as fmt
    from seqcache import pipelines, tasks

    if not SHARED.is_file():
        sys.exit(f"corpus not found: {SHARED}")
    src = pathlib.Path(root) / "corpus"
    src.mkdir(parents=True, exist_ok=True)
    corpus = src / "input.txt"
    if not corpus.exists():
        corpus.write_bytes(SHARED.read_bytes())
    task = tasks.Task(
        "shakespeare_lm",
        source=tasks.TextLineSource(str(src / "*.txt"), on_error={"empty": "skip"}),  # blank lines separate speeches
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.preprocessors.append_eos()],
        packing="lm",
    )
    t0 = time.perf_counter()
    result = pipelines.build_task(task, cache_dir=os.path.join(root, "caches"),
                                  config=pipelines.BuildConfig(num_shards=4, sequence_length={"targets": length}))
    m = fmt.read_manifest(result.cache_dir)
    verb = "reused" if result.reused else f"built in {time.perf_counter() - t0:.1f} s"
    print(f"cache {result.cache_dir}: {m.num_examples:,} packed examples of {length} tokens, {verb}")
    return result.cache_dir


def build_span_cache(root: str, inputs_length: int) -> tuple[str, dict]:
    """A span-corruption cache of the C4 sample (byte vocabulary with 100
    sentinels, first-fit packing); returns (cache folder, lengths)."""
    from seqcache import pipelines, tasks
    from seqcache.tasks import denoising
    from seqcache.tasks import preprocessors as P

    if not C4.is_file():
        sys.exit(f"corpus not found: {C4}")
    lengths = {"inputs": inputs_length, "targets": denoising.random_spans_helper(inputs_length)[1]}
    vocab = tasks.ByteVocabulary(extra_ids=100)
    task = tasks.Task(
        "c4_span",
        source=tasks.ParquetSource(str(C4), column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
        packing="first_fit",
    )
    result = pipelines.build_task(task, cache_dir=os.path.join(root, "caches"),
                                  config=pipelines.BuildConfig(num_shards=4, sequence_length=lengths))
    print(f"cache {result.cache_dir}: span corruption, lengths {lengths}")
    return result.cache_dir, lengths


class InMemoryFeeder:
    """Replays host batches from memory, with the feeder interface the trainer uses."""

    def __init__(self, batches, global_batch_size):
        self.batches = batches
        self.global_batch_size = global_batch_size
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = self.batches[self.step % len(self.batches)]
        self.step += 1
        return batch

    def state(self):
        return {"global_batch_size": self.global_batch_size, "position": self.step * self.global_batch_size}

    def close(self):
        pass


def summarize(result, warmup: int, tokens_per_step: int) -> dict:
    records = result.metrics[warmup:]
    step_time = sum(r["step_time_s"] for r in records)
    wait = sum(r["data_wait_s"] for r in records)
    return {
        "tokens_per_s": tokens_per_step * len(records) / step_time,
        "step_time_s": statistics.median(r["step_time_s"] for r in records),
        "data_wait_fraction": wait / step_time,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,small,t5-tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dir")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def prepare(architecture: str, root: str, args: argparse.Namespace):
    """(a function that makes a feeder, the first ``steps + warmup`` host batches
    read beforehand, the TrainConfig fields of the data, vocabulary size) for
    ``architecture``: the span-corruption cache through ``ConvertedFeeder("encdec")``
    for ``t5``, the language-model cache through ``Feeder`` otherwise."""
    from seqcache.feeders import Feeder
    from seqcache.feeders.converters import ConvertedFeeder
    from seqcache.training import config as config_lib
    from seqcache.training import data as data_lib

    if architecture == "t5":
        cache, lengths = build_span_cache(root, args.length)

        def make():
            return ConvertedFeeder(converter="encdec", cache=cache, sequence_length=lengths,
                                   global_batch_size=args.batch_size)
        fields = {"sequence_length": lengths, "data": config_lib.DataConfig(converter="encdec")}
    else:
        cache = build_cache(root, args.length)

        def make():
            return Feeder(cache=cache, global_batch_size=args.batch_size, sequence_length=args.length)
        fields = {"sequence_length": {"targets": args.length}}
    vocab = data_lib.vocab_size_of(data_lib.Source(kwargs={"cache": cache}, cache_dirs=(cache,), name=cache))
    with make() as f:
        replay = [{k: v.copy() for k, v in f.get_batch(s).items()} for s in range(args.steps + args.warmup)]
    return make, replay, fields, vocab


def bench_model(name: str, preset, data, args: argparse.Namespace) -> dict:
    """One model's row: the trainer compiled once, then ``args.rounds`` rounds of a
    feeder run and an in-memory run (alternating which goes first); medians over
    rounds. ``data`` is ``prepare``'s result for the preset's architecture."""
    from seqcache.training import config as config_lib
    from seqcache.training.trainer import Trainer

    make_feeder, replay, fields, vocab = data
    cfg = config_lib.TrainConfig(
        model=dataclasses.replace(preset, vocab_size=vocab),
        steps=args.steps + args.warmup,
        global_batch_size=args.batch_size,
        mesh=config_lib.MeshConfig(data=-1),
        progress=False,
        **fields,
    )
    trainer = Trainer(cfg)
    trainer.compile()
    runs = {"feeder": [], "in-memory": []}
    for r in range(args.rounds):
        order = ["feeder", "in-memory"] if r % 2 == 0 else ["in-memory", "feeder"]
        for kind in order:
            if kind == "feeder":
                feeder = make_feeder()
            else:
                feeder = InMemoryFeeder(replay, args.batch_size)
            result = trainer.fit(feeder)
            runs[kind].append(summarize(result, args.warmup, cfg.tokens_per_step))
    med = {kind: {k: statistics.median(x[k] for x in v) for k in v[0]} for kind, v in runs.items()}
    return {
        "model": name,
        "parameters": trainer.num_params,
        "tokens_per_step": cfg.tokens_per_step,
        "compile_time_s": trainer.compile_time_s,
        "feeder_tokens_per_s": med["feeder"]["tokens_per_s"],
        "in_memory_tokens_per_s": med["in-memory"]["tokens_per_s"],
        "feeder_over_in_memory": med["feeder"]["tokens_per_s"] / med["in-memory"]["tokens_per_s"],
        "step_time_s": med["feeder"]["step_time_s"],
        "data_wait_fraction": med["feeder"]["data_wait_fraction"],
    }


def print_table(rows: list[dict], args: argparse.Namespace, devices: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"training on CPU ({devices} device(s)), B={args.batch_size}, L={args.length}")
    for col in ("model", "params", "tok/s feeder", "tok/s in-memory", "feeder/in-mem", "step s",
                "data wait", "compile s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], f"{r['parameters']:,}", f"{r['feeder_tokens_per_s']:,.0f}",
                      f"{r['in_memory_tokens_per_s']:,.0f}", f"{r['feeder_over_in_memory']:.3f}",
                      f"{r['step_time_s']:.4f}", f"{100 * r['data_wait_fraction']:.2f}%",
                      f"{r['compile_time_s']:.1f}")
    Console(width=120).print(table)


def main(argv=None) -> int:
    args = parse_args(argv)

    import jax

    from seqcache.training import config as config_lib

    root = args.cache_dir or tempfile.mkdtemp(prefix="seqcache-train-bench-")
    data = {}  # architecture -> prepare's result
    rows = []
    for name in args.models.split(","):
        preset = config_lib.model_preset(name)
        if preset.architecture not in data:
            data[preset.architecture] = prepare(preset.architecture, root, args)
        rows.append(bench_model(name, preset, data[preset.architecture], args))

    print_table(rows, args, jax.device_count())
    report = {"batch_size": args.batch_size, "sequence_length": args.length, "steps": args.steps,
              "warmup": args.warmup, "rounds": args.rounds, "devices": jax.device_count(), "results": rows}
    print(json.dumps(report, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
