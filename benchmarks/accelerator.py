"""The bundled trainer on an accelerator: throughput, MFU and the largest global
batch that fits, per model preset, reading a real packed cache.

On whatever devices JAX sees (a TPU chip; the CPU with tiny settings), for each
model preset of ``--models`` (``seqcache.training.config.MODEL_PRESETS``; the
compute dtype bfloat16, the vocabulary size from the cache's manifest, then the
``--set`` overrides, as ``seqcache train --set`` takes them):

  search: for global batch sizes B = ``--min-batch``, 2x, 4x ... ``--max-batch``,
          the train step compiled ahead of time (nothing runs) and its memory
          analysis compared with the device's memory (``memory_stats()
          ["bytes_limit"]`` times ``--memory-fraction``); a compile that fails
          for lack of memory does not fit. Stops at the first B that does not
          fit. Not on a device without memory statistics (the CPU) unless
          ``--memory-limit`` gives its size, nor with ``--no-search``.
  runs:   for each B of ``--batch-sizes`` and the largest B that fits,
          ``Trainer.fit`` on batches from ``seqcache.feeders.Feeder`` over the
          cache (as ``seqcache train`` builds it: ``seqcache.training.data``),
          ``--steps`` steps without checkpoints, metrics file or TensorBoard;
          the first ``--warmup`` steps are left out of every figure.

Reported per run: parameters, B, the sequence length L (the cache's), tokens/s
(median over steps, B * L tokens a step), step time (median), MFU and model
TFLOP/s per chip (medians of the trainer's per-step ``mfu`` and
``tflops_per_s_per_device``: model FLOPs, see ``seqcache.training.flops``; MFU
is n/a where the chip's peak is unknown, the CPU included), the data-wait share
(sum of ``data_wait_s`` / sum of ``step_time_s``: host time inside the feeder's
``next``, an upper bound on the device's wait since the fetch overlaps the
previous step), compile time, and device memory twice: the compiled step's
peak (XLA's memory analysis, ``program_bytes``, what the search compares) and
the runtime's ``peak_bytes_in_use`` after the run (on a TPU it counts arrays
only: parameters, optimizer state and batches, not the step's temporaries; a
process-wide maximum, so a run that did not raise it is shown as "<=" that
value). A run that runs out of device memory is reported as such, and the next
one goes on. The header gives the device kind and count, the versions of JAX
and jaxlib, the seqcache copy imported and the command line.

``--fit auto`` (the default) runs the fit of ``seqcache train --fit auto``
before each run the search did not compile (``seqcache.training.fit``: on a
TPU or GPU it compiles at most 4 settings of ``num_microbatches`` and
``model.remat``, keeps those that fit and probes them; elsewhere it changes
nothing); each row gives the setting trained and how the fit chose it.
``--fit off`` trains the preset's settings as they are.

``--profile DIR`` wraps 3 steps after the warm-up of the first run in a JAX
profiler trace (``jax.profiler.start_trace`` / ``stop_trace``, as
``jax.profiler.trace(DIR)`` does around a block) for TensorBoard's profile
plugin or xprof.

Usage: python benchmarks/accelerator.py --cache CACHE_FOLDER [--models base,large]
       [--batch-sizes 32] [--steps 20] [--warmup 3] [--min-batch 8] [--max-batch 512]
       [--no-search] [--memory-fraction 0.95] [--memory-limit BYTES] [--set 'model.remat=full ...'] [--fit off]
       [--profile DIR] [--json out.json]
CPU smoke test: JAX_PLATFORMS=cpu python benchmarks/accelerator.py --cache CACHE
       --models tiny --batch-sizes 8 --steps 4 --warmup 1
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import pathlib
import shlex
import statistics
import sys
import time

# Overrides that would change what is measured: the batch comes from the search
# and --batch-sizes, the length from the cache, the step count from --steps.
_FIXED_FIELDS = ("global_batch_size", "sequence_length", "inputs_sequence_length", "steps")
# The steps a --profile trace holds.
PROFILE_STEPS = 3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True, help="a packed cache folder (with manifest.json)")
    parser.add_argument("--models", default="base,large", help="model presets, comma-separated")
    parser.add_argument("--batch-sizes", default="32", help="global batch sizes to train, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="steps per run, the warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out of the figures")
    parser.add_argument("--min-batch", type=int, default=8)
    parser.add_argument("--max-batch", type=int, default=512)
    parser.add_argument("--no-search", action="store_true", help="skip the search for the largest batch that fits")
    parser.add_argument("--memory-fraction", type=float, default=0.95,
                        help="share of the device's memory a compiled step may take to count as fitting")
    parser.add_argument("--memory-limit", type=int,
                        help="device memory in bytes for the search, instead of memory_stats()['bytes_limit'] "
                             "(also searches on the CPU, which reports none)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="dotted config overrides, as seqcache train --set (repeatable)")
    parser.add_argument("--fit", choices=("auto", "off"), default="auto",
                        help="auto: before each run (not those the search compiled), the fit of seqcache train "
                             "chooses num_microbatches and model.remat (seqcache.training.fit); off: the preset's")
    parser.add_argument("--profile", help="write a profiler trace of 3 steps of the first run to this folder")
    parser.add_argument("--json", help="write the report as JSON to this file")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    except ValueError:
        parser.error(f"--batch-sizes must be integers separated by commas (got {args.batch_sizes!r})")
    if not args.models:
        parser.error("--models names no preset")
    if any(b < 1 for b in args.batch_sizes) or not 1 <= args.min_batch <= args.max_batch:
        parser.error(f"batch sizes must be >= 1 and --min-batch <= --max-batch (got {args.batch_sizes}, "
                     f"{args.min_batch=}, {args.max_batch=})")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps) (got {args.warmup=}, {args.steps=})")
    if not 0 < args.memory_fraction <= 1:
        parser.error(f"--memory-fraction must be in (0, 1] (got {args.memory_fraction})")
    return args


# -- data and configs ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Data:
    """The cache as ``seqcache train`` resolves it (``seqcache.training.data``)."""

    source: object  # seqcache.training.data.Source
    sequence_length: int  # L, tokens per row of targets, as packed
    num_examples: int


def open_cache(path: str) -> Data:
    """The training source of the cache folder ``path`` and its packed length.

    Raises:
      SystemExit: not a cache folder, or a cache that records no packed length.
    """
    from seqcache import layout
    from seqcache.training import config as config_lib
    from seqcache.training import data as data_lib

    if not layout.is_cache(path):
        sys.exit(f"--cache {path}: not a cache folder (no manifest.json); build one with scripts/tpu_bundle.sh")
    source = data_lib.resolve_source(config_lib.DataConfig(task=path), "train")
    try:
        length = data_lib.source_lengths(source, None, ["targets"])["targets"]
    except ValueError as e:
        sys.exit(f"{e}; the benchmark needs a packed cache (seqcache build ... --sequence-length N --pack)")
    return Data(source=source, sequence_length=length, num_examples=data_lib.num_examples_of(source))


def check_overrides(overrides: list[str]) -> list[str]:
    """The ``--set`` values split into ``key=value`` items; refuses the fields the benchmark sets itself."""
    from seqcache.training import config as config_lib

    items = config_lib.split_overrides(overrides)
    for item in items:
        key = item.split("=", 1)[0].strip()
        if key in _FIXED_FIELDS:
            sys.exit(f"--set {item}: the benchmark sets {key} itself (--batch-sizes, --steps; the sequence "
                     "length is the cache's)")
    return items


def make_config(preset: str, data: Data, batch_size: int, steps: int, overrides: list[str]):
    """The ``TrainConfig`` of one run: the preset (``apply_preset``: its model,
    in bfloat16, and the run settings it brings, such as ``large``'s 4
    microbatches) with the cache's vocabulary size, length and converter, no
    checkpoints, metrics file, TensorBoard or progress bar, then ``overrides``
    (``apply_overrides``).

    Raises:
      ConfigError: an unknown preset, a bad override, a model that cannot read the cache.
    """
    from seqcache.training import config as config_lib
    from seqcache.training import data as data_lib

    cfg = config_lib.TrainConfig(
        steps=steps, global_batch_size=batch_size, sequence_length={"targets": data.sequence_length},
        data=config_lib.DataConfig(task=data.source.name, seed=config_lib.DEFAULT_DATA_SEED),
        mesh=config_lib.MeshConfig(data=-1), checkpoint=config_lib.CheckpointConfig(directory=None),
        metrics_file=None, tensorboard=False, progress=False)
    cfg = config_lib.apply_preset(cfg, preset)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="bfloat16"))
    cfg = config_lib.apply_overrides(cfg, overrides)
    # What seqcache train takes from the cache: converter, inputs length, vocabulary size.
    converter = data_lib.resolve_converter(cfg, data.source, model_label=preset)
    lengths = data_lib.source_lengths(data.source, {"targets": data.sequence_length},
                                      config_lib.converter_features(converter))
    vocab = cfg.model.vocab_size or data_lib.model_vocab_size(data.source, converter)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, converter=converter), sequence_length=lengths,
                              model=dataclasses.replace(cfg.model, vocab_size=vocab))
    cfg.validate()
    return cfg


# -- device memory --------------------------------------------------------------


def memory_stats() -> dict | None:
    """``memory_stats()`` of the first device, or None where JAX has none (the CPU)."""
    import jax

    try:
        return jax.devices()[0].memory_stats() or None
    except Exception:  # some backends raise instead of returning None
        return None


def is_out_of_memory(error: BaseException) -> bool:
    """True for XLA's out-of-memory errors, at compile time or run time
    (``RESOURCE_EXHAUSTED``, "Ran out of memory", "Out of memory while ...")."""
    text = f"{type(error).__name__}: {error}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def program_bytes(memory: dict) -> int | None:
    """Device bytes a compiled step needs, from ``Trainer.memory_analysis``: XLA's
    ``peak_memory_in_bytes`` (on a TPU it counts the temporaries over their
    lifetimes), except on the CPU, whose peak is about the arguments alone:
    there, and where no peak is reported, arguments + outputs - aliased
    (donated) + temporaries + generated code. None when the analysis is empty."""
    import jax

    if not memory:
        return None
    if memory.get("peak_memory_in_bytes") and jax.devices()[0].platform != "cpu":
        return int(memory["peak_memory_in_bytes"])
    return int(memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
               - memory.get("alias_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0)
               + memory.get("generated_code_size_in_bytes", 0))


def release() -> None:
    """Drops what the last run left on the devices (its arrays are garbage by now)."""
    import jax

    gc.collect()
    jax.clear_caches()


# -- the search -----------------------------------------------------------------


def search_largest(preset: str, data: Data, args, overrides: list[str], limit: int) -> tuple[int | None, list, dict]:
    """(largest B that fits or None, one record per B tried, {B: compiled Trainer}
    for the sizes that fit and will run). Compiles only; ``limit``: device bytes."""
    from seqcache.training.trainer import Trainer

    budget = int(limit * args.memory_fraction)
    tried, kept, largest = [], {}, None
    b = args.min_batch
    while b <= args.max_batch:
        record = {"model": preset, "batch_size": b, "budget_bytes": budget}
        try:
            trainer = Trainer(make_config(preset, data, b, args.steps, overrides))
            trainer.compile()
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            record.update(fits=False, program_bytes=None, error=_first_line(e))
            tried.append(record)
            print(f"  {preset} B={b}: out of memory at compile time", flush=True)
            break
        need = program_bytes(trainer.memory_analysis)
        fits = need is None or need <= budget
        record.update(fits=fits, program_bytes=need, compile_time_s=trainer.compile_time_s,
                      memory_analysis=trainer.memory_analysis)
        tried.append(record)
        print(f"  {preset} B={b}: {_gb(need)} GB of {_gb(budget)} GB, {'fits' if fits else 'does not fit'} "
              f"(compiled in {trainer.compile_time_s:.1f} s)", flush=True)
        if not fits:
            break
        # Kept for its run: the sizes of --batch-sizes, and the largest so far.
        kept = {k: v for k, v in kept.items() if k in args.batch_sizes}
        kept[b] = trainer
        largest = b
        b *= 2
    return largest, tried, kept


# -- one run ----------------------------------------------------------------------


class Profiler:
    """``on_step`` hook that traces steps ``warmup`` .. ``warmup + PROFILE_STEPS - 1``
    into ``directory`` (the trace starts once the warm-up's last step is done)."""

    def __init__(self, directory: str, warmup: int):
        self.directory, self.warmup = directory, warmup
        self.active = False
        self.steps: list[int] = []

    def start(self) -> None:
        import jax

        jax.profiler.start_trace(self.directory)
        self.active = True

    def stop(self) -> None:
        import jax

        if self.active:
            jax.profiler.stop_trace()
            self.active = False

    def __call__(self, record: dict) -> None:
        step = int(record["step"])
        if self.active:
            self.steps.append(step)
            if len(self.steps) == PROFILE_STEPS:
                self.stop()
        elif not self.steps and step == self.warmup - 1:
            self.start()


def run_one(preset: str, batch_size: int, data: Data, args, overrides: list[str], trainer=None,
            profiler: Profiler | None = None) -> dict:
    """Trains one run and returns its row (see ``summarize``); ``status`` "out of
    memory" when compiling or running it exhausts the device's memory."""
    from seqcache.training import config as config_lib
    from seqcache.training import data as data_lib
    from seqcache.training.trainer import Trainer

    cfg = make_config(preset, data, batch_size, args.steps, overrides)
    row = {"model": preset, "batch_size": batch_size, "sequence_length": cfg.sequence_length["targets"],
           "tokens_per_step": cfg.tokens_per_step, "status": "ok"}
    stats_before = memory_stats()
    result = None
    try:
        if trainer is None and getattr(args, "fit", "off") == "auto":
            cfg, trainer, row["fit"] = run_fit(cfg, overrides)
        trainer = trainer or Trainer(cfg)
        row["setting"] = {"num_microbatches": cfg.num_microbatches, "model.remat": cfg.model.remat,
                          "model.scan_layers": cfg.model.scan_layers}
        row["parameters"] = trainer.num_params
        feeder = data_lib.make_feeder(cfg, data.source, seed=config_lib.DEFAULT_DATA_SEED)
        if profiler is not None and args.warmup == 0:
            profiler.start()
        try:
            result = trainer.fit(feeder, on_step=profiler)
        finally:
            if profiler is not None:
                profiler.stop()
        row.update(summarize(result.metrics, args.warmup, cfg))
        if result.data_exhausted:
            row["status"] = f"data ended after {result.end_step} steps"
    except Exception as e:
        if not is_out_of_memory(e):
            raise
        row.update(status="out of memory", error=_first_line(e))
    if trainer is not None:  # its step compiled, or None where compiling failed
        row["compile_time_s"] = trainer.compile_time_s or None
        row["program_bytes"] = program_bytes(trainer.memory_analysis)
    row.update(_peak_memory(stats_before, memory_stats()))
    del result, trainer
    release()
    return row


def run_fit(cfg, overrides: list[str]):
    """(config, compiled Trainer or None, the fit's record): ``seqcache train
    --fit auto`` for ``cfg``; the fields ``overrides`` set are not varied."""
    import jax

    from seqcache.training import fit as fit_lib
    from seqcache.training.trainer import Trainer

    device = jax.devices()[0]
    limit = (memory_stats() or {}).get("bytes_limit")
    result = fit_lib.fit(cfg, pinned=fit_lib.pinned_fields(overrides, None), platform=device.platform,
                         device_kind=device.device_kind, memory_limit=limit, make_trainer=Trainer)
    chosen = result.record.get("chosen")
    print(f"  fit: {chosen} ({result.record.get('by')}; {len(result.record.get('candidates', []))} compiled in "
          f"{result.record.get('compile_time_s', 0):.1f} s, probes {result.record.get('probe_time_s', 0):.1f} s)",
          flush=True)
    return result.config, result.trainer, result.record


def summarize(records: list[dict], warmup: int, cfg) -> dict:
    """Figures of the steps after the warm-up: medians of tokens/s, step time, MFU
    and TFLOP/s per chip, the data-wait share (sums), the step count. MFU and
    TFLOP/s are the trainer's per-step fields; where its records lack them, they
    are computed with ``seqcache.training.flops`` when that exists, else None."""
    measured = records[warmup:]
    if not measured:
        return {"steps_measured": 0}
    step_time = sum(r["step_time_s"] for r in measured)
    out = {
        "steps_measured": len(measured),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
        "step_time_s": statistics.median(r["step_time_s"] for r in measured),
        "data_wait_share": sum(r["data_wait_s"] for r in measured) / step_time if step_time > 0 else None,
        "loss_first": records[0].get("loss"),
        "loss_last": records[-1].get("loss"),
    }
    flops = [_flops_fields(r, cfg) for r in measured]
    for key in ("mfu", "tflops_per_s_per_device"):
        values = [f[key] for f in flops if f.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    out["model_flops_per_token"] = flops[0].get("model_flops_per_token")
    return out


def _flops_fields(record: dict, cfg) -> dict:
    if "tflops_per_s_per_device" in record:
        return record
    try:
        import jax

        from seqcache.training import flops  # optional: the trainer's FLOP count (newer versions)
    except ImportError:
        return {}
    per_step = flops.model_flops_per_step(cfg)
    devices = jax.device_count()
    return {"model_flops_per_token": flops.flops_per_token(cfg),
            "tflops_per_s_per_device": flops.tflops_per_s_per_device(per_step, record["step_time_s"], devices),
            "mfu": flops.mfu(per_step, record["step_time_s"], devices,
                             flops.peak_tflops(jax.devices()[0].device_kind))}


def _peak_memory(before: dict | None, after: dict | None) -> dict:
    """The runtime's ``peak_bytes_in_use`` after the run, exact when the run
    raised it (else only an upper bound: an earlier run's peak); None without
    memory statistics."""
    if not after or "peak_bytes_in_use" not in after:
        return {"peak_bytes_in_use": None, "peak_is_upper_bound": None}
    peak = int(after["peak_bytes_in_use"])
    earlier = int((before or {}).get("peak_bytes_in_use", 0))
    return {"peak_bytes_in_use": peak, "peak_is_upper_bound": peak <= earlier and earlier > 0}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _gb(n) -> str:
    return "n/a" if n is None else f"{n / 1e9:.3g}"


# -- the report -------------------------------------------------------------------


def environment(args, data: Data, argv: list[str]) -> dict:
    import jax
    import jaxlib

    import seqcache

    stats = memory_stats()
    device = jax.devices()[0]
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "devices": jax.device_count(),
        "device_memory_bytes": (stats or {}).get("bytes_limit"),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "seqcache": f"{seqcache.__version__} ({pathlib.Path(seqcache.__file__).parent})",
        "python": sys.version.split()[0],
        "command": shlex.join([pathlib.Path(sys.executable).name, *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cache": data.source.name,
        "cache_examples": data.num_examples,
        "sequence_length": data.sequence_length,
        "overrides": check_overrides(args.overrides),
        "steps": args.steps,
        "warmup": args.warmup,
    }


def _cell(value, fmt: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value * scale, fmt)


def markdown(env: dict, searches: list[dict], rows: list[dict]) -> str:
    """The report as markdown: the environment, the search, one table row per run."""
    lines = [
        f"device: {env['devices']} x {env['device_kind']} ({_gb(env['device_memory_bytes'])} GB each), "
        f"JAX {env['jax']}, jaxlib {env['jaxlib']}, Python {env['python']}, seqcache {env['seqcache']}",
        f"cache: {env['cache']} ({env['cache_examples']:,} examples of L = {env['sequence_length']:,} tokens); "
        f"{env['steps']} steps a run, the first {env['warmup']} left out; overrides: "
        f"{' '.join(env['overrides']) or 'none'}",
        f"command: `{env['command']}`",
        "",
    ]
    for s in searches:
        if s["largest"] is None and not s["tried"]:
            lines.append(f"largest batch that fits, {s['model']}: n/a ({s['why']})")
            continue
        tried = ", ".join(f"B={t['batch_size']} {_gb(t['program_bytes'])} GB {'fits' if t['fits'] else 'no'}"
                          for t in s["tried"])
        lines.append(f"largest batch that fits, {s['model']}: {s['largest'] or 'none'} (compiled step against "
                     f"{_gb(s['tried'][0]['budget_bytes'])} GB: {tried})")
    lines += ["", "| preset | params | B | L | M, remat, scan | tokens/s | step s | MFU | TFLOP/s/chip | data wait | "
                  "compile s | step peak GB | arrays peak GB | fit | status |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        arrays = _gb(r.get("peak_bytes_in_use"))
        if r.get("peak_is_upper_bound"):
            arrays = "<=" + arrays
        params = f"{r['parameters'] / 1e6:,.1f} M" if r.get("parameters") else "n/a"
        setting = r.get("setting")
        setting = (f"{setting['num_microbatches']}, {setting['model.remat']}, "
                   f"{'scan' if setting['model.scan_layers'] else 'unrolled'}" if setting else "n/a")
        fit = r.get("fit") or {}
        fit = (f"{fit.get('by')}: {len(fit.get('candidates', []))} compiled in {fit.get('compile_time_s', 0):.0f} s"
               if fit.get("chosen") else (fit.get("by") or "off"))
        lines.append(
            f"| {r['model']} | {params} | {r['batch_size']} | {r['sequence_length']} | {setting} | "
            f"{_cell(r.get('tokens_per_s'), ',.0f')} | {_cell(r.get('step_time_s'), '.4f')} | "
            f"{_cell(r.get('mfu'), '.1f', 100)}{'%' if r.get('mfu') is not None else ''} | "
            f"{_cell(r.get('tflops_per_s_per_device'), '.2f')} | "
            f"{_cell(r.get('data_wait_share'), '.2f', 100)}{'%' if r.get('data_wait_share') is not None else ''} | "
            f"{_cell(r.get('compile_time_s'), '.1f')} | {_gb(r.get('program_bytes'))} | {arrays} | {fit} | "
            f"{r['status']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    overrides = check_overrides(args.overrides)
    data = open_cache(args.cache)
    from seqcache.training.config import ConfigError

    for preset in args.models:  # a bad preset or override: one line before anything is compiled
        try:
            make_config(preset, data, max(args.batch_sizes), args.steps, overrides).validate()
        except ConfigError as e:
            sys.exit(f"error: {preset}: {e}")
    env = environment(args, data, [sys.argv[0], *argv])
    print(f"{env['devices']} x {env['device_kind']}, JAX {env['jax']}; cache {data.source.name}: "
          f"{data.num_examples:,} examples, L = {data.sequence_length:,}", flush=True)
    limit = args.memory_limit or env["device_memory_bytes"]
    searches, rows = [], []
    profiler = Profiler(args.profile, args.warmup) if args.profile else None
    for preset in args.models:
        search = {"model": preset, "largest": None, "tried": []}
        compiled = {}
        if args.no_search:
            search["why"] = "--no-search"
        elif not limit:
            search["why"] = f"{env['device_kind']} reports no memory limit"
        else:
            print(f"{preset}: largest global batch that fits", flush=True)
            search["largest"], search["tried"], compiled = search_largest(preset, data, args, overrides, limit)
        searches.append(search)
        sizes = sorted(set(args.batch_sizes) | ({search["largest"]} if search["largest"] else set()))
        for b in sizes:
            t0 = time.perf_counter()
            row = run_one(preset, b, data, args, overrides, trainer=compiled.pop(b, None), profiler=profiler)
            if profiler is not None and row["status"] == "out of memory":
                profiler.steps.clear()  # the next run is traced instead
            elif profiler is not None:
                row["profile"] = {"directory": args.profile, "steps": profiler.steps}
                profiler = None
            row["largest_that_fits"] = b == search["largest"]
            rows.append(row)
            print(f"{preset} B={b}: {row['status']}, {_cell(row.get('tokens_per_s'), ',.0f')} tokens/s "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        del compiled
        release()
    print()
    print(markdown(env, searches, rows))
    if args.json:
        report = {"environment": env, "search": searches, "runs": rows}
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
