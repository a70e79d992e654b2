"""``seqcache eval`` and ``seqcache infer``: a trained run's predictions on a
cached split, with the task's metrics (eval) or without (infer);
``seqcache.training.evaluation`` does the work. docs/evaluation.md."""

from __future__ import annotations

import os
import shutil
import tempfile

import click
import jax

from seqcache import format as fmt
from seqcache import pipelines, tasks
from seqcache.cli.commands import common
from seqcache.cli.commands.train import fail_line, start_distributed, summary_line
from seqcache.feeders import FeederStateError
from seqcache.feeders.reader import CacheReader
from seqcache.tasks import preprocessors as P
from seqcache.training import config as config_lib
from seqcache.training import data as data_lib
from seqcache.training import compile_cache, decoding, evaluation
from seqcache.training.metrics import MetricsWriter
from seqcache.training.report import metrics_path_for, tensorboard_dir_for

# The task and split names of the cache ``seqcache infer --source`` builds:
# its predictions go to OUTPUT_DIR/infer/source/source/step_<N>/.
SOURCE_TASK = SOURCE_SPLIT = "source"
# What a failed evaluation prints before exiting 1 (a usage mistake exits 2).
_FAILURES = ("CheckpointError", "EvalError", "MetricError", "CacheError", "FeederStateError")


