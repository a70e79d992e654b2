"""``seqcache train``: the bundled JAX trainer on a cache (seqcache.training)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
import os
import statistics
import sys

import click
from rich.console import Console
from rich.table import Column, Table

from seqcache import bounded_json
from seqcache import format as fmt
from seqcache import lengths as lengths_lib
from seqcache.cli.commands import common
from seqcache.feeders import FeederStateError
from seqcache.training import compile_cache
from seqcache.training import config as config_lib
from seqcache.training import data as data_lib
from seqcache.training import distributed
from seqcache.training import flops as flops_lib
from seqcache.training import metrics as metrics_lib

# Exit status after SIGTERM: the run stopped early with a checkpoint saved
# (128 + SIGTERM, as a shell reports a process ended by the signal).
EXIT_PREEMPTED = 143


class _TrainCommand(click.Command):
    """Keeps the command's arguments (``ctx.meta``) for ``--local-processes`` to run again."""

    def parse_args(self, ctx, args):
        ctx.meta[_RAW_ARGS] = list(args)
        return super().parse_args(ctx, args)


_RAW_ARGS = "seqcache.train.args"
# Options of the launcher itself, left out of the command each process runs.
_LAUNCHER_OPTIONS = ("--local-processes", "--local-devices")


def _without_launcher_options(args: list[str]) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _LAUNCHER_OPTIONS:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


@click.command("train", cls=_TrainCommand)
@click.option("--cache-dir", help="Root folder of caches (CACHE_DIR/<task>/<split>).")
@click.option("--task", help="A cache folder, a task name under --cache-dir, or a registered task or mixture name.")
@click.option("--split", help="Training split [default: train].")
@click.option("--eval-split", help="Split to evaluate on (every example once) after training and every eval_every steps.")
@click.option("--mixture-schedule", type=click.Path(exists=True, dir_okay=False),
              help="JSON or YAML file {step: {task or cache folder: rate}}: mixing rates that change at the given "
                   "steps (the first stage at step 0); replaces --task.")
@click.option("--module", "modules", multiple=True, help="Python module or .py file that registers tasks and mixtures (repeatable).")
@click.option("--steps", type=int, help="Total optimizer steps of the run.")
@click.option("--batch-size", type=int, help="Global batch size (rows per step over all hosts).")
@common.sequence_length_option("The features are the converter's: targets (lm), inputs and targets (encdec, "
                               "prefix_lm) [default: the cache's own; a given length only cuts rows shorter].")
@click.option("--mesh", "mesh_flag", help="Mesh shape, e.g. data=2,fsdp=4,model=1 (one axis may be -1).")
@click.option("--rules", type=click.Choice(["dp", "fsdp", "tp", "fsdp+tp"]), help="Logical axis rules preset.")
@click.option("--checkpoint-dir", help="Checkpoints, config.json and metrics.jsonl; resumes from the latest checkpoint.")
@click.option("--seed", type=int, help="Seed of parameter initialisation and dropout (the feeder's is data.seed).")
@click.option("--model", "model_preset",
              help="Model preset: tiny, small, base, large or 1b (decoder-only), t5-tiny or t5-small "
                   "(encoder-decoder).")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False), help="JSON config file (nested like the config.json a run writes).")
@click.option("--set", "overrides", multiple=True, help="Dotted overrides, e.g. --set 'model.d_model=128 optimizer.lr=1e-3' (repeatable); JSON values "
                   "may contain spaces: --set 'data.mixture={\"wiki/train\": 3, \"code/train\": 1}'.")
@click.option("--stop-at-step", type=click.IntRange(min=1),
              help="Stop once this many steps are done, saving a checkpoint, as a preemption would; the run's "
                   "config (and so its learning-rate schedule) is unchanged, and the same command without this "
                   "flag resumes it.")
@click.option("--tensorboard/--no-tensorboard", default=None,
              help="Write TensorBoard event files (loss, learning rate, grad norm, tokens/s, eval) in the folder "
                   "'tensorboard' next to metrics.jsonl [default: on].")
