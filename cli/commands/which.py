"""``seqcache which``: what did the model see at step S, row R? (G6)"""

from __future__ import annotations

import json
import os
import sys
import time

import click
import pyarrow.parquet as pq

from seqcache import layout
from seqcache import format as fmt
from seqcache.cli.commands import common
from seqcache.feeders.inverse import excluded_entries, where_in_run, where_in_state
from seqcache.feeders.provenance import open_checked, locate_row, locate_row_in_state, trace_rows, trace_rows_in_state
from seqcache.feeders.schedule_file import read_schedule_file
from seqcache.feeders.state import MAX_GLOBAL_BATCH_SIZE, STATE_IN_STEP, FeederStateError, load_state
from seqcache.feeders.stream import open_mixture
from seqcache.tasks import describe_record, registry


def _parse_rates(pairs, root: str) -> list[tuple[str, float]]:
    out = []
    for pair in pairs:
        path, sep, rate = pair.rpartition("=")
        if not sep or not path:
            raise click.BadParameter(f"expected PATH=RATE (got {pair!r})", param_hint="--mixture-rate")
        try:
            value = float(rate)
        except ValueError:
            raise click.BadParameter(f"rate {rate!r} of {path} is not a number", param_hint="--mixture-rate") from None
        out.append((path if os.path.isabs(path) else os.path.join(root, path), value))
    return out


def read_state(path: str, batch_size, seed, num_epochs) -> dict:
    """The keyword arguments for a saved feeder state read from ``path``."""
    try:
        state = load_state(path)
    except FeederStateError as e:  # a damaged file, not a usage mistake: one line, exit 1
        common.fail(f"not a readable feeder state: {e}")
    for name, given in (("global_batch_size", batch_size), ("seed", seed), ("num_epochs", num_epochs)):
        if given is not None and given != state[name]:
            raise click.UsageError(f"{path} has {name}={json.dumps(state[name])}, but {given} was given; drop "
                                   "the option")
    # The state fixes the stream; its caches are checked against it (fingerprints).
    return {"state": state, "global_batch_size": state["global_batch_size"]}