def _decode_options(command):
    """The decoding and run options shared by ``eval`` and ``infer``."""
    options = [
        click.option("--checkpoint-dir", required=True, help="The run's folder (seqcache train --checkpoint-dir): "
                     "its config.json and checkpoints."),
        click.option("--step", type=click.IntRange(min=0), help="The checkpoint to evaluate [default: the latest]."),
        click.option("--cache-dir", help="Root folder of caches [default: the run's data.cache_dir]."),
        click.option("--module", "modules", multiple=True,
                     help="Python module or .py file that registers tasks and mixtures (repeatable)."),
        click.option("--output-dir", help="Where eval/ (or infer/) is written [default: --checkpoint-dir]."),
        click.option("--max-decode-length", type=click.IntRange(min=1),
                     help="Tokens to generate per example [default: the run's targets length]."),
        click.option("--method", type=click.Choice(["greedy", "sample"]), default="greedy", show_default=True),
        click.option("--temperature", type=float, default=1.0, show_default=True, help="With --method sample."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                     help="1: off."),
        click.option("--seed", type=int, default=0, show_default=True, help="Seed of --method sample."),
        click.option("--batch-size", type=click.IntRange(min=1),
                     help="Rows decoded together over all processes [default: the run's global batch size]."),
        common.compilation_cache_option,
        click.option("--coordinator-address", envvar="JAX_COORDINATOR_ADDRESS", show_envvar=True,
                     help="Multi-process: HOST:PORT of process 0 (jax.distributed.initialize)."),
        click.option("--num-processes", type=click.IntRange(min=1), envvar="JAX_NUM_PROCESSES", show_envvar=True,
                     help="Multi-process: the number of JAX processes."),
        click.option("--process-id", type=click.IntRange(min=0), envvar="JAX_PROCESS_ID", show_envvar=True,
                     help="Multi-process: this process's index."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("eval")
@click.option("--task", help="A cache folder, a task name under --cache-dir, or a registered task or mixture "
                             "[default: the run's task].")
@click.option("--split", default="validation", show_default=True, help="The split to evaluate.")
@_decode_options
def eval_cmd(task, split, **options):
    """Evaluate a trained run's checkpoint on a cached split: decode every
    example once, run the task's metrics (its metric_fns, after its
    postprocess_fn) and write predictions.jsonl and metrics.json under
    OUTPUT_DIR/eval/<task>/<split>/step_<N>/; the metrics are also appended to
    the run's metrics.jsonl and TensorBoard files. Prints one JSON line.

    A metric that fails, a missing checkpoint or a damaged cache prints one
    error line and exits with status 1, writing nothing."""
    _run(task=task, split=split, with_metrics=True, **options)


@click.command("infer")
@click.option("--task", help="A cache folder, a task name under --cache-dir, or a registered task or mixture.")
@click.option("--split", default="validation", show_default=True, help="The split of --task.")
@click.option("--source", "source_spec",
              help="Instead of --task: a source spec (as seqcache build --source, e.g. 'text:prompts.txt' or "
                   "'parallel:inputs=A,targets=B'), built into a temporary cache with the run's vocabulary.")
@_decode_options
def infer(task, split, source_spec, **options):
    """Write a trained run's predictions for a cache or a source, without
    metrics: OUTPUT_DIR/infer/<task>/<split>/step_<N>/predictions.jsonl, one
    line per example with its source file and line. Prints one JSON line."""
    if bool(task) == bool(source_spec):
        raise click.UsageError("give one of --task or --source")
    _run(task=task, split=split, with_metrics=False, source_spec=source_spec, **options)


def _run(*, task, split, with_metrics, source_spec=None, checkpoint_dir, step, cache_dir, modules, output_dir,
         max_decode_length, method, temperature, top_k, top_p, seed, batch_size, compilation_cache,
         coordinator_address, num_processes, process_id):
    """Loads the run, resolves the caches, evaluates, writes and prints (see ``eval_cmd``)."""
    common.import_modules(modules)  # a module that cannot be imported stops here, before the run is loaded
    start_distributed(coordinator_address=coordinator_address, num_processes=num_processes,
                       process_id=process_id, jax_distributed=False, compilation_cache=compilation_cache)
    temporary = None
    try:
        run = evaluation.load_run(checkpoint_dir, step=step)
        if source_spec:
            temporary = tempfile.mkdtemp(prefix="seqcache-infer-")
            task, cache_dir, split = _source_cache(run.config, source_spec, temporary), None, SOURCE_SPLIT
        to_evaluate = evaluation.eval_tasks(run.config, split, task=task, cache_dir=cache_dir, modules=modules)
        unregistered = evaluation.unregistered_metrics(to_evaluate) if with_metrics else None
        if unregistered:  # metrics.json would be empty: refused, not written
            raise click.UsageError(unregistered)
        decode = decoding.DecodeConfig(max_decode_length=max_decode_length or run.config.sequence_length["targets"],
                                       method=method, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        evaluator = evaluation.evaluator_for(run.config, to_evaluate, split=split, mesh=run.trainer.mesh, decode=decode,
                                             global_batch_size=batch_size, metrics=with_metrics)
        result = evaluator.evaluate(run.model, step=run.step, out_root=output_dir or checkpoint_dir)
    except (config_lib.ConfigError, ValueError) as e:
        if type(e).__name__ in _FAILURES or isinstance(e, (fmt.CacheError, FeederStateError)):
            fail_line(e)
        raise click.UsageError(str(e)) from None
    except Exception as e:  # CheckpointError is a RuntimeError
        if type(e).__name__ not in _FAILURES:
            raise
        fail_line(e)
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    if with_metrics and result.metrics:
        _log_metrics(run, result, checkpoint_dir)
    if jax.process_index() == 0:
        click.echo(summary_line({"step": result.step, "split": split, "metrics": result.metrics,
                                 "examples": {t: len(r) for t, r in result.rows.items()},
                                 "outputs": result.paths, **compile_cache.summary()}))


def _log_metrics(run, result, checkpoint_dir) -> None:
    """The metrics appended to the run's metrics.jsonl and TensorBoard files
    (process 0), at the step the checkpoint's last update was (``N - 1``), as
    the training's own eval lines."""
    if jax.process_index() != 0:
        return
    path = metrics_path_for(run.config)  # the run's metrics_file, else RUN/metrics.jsonl
    writer = MetricsWriter(path, tensorboard_dir=tensorboard_dir_for(run.config, path))
    try:
        writer.write({"step": max(result.step - 1, 0), "eval_checkpoint": result.step, **result.flat()})
    finally:
        writer.close()


def _source_cache(config, spec: str, root: str) -> str:
    """Builds the source ``spec`` into a cache under ``root`` with the run's
    vocabulary (the training cache's), as ``inputs`` (and ``targets`` when the
    source gives both); returns the cache folder.

    Raises:
      click.UsageError: a bad spec, or a run whose cache records no vocabulary.
    """
    source_of_run = data_lib.resolve_source(config.data, config.data.split)
    reader_manifest = fmt.read_manifest(source_of_run.cache_dirs[0])
    vocab = _run_vocabulary(source_of_run.cache_dirs[0], reader_manifest)
    try:
        source = tasks.parse_source_spec(spec)
    except (ValueError, ImportError) as e:
        raise click.UsageError(f"--source {spec!r}: {e}") from None
    pair = "inputs=" in spec and "targets=" in spec
    features = {"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab, required=pair)}
    rekey = {"inputs": "inputs", "targets": "targets"} if pair else {"inputs": "text", "targets": None}
    task = tasks.Task(SOURCE_TASK, source=source, output_features=features,
                      preprocessors=[P.rekey(rekey), P.tokenize(), P.append_eos_after_trim()])
    targets = config.sequence_length["targets"]
    inputs = config.sequence_length.get("inputs") if config.converter != "lm" else None
    lengths = {"inputs": inputs or targets, "targets": targets}
    pipelines.build_task(task, cache_dir=root, config=pipelines.BuildConfig(
        split=SOURCE_SPLIT, num_shards=1, sequence_length=lengths), resume=False)  # a cache for this command only
    return os.path.join(root, SOURCE_TASK, SOURCE_SPLIT)


def _run_vocabulary(cache_dir: str, manifest):
    """The vocabulary of the run's training cache (``inputs``, else ``targets``).

    Raises:
      click.UsageError: the cache's manifest records none that can be rebuilt (says why).
    """
    feature = "inputs" if "inputs" in manifest.vocabularies else "targets"
    reader = CacheReader(cache_dir)
    try:
        vocab = reader.vocabulary(feature)
    except (ImportError, ValueError, OSError) as e:
        raise click.UsageError(f"{cache_dir}: cannot rebuild the run's vocabulary for --source: {e}") from None
    finally:
        reader.close()
    if vocab is None:
        raise click.UsageError(f"{cache_dir}: the run's cache records no vocabulary for {feature!r}, so --source "
                               "cannot be tokenised as it was trained; build a cache and give --task")
    return vocab