@click.option("--fit", "fit_mode", type=click.Choice(["auto", "off"]),
              help="auto: before training, compile at most 4 settings of num_microbatches and model.remat for "
                   "the global batch, keep those that fit the device's memory and train with the fastest (a "
                   "short timed probe); off: train with the config as it is. A field given with --set or "
                   "--config is kept; a resumed run takes the settings of its config.json [default: auto on "
                   "a TPU or GPU; on other devices nothing is chosen].")
@click.option("--dry-run", is_flag=True, help="Resolve the config, print the derived quantities and exit.")
@common.compilation_cache_option
@click.option("--coordinator-address", envvar="JAX_COORDINATOR_ADDRESS", show_envvar=True,
              help="Multi-process run: HOST:PORT of process 0's coordination service (jax.distributed.initialize).")
@click.option("--num-processes", type=click.IntRange(min=1), envvar="JAX_NUM_PROCESSES", show_envvar=True,
              help="Multi-process run: the number of JAX processes (one per host).")
@click.option("--process-id", type=click.IntRange(min=0), envvar="JAX_PROCESS_ID", show_envvar=True,
              help="Multi-process run: this process's index in [0, --num-processes).")
@click.option("--jax-distributed", is_flag=True,
              help="Call jax.distributed.initialize() and let JAX detect what is not given (SLURM, Open MPI, "
                   "Cloud TPU, Kubernetes).")
@click.option("--local-processes", type=click.IntRange(min=1),
              help="Try a multi-process run on this machine: start N processes of this command on 127.0.0.1 "
                   "(a free port) and wait for them; SIGTERM or Ctrl-C is passed on to every process.")
@click.option("--local-devices", type=click.IntRange(min=1),
              help="With --local-processes: give each process this many CPU devices "
                   "(--xla_force_host_platform_device_count).")
@click.pass_context
def train(ctx, cache_dir, task, split, eval_split, modules, steps, batch_size, sequence_length, mesh_flag, rules,
          checkpoint_dir, seed, model_preset, config_file, overrides, stop_at_step, tensorboard, fit_mode, dry_run,
          compilation_cache, coordinator_address,
          num_processes, process_id, jax_distributed, local_processes, local_devices, mixture_schedule=None):
    """Train a decoder-only or a T5 encoder-decoder model on a cache with the
    exactly-once feeder (the model reads the cache through the feature converter
    that fits its features: lm, prefix_lm or encdec).

    The config is built from the defaults, then --model, then --config, then the
    other flags, then --set. Re-running the same command resumes from the latest
    checkpoint in --checkpoint-dir. On SIGTERM the trainer saves a checkpoint and
    exits with status 143.

    Several hosts: run this command once per host with --coordinator-address,
    --num-processes and --process-id (or the JAX_* variables); every process
    reads only its own rows, process 0 writes the metrics and config.json.
    --local-processes N tries it on one machine.
    """
    if local_devices is not None and local_processes is None:
        raise click.UsageError("--local-devices goes with --local-processes")
    if local_processes is not None:
        distributed_given = (any(v is not None for v in (coordinator_address, num_processes, process_id))
                             or jax_distributed)
        _launch_local(ctx, local_processes, local_devices, distributed_given=distributed_given)
    start_distributed(coordinator_address=coordinator_address, num_processes=num_processes,
                       process_id=process_id, jax_distributed=jax_distributed, compilation_cache=compilation_cache,
                       compiles=not dry_run)
    import jax  # optional: jax

    is_chief = jax.process_index() == 0
    flags = config_lib.CommandLineFlags(
        cache_dir=cache_dir, task=task, split=split, eval_split=eval_split, steps=steps,
        global_batch_size=batch_size, sequence_length=sequence_length, rules=rules, seed=seed,
        tensorboard=tensorboard, mesh=mesh_flag, checkpoint_dir=checkpoint_dir)
    cfg, source, eval_source = _resolve_config(flags, model_preset=model_preset, config_file=config_file,
                                               overrides=overrides, mixture_schedule=mixture_schedule,
                                               modules=tuple(modules))
    fit_options = {"mode": fit_mode, "overrides": overrides, "config_file": config_file, "dry_run": dry_run}
    cfg, trainer, evaluator = _make_trainer(cfg, modules=tuple(modules), evaluate_tasks=not mixture_schedule,
                                            fit_options=fit_options)
    feeder, eval_fn = _open_feeders(cfg, source, eval_source)
    derived = _derived_quantities(trainer, cfg, source, model_preset)  # on every process; process 0 prints it
    if is_chief:
        _print_derived(derived)
    if dry_run:
        _finish_dry_run(cfg, trainer, feeder, is_chief=is_chief)
        return
    _fit_and_report(trainer, feeder, eval_fn, stop_at_step=stop_at_step, evaluator=evaluator)


