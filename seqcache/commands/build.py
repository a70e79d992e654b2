"""``seqcache build``: build the cache of a registered task or mixture, or of an
ad-hoc task described on the command line."""

from __future__ import annotations

import json
import logging
import re
import sys

import click

from seqcache.commands import common


def parse_sequence_length(values, default_feature="targets"):
    """``("1024",)`` or ``("targets=1024", "inputs=512")`` -> {feature: length}."""
    out = {}
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            name, sep, length = part.rpartition("=")
            name = name if sep else default_feature
            try:
                n = int(length)
            except ValueError:
                raise click.BadParameter(f"{part!r}: expected N or FEATURE=N") from None
            if n < 1:
                raise click.BadParameter(f"{part!r}: a sequence length must be >= 1")
            out[name] = n
    return out or None


def adhoc_task(*, name, source_spec, exclude=(), on_error="raise", vocabulary_spec, extra_ids, sequence_length, pack,
               split="train", tfds_data_dir=None):
    """The task ``build --source ... --vocabulary ...`` describes: one feature,
    ``targets``, tokenized with EOS appended, trimmed to the sequence length (or
    packed to it with ``--pack``)."""
    from seqcache import tasks

    try:
        source = tasks.parse_source_spec(source_spec, exclude=exclude, on_error=on_error, split=split,
                                         tfds_data_dir=tfds_data_dir)
        vocabulary = tasks.vocabulary_from_spec(vocabulary_spec, extra_ids=extra_ids)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise click.UsageError(str(e)) from None
    pre = [tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(), tasks.preprocessors.append_eos()]
    if sequence_length and not pack:
        pre.append(tasks.preprocessors.trim())
    try:
        return tasks.Task(
            name,
            source=source,
            output_features={"targets": tasks.Feature(vocabulary, add_eos=True)},
            preprocessors=pre,
            packing="lm" if pack else None,
        )
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--name") from None


def import_modules(modules):
    from seqcache import tasks

    for m in modules:
        try:
            tasks.import_definitions(m)
        except (ImportError, FileNotFoundError) as e:
            raise click.UsageError(f"--module {m}: cannot import it: {e}") from None


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any other --flag is passed to Beam as a pipeline option, for example --runner=DataflowRunner "
    "--project=P --region=R --temp_location=gs://..., or --direct_num_workers=2 --direct_running_mode=multi_processing, "
    "or an object store's endpoint and credentials: --s3_endpoint_url=... --s3_access_key_id=... "
    "--s3_secret_access_key=... (see docs/object-stores.md).",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--cache-dir", required=True, help="Root folder of caches (local path, or gs://... / s3://... URL).")
@click.option("--module", "modules", multiple=True, help="Python module that registers tasks and mixtures (repeatable).")
@click.option("--source", "source_spec", help="Ad-hoc task source: text:GLOB | files:GLOB | jsonl:GLOB#field | parquet:GLOB#column "
              "| tfrecord:GLOB[#feature] | tfds:NAME[/CONFIG][:VERSION][@SPLIT]#feature | hf:PATH[@SPLIT]#column.")
@click.option("--tfds-data-dir", "tfds_data_dir", help="Ad-hoc tfds: source: the folder the TFDS dataset was prepared "
              "into (default: $TFDS_DATA_DIR or ~/tensorflow_datasets). Nothing is downloaded.")
@common.on_error_option()
@click.option("--exclude", "exclude", multiple=True, help="Ad-hoc task: leave out files whose path matches this glob (repeatable).")
@click.option("--vocabulary", "vocabulary_spec", default="byte", show_default=True, help="Ad-hoc task vocabulary: byte or a SentencePiece .model path.")
@click.option("--extra-ids", default=0, show_default=True, help="Sentinel ids appended to the ad-hoc vocabulary.")
@click.option("--name", "adhoc_name", help="Name of the ad-hoc task (the cache folder name).")
@click.option("--split", default="train", show_default=True)
@click.option("--sequence-length", "sequence_length", multiple=True, help="N or FEATURE=N (tokens); repeatable.")
@click.option("--pack/--no-pack", default=False, show_default=True, help="Language-model packing to the sequence length (ad-hoc tasks).")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1), help="Shuffle seed.")
@click.option("--num-shards", type=click.IntRange(min=1), help="Shard count (default: from the corpus size and --shard-size).")
@click.option("--shard-size", type=common.BYTE_SIZE, help="Raw input bytes per shard when --num-shards is not given, "
              "e.g. 128MiB (the default), 1GB, 500000. One shard is sorted in one worker's memory.")
@click.option("--split-size", type=common.BYTE_SIZE, help="Input bytes per unit of reading work (default: about 1/64 "
              "of the corpus, between 1 MiB and 64 MiB). Never changes the cache's bytes.")
