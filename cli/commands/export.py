"""``seqcache export``: the Feeder's global stream as files another trainer reads
in that order (``--format maxtext``: seqcache.feeders.trainers.export)."""

from __future__ import annotations

import json
import os
import sys

import click

from seqcache import format as fmt
from seqcache.cli.commands import common
from seqcache.cli.commands.which import resolve
from seqcache.feeders.trainers.export import EXPORT_NAME, export_maxtext, maxtext_flags
from seqcache.lengths import ALL_FEATURES, SequenceLengthError, sequence_lengths


@click.command()
@click.argument("target", metavar="CACHE_OR_MIXTURE")
@click.option("--format", "export_format", type=click.Choice(["maxtext"]), required=True,
              help="maxtext: one ArrayRecord file of tf.train.Example records (int64 token ids) that MaxText's grain "
                   "pipeline reads, with shuffling off, in the Feeder's order.")
@click.option("--output", required=True, type=click.Path(file_okay=False), help="The export folder (local).")
@click.option("--batch-size", "--global-batch-size", "batch_size", type=click.IntRange(min=1),
              help="Global batch size B (taken from a saved state).")
@common.sequence_length_option("The feature is --feature's [default: the cache's own; a given length only cuts "
                               "rows; a saved state fixes it].")
@click.option("--steps", type=click.IntRange(min=1),
              help="Steps to export, from step 0 or a saved state's step (steps x B records) [default with "
                   "--num-epochs: the rest of the run].")
@click.option("--seed", type=click.IntRange(min=0), help="Feeder seed (default 0; taken from a saved state).")
@click.option("--num-epochs", type=click.IntRange(min=1), help="For finite runs: epochs per task.")
@click.option("--host-count", type=click.IntRange(min=1), default=1, show_default=True,
              help="MaxText process count whose processes read exactly the Feeder's host slices; any process count "
                   "reads the same rows at every step.")
@click.option("--column", default="text", show_default=True,
              help="Example feature of the token ids (MaxText's train_data_columns).")
@click.option("--feature", help="The cache's token feature [default: targets; a saved state fixes it].")
@common.caches_options(common.schedule_option())
@click.option("--overwrite", is_flag=True, help="Replace an export already in --output.")
@click.option("--json", "as_json", is_flag=True, help="Print export.json instead of a summary.")
def export(target, export_format, output, batch_size, sequence_length, steps, seed, num_epochs, host_count, column,
           feature, mixture_rates, schedule, cache_dir, split, modules, overwrite, as_json):
    """Write the Feeder's global stream, steps S..S+STEPS-1, as files another
    trainer reads in that order (S = 0, or the step of a saved feeder state).

    CACHE_OR_MIXTURE is what `seqcache which` takes: a cache folder; a saved
    feeder state (JSON file or checkpoint step folder), whose position S*B is
    where the export starts; with --cache-dir a task or mixture name; with
    --mixture-rate or --mixture-schedule the folder the cache paths are
    relative to.

    --format maxtext writes OUTPUT/train.array_record and OUTPUT/export.json
    (written last: the stream, start_step S and start_position S*B, the
    layout, the file's sha256 and the MaxText flags). Record (s-S)*B + h + j*H
    holds row h*(B/H) + j of step s (H = --host-count); MaxText's checkpointed
    {"global_next_index": g} is the Feeder's position S*B + g. See
    docs/trainers/maxtext.md.
    """
    output = os.path.normpath(output)
    if os.path.exists(os.path.join(output, EXPORT_NAME)) and not overwrite:
        click.echo(f"error: {common.cut_value(output)} already holds an export ({EXPORT_NAME}); pass --overwrite or "
                   "choose another folder", err=True)
        sys.exit(1)
    kw = resolve(target, mixture_rates, cache_dir, split, modules, batch_size, seed, num_epochs, schedule)
    exported = kw["state"]["feature"] if "state" in kw else feature or "targets"
    if "state" in kw and feature not in (None, exported):
        raise click.UsageError(f"{target} has feature={json.dumps(exported)}, but --feature {feature} was given; drop "
                               "the option")
    unknown = sorted(set(sequence_length or ()) - {exported, ALL_FEATURES})
    if unknown:  # the export writes one feature
        raise click.UsageError(f"--sequence-length: the export writes feature {exported!r} only, not "
                               f"{', '.join(unknown)} (give N or {exported}=N; --feature picks the feature)")
    if "state" in kw and sequence_length:  # a state fixes its stream's rows, as its batch size and seed
        given = sequence_lengths(sequence_length, [exported])[exported]
        own = kw["state"]["sequence_length"].get(exported)
        if given != own:
            raise click.UsageError(f"{target} has sequence_length={own} for feature {exported!r}, but "
                                   f"--sequence-length {given} was given; drop the option")
    args = {"steps": steps, "host_count": host_count, "column": column, "overwrite": overwrite}
    if "state" in kw:
        args.update(state=kw["state"], sequence_length=sequence_length)
    else:
        if kw["global_batch_size"] is None:
            raise click.UsageError("--batch-size is required (the global batch size B of the run)")
        if steps is None and num_epochs is None:
            raise click.UsageError("--steps is required (the stream repeats forever without --num-epochs)")
        args.update({k: v for k, v in kw.items() if k != "seed"}, seed=kw["seed"] or 0,
                    sequence_length=sequence_length, feature=feature or "targets")
    try:
        done = export_maxtext(output, **args)
    except (fmt.CacheError, ValueError) as e:
        if isinstance(e, SequenceLengthError):
            e = e.for_setting("--sequence-length ")
        click.echo(f"error: {common.cut_values(e)}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(done, indent=2, sort_keys=True))
        return
    first, last = done["start_step"], done["start_step"] + done["steps"] - 1
    click.echo(
        f"{os.path.join(output, done['file'])}: {done['records']:,} records (steps {first}..{last}: "
        f"{done['steps']:,} steps x {done['global_batch_size']} rows, {done['sequence_length']} tokens each, "
        f"{done['tokens']:,} non-padding tokens), {done['bytes']:,} bytes, sha256 {done['sha256'][:16]}..., laid "
        f"out for {done['host_count']} MaxText process(es)"
    )
    if first:
        click.echo(f"The export starts at step {first} (the state's position {done['start_position']:,}): MaxText's "
                   f"global_next_index g is the Feeder's position {done['start_position']:,} + g.")
    click.echo("MaxText flags: " + " ".join(maxtext_flags(done)))