def _checkpoint_steps(folder: str) -> list[int]:
    """The step folders of a checkpoint directory that hold a feeder state."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(int(n) for n in names if n.isdigit() and os.path.isfile(os.path.join(folder, n, STATE_IN_STEP)))


def read_schedule(path: str, root: str) -> dict[int, dict[str, float]]:
    """A mixture schedule file (``seqcache.feeders.schedule_file``: JSON
    ``{"STEP": {"CACHE_PATH": RATE, ...}, ...}``, e.g. ``{"0": {"wiki": 1,
    "code": 1}, "10000": {"wiki": 3, "code": 1}}``, or YAML for ``.yaml`` and
    ``.yml``); relative cache paths are relative to ``root``. A damaged file
    is one ``error:`` line, exit status 1."""
    class _Bad(Exception):
        pass

    try:
        schedule = read_schedule_file(path, error=_Bad)
    except _Bad as e:  # a damaged file, not a usage mistake: one line, exit 1
        common.fail(f"--mixture-schedule: {e}")
    return {step: {(p if os.path.isabs(p) else os.path.join(root, p)): r for p, r in rates.items()}
            for step, rates in schedule.items()}


def resolve(target, mixture_rates, cache_dir, split, modules, batch_size, seed, num_epochs, schedule=None):
    """Returns the keyword arguments of ``locate_row`` (without step/row), or
    ``{"state": ..., "global_batch_size": ...}`` for a saved feeder state."""
    common_kw = {"global_batch_size": batch_size, "seed": seed, "num_epochs": num_epochs}
    if schedule:
        if mixture_rates:
            raise click.UsageError("give --mixture-rate or --mixture-schedule, not both")
        if not os.path.isdir(target):
            raise click.UsageError(f"with --mixture-schedule, {target} must be the folder the cache paths are "
                                   "relative to")
        return {"mixture": read_schedule(schedule, target), **common_kw}
    if mixture_rates:
        if not os.path.exists(target):
            raise click.UsageError(f"no such file or folder: {target}")
        if not os.path.isdir(target):
            raise click.UsageError(f"with --mixture-rate, {target} must be the folder the cache paths are relative to")
        return {"mixture": _parse_rates(mixture_rates, target), **common_kw}
    if os.path.exists(target) and not os.path.isdir(target):
        # A saved feeder state (the "feeder" item of a checkpoint): it fixes the stream. A
        # pipe or a device there is refused by the state's reader, which names it.
        return read_state(target, batch_size, seed, num_epochs)
    if os.path.isdir(target):
        in_step = os.path.join(target, STATE_IN_STEP)
        if os.path.isfile(in_step):
            # A checkpoint step folder of `seqcache train`: its saved feeder state.
            return read_state(target, batch_size, seed, num_epochs)
        if not layout.is_cache(target):
            steps = _checkpoint_steps(target)
            if steps:
                raise click.UsageError(
                    f"{target} is a checkpoint directory; give one of its step folders, e.g. "
                    f"{os.path.join(target, str(steps[-1]))} (steps with a feeder state: "
                    f"{', '.join(map(str, steps))})"
                )
        return {"cache": target, **common_kw}
    if cache_dir is None:
        raise click.UsageError(
            f"no such file or folder: {target} (to look up a task or mixture name, give --cache-dir, the root of "
            "<task>/<split> caches)"
        )
    # A task cache under --cache-dir, or a registered task or mixture name: as
    # `seqcache train --task NAME --cache-dir DIR` finds it.
    found = registry.resolve_name(target, split=split, cache_dir=cache_dir, modules=modules)
    if found is None:
        under = layout.cache_path(cache_dir, target, split)
        raise click.UsageError(
            f"no such file or folder: {target}; no cache at {under}; and {registry.not_registered(target)}"
        )
    if found.kind == "mixture":
        return {"mixture": found.mixture, "caches_root": cache_dir, "split": split, **common_kw}
    return {"cache": found.cache_dirs[0], **common_kw}


def format_text(d: dict) -> str:
    """The human-readable form of a ``which`` result."""
    lines = [f"step {d['step']}, row {d['row']}: global position {d['position']} "
             f"(global batch {d['global_batch_size']}, seed {d['seed']})"]
    if d["padding"]:
        lines.append(f"padding row: task {d['task']} is exhausted in this finite run (zero loss weight)")
        return "\n".join(lines)
    lines += [
        f"task         {d['task']} ({d['split']}), task index {d['task_index']} of {len(d['mixture'])}",
        f"cache        {d['cache']}",
        f"ordinal      {d['ordinal']} -> epoch {d['epoch']}, element {d['element']} of {d['num_examples']}",
        f"cache index  {d['cache_index']}: {d['shard']} record {d['record']}",
    ]
    for seg in d["segments"]:
        src = seg.get("source") or f"source #{seg.get('source_index')}"
        place = describe_record(seg.get("source"), seg.get("locator"), seg.get("record_number"))
        lines.append(
            f"segment {seg['segment']}: {src} {place} "
            f"(token offset {seg.get('token_offset')}), {seg.get('num_tokens', '?')} tokens"
        )
        if seg.get("text") is not None:
            lines.append("  " + seg["text"].replace("\n", "\n  "))
        elif "token_ids" in seg:
            lines.append(f"  token ids: {seg['token_ids']}")
            if seg.get("vocabulary_error"):
                lines.append(f"  (no text: {seg['vocabulary_error']})")
    return "\n".join(lines)


def _parse_steps(text: str) -> range:
    start, sep, stop = text.partition(":")
    try:
        lo, hi = int(start), int(stop) if sep else int(start) + 1
    except ValueError:
        raise click.BadParameter(f"expected START:STOP (got {text!r})", param_hint="--steps") from None
    if lo < 0 or hi <= lo:
        raise click.BadParameter(f"expected 0 <= START < STOP (got {text!r})", param_hint="--steps")
    return range(lo, hi)


@click.command()
@click.argument("target", metavar="CACHE_OR_MIXTURE")
@click.option("--step", type=click.IntRange(min=0), help="Training step s.")
@click.option("--row", type=click.IntRange(min=0), help="Row r of the global batch, in [0, B).")
@click.option("--steps", "steps_text", metavar="START:STOP",
              help="Whole steps START..STOP-1, every row: one table row per (step, row, segment); needs --output.")
@click.option("--output", type=click.Path(dir_okay=False), help="With --steps: the Parquet file to write.")
@click.option("--example", "example", type=click.IntRange(min=0), metavar="INDEX",
              help="Inverse look-up: where cache index INDEX (of --task, in a mixture) appears in the run: "
                   "epoch, step, row and host, per epoch.")
@click.option("--source", "source", metavar="FILE:LINE",
              help="Inverse look-up of a source record (FILE:LINE, FILE:row=N, FILE:byte=N or FILE:record=N): "
                   "every example holding a segment of it (a scan of the provenance sidecars), and where each "
                   "appears.")
@click.option("--task", "task", metavar="NAME_OR_INDEX",
              help="With --example or --source: the task (name, cache folder or mixture index).")
@click.option("--until-step", type=click.IntRange(min=0),
              help="With --example or --source: look at steps 0..S-1 [default: a saved state's step; a finite "
                   "run's last].")
@click.option("--hosts", "host_count", type=click.IntRange(min=1), default=1, show_default=True,
              help="With --example or --source: the host count H, for each row's host.")
@click.option("--text", "with_text", is_flag=True,
              help="With --steps: also read the data records for each segment's token count and text.")
@common.schedule_option()
@click.option("--batch-size", type=click.IntRange(min=1), help="Global batch size B (taken from a saved state).")
@click.option("--seed", type=click.IntRange(min=0), help="Feeder seed (default 0; taken from a saved state).")
@click.option("--num-epochs", type=click.IntRange(min=1), help="For finite runs: epochs per task.")
@common.caches_options()
@click.option("--feature", help="The token feature [default: the state's, else targets].")
@click.option("--tokens/--no-tokens", default=True, show_default=True, help="Show token ids and text.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def which(target, step, row, steps_text, output, example, source, task, until_step, host_count, with_text, schedule,
          batch_size, seed, num_epochs, mixture_rates, cache_dir, split, modules, feature, tokens, as_json):
    """Show what row ROW of global batch STEP was: task, cache index, source file and
    record number of each segment, and the decoded text.

    CACHE_OR_MIXTURE is one of:

    \b
    - a cache folder (one task);
    - a saved feeder state: a JSON file, or a checkpoint step folder of
      `seqcache train` (e.g. runs/c4/12, whose state is runs/c4/12/feeder/metadata).
      The state fixes the caches, rates, seed and batch size; a cache rebuilt
      since it was saved is refused;
    - with --cache-dir: a task name whose cache is CACHE_DIR/NAME/SPLIT, or a
      registered task or mixture name;
    - with --mixture-rate or --mixture-schedule: the folder the mixture's cache
      paths are relative to.

    With --steps START:STOP --output FILE.parquet, every row of those steps, one
    table row per (step, row, segment): task, cache index, shard and record,
    source file, locator and record number, token offset (and with --text the
    segment's token count and text), computed from the positions and the
    provenance sidecars, with no replay.

    With --example INDEX (and --task in a mixture) or --source FILE:LINE, the
    inverse: where that example, or every example from that source record,
    appears in steps 0..S-1 (--until-step S): per epoch its step, row, host
    (of --hosts H) and global position.
    """
    if batch_size is not None and batch_size >= MAX_GLOBAL_BATCH_SIZE:
        raise click.BadParameter(f"{batch_size} is not below 2^24, the largest global batch a feeder (and its "
                                 "saved state) takes", param_hint="--batch-size")
    kw = resolve(target, mixture_rates, cache_dir, split, modules, batch_size, seed, num_epochs, schedule)
    if kw["global_batch_size"] is None:
        raise click.UsageError("--batch-size is required (the global batch size B of the run)")
    if example is not None or source is not None:
        if step is not None or row is not None or steps_text is not None:
            raise click.UsageError("--example/--source look up where an example is; leave out --step, --row and "
                                   "--steps")
        _which_where(kw, example=example, source=source, task=task, until_step=until_step, host_count=host_count,
                     as_json=as_json)
        return
    if task is not None or until_step is not None:
        raise click.UsageError("--task and --until-step go with --example INDEX or --source FILE:LINE")
    if steps_text is not None:
        steps = _parse_steps(steps_text)
        check_position(steps.stop, kw["global_batch_size"], "--steps")
        _which_steps(kw, steps, output, feature, with_text)
        return
    if step is None or row is None:
        raise click.UsageError("give --step and --row (one row), or --steps START:STOP --output FILE (whole steps), "
                               "or --example INDEX / --source FILE:LINE (where an example is)")
    if row >= kw["global_batch_size"]:
        raise click.UsageError(f"--row {row} is outside the global batch of {kw['global_batch_size']} rows")
    check_position(step + 1, kw["global_batch_size"], "--step")
    d = _located(kw, locate_row_in_state, locate_row, step=step, row=row, feature=feature, tokens=tokens)
    if as_json:
        click.echo(json.dumps(d, indent=2, ensure_ascii=False))
    else:
        click.echo(format_text(d))


def _located(kw: dict, in_state, in_run, **args):
    """``in_state(state, **args)`` for a saved feeder state, else ``in_run(**kw, **args)`` (seed 0 and feature
    targets unless given); a damaged cache or a bad value is one error line and exit status 1."""
    try:
        if "state" in kw:
            return in_state(kw["state"], **args)
        if "feature" in args:
            args["feature"] = args["feature"] or "targets"
        return in_run(**dict(kw, seed=0 if kw["seed"] is None else kw["seed"]), **args)
    except (fmt.CacheError, ValueError) as e:
        click.echo(f"error: {common.cut_values(e)}", err=True)
        sys.exit(1)


def check_position(stop_step: int, global_batch_size: int, option: str) -> None:
    """Refuses steps whose global positions (step * B + row) reach 2^62, where
    the feeder's int64 arithmetic ends.

    Raises:
      click.BadParameter: naming ``option``, the steps and the global batch.
    """
    if stop_step * global_batch_size > 2**62:
        raise click.BadParameter(f"steps up to {stop_step - 1} with a global batch of {global_batch_size} rows reach "
                                 "global position 2^62 or beyond, past any run", param_hint=option)


def _which_steps(kw: dict, steps: range, output, feature, with_text: bool) -> None:
    """``which --steps``: writes the trace of whole steps to a Parquet file."""
    if output is None:
        raise click.UsageError("--steps needs --output FILE.parquet")
    t0 = time.perf_counter()
    table = _located(kw, trace_rows_in_state, trace_rows, steps=steps, feature=feature, text=with_text)
    pq.write_table(table, output)
    dt = time.perf_counter() - t0
    click.echo(f"{output}: {table.num_rows:,} rows (steps {steps.start}..{steps.stop - 1}, "
               f"{len(steps) * kw['global_batch_size']:,} batch rows) in {dt:.2f} s")


def _which_where(kw: dict, *, example, source, task, until_step, host_count, as_json: bool) -> None:
    """``which --example/--source``: where examples appear in the run (``seqcache.feeders.inverse``)."""
    if example is not None and source is not None:
        raise click.UsageError("give --example INDEX or --source FILE:LINE, not both")
    b = kw["global_batch_size"]
    if b % host_count:
        raise click.UsageError(f"--hosts {host_count} does not divide the global batch of {b} rows")
    if until_step is not None:
        check_position(until_step, b, "--until-step")
    query = {"cache_index": example, "source": source, "task": task, "host_count": host_count}
    if until_step is not None:
        query["until_step"] = until_step
    found = _located(kw, where_in_state, where_in_run, **query)
    if as_json:
        click.echo(json.dumps(found, indent=2, ensure_ascii=False))
        return
    text = format_where(found, source=source, global_batch_size=b, host_count=host_count)
    if source is not None and not found:
        text = _excluded_text(kw, source) or text
    click.echo(text)


def _excluded_text(kw: dict, source: str) -> str | None:
    """What ``which --source`` says of a record that ``build --exclude-benchmark``
    left out (from the caches' quarantine files), or None."""
    split = kw.get("split", "train")
    try:
        opened = (open_checked(kw["state"], cache=None, mixture=None, caches_root=None, split=split)
                  if "state" in kw else open_mixture(cache=kw.get("cache"), mixture=kw.get("mixture"),
                                                     caches_root=kw.get("caches_root"), split=split))
        try:
            entries = excluded_entries(opened.readers, opened.paths, source)
        finally:
            opened.close()
    except (fmt.CacheError, ValueError, OSError):
        return None
    lines = []
    for e in entries:
        item = e.get("item") or {}
        lines.append(f"{source}: excluded from the cache of task {e['task']} ({e['cache']}) by seqcache build "
                     f"--exclude-benchmark: it overlaps item {item.get('number')} of benchmark "
                     f"{e.get('benchmark')!r} (n-gram {e.get('ngram')!r}; listed in its quarantine.jsonl)")
    return "\n".join(lines) or None


def format_where(found: list, *, source, global_batch_size: int, host_count: int) -> str:
    """The human-readable form of ``which --example/--source``."""
    if not found:
        return f"{source}: no example of this run holds a segment of that record (skipped, filtered or empty)"
    lines = []
    for d in found:
        until = d["until_step"]
        span = f"steps 0..{until - 1}" if until is not None else "the whole run"
        head = f"cache index {d['cache_index']} of task {d['task']} ({d['cache']}, {d['num_examples']} examples)"
        if "segment" in d:
            place = describe_record(d.get("source"), d.get("locator"), d.get("record_number"))
            head += f": segment {d['segment']} is {d['source']} {place} (token offset {d['token_offset']})"
        lines.append(head)
        lines.append(f"  in {span} (global batch {global_batch_size}, {host_count} host(s)): "
                     f"{d['epochs_started']} epoch(s) started, seen {len(d['occurrences'])} time(s)")
        at = {o["epoch"]: o for o in d["occurrences"]}
        for e in range(d["epochs_started"]) if d["epochs_started"] <= 20 else sorted(at):
            o = at.get(e)
            if o is None:
                lines.append(f"  epoch {e}: not in {span}")
            else:
                lines.append(f"  epoch {e}: step {o['step']}, row {o['row']} (host {o['host']}, row {o['host_row']}), "
                             f"global position {o['position']}")
    return "\n".join(lines)
