"""``seqcache report``: a cache (or a mixture's caches) as one HTML page of plots."""

from __future__ import annotations

import os
import sys
import time

import click

from seqcache import format as fmt
from seqcache import fs
from seqcache.cli import report_html
from seqcache.cli import report as report_lib
from seqcache.cli.commands import common
from seqcache.cli.commands.which import check_position, resolve
from seqcache.feeders import state as state_lib
from seqcache.feeders.stream import open_mixture


def _read_overlaps(paths) -> list[dict]:
    """The results of ``seqcache overlap`` given with --overlap."""
    from seqcache.pipelines.overlap import read_result  # keeps Beam out of `seqcache report` without --overlap

    return [read_result(p) for p in paths]


def _mixture_section(kw: dict, steps: int, at_step: int | None) -> tuple[list[str], dict | None]:
    """The caches of a resolved target (``which.resolve``'s dict) and the
    mixture's section, or None for a single cache without --batch-size."""
    state = kw.get("state")
    if state is None and kw.get("cache") is not None and kw.get("global_batch_size") is None:
        return [kw["cache"]], None  # one cache and no stream asked for: nothing to open
    if state is not None:
        opened = open_mixture(mixture=state_lib.mixture_pairs(state))
        batch, num_epochs, position = state["global_batch_size"], state["num_epochs"], state["position"]
    else:
        opened = open_mixture(cache=kw.get("cache"), mixture=kw.get("mixture"), caches_root=kw.get("caches_root"),
                              split=kw.get("split", "train"))
        batch, num_epochs, position = kw.get("global_batch_size"), kw.get("num_epochs"), None
    try:
        paths = list(opened.paths)
        if batch is None:
            if len(paths) > 1:
                raise click.UsageError("--batch-size is required for a mixture (the global batch size B of the run)")
            return paths, None
        check_position(steps + 1, int(batch), "--steps")
        check_position(max(steps, at_step or 0) + 1, int(batch), "--at-step")
        section = report_lib.mixture_report(
            paths=paths, names=[r.manifest.task for r in opened.readers], rates=opened.rates, weights=opened.weights,
            num_examples=[r.num_examples for r in opened.readers], global_batch_size=int(batch), steps=steps,
            at_step=at_step, num_epochs=num_epochs, position=position)
        return paths, section
    finally:
        opened.close()


@click.command()
@click.argument("target", metavar="CACHE_OR_MIXTURE")
@click.option("--output", "-o", type=click.Path(dir_okay=False),
              help="The HTML file to write [default: report.html, unless --json].")
@click.option("--json", "as_json", is_flag=True, help="Print the report's numbers as JSON (no pictures).")
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Mixtures: the share of each task over the first STEPS steps.")
@click.option("--at-step", type=click.IntRange(min=0), help="Mixtures: the epoch each task reaches by this step "
                                                             "[default: --steps].")
@click.option("--batch-size", type=click.IntRange(min=1), help="Mixtures: the global batch size B (taken from a saved "
                                                                "state).")
@click.option("--num-epochs", type=click.IntRange(min=1), help="Mixtures: a finite run's epochs per task.")
@common.caches_options()
@click.option("--top-files", type=click.IntRange(min=1), default=20, show_default=True,
              help="Source files shown one by one; the rest are added up.")
@click.option("--first", "first_entries", type=click.IntRange(min=0), default=5, show_default=True,
              help="Skipped or repaired records shown per kind.")
@click.option("--overlap", "overlaps", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="A result of seqcache overlap (.json or .parquet) to show (repeatable).")
def report(target, output, as_json, steps, at_step, batch_size, num_epochs, mixture_rates, cache_dir, split, modules,
           top_files, first_entries, overlaps):
    """Write a self-contained HTML report of a cache: example lengths against the
    sequence length, packing efficiency, tokens and examples per source file,
    skipped and repaired records, shard sizes; for a mixture or a saved feeder
    state, each task's share of the first steps and the epoch it reaches; with
    --overlap FILE, a result of `seqcache overlap`: the benchmark items found in
    the caches and the step at which the run first reads each.

    CACHE_OR_MIXTURE is what `seqcache which` takes: a cache folder, a saved feeder
    state or checkpoint step folder, a task or mixture name with --cache-dir, or a
    folder with --mixture-rate. The numbers come from the manifests and quarantine
    files only (no record is read); images are inline, so the file opens offline.
    """
    t0 = time.perf_counter()
    kw = resolve(target, mixture_rates, cache_dir, split, modules, batch_size, None, num_epochs)
    try:
        caches, mixture = _mixture_section(kw, steps, at_step)
        rep = report_lib.build_report(caches=caches, mixture=mixture, top_files=top_files,
                                      first_entries=first_entries,
                                      overlaps=_read_overlaps(overlaps) if overlaps else [])
    except (fmt.CacheError, ValueError) as e:
        common.print_error(e)
        sys.exit(1)
    computed = time.perf_counter() - t0
    if as_json:
        click.echo(report_lib.to_json(rep))
    if output is None and as_json:
        return
    output = output or "report.html"
    page = report_html.render(rep, elapsed_s=computed)
    parent = os.path.dirname(os.path.abspath(output))
    os.makedirs(parent, exist_ok=True)
    data = page.encode("utf-8")
    fs.write_bytes_atomic(output, data, fsync=False)
    elapsed = time.perf_counter() - t0
    message = f"wrote {output} ({len(data) / 1e3:,.0f} kB, {len(caches)} cache(s)) in {elapsed:.2f} s"
    click.echo(message, err=as_json)
