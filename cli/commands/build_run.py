"""``seqcache build`` once its flags are read (``cli/commands/build.py``):
the tasks and their build configuration, Beam's pipeline for each task
(``seqcache.pipelines.build_task``) and what the command prints of it."""

from __future__ import annotations

import functools
import json
import logging
import sys

import click
import msgspec

from seqcache import format as fmt
from seqcache import fs, pipelines, process
from seqcache.cli import interrupts
from seqcache.cli.commands import common
from seqcache.pipelines import BuildConfig, BuildError, cache_path, exclusion
from seqcache.pipelines import beam_text, work as workmod
from seqcache.pipelines.dataflow import DryRun
from seqcache.pipelines.runner import causes, interrupted_in_step, option_value_errors, unknown_flags
from seqcache.tasks.sources.base import SPEC_KINDS
from seqcache.tasks.sources.policy import BadInputError


def run(ctx, tasks_of, args, cache_dir, modules, source_spec, exclude, on_error, vocabulary_spec, extra_ids, adhoc_name,
        split, sequence_length, objective, noise_density, mean_noise_span_length, pack, no_pack, seed, num_shards,
        shard_size, split_size, exchange, workers, overwrite, as_json, verbose, tfds_data_dir, exclude_benchmarks,
        exclude_ngram, work, work_dir, near_duplicates):
    """Runs ``seqcache build`` with its flags (``build``'s parameters): checks
    them, builds each task's cache and prints what came of it. ``tasks_of``:
    the tasks and their sequence lengths (``build.tasks_of``: read before Beam
    is imported, so that a bad ad-hoc flag costs no Beam import)."""
    task_list, seq_len = tasks_of
    pipeline_args = common.with_workers(beam_pipeline_args(
        [a for a in args if a.startswith("-")] + list(ctx.args),
        "--runner=dask --dask_client_address=HOST:PORT or --s3_endpoint_url=URL"), workers)
    beam_logging(pipeline_args, verbose=verbose)
    benchmarks = _benchmarks(exclude_benchmarks, exclude_ngram, exclude)
    try:
        config = BuildConfig(split=split, seed=seed, sequence_length=seq_len, num_shards=num_shards, shard_size=shard_size,
                             exclude_benchmarks=benchmarks, near_duplicates=near_duplicates)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    # Object-store options (--s3_endpoint_url=..., --s3_access_key_id=...) reach Beam's
    # FileSystems before the build's first file-system call in this process (listing
    # the source files, reading an existing manifest); the pipeline hands them to its
    # workers itself.
    process.tune_allocator()  # this process's malloc (the local workers tune their own)
    fs.set_options(pipeline_args)
    results = []
    # What Beam's workers write to standard error outside of logging: nothing without -v.
    with common.worker_stderr(verbose=verbose) as stderr:
        console = common.stderr_console(stderr)
        for task in task_list:
            results.append(_build_one(console, task, split=split, cache_dir=cache_dir, config=config,
                                      pipeline_args=pipeline_args, overwrite=overwrite, as_json=as_json,
                                      split_size=split_size, exchange=exchange,
                                      work=_work_options(work, work_dir, len(task_list), task.name)))
    if as_json:
        click.echo(json.dumps([r if isinstance(r, dict) else _result_json(r) for r in results], indent=2))


def _work_options(work: str, work_dir: str | None, num_tasks: int, task_name: str) -> dict:
    """``build_task``'s keywords for ``--work`` and ``--work-dir`` (a mixture's
    tasks each get a folder of their own under ``--work-dir``)."""
    if work_dir is not None and num_tasks > 1:
        work_dir = fs.join(work_dir, task_name)
    return {"resume": work != "off", "keep_work": work == "keep", "work_dir": work_dir}


def beam_pipeline_args(args, example: str) -> list[str]:
    """``args``, Beam pipeline options (``--flag=value``), checked before the work starts.

    Raises:
      click.UsageError: a flag no Beam option defines (the message ends with
        ``example``), or a value Beam refuses.
    """
    args = list(args)
    if args:
        unknown = unknown_flags(args)
        if unknown:
            raise click.UsageError(f"no such option: {', '.join(unknown)} (options other than this command's own "
                                   f"are Beam pipeline options, e.g. {example})")
        wrong = option_value_errors(args)
        if wrong:
            raise click.UsageError(f"Beam pipeline option: {wrong}")
    return args


def beam_logging(pipeline_args: list[str], *, verbose: bool) -> None:
    """Logs at INFO with ``-v``, else at WARNING; Beam's logs, in this process
    and in its workers (``pipeline_args`` gains the option they read), only
    with ``-v``."""
    # force: a library that logged before this (at import) has configured the root logger already.
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s",
                        force=True)
    if not verbose:
        logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
        if not any(a.startswith("--default_sdk_harness_log_level") for a in pipeline_args):
            pipeline_args.append("--default_sdk_harness_log_level=ERROR")


