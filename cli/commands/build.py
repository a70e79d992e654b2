"""``seqcache build``: build the cache of a registered task or mixture, or of
an ad-hoc task described on the command line. This module is the command and
its flags; the build itself (Beam's pipeline for each task, and what the
command prints of it) is ``build_run``, imported when the command runs, so
that ``seqcache build --help`` imports no Beam."""

from __future__ import annotations

import click

from seqcache.cli.commands import common
from seqcache.cli.commands import adhoc
from seqcache.cli.commands.adhoc import OBJECTIVES, PACK_DEFAULT, PACKINGS

# ``--work``: keep the build's work while it runs (auto), after too (keep), or not at all (off).
WORK_MODES = ("auto", "keep", "off")


@click.command(
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    epilog="Any other --flag is passed to Beam as a pipeline option, for example --runner=DataflowRunner "
    "--project=P --region=R --temp_location=gs://..., or --direct_num_workers=2 --direct_running_mode=multi_processing, "
    "or an object store's endpoint and credentials: --s3_endpoint_url=... --s3_access_key_id=... "
    "--s3_secret_access_key=... (see docs/object-stores.md).",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.option("--cache-dir", required=True, help="Root folder of caches (local path, or gs://... / s3://... URL).")
@common.MODULES_OPTION
@adhoc.source_options
@click.option("--tfds-data-dir", "tfds_data_dir", help="Ad-hoc tfds: source: the folder the TFDS dataset was prepared "
              "into (default: $TFDS_DATA_DIR or ~/tensorflow_datasets). Nothing is downloaded.")
@common.on_error_option()
@click.option("--exclude-benchmark", "exclude_benchmarks", multiple=True, metavar="[NAME=]SPEC",
              help="Leave out (quarantine) every source record that shares an n-gram of normalised words with an "
              "item of this benchmark, a source spec such as jsonl:test.jsonl#question (repeatable; NAME=SPEC names "
              "it). Its fingerprint enters the cache's.")
@click.option("--exclude-ngram", "exclude_ngram", type=click.IntRange(min=1), metavar="N",
              help="n-gram length in words for --exclude-benchmark (default 13).")
@click.option("--near-duplicates", "near_duplicates", metavar="NAME=VALUE,...", multiple=True,
              callback=common.near_duplicates_option,
              help="Parameters of near-duplicate removal (repeatable, each parameter once), which --on-error "
              "near_duplicate=skip turns on: "
              "ngram (words per shingle, default 5), bands (14), rows (8), seed (0), fields (the text fields "
              "compared, joined by +; default every text field) and rounds (6: the clustering's shuffle rounds), "
              "e.g. ngram=5,bands=20,rows=5. Words are compared after lower-casing and removing punctuation; see "
              "docs/bad-input.md. Each but rounds enters the cache's fingerprint.")
@click.option("--extra-ids", default=0, show_default=True, help="Sentinel ids appended to the ad-hoc vocabulary "
              "(span_corruption needs one per noise span; T5 uses 100).")
@click.option("--name", "adhoc_name", help="Name of the ad-hoc task (the cache folder name).")
@click.option("--split", default="train", show_default=True,
              help="The split: the cache goes to CACHE_DIR/TASK/SPLIT; a task with a source per split "
              "reads SPLIT's, an ad-hoc tfds: or hf: source that split unless its spec names one.")
@common.sequence_length_option("The features are the task's. With span_corruption one of inputs=N / "
                               "targets=N derives the other as T5 does (a bare N is refused).")
@click.option("--objective", type=click.Choice(OBJECTIVES), help="Ad-hoc task: lm (targets = the text), "
              "span_corruption or prefix_lm (T5's, inputs and targets from the text), supervised (the source's "
              "inputs and targets). Default: supervised for a source of inputs and targets, else lm.")
@click.option("--noise-density", type=float, help="span_corruption / prefix_lm: fraction of tokens that are noise "
              "(default 0.15 for span_corruption, 0.5 for prefix_lm).")
@click.option("--mean-noise-span-length", type=float, help="span_corruption: mean noise span length in tokens "
              "(default 3.0).")
@click.option("--pack", type=click.Choice(PACKINGS + (PACK_DEFAULT,)), is_flag=False, flag_value=PACK_DEFAULT,
              default=None, help="Ad-hoc task packing to the sequence length: lm (concatenate, split into full rows), "
              "first_fit (whole inputs/targets examples into rows), none. --pack alone (or auto): lm for "
              "--objective lm, first_fit for the others.")
@click.option("--no-pack", "no_pack", is_flag=True, hidden=True, help="The same as --pack none.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, 2**64 - 1), help="Shuffle seed.")
@click.option("--num-shards", type=click.IntRange(min=1), help="Shard count (default: from the corpus size and --shard-size).")
@click.option("--shard-size", type=common.BYTE_SIZE, help="Raw input bytes per shard when --num-shards is not given, "
              "e.g. 128MiB (the default), 1GB, 500000. One shard is sorted in one worker's memory.")
@click.option("--split-size", type=common.BYTE_SIZE, help="Input bytes per unit of reading work (default: about 1/64 "
              "of the corpus, between 1 MiB and 64 MiB). Never changes the cache's bytes.")
@click.option("--exchange", type=click.Choice(["auto", "runner", "spill"]), default="auto", show_default=True,
              help="How examples reach the shard writers: the runner's shuffle, or spill files (auto: spill files on "
              "Beam's local engine and on Prism, whose steps run in this process; the runner's shuffle elsewhere). "
              "Never changes the cache's bytes.")
@click.option("--workers", type=click.IntRange(min=1), default=1, show_default=True, help=common.WORKERS_HELP)
@click.option("--work", "work", type=click.Choice(WORK_MODES), default="auto", show_default=True,
              help="The build's work folder (its units read and tokenized, its shards written): auto keeps it "
              "while the build runs, so that the same command run again after the build died pays only for what "
              "is left, and removes it once the cache is complete; keep keeps it then too, so that a build of "
              "the corpus grown or changed (with --overwrite) reads only the new and changed files (about the "
              "tokenized size on disk); off keeps nothing. Never changes the cache's bytes.")
@click.option("--work-dir", "work_dir", help="Where the work folder goes (default CACHE_DIR/TASK/.SPLIT.work; a "
              "local path or URL that every worker reads and writes).")
@click.option("--overwrite", is_flag=True, help="Replace an existing cache whose fingerprint differs.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("-v", "--verbose", is_flag=True, help="Log Beam's progress.")
@click.pass_context
def build(ctx, **options):
    """Build the deterministic cache of NAME (a registered task or mixture), or of
    an ad-hoc task given by --source/--vocabulary/--name.

    The cache of task T goes to CACHE_DIR/T/SPLIT; a task with a source per
    split reads SPLIT's (one it lacks is refused). A cache with the same
    fingerprint is reused; a different one is refused unless --overwrite.
    A build that died is finished by the same command (--work).
    """
    found = tasks_of(ctx, **options)  # before Beam: a bad flag costs no Beam import
    from seqcache.cli.commands import build_run  # Beam: imported when a build runs, not for `seqcache build --help`

    build_run.run(ctx, found, **options)


def tasks_of(ctx, *, args, modules, source_spec, exclude, on_error, vocabulary_spec, extra_ids, adhoc_name, split,
             sequence_length, objective, noise_density, mean_noise_span_length, pack, no_pack, tfds_data_dir, work,
             work_dir, **_) -> tuple[list, dict | None]:
    """The tasks a ``seqcache build`` command line names, for ``split``, and
    their sequence lengths (feature -> tokens, or None; a registered task's
    bare N, "*", is expanded by ``build_task``): the registered task or
    mixture NAME (among ``args``), or the ad-hoc task of ``--source``.

    Raises:
      click.UsageError: flags that contradict each other or describe no task.
      SystemExit: (``common.fail``) a task without a source for ``split``.
    """
    if work_dir is not None and work == "off":
        raise click.UsageError("--work-dir names the work folder that --work off does without")
    names = [a for a in args if not a.startswith("-")]
    if len(names) > 1:
        raise click.UsageError(f"one task or mixture NAME at a time (got {names}); Beam options take the "
                               "--flag=value form")
    common.import_modules(modules)
    seq_len = sequence_length
    if source_spec:
        if names:
            raise click.UsageError("give either NAME (a registered task) or --source (an ad-hoc task), not both")
        if not adhoc_name:
            raise click.UsageError("an ad-hoc task needs --name")
        pack = _pack_option(pack, no_pack, seq_len)
        task = adhoc.adhoc_task(name=adhoc_name, source_spec=source_spec, exclude=exclude, on_error=on_error,
                                vocabulary_spec=vocabulary_spec, extra_ids=extra_ids, sequence_length=seq_len,
                                pack=pack, objective=objective, noise_density=noise_density,
                                mean_noise_span_length=mean_noise_span_length, split=split,
                                tfds_data_dir=tfds_data_dir)
        seq_len, task_list = adhoc.adhoc_sequence_length(task, seq_len), [task]
    elif names:
        task_list = _registered_tasks(ctx, names[0])
    else:
        raise click.UsageError("give a task or mixture NAME, or an ad-hoc --source with --name")
    try:  # every task of a mixture has the split (a source for it), before anything is built
        return [task.for_split(split) for task in task_list], seq_len
    except ValueError as e:
        common.fail(e)


def _pack_option(pack, no_pack, seq_len):
    """``--pack`` with ``--no-pack`` folded in; packing needs a sequence length."""
    if no_pack:
        if pack not in (None, "none"):
            raise click.UsageError(f"give --pack {pack} or --no-pack, not both")
        pack = "none"
    if pack not in (None, "none") and not seq_len:
        raise click.UsageError("--pack needs --sequence-length")
    return pack


def _registered_tasks(ctx, name) -> list:
    """The tasks of registered task or mixture ``name`` (refusing the ad-hoc task options)."""
    given = common.adhoc_options_given(ctx, ("on_error", "exclude", "vocabulary_spec", "extra_ids", "adhoc_name",
                                              "objective", "noise_density", "mean_noise_span_length", "pack",
                                              "no_pack", "tfds_data_dir"))
    if given:
        raise click.UsageError(
            f"{' and '.join(given)} {'describe' if len(given) > 1 else 'describes'} an ad-hoc --source; a "
            f"registered task sets {_how_a_task_sets(given)} itself in the module that registers it"
        )
    return common.registered_tasks(name)


def _how_a_task_sets(given) -> str:
    """What a registered task sets in place of the ad-hoc options ``given``, with examples."""
    ways = []
    if {"--pack", "--no-pack"} & set(given):
        ways.append("its packing (Task(..., packing='first_fit' or 'lm'; None: unpacked))")
    if set(given) - {"--pack", "--no-pack"}:
        ways.append("its source's options, e.g. TextLineSource(..., on_error={'empty': 'skip'}, exclude=[...]), "
                    "and its features' vocabularies")
    return " and ".join(ways)
