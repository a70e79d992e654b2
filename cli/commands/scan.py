"""``seqcache scan``: every kind of bad input in a task's sources, in one pass."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from seqcache.cli.commands import common
from seqcache.cli.commands import adhoc
from seqcache.cli.commands.adhoc import adhoc_task
from seqcache.tasks.scan import scan_task


def near_line(label: str, found: dict) -> str:
    """The one line of a source's near-duplicate estimate (``ScanReport.near_duplicates``)."""
    sampled, removed, p = found["sampled"], found["removed"], found["parameters"]
    share = removed / sampled if sampled else 0.0
    stopped = found.get("stopped") or []
    where = (f"; the sample stopped early in {len(stopped)} file{'s' if len(stopped) > 1 else ''}, at a record the "
             f"source's on_error policy raises on, as a build would stop there ({stopped[0]})" if stopped else "")
    return (f"{label}: near duplicates: {share:.1%} of the {sampled:,} records sampled ({removed:,} would be removed "
            f"by --on-error near_duplicate=skip; word {p['ngram']}-grams, {p['bands']} x {p['rows']}); pairs reaching "
            f"past the sample are not seen, so the corpus may hold more{where}")


@click.command()
@click.argument("name", required=False)
@common.MODULES_OPTION
@adhoc.source_options
@common.on_error_option("Ad-hoc source: the policy to compare against, as for build (default: each kind's default).")
@click.option("--split", default=None, help="For a task with a source per split: scan this split's source only "
              "[default: every split's]. Ad-hoc tfds: and hf: sources: the split read unless the spec names one [default: train].")
@click.option("--max-records", type=click.IntRange(min=1), default=None, help="Stop after this many source records.")
@click.option("--near-duplicates", "near_duplicates", is_flag=False, flag_value="", default=None,
              metavar="[NAME=VALUE,...]", callback=common.near_duplicates_option,
              help="Also estimate the share of near duplicates (as --on-error near_duplicate=skip would remove them, "
              "with build's --near-duplicates parameters) on the first --near-sample records of each source.")
@click.option("--near-sample", type=click.IntRange(min=2), default=10_000, show_default=True,
              help="Records the near-duplicate estimate reads (held in memory).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def scan(ctx, name, modules, source_spec, exclude, on_error, vocabulary_spec, split, max_records, as_json,
         near_duplicates, near_sample):
    """Count every kind of bad input in the sources of NAME (a registered task or
    mixture) or of an ad-hoc --source, without building anything.

    A build stops at the first record its policy raises on; scan reads every
    record (and runs the task's preprocessors and checks) with every kind skipped,
    and prints each kind found with its count, its first record and what the
    policy does with it, plus the --on-error settings that would let the build go
    on. Exits 1 when the build would stop, else 0."""
    common.import_modules(modules)
    if source_spec:
        if name:
            raise click.UsageError("give either NAME (a registered task) or --source, not both")
        task_list = [adhoc_task(name="adhoc", source_spec=source_spec, exclude=exclude, on_error=on_error,
                                vocabulary_spec=vocabulary_spec, extra_ids=0, sequence_length=None, pack=False,
                                split=split or "train")]
    elif name:
        given = common.adhoc_options_given(ctx, ("on_error", "exclude", "vocabulary_spec"))
        if given:
            raise click.UsageError(f"{' and '.join(given)}: only with --source; a registered task's source sets its own")
        task_list = _per_split(common.registered_tasks(name), split)
    else:
        raise click.UsageError("give a task or mixture NAME, or an ad-hoc --source")

    err = common.stderr_console()
    reports = []
    for task in task_list:
        try:
            label = task.name if task.split is None else f"{task.name}/{task.split}"
            with err.status(Text(f"scanning {label}")) as status:
                reports.append(scan_task(task, max_records=max_records, near=near_duplicates, near_sample=near_sample,
                                         progress=lambda n: status.update(Text(f"scanning {label}: {n:,} records"))))
        except (ValueError, FileNotFoundError, OSError) as e:
            common.print_error(e, err)
            sys.exit(1)
    stops = [r for r in reports if r.stops_build or r.unreadable_files]
    if as_json:
        click.echo(json.dumps([r.to_json() for r in reports], indent=2, ensure_ascii=False))
        sys.exit(1 if stops else 0)
    console = Console(soft_wrap=True, emoji=False)
    for r in reports:
        if r.near_duplicates is not None:
            console.print(near_line(r.label, r.near_duplicates), highlight=False, markup=False)
    for r in reports:
        title = (f"{r.label}: {common.plural(r.records, 'record')} in {common.plural(r.files, 'file')}"
                 + ("" if r.complete else " (stopped at --max-records)"))
        for message in r.unreadable_files:
            console.print(common.styled("red", "unreadable file",
                                        f" (a build stops here whatever the policy): {message}"), highlight=False)
        if not r.kinds:
            if not r.unreadable_files:
                console.print(f"{title}: no bad input", highlight=False, markup=False)
            continue
        t = Table(*(Column(c, overflow="fold") for c in ("kind", "records", "policy", "first")),
                  title=Text(title, style="table.title"))
        for k in r.kinds:
            t.add_row(k.kind, f"{k.records:,}", k.action, k.first)
        console.print(t, markup=False)  # the first record's file and text: not markup
        if r.stops_build:
            raising = [k.kind for k in r.kinds if k.action == "raise"]
            if source_spec:
                fix = " ".join(f"--on-error {kind}=skip" for kind in raising)
            else:
                fix = "on_error=" + repr({kind: "skip" for kind in raising}) + " in the task's source"
            console.print(f"a build of {r.label} stops at its first record of a kind whose policy is raise. To skip "
                          f"them all (counted, and listed in the cache's quarantine file): {fix}. "
                          "`seqcache build --help` explains replace and keep.", highlight=False, markup=False)
    sys.exit(1 if stops else 0)


def _per_split(task_list, split):
    """The tasks to scan: a task with a source per split once per split (only
    ``split`` when given; exits 1 naming the task's splits when one lacks it)."""
    out = []
    for task in task_list:
        try:
            out.extend([task.for_split(split)] if split is not None else
                       [task.for_split(s) for s in task.splits] if task.splits else [task])
        except ValueError as e:
            common.fail(e)
    return out