def _benchmarks(specs, ngram, exclude) -> list:
    """The benchmarks of ``--exclude-benchmark`` (``[NAME=]SPEC``), read once for
    every task, each noted on stderr (items, n-grams, items too short to match)."""
    spec_like = [g for g in exclude if exclusion.split_name(g)[1].partition(":")[0] in SPEC_KINDS]
    if spec_like:
        raise click.UsageError(f"--exclude {spec_like[0]}: --exclude leaves out files by glob; to leave out the records "
                               f"that overlap a benchmark give --exclude-benchmark {spec_like[0]}")
    if ngram is not None and not specs:
        raise click.UsageError("--exclude-ngram applies to --exclude-benchmark, which was not given")
    try:
        benchmarks = exclusion.load_benchmarks(specs, n=ngram)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise click.UsageError(f"--exclude-benchmark: {e}") from None
    for b in benchmarks:
        short = (f"; {common.plural(len(b.too_short), 'item')} of fewer than {b.min_words} words cannot match"
                 if b.too_short else "")
        short += f"; {common.plural(b.empty, 'empty record')} skipped" if b.empty else ""
        click.echo(f"excluding benchmark {b.name}: {common.plural(len(b.items), 'item')}, "
                   f"{common.plural(b.num_ngrams, f'{b.n}-gram')}{short}", err=True)
    return benchmarks


def _result_json(r) -> dict:
    """One built (or reused) cache, as ``build --json`` prints it: its
    counts, and (``work``) what its work folder gave it (absent for a cache
    reused whole or built with --work off)."""
    stats = r.manifest.statistics.to_json()
    work = msgspec.structs.asdict(r.manifest.work) if r.manifest.work is not None and not r.reused else None
    return {"task": r.manifest.task, "split": r.manifest.split, "cache_dir": r.cache_dir, "reused": r.reused,
            "seconds": round(r.seconds, 3), "num_examples": r.manifest.num_examples,
            "num_shards": len(r.manifest.shards), "fingerprint": r.manifest.fingerprint,
            **{k: int(stats.get(k) or 0)
               for k in ("source_records", "skipped_records", "replaced_records", "truncated_tokens")},
            "bad_input_records": stats.get("bad_input_records"),
            **({k: stats.get(k) for k in ("excluded_records", "excluded_by_benchmark")}
               if "excluded_by_benchmark" in stats else {}),
            **({"work": work} if work is not None else {})}


def _is_bad_input(error: BaseException) -> bool:
    """Whether ``build_task`` stopped on bad input under the source's
    ``on_error`` policy: a ``BuildError`` with ``bad_input``, or a
    ``BadInputError`` among the errors ``error`` was raised from. Beam hands a
    worker's error back as text only (inside its ``RuntimeError``, across
    processes), so then its text is read for ``error_hint``'s ``on_error=``
    advice (``beam_text.read``)."""
    if isinstance(error, BuildError):
        return error.bad_input
    return any(isinstance(e, BadInputError) for e in causes(error)) or beam_text.read(error).bad_input_advice


def _build_one(console, task, *, split, cache_dir, config, pipeline_args, overwrite, as_json, split_size=None,
               exchange="auto", work=None):
    """Builds one task's cache and prints its summary and notes; exits 1 on
    failure, 130 after Ctrl-C and 143 after SIGTERM (``interrupts.exit_status``),
    also when the build failed otherwise after the signal came: Ctrl-C reaches
    a runner's job server or workers as well (the terminal's process group),
    whose loss the runner may report before, or instead of, the interrupt
    (``runner FlinkRunner: lost its job server``).
    Returns the ``BuildResult``, or for Dataflow's dry run (``--dry_run=True``)
    what ``--json`` prints of it (a dict)."""
    deadline = functools.partial(_interrupt_deadline, task, split, cache_dir)
    with common.shard_progress(console, f"{task.name}/{split}") as progress, \
            interrupts.handled(on_deadline=deadline):
        try:
            result = pipelines.build_task(task, cache_dir=cache_dir, config=config, pipeline_args=pipeline_args,
                                          overwrite=overwrite, progress=progress, split_size=split_size,
                                          exchange=exchange, unit_progress=progress.units, **(work or {}))
        except DryRun as dry:  # the job translated for Dataflow, nothing submitted or built
            return _dry_run(console, task, split, cache_dir, dry, as_json=as_json)
        except (BuildError, FileNotFoundError, ValueError, OSError, RuntimeError, ImportError) as e:
            if not (interrupted_in_step(e) or interrupts.received() is not None):
                message = common.error_line(e)
                common.print_error(message, console)
                if _is_bad_input(e):
                    console.print("(`seqcache scan` with the same task or --source lists every kind of bad input "
                                  "in the corpus at once)", highlight=False)
                kept = _work_kept(task, split, cache_dir, work)
                if kept is not None:
                    console.print(f"(the work done so far is kept in {kept}: the same command run again, once "
                                  "the cause is fixed, reads only what is left; seqcache clean removes it)",
                                  highlight=False, markup=False)
                sys.exit(1)
            _interrupted(console, task, split, cache_dir)
        except KeyboardInterrupt:
            _interrupted(console, task, split, cache_dir)
    m = result.manifest
    if not as_json:
        verb = "reused" if result.reused else f"built in {result.seconds:.1f} s{_work_note(m.work)}"
        console.print(
            common.styled("green", f"{task.name}/{split}", f": {common.plural(m.num_examples, 'example')} in "
                          f"{common.plural(len(m.shards), 'shard')}, {verb} -> {result.cache_dir}"),
            highlight=False,
        )
    stats = m.statistics.to_json()
    if result.work_dir is not None and not as_json:
        console.print(common.styled("yellow", "note", f": the work folder is kept in {result.work_dir} for a build "
                                    "of the corpus grown or changed (--overwrite); seqcache clean removes it"),
                      highlight=False)
    if stats.get("truncated_tokens"):
        total = stats["truncated_tokens"] + sum(stats.get("tokens", {}).values())
        # First-fit packing places whole examples, so it trims too: only a longer length keeps them.
        advice = ("a longer --sequence-length keeps them" if task.packing == "first_fit" or len(task.output_features) > 1
                  else "--pack keeps every token")
        console.print(
            f"[yellow]warning[/yellow]: trimming to the sequence length dropped {stats['truncated_tokens']:,} tokens "
            f"({stats['truncated_tokens'] / max(total, 1):.1%}); {advice}",
            highlight=False,
        )
    for line in common.describe_bad_input(stats):  # the source's on_error policy: counted, never silent
        where = ("counted in the manifest's statistics" if line.startswith("kept")
                 else f"listed with the reason in {result.cache_dir}/quarantine.jsonl")
        console.print(common.styled("yellow", "note", f": {line} under the source's on_error policy; {where}"),
                      highlight=False)
    if "excluded_by_benchmark" in stats:  # decontamination: counted per benchmark, never silent
        per = ", ".join(f"{name} {n:,}" for name, n in stats["excluded_by_benchmark"].items())
        listed = (f"; listed with the item and the matched n-gram in {result.cache_dir}/{m.quarantine}"
                  if stats.get("excluded_records") and m.quarantine else "")
        excluded = common.plural(stats.get("excluded_records", 0), "record")
        console.print(common.styled("yellow", "note", f": excluded {excluded} that overlap benchmarks ({per}){listed}"),
                      highlight=False)
    return result