def _launch_local(ctx, local_processes: int, local_devices: int | None, *, distributed_given: bool) -> None:
    """``--local-processes N``: runs this command in N local processes and exits with their status."""
    if distributed_given:
        raise click.UsageError(
            "--local-processes starts its own processes and chooses their coordinator, count and ids; "
            "drop --coordinator-address/--num-processes/--process-id/--jax-distributed (and the JAX_* "
            "variables)")
    argv = [sys.executable, "-m", "seqcache.cli", "train", *_without_launcher_options(ctx.meta[_RAW_ARGS])]
    sys.exit(distributed.launch_local(argv, num_processes=local_processes, devices_per_process=local_devices))


def start_distributed(*, coordinator_address, num_processes, process_id, jax_distributed,
                      compilation_cache=None, compiles: bool = True) -> None:
    """Checks the multi-process flags, sets up logging, initialises JAX's
    distributed runtime, before anything asks JAX for devices, and sets the
    persistent compilation cache (``--compilation-cache``,
    ``seqcache.training.compile_cache``) before anything compiles where the
    command ``compiles`` (a dry run does not: JAX's setting is left alone).
    ``train`` and ``evaluate`` both start this way. From then on the standard output
    carries only what the command prints: what JAX's libraries print to it
    (Gloo's connection messages) goes to the standard error
    (``common.stdout_for_output_only``).

    Raises:
      click.UsageError: flags that do not make one valid multi-process setup.
    """
    try:
        settings = distributed.settings_from(coordinator_address=coordinator_address, num_processes=num_processes,
                                             process_id=process_id, auto=jax_distributed, environ={})
        settings.validate()
    except distributed.DistributedError as e:
        raise click.UsageError(str(e)) from None
    prefix = f"[process {settings.process_id}/{settings.num_processes}] " if settings.num_processes else ""
    logging.basicConfig(level=logging.INFO, format=f"{prefix}%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    common.stdout_for_output_only()
    distributed.initialize(settings)
    try:
        if compiles:
            compile_cache.enable(compilation_cache)
    except compile_cache.CompileCacheError as e:
        raise click.UsageError(str(e)) from None


def _resolve_config(flags, *, model_preset, config_file, overrides, mixture_schedule, modules):
    """(config, training data source, eval data source or None), the config from its layers
    (``config_from_layers``) completed from the cache and checked against it."""
    from seqcache.training import partitioning  # optional: jax

    layers = dict(preset=model_preset, config_file=config_file, flags=flags,
                  overrides=config_lib.split_overrides(overrides))
    try:
        cfg = config_lib.config_from_layers(**layers)
        if mixture_schedule and cfg.data.task:
            raise config_lib.ConfigError(f"--mixture-schedule replaces --task (data.task={cfg.data.task!r}): give one")
        schedule = data_lib.load_mixture_schedule(mixture_schedule) if mixture_schedule else None
        source = data_lib.resolve_source(cfg.data, cfg.data.split, modules, schedule=schedule)
        converter = data_lib.resolve_converter(cfg, source, model_label=model_preset or cfg.model.architecture)
        if converter != cfg.converter:  # a decoder on inputs and targets: a length for every feature covers both
            cfg = config_lib.config_from_layers(**layers, converter=converter)
        cfg = _resolve_from_cache(cfg, source, converter)
        cfg.validate()
        folder = cfg.checkpoint.directory
        if folder and os.path.exists(folder) and not os.path.isdir(folder):
            raise config_lib.ConfigError(f"--checkpoint-dir {folder}: not a folder (a run keeps its checkpoints, "
                                         "config.json and metrics there)")
        eval_source = (
            data_lib.resolve_source(cfg.data, cfg.data.eval_split, modules, schedule=schedule, for_eval=True)
            if cfg.data.eval_split else None
        )
        if eval_source is not None:
            data_lib.source_lengths(eval_source, cfg.sequence_length, list(cfg.sequence_length))
    except (config_lib.ConfigError, partitioning.PartitioningError) as e:
        raise click.UsageError(str(e)) from None
    except (fmt.CacheError, lengths_lib.SequenceLengthError) as e:
        fail_line(e)
    return cfg, source, eval_source


def _make_trainer(cfg, *, modules=(), evaluate_tasks=False, fit_options=None):
    """(the config the fit chose, its Trainer, the Evaluator of its eval split
    or None): the fit first (``seqcache.training.fit.for_run`` with
    ``fit_options``: ``mode`` (``--fit``), ``overrides`` and ``config_file``,
    whose settings it keeps, ``dry_run``), then the Trainer it compiled or a
    new one; a config that cannot work on these devices is a usage error. With
    ``evaluate_tasks`` (and ``cfg.eval_metrics``), the Evaluator decodes the eval
    split and runs its task's metrics when a registered task of it has metric_fns."""
    from seqcache.training import checkpoints, evaluation, fit, partitioning, trainer as trainer_lib  # optional: jax

    options = fit_options or {}
    raw = None
    if options.get("config_file"):  # config_from_layers read it already: it parses
        raw = bounded_json.read_file(options["config_file"], error=config_lib.ConfigError, max_bytes=1 << 20,
                                     max_depth=16, what="config file")
    pinned = fit.pinned_fields(config_lib.split_overrides(options.get("overrides", ())), raw)
    try:
        fitted = fit.for_run(cfg, options.get("mode"), pinned=pinned, dry_run=options.get("dry_run", False),
                             make_trainer=trainer_lib.Trainer)
        cfg = fitted.config
        trainer = fitted.trainer or trainer_lib.Trainer(cfg)
        if not (evaluate_tasks and cfg.eval_metrics and cfg.data.eval_split):
            return cfg, trainer, None
        tasks = evaluation.eval_tasks(cfg, cfg.data.eval_split, modules=modules)
        if not any(t.metric_fns for t in tasks):
            return cfg, trainer, None
        return cfg, trainer, evaluation.evaluator_for(cfg, tasks, split=cfg.data.eval_split, mesh=trainer.mesh)
    except (config_lib.ConfigError, partitioning.PartitioningError) as e:
        raise click.UsageError(str(e)) from None
    except (evaluation.EvalError, checkpoints.CheckpointError) as e:
        # A packed eval split, or (a dry run) a checkpoint of another layout, shape or
        # optimizer: refused before the first step.
        fail_line(e)


def _open_feeders(cfg, source, eval_source):
    """(training feeder, eval feeder factory or None), built before anything is compiled."""
    feeder_seed = cfg.data.seed  # set by resolve_seeds, never from cfg.seed
    feeder = None
    try:
        feeder = data_lib.make_feeder(cfg, source, seed=feeder_seed)
        eval_fn = data_lib.eval_feeder_factory(cfg, eval_source, seed=feeder_seed) if eval_source else None
        if eval_fn is not None:
            eval_fn().close()
    except (ValueError, fmt.CacheError) as e:
        if feeder is not None:
            feeder.close()
        if isinstance(e, fmt.CacheError):
            fail_line(e)
        raise click.UsageError(str(e)) from None
    return feeder, eval_fn


def _derived_quantities(trainer, cfg, source, model_preset) -> dict:
    """The quantities printed before training: the trainer's, the data's and where the run writes."""
    from seqcache.training.trainer import METRICS_FILE, tensorboard_dir_for  # optional: jax

    derived = trainer.describe()
    derived["model_flops_per_token"] = round(flops_lib.flops_per_token(cfg))
    derived["peak_tflops_per_device"] = flops_lib.peak_tflops(flops_lib.device_kind_of(trainer.mesh))
    derived["data"] = source.name
    derived["examples"] = data_lib.num_examples_of(source)
    derived["steps_per_epoch"] = data_lib.steps_per_epoch(source, cfg.global_batch_size)
    if derived["steps_per_epoch"]:
        derived["epochs"] = round(cfg.steps / derived["steps_per_epoch"], 3)
    derived["vocab_size"] = cfg.model.vocab_size
    derived["model"] = model_preset or "config"
    if cfg.fit:
        derived["fit"] = _fit_line(cfg.fit)
    derived["checkpoint_dir"] = cfg.checkpoint.directory
    metrics_path = cfg.metrics_file or (os.path.join(cfg.checkpoint.directory, METRICS_FILE)
                                        if cfg.checkpoint.directory else None)
    derived["metrics_file"] = metrics_path
    derived["tensorboard_dir"] = tensorboard_dir_for(cfg, metrics_path)
    return derived


def _fit_line(record: dict | None) -> str | None:
    """The fit's choice in a few words, e.g. ``num_microbatches=4 model.remat=dots
    model.scan_layers=true (probe; 3 compiled in 58.1 s)``; None without a fit."""
    if not record or not record.get("chosen"):
        return None
    chosen = " ".join(f"{k}={json.dumps(v)}" for k, v in record["chosen"].items())
    if record.get("resumed"):
        return f"{chosen} (resumed)"
    return (f"{chosen} ({record.get('by')}; {len(record.get('candidates', []))} compiled in "
            f"{record.get('compile_time_s', 0):.1f} s)")


def _finish_dry_run(cfg, trainer, feeder, *, is_chief: bool) -> None:
    """Checks the shard files and what a run checks before it restores (the
    latest checkpoint's layout, shapes, optimizer, global batch and data
    stream: ``Trainer.check_resumable``), closes the feeder and prints the
    resolved config (process 0)."""
    # A dry run reads no shard, so the feeder's check at the first read is made here.
    try:
        for reader in data_lib.feeder_readers(feeder):
            fmt.check_shard_files(reader.cache_dir, reader.manifest)
        trainer.check_resumable(feeder)
    except (fmt.CacheError, RuntimeError) as e:
        feeder.close()
        if isinstance(e, RuntimeError) and type(e).__name__ != "CheckpointError":
            raise
        fail_line(e)
    feeder.close()
    if is_chief:
        click.echo(config_lib.to_json(cfg), nl=False)


def _fit_and_report(trainer, feeder, eval_fn, *, stop_at_step, evaluator=None) -> None:
    """Trains, prints the run's summary as one JSON line, and exits 1 on a loss
    that is not finite, 143 after SIGTERM."""
    from seqcache.training.checkpoints import CheckpointError  # optional: jax

    try:
        result = trainer.fit(feeder, eval_feeder_fn=eval_fn, stop_at=stop_at_step, evaluator=evaluator)
    except (CheckpointError, FeederStateError, fmt.CacheError) as e:
        fail_line(e)
    except ValueError as e:  # a task metric that failed (MetricError) or an eval split read wrongly (EvalError)
        if type(e).__name__ not in ("MetricError", "EvalError"):
            raise
        fail_line(e)
    summary = _summary(result)
    if trainer.config.fit:
        summary["fit"] = trainer.config.fit
    click.echo(summary_line(summary))
    bad = next((result.start_step + i + 1 for i, x in enumerate(result.losses) if not math.isfinite(float(x))), None)
    if bad is not None:
        click.echo(f"error: the loss is not finite from step {bad} on (a learning rate too high, or bad data: "
                   "run `seqcache verify` on the cache)", err=True)
        sys.exit(1)
    if result.stopped_by_signal:
        sys.exit(EXIT_PREEMPTED)


def summary_line(summary: dict) -> str:
    """The summary as one line of strict JSON: a NaN or infinite value (a diverged
    run) is written as null, which every JSON reader reads (``NaN`` is Python's only)."""
    return json.dumps(metrics_lib.strict_json(summary), sort_keys=True, allow_nan=False)


def _summary(result) -> dict:
    """The run's summary: steps, final loss, compile time, how it ended, parameters' digest, throughput
    (``throughput_summary``), process, eval."""
    import jax  # optional: jax

    from seqcache.training.trainer import params_digest  # optional: jax

    summary = {
        "start_step": result.start_step,
        "end_step": result.end_step,
        "final_loss": result.losses[-1] if result.losses else None,
        "compile_time_s": round(result.compile_time_s, 3),
        "stopped_by_signal": result.stopped_by_signal,
        "data_exhausted": result.data_exhausted,
        "params_sha256": params_digest(result.params),
    }
    summary.update(throughput_summary(result.metrics), **compile_cache.summary())
    if jax.process_count() > 1:
        summary["process"] = jax.process_index()
        summary["processes"] = jax.process_count()
    if result.eval:
        summary.update(result.eval)
    return summary


# The step metrics the summary gives as medians over a run's steps (``throughput_summary``).
THROUGHPUT_FIELDS = ("model_flops_per_token", "tokens_per_s", "tflops_per_s_per_device", "mfu")


def throughput_summary(records: list[dict]) -> dict:
    """``THROUGHPUT_FIELDS`` as medians over the step records of a run, leaving
    out the first step (its time includes dispatching the compiled program) unless
    it is the only one; a field is None where no step has a number for it (``mfu``
    on a device of unknown peak, or no step at all)."""
    steps = records[1:] if len(records) > 1 else records
    out = {}
    for name in THROUGHPUT_FIELDS:
        values = [r[name] for r in steps if isinstance(r.get(name), numbers.Real)]
        out[name] = statistics.median(values) if values else None
    return out


def _resolve_from_cache(cfg, source, converter):
    """The config with what the cache decides where it is unset: ``converter``
    (``data_lib.resolve_converter``'s), the sequence length of every feature it
    reads (``data_lib.source_lengths``), vocabulary size.

    Raises:
      ConfigError: a sequence length given for a feature the converter does not read."""
    features = config_lib.converter_features(converter)
    given = dict(cfg.sequence_length or {})
    extra = [f for f in given if f not in features]
    if extra:
        raise config_lib.ConfigError(
            f"sequence length given for {extra[0]!r} ({extra[0]}={given[extra[0]]}), which converter {converter!r} "
            f"does not read (it reads {list(features)}); leave it out")
    lengths = data_lib.source_lengths(source, given, features)
    updates = {"data": dataclasses.replace(cfg.data, converter=converter), "sequence_length": lengths}
    if cfg.model.vocab_size is None:
        updates["model"] = dataclasses.replace(cfg.model, vocab_size=data_lib.model_vocab_size(source, converter))
        return dataclasses.replace(cfg, **updates)
    try:
        needed = data_lib.model_vocab_size(source, converter)
    except config_lib.ConfigError:  # the manifest records no vocabulary size: the config's is the only one
        needed = 0
    if cfg.model.vocab_size < needed:
        raise config_lib.ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the vocabulary of {source.name} ({needed} ids): "
            f"its token ids would index outside the embedding; leave model.vocab_size unset or set it to {needed} "
            "or more")
    return dataclasses.replace(cfg, **updates)


def fail_line(error: BaseException) -> None:
    """``error: MESSAGE`` on one line (plain text) and exit status 1: a damaged cache, a
    checkpoint that cannot be resumed (``seqcache train`` and ``seqcache eval``); long
    values cut (``common.cut_values``)."""
    click.echo(f"error: {common.cut_values(error)}", err=True)
    sys.exit(1)


def _print_derived(derived: dict) -> None:
    table = Table("quantity", Column("value", justify="right"), title="seqcache train", show_header=False)
    for key, value in derived.items():
        if isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        table.add_row(key.replace("_", " "), "-" if value is None else str(value))
    Console(stderr=True, emoji=False).print(table, markup=False)  # paths and the cache's name: not markup