@click.option("--exchange", type=click.Choice(["auto", "runner", "spill"]), default="auto", show_default=True,
              help="How examples reach the shard writers: the runner's shuffle, or spill files (auto: spill files on "
              "Beam's local engine, the runner's shuffle elsewhere). Never changes the cache's bytes.")
@click.option("--overwrite", is_flag=True, help="Replace an existing cache whose fingerprint differs.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Log Beam's progress.")
@click.pass_context
def build(ctx, args, cache_dir, modules, source_spec, exclude, on_error, vocabulary_spec, extra_ids, adhoc_name, split, sequence_length,
          pack, seed, num_shards, shard_size, split_size, exchange, overwrite, as_json, verbose, tfds_data_dir):
    """Build the deterministic cache of NAME (a registered task or mixture), or of
    an ad-hoc task given by --source/--vocabulary/--name.

    The cache of task T goes to CACHE_DIR/T/SPLIT. A cache with the same
    fingerprint is reused; a different one is refused unless --overwrite.
    """
    from seqcache import tasks
    from seqcache.pipelines import BuildConfig

    # NAME and the Beam pipeline options share the free arguments: options start with "-".
    names = [a for a in args if not a.startswith("-")]
    pipeline_args = [a for a in args if a.startswith("-")] + list(ctx.args)
    if len(names) > 1:
        raise click.UsageError(f"one task or mixture NAME at a time (got {names}); Beam options take the --flag=value form")
    name = names[0] if names else None
    if pipeline_args:
        from seqcache.pipelines.build import import_beam
        from seqcache.pipelines.runner import unknown_flags

        import_beam()
        unknown = unknown_flags(pipeline_args)
        if unknown:
            raise click.UsageError(
                f"no such option: {', '.join(unknown)} (options other than this command's own are Beam pipeline "
                "options, e.g. --runner=dask --dask_client_address=HOST:PORT or --s3_endpoint_url=URL)"
            )
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import_modules(modules)
    seq_len = parse_sequence_length(sequence_length)
    if source_spec:
        if name:
            raise click.UsageError("give either NAME (a registered task) or --source (an ad-hoc task), not both")
        if not adhoc_name:
            raise click.UsageError("an ad-hoc task needs --name")
        if pack and not seq_len:
            raise click.UsageError("--pack needs --sequence-length")
        task_list = [adhoc_task(name=adhoc_name, source_spec=source_spec, exclude=exclude, on_error=on_error, vocabulary_spec=vocabulary_spec,
                                extra_ids=extra_ids, sequence_length=seq_len, pack=pack, split=split,
                                tfds_data_dir=tfds_data_dir)]
    elif name:
        given = common.adhoc_options_given(ctx, ("on_error", "exclude", "vocabulary_spec", "extra_ids", "adhoc_name",
                                                  "pack", "tfds_data_dir"))
        if given:
            raise click.UsageError(
                f"{' and '.join(given)} {'describe' if len(given) > 1 else 'describes'} an ad-hoc --source; a "
                "registered task sets them itself, e.g. TextLineSource(..., on_error={'empty': 'skip'}, "
                "exclude=[...]) and its features' vocabularies in the module that registers it"
            )
        try:
            obj = tasks.get_task_or_mixture(name)
        except KeyError as e:
            raise click.UsageError(e.args[0] if e.args else str(e)) from None
        if isinstance(obj, tasks.Mixture):
            task_list = list(obj.get_tasks())
        else:
            task_list = [obj]
    else:
        raise click.UsageError("give a task or mixture NAME, or an ad-hoc --source with --name")

    try:
        config = BuildConfig(split=split, seed=seed, sequence_length=seq_len, num_shards=num_shards, shard_size=shard_size)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if not verbose:
        # Beam's logs, in this process and in its workers (which read this option), only on -v.
        logging.getLogger("apache_beam").setLevel(logging.CRITICAL)
        if not any(a.startswith("--default_sdk_harness_log_level") for a in pipeline_args):
            pipeline_args.append("--default_sdk_harness_log_level=ERROR")
    # Object-store options (--s3_endpoint_url=..., --s3_access_key_id=...) reach Beam's
    # FileSystems before the build's first file-system call in this process (listing
    # the source files, reading an existing manifest); the pipeline hands them to its
    # workers itself.
    from seqcache import fs

    fs.set_options(pipeline_args)
    results = []
    # What Beam's workers write to standard error outside of logging: nothing without -v.
    with common.worker_stderr(verbose=verbose) as stderr:
        console = common.stderr_console(stderr)
        for task in task_list:
            results.append(_build_one(console, task, split=split, cache_dir=cache_dir, config=config,
                                      pipeline_args=pipeline_args, overwrite=overwrite, as_json=as_json,
                                      split_size=split_size, exchange=exchange))
    if as_json:
        click.echo(json.dumps([
            {"task": r.manifest.task, "split": r.manifest.split, "cache_dir": r.cache_dir, "reused": r.reused,
             "seconds": round(r.seconds, 3), "num_examples": r.manifest.num_examples,
             "num_shards": len(r.manifest.shards), "fingerprint": r.manifest.fingerprint,
             **{k: int(r.manifest.statistics.get(k) or 0)
                for k in ("source_records", "skipped_records", "replaced_records", "truncated_tokens")}}
            for r in results
        ], indent=2))