def _work_kept(task, split, cache_dir, work) -> str | None:
    """The work folder a failed build left with work in it, or None."""
    if not work or not work.get("resume"):
        return None
    out_dir = cache_path(cache_dir, task.name, split)
    for folder in ([work["work_dir"]] if work.get("work_dir") else
                   [workmod.work_path(out_dir), workmod.work_path(out_dir, steps_run_here=True)]):
        try:
            if workmod.usage(folder)[1]:
                return folder
        except OSError:
            pass
    return None


def _work_note(work) -> str:
    """`` (from the work folder: 5 of 8 work units, 1 of them in part, and 1
    shard written before)``, or nothing when the work folder gave nothing."""
    if work is None:
        return ""
    units = work.units_reused + work.units_resumed
    parts = []
    if units:
        resumed = f", {work.units_resumed} of them in part" if work.units_resumed else ""
        parts.append(f"{units} of {common.plural(work.units, 'work unit')}{resumed}")
    if work.shards_reused:
        parts.append(f"{common.plural(work.shards_reused, 'shard')} written before")
    redone = (f"{common.plural(work.checkpoints_rejected, 'checkpoint')} that did not match its checksum "
              "read again" if work.checkpoints_rejected else "")
    if not parts:
        return f" ({redone})" if redone else ""
    return f" (from the work folder: {', and '.join(parts)}{'; ' + redone if redone else ''})"


def _dry_run(console, task, split, cache_dir, dry: DryRun, *, as_json) -> dict:
    """Says what Dataflow's dry run of ``task`` made (unless ``as_json``);
    returns it as ``--json`` prints it."""
    if not as_json:
        console.print(common.styled("green", f"{task.name}/{split}", f": nothing built ({dry})"), highlight=False)
    return {"task": task.name, "split": split, "cache_dir": cache_path(cache_dir, task.name, split), "dry_run": True,
            **dry.to_json()}


def _interrupted(console, task, split, cache_dir):
    """Says that the build of ``task`` was interrupted ("interrupted by SIGTERM"
    after SIGTERM) and what is left of its cache; exits 130 or 143."""
    console.print(common.styled("yellow", interrupts.describe(), f": {_interrupt_text(task, split, cache_dir)}"),
                  highlight=False)
    sys.exit(interrupts.exit_status())


def _interrupt_deadline(task, split, cache_dir):
    """What a build says when its shutdown ran out of time (straight to stderr: the console may be held)."""
    common.write_stderr(f"{interrupts.describe()}: {_interrupt_text(task, split, cache_dir)}\n")


def _interrupt_text(task, split, cache_dir) -> str:
    try:  # a replacing build (--overwrite) is staged: the old cache is still there
        fmt.read_manifest(cache_path(cache_dir, task.name, split))
    except Exception:
        return (f"{task.name}/{split} has no manifest, so it is not a cache; run the same command again to finish "
                "it (the work done so far is kept, unless --work off)")
    return f"{task.name}/{split} still holds the cache from before, untouched; run the same command again to replace it"