def _build_one(console, task, *, split, cache_dir, config, pipeline_args, overwrite, as_json, split_size=None,
               exchange="auto"):
    """Builds one task's cache and prints its summary and warnings; a failure
    prints the error and exits 1, an interrupt (Ctrl-C, SIGTERM) exits 130."""
    from seqcache.pipelines import BuildError, build_task

    with common.shard_progress(console, f"{task.name}/{split}") as progress, common.sigterm_as_interrupt():
        try:
            result = build_task(task, cache_dir=cache_dir, config=config, pipeline_args=pipeline_args,
                                overwrite=overwrite, progress=progress, split_size=split_size, exchange=exchange)
        except (BuildError, FileNotFoundError, ValueError, OSError, RuntimeError, ImportError) as e:
            if "KeyboardInterrupt" not in str(e):  # Beam wraps an interrupt raised inside a step
                message = _cause(e)
                console.print(f"[red]error:[/red] {message}", highlight=False)
                if "on_error=" in message:  # bad input that the policy raises on
                    console.print("(`seqcache scan` with the same task or --source lists every kind of bad input "
                                  "in the corpus at once)", highlight=False)
                sys.exit(1)
            _interrupted(console, task, split, cache_dir)
        except KeyboardInterrupt:
            _interrupted(console, task, split, cache_dir)
    m = result.manifest
    if not as_json:
        verb = "reused" if result.reused else f"built in {result.seconds:.1f} s"
        console.print(
            f"[green]{task.name}/{split}[/green]: {common.plural(m.num_examples, 'example')} in "
            f"{common.plural(len(m.shards), 'shard')}, {verb} -> {result.cache_dir}",
            highlight=False,
        )
    stats = m.statistics
    if stats.get("truncated_tokens"):
        total = stats["truncated_tokens"] + sum(stats.get("tokens", {}).values())
        console.print(
            f"[yellow]warning[/yellow]: trimming to the sequence length dropped {stats['truncated_tokens']:,} tokens "
            f"({stats['truncated_tokens'] / max(total, 1):.1%}); --pack keeps every token",
            highlight=False,
        )
    if stats.get("replaced_records"):
        console.print(
            f"[yellow]warning[/yellow]: repaired {common.plural(stats['replaced_records'], 'record')}, listed with what was "
            f"repaired in {result.cache_dir}/quarantine.jsonl",
            highlight=False,
        )
    if stats.get("skipped_records"):
        console.print(
            f"[yellow]warning[/yellow]: skipped {common.plural(stats['skipped_records'], 'bad record')}, listed with "
            f"the reason in "
            f"{result.cache_dir}/quarantine.jsonl",
            highlight=False,
        )
    return result


def _interrupted(console, task, split, cache_dir):
    from seqcache import format as fmt
    from seqcache.pipelines import cache_path

    try:  # a replacing build (--overwrite) is staged: the old cache is still there
        fmt.read_manifest(cache_path(cache_dir, task.name, split))
        before = True
    except Exception:
        before = False
    if before:
        console.print(f"[yellow]interrupted[/yellow]: {task.name}/{split} still holds the cache from before, "
                      "untouched; run the same command again to replace it")
    else:
        console.print(f"[yellow]interrupted[/yellow]: {task.name}/{split} has no manifest, so it is not a cache; "
                      "run the same command again to build it")
    sys.exit(130)


# "ValueError: ", "seqcache.pipelines.build.BuildError: ": the name of an exception
# class at the start of a line of a traceback or of a wrapped message.
_EXCEPTION_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")


def _cause(error: BaseException) -> str:
    """The message of the error a step raised, without what Beam wraps around
    it: the exception names of ``RuntimeError: ValueError: ...``, the
    `` [while running 'STEP']`` suffix and, when the step ran in a worker
    (``multi_processing``, ``multi_threading``), the worker's traceback that
    Beam sends back as the message (the last exception line is the cause)."""
    text = str(error)
    if "Traceback (most recent call last):" in text:
        text = _last_exception_line(text) or text
    while (m := _EXCEPTION_PREFIX.match(text)) is not None:
        text = text[m.end():]
    return text.split(" [while running ")[0].strip()


def _last_exception_line(traceback_text: str) -> str | None:
    """The ``Name: message`` line that ends the last traceback in ``traceback_text``
    (frames are indented; the exception line is the first one that is not)."""
    tail = traceback_text.rsplit("Traceback (most recent call last):", 1)[1]
    for line in tail.splitlines():
        if line and not line.startswith(" "):
            return line
    return None
