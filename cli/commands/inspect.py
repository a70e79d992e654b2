"""``seqcache info | show | verify | tasks``: look inside caches and registries.

``info``, ``show`` and ``verify`` read a cache at a local path or a URL, with
Beam pipeline options (``--s3_endpoint_url=...``: ``common.filesystem_options``);
a file system that fails is one ``error:`` line and exit status 1.
"""

from __future__ import annotations

import json
import sys

import click
import msgspec
from rich.console import Console
from rich.table import Column, Table
from rich.text import Text

from seqcache import bounded_json, fs, layout, tasks
from seqcache import format as fmt
from seqcache import lengths as lengths_lib
from seqcache.cli.commands import common
from seqcache.feeders.reader import CacheReader
from seqcache.tasks import describe_record
from seqcache.tasks.sources import users_class
from seqcache.tasks.task import function_names
from seqcache.tasks.vocabularies import decode_with_sentinels
from seqcache.cli.url_reader import UrlCacheReader
from seqcache.cli.verify import verify_cache


def _open(cache_dir, *, open_shards=True):
    """A reader of the cache at ``cache_dir``: ``CacheReader``, or ``UrlCacheReader``
    for a URL, its manifest checked as verify checks it (``Manifest.check_shards``)."""
    try:
        reader = (UrlCacheReader if fs.is_url(cache_dir) else CacheReader)(cache_dir, open_shards=open_shards)
    except (fmt.CacheError, OSError) as e:
        common.print_error(e)
        sys.exit(1)
    try:
        reader.manifest.check_shards()
    except fmt.CacheError as e:
        reader.close()
        common.print_error(e)
        sys.exit(1)
    return reader


def packing_efficiency(manifest: fmt.Manifest) -> dict[str, float] | None:
    """Per feature, non-padding tokens / all tokens of the rows the feeder
    makes (examples x sequence length), for a cache with a sequence length per
    feature; None otherwise. Units: a fraction in [0, 1]."""
    lengths = lengths_lib.built_lengths(manifest)
    tokens = manifest.statistics.tokens or {}
    if not manifest.num_examples or not tokens or any(name not in lengths for name in tokens):
        return None
    return {name: n / (manifest.num_examples * lengths[name]) for name, n in tokens.items()}


def preprocessors(manifest: fmt.Manifest) -> list[str]:
    """The task's preprocessors as the manifest's fingerprint records them, one
    ``name(param=value, ...)`` each (values as JSON; None and False left out),
    e.g. ``span_corruption(noise_density=0.15, mean_noise_span_length=3.0,
    input_feature="targets")``; [] when the manifest lacks them."""
    # fingerprint_inputs is free-form (what the build hashed): read it defensively.
    inputs = manifest.fingerprint_inputs
    task = inputs.get("task") if isinstance(inputs, dict) else None
    entries = task.get("preprocessors") if isinstance(task, dict) else None
    out = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], dict):
            name, params = entry
        else:
            name, params = (entry if isinstance(entry, str) else bounded_json.short(entry)), {}
        shown = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in params.items()
                          if v is not None and v is not False)
        out.append(f"{name}({shown})")
    return out


def info_dict(manifest: fmt.Manifest, cache_dir: str) -> dict:
    m = manifest
    return {"cache_dir": cache_dir, "task": m.task, "split": m.split, "fingerprint": m.fingerprint,
            "format_version": m.format_version, "seed": m.seed, "sequence_length": m.sequence_length,
            "packing": m.packing, "preprocessors": preprocessors(m), "features": [f.to_json() for f in m.features],
            "vocabularies": {k: v.to_json() for k, v in m.vocabularies.items()}, "num_examples": m.num_examples,
            "num_shards": len(m.shards), "num_bytes": sum(s.num_bytes for s in m.shards),
            "statistics": m.statistics.to_json(), "packing_efficiency": packing_efficiency(m),
            "num_sources": m.num_sources, "created": m.created, "seqcache_version": m.seqcache_version,
            "evaluation": None if m.evaluation is None else m.evaluation.to_json(),
            "work": None if m.work is None else msgspec.structs.asdict(m.work),
            "shards": [{"file": s.file, "num_records": s.num_records, "num_bytes": s.num_bytes} for s in manifest.shards]}


def _shown(value) -> str:
    """A manifest value in ``info``'s table: ``none`` for null (whatever the
    field), JSON for an object (``{"targets": 512}``), else its text."""
    if value is None:
        return "none"
    return json.dumps(value, ensure_ascii=False) if isinstance(value, (dict, list)) else str(value)


def _evaluation_rows(t: Table, evaluation) -> None:
    """``info``'s rows of the task's evaluation (the manifest's ``evaluation``), if it has one."""
    if not isinstance(evaluation, dict):
        return
    t.add_row("metrics", ", ".join(map(str, evaluation.get("metrics") or [])) or "none")
    t.add_row("postprocess_fn", _shown(evaluation.get("postprocess_fn")))
    if evaluation.get("pretokenized"):
        t.add_row("target text", ", ".join(map(str, evaluation["pretokenized"])) + " (source text, UTF-8)")


def _feature_rows(t: Table, m, efficiency) -> None:
    """``info``'s rows of each feature: its vocabulary, tokens and packing
    efficiency, at most ``common.MAX_ROWS`` of each."""
    stats = m.statistics
    for rows, label in (
            ([(f"vocabulary ({name})", ", ".join(f"{k}={v}" for k, v in vocab.to_json().items() if k != "sha256"))
              for name, vocab in m.vocabularies.items()], "vocabularies"),
            ([(f"tokens ({name})", f"{n:,} (mean {(stats.mean_length or {}).get(name, 0):,.1f}, max "
                                   f"{(stats.max_length or {}).get(name, 0):,} per example)")
              for name, n in (stats.tokens or {}).items()], "tokens"),
            ([(f"packing efficiency ({name})", f"{eff:.1%} (non-padding tokens / all tokens)")
              for name, eff in (efficiency or {}).items()], "packing efficiency")):
        shown, more = common.head(rows)
        for row in shown:
            t.add_row(*row)
        if more:
            t.add_row(label, f"{more} features")


def _record_rows(t: Table, m) -> None:
    """``info``'s rows of the source records: counts, bad input and the records
    excluded per benchmark (the quarantine file named where it lists some)."""
    stats = m.statistics
    for key in ("source_records", "source_examples", "segments", "truncated_tokens", "skipped_records",
                "replaced_records"):
        if getattr(stats, key) is not None:
            t.add_row(key.replace("_", " "), f"{getattr(stats, key):,}")
    for line in common.describe_bad_input(stats.to_json()):
        t.add_row("bad input", line)
    excluded, more = common.head((stats.excluded_by_benchmark or {}).items())
    for name, n in excluded:
        listed = f" ({m.quarantine})" if n and m.quarantine else ""
        t.add_row("excluded", f"{common.plural(n, 'record')} overlapping benchmark {name}{listed}")
    if more:
        t.add_row("excluded", f"{more} benchmarks")


@click.command(context_settings=common.BEAM_OPTIONS_CONTEXT, epilog=common.BEAM_OPTIONS_EPILOG)
@click.argument("cache_dir")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--shards/--no-shards", default=False, help="List every shard.")
@click.pass_context
def info(ctx, cache_dir, as_json, shards):
    """Summarise the cache at CACHE_DIR (a folder with manifest.json: a local
    path, or a gs:// or s3:// URL).

    Reads the manifest and checks that every shard file is there with its size; a
    missing or resized shard is reported as a warning and makes the exit status 1.
    Record counts are checked when the shards are opened (show, which, a feeder)
    and, with every checksum, by `seqcache verify`."""
    common.filesystem_options(ctx.args)
    try:
        # Checked as verify checks it (every shard's entry, its sizes against its records): the totals shown add up.
        m = fmt.read_manifest(cache_dir, check_shards=True)
    except (fmt.CacheError, OSError) as e:
        common.print_error(e)
        sys.exit(1)
    try:
        fmt.check_shard_files(cache_dir, m)
        layout.check_named_files(cache_dir, m)  # the vocabulary models and quarantine file too
        problem = None
    except fmt.CacheError as e:
        problem = str(e)
    except OSError as e:
        common.print_error(e)
        sys.exit(1)
    d = info_dict(m, cache_dir)
    d["problem"] = problem
    if as_json:
        click.echo(json.dumps(d, indent=2, ensure_ascii=False))
        sys.exit(1 if problem else 0)
    console = Console(emoji=False)
    # The title and the cells hold manifest text and paths: a Text, and printed with markup=False.
    t = common.CutTable(Column("field", style="bold"), "value", title=Text(f"{m.task}/{m.split}", style="table.title"),
              show_header=False)
    t.add_row("cache", cache_dir)
    t.add_row("fingerprint", m.fingerprint)
    t.add_row("examples", f"{m.num_examples:,}")
    t.add_row("shards", f"{common.plural(len(m.shards), 'shard')} ({d['num_bytes'] / 1e6:,.1f} MB)")
    t.add_row("seed", _shown(d["seed"]))
    t.add_row("sequence length", _shown(d["sequence_length"]))
    t.add_row("packing", _shown(d["packing"]))
    if d["preprocessors"]:
        t.add_row("preprocessors", ", ".join(d["preprocessors"]))
    t.add_row("features", common.joined([f"{f['name']}:{f['dtype']}" for f in d["features"]]))
    _feature_rows(t, m, d["packing_efficiency"])
    _evaluation_rows(t, d["evaluation"])
    _record_rows(t, m)
    t.add_row("sources", common.plural(m.num_sources, "file"))
    t.add_row("created", f"{d['created']} by seqcache {d['seqcache_version']}")
    if m.work is not None and (m.work.units_reused or m.work.units_resumed or m.work.shards_reused):
        w = m.work
        t.add_row("work folder", f"{w.units_reused + w.units_resumed} of {common.plural(w.units, 'work unit')} "
                  f"({w.units_resumed} in part) and {common.plural(w.shards_reused, 'shard')} reused from it")
    console.print(t, markup=False)
    if shards:
        st = common.CutTable("file", "records", "bytes", title="shards")
        for i in range(min(len(m.shards), common.MAX_ROWS)):
            s = m.shards[i]
            st.add_row(s.file, f"{s.num_records:,}", f"{s.num_bytes:,}")
        if len(m.shards) > common.MAX_ROWS:
            st.add_row(f"… and {len(m.shards) - common.MAX_ROWS:,} more (seqcache info --json lists every shard)", "", "")
        console.print(st, markup=False)
    if problem:
        common.stderr_console().print(
            common.styled("red", "warning:", f" {problem}; run `seqcache verify {cache_dir}`"), highlight=False)
        sys.exit(1)


@click.command(context_settings=common.BEAM_OPTIONS_CONTEXT, epilog=common.BEAM_OPTIONS_EPILOG)
@click.argument("cache_dir")
@click.option("--index", "indices", type=int, multiple=True, help="Cache index to show (repeatable; default 0).")
@click.option("--count", type=int, default=None, help="Show COUNT examples from the first --index.")
@click.option("--ids/--no-ids", default=False, help="Also print token ids.")
@click.option("--max-chars", type=int, default=600, show_default=True, help="Cut decoded text after this many characters (0: no limit).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx, cache_dir, indices, count, ids, max_chars, as_json):
    """Decode examples of the cache at CACHE_DIR (a local path, or a gs:// or
    s3:// URL), with their provenance. From a URL, only the shards holding the
    examples shown are downloaded (to a temporary folder, removed at the end);
    the shards before them are downloaded one at a time to check their record
    counts."""
    common.filesystem_options(ctx.args)
    indices = list(indices) or [0]
    if count is not None and count < 1:
        raise click.BadParameter(f"must be >= 1 (got {count})", param_hint="--count")
    reader = _open(cache_dir, open_shards=False)  # reads only the shards it shows
    try:
        total = len(reader)
        examples, provenance, vocabs, indices = _read_for_show(reader, cache_dir, indices, count)
    finally:
        reader.close()
    if count is not None and len(indices) < count:
        click.echo(f"note: {cache_dir} has {total:,} examples (indices 0..{total - 1:,}): showing "
                   f"{len(indices):,} of the {count:,} asked for, from index {indices[0]:,}", err=True)
    out = [_describe_example(i, ex, prov, vocabs, ids) for i, ex, prov in zip(indices, examples, provenance)]
    if as_json:
        click.echo(json.dumps(out, indent=2, ensure_ascii=False))
        return
    console = Console(soft_wrap=True, emoji=False)
    for item in out:
        console.rule(f"[bold]example {item['index']}")
        for name, entry in item["features"].items():
            if "segments" not in entry:  # the source's text that an evaluation cache keeps (UTF-8 bytes)
                console.print(common.styled("bold", name, f": {entry['length']} bytes of source text"), highlight=False)
                console.out(_cut(entry["text"], max_chars), highlight=False)
                continue
            console.print(common.styled("bold", name, f": {entry['length']} tokens, "
                                        f"{len(entry['segments'])} segment(s)"), highlight=False)
            segments, more = common.head(entry["segments"])
            for k, seg in enumerate(segments, 1):
                p = seg.get("provenance") or {}
                where = f"{p.get('path')} {describe_record(p.get('path'), p.get('locator'), p.get('record_number'))}" \
                    if p else "unknown source"
                if p.get("token_offset"):
                    where += f", from token {p['token_offset']}"
                console.print(common.styled("cyan", f"segment {k}", f" ({seg['length']} tokens) <- {where}"),
                              highlight=False)
                if seg.get("text") is not None:
                    console.out(_cut(seg["text"], max_chars), highlight=False)
                if "ids" in seg:
                    console.print(f"ids: {seg['ids'][:64]}" + (" …" if seg["length"] > 64 else ""), highlight=False)
            if more:
                console.print(f"{more} segments (--json lists every one)", highlight=False)


def _read_for_show(reader, cache_dir, indices, count):
    """(examples, provenance, vocabularies, indices) of what ``show`` prints; a
    bad cache or file system prints one error line and exits 1."""
    if count is not None:
        # Stops at the end of the cache.
        indices = list(range(indices[0], min(indices[0] + count, len(reader))))
    _check_indices(indices, len(reader))
    try:
        if indices:
            shards, _ = reader.locate(indices)
            read = {int(s) for s in shards}
            # Index -> shard follows the manifest's counts: every shard up to the
            # last one read is checked; those read are checked when opened, before
            # their first record is read (in shard order). An index out of range
            # is the read's IndexError.
            last = min(int(max(shards)), len(reader.manifest.shards) - 1)
            reader.check_record_counts([s for s in range(last + 1) if s not in read])
        examples = reader.read_examples(indices)
        provenance = reader.read_sources(indices)
    except IndexError as e:
        raise click.UsageError(str(e)) from None
    except (fmt.CacheError, OSError) as e:
        common.print_error(e)
        sys.exit(1)
    vocabs = {}
    for name in reader.manifest.vocabularies:
        try:
            vocabs[name] = reader.vocabulary(name)
        except (ValueError, OSError) as e:
            common.print_error(f"{e}; run `seqcache verify {cache_dir}`")
            sys.exit(1)
    return examples, provenance, vocabs, indices


def _check_indices(indices, num_examples: int) -> None:
    """Raises ``click.BadParameter`` (``--index``) naming each index outside
    ``[0, num_examples)`` (the first 5) and the cache's range."""
    bad = sorted({i for i in indices if not 0 <= i < num_examples})
    if not bad:
        return
    shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    noun = "index" if len(bad) == 1 else "indices"
    have = (f"the cache has {common.plural(num_examples, 'example')}, indices 0 to {num_examples - 1}"
            if num_examples else "the cache has no examples")
    raise click.BadParameter(f"{noun} {shown} out of range: {have}", param_hint="--index")


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut after ``max_chars`` characters (0: whole), saying how many more there are."""
    if max_chars and len(text) > max_chars:
        return text[:max_chars] + f"… [{len(text) - max_chars} more characters]"
    return text


def _describe_example(index, example, provenance, vocabs, with_ids):
    """One example as JSON-able dict: per token feature, its segments with
    provenance, decoded text and (optionally) ids."""
    item = {"index": index, "provenance": provenance, "features": {}}
    for name, arr in example.items():
        if name.endswith(("_segment_ids", "_positions")):
            continue
        if name.endswith(fmt.PRETOKENIZED_SUFFIX):  # the source's text, UTF-8 bytes
            text = bytes(arr.astype("uint8")).decode("utf-8", errors="replace")
            item["features"][name] = {"length": int(arr.size), "text": text}
            continue
        seg_ids = example.get(f"{name}_segment_ids")
        vocab = vocabs.get(name)
        if seg_ids is None:
            pieces = [(arr, provenance[0] if provenance else None)]
        else:
            pieces = [(arr[seg_ids == k], provenance[k - 1] if k - 1 < len(provenance) else None)
                      for k in range(1, int(seg_ids.max(initial=0)) + 1)]
        segments = []
        for tokens, prov in pieces:
            seg = {"length": int(tokens.size), "provenance": prov}
            if vocab is not None:
                seg["text"] = decode_with_sentinels(vocab, tokens.tolist())
            if with_ids or vocab is None:
                seg["ids"] = tokens.tolist()
            segments.append(seg)
        item["features"][name] = {"length": int(arr.size), "segments": segments}
    return item


@click.command(context_settings=common.BEAM_OPTIONS_CONTEXT, epilog=common.BEAM_OPTIONS_EPILOG)
@click.argument("cache_dir")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def verify(ctx, cache_dir, as_json):
    """Check every shard of CACHE_DIR (a local path, or a gs:// or s3:// URL):
    counts, checksums, decodability; and the cache's other files (vocabulary
    models, quarantine file, source table) against the manifest. The source
    files themselves are not read. From a URL, the shards are downloaded one
    at a time to a temporary file, checked and deleted.

    Exits with status 1 and names each bad file when anything is wrong."""
    common.filesystem_options(ctx.args)
    try:
        report = verify_cache(cache_dir)
    except (fmt.CacheError, OSError) as e:
        if as_json:
            click.echo(json.dumps({"cache_dir": cache_dir, "ok": False, "problems": [str(e)], "shards": []}, indent=2))
        else:
            common.print_error(e)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console = Console(soft_wrap=True, emoji=False)
        n = len(report.shards)
        bad = [s for s in report.shards if not s.ok]
        if report.ok:
            console.print(console.highlighter(common.styled(
                "green", "ok", f": {cache_dir}: {n} files verified (sizes, sha256, record counts, every record "
                "decoded), and the vocabulary models, quarantine file and source table against the manifest")))
        else:
            console.print(console.highlighter(common.styled(
                "red", "FAILED", f": {cache_dir}: {common.plural(len(report.problems), 'problem')}"
                + (f", {len(bad)} of {n} files bad" if bad else ""))))
            for p in report.problems:
                console.print(f"  - {p}", highlight=False, markup=False)
    sys.exit(0 if report.ok else 1)


def _described(source) -> str:
    """``source.describe()``, with the class of a user's subclass (``read_split``'s
    override changes what the parent's description says)."""
    own = users_class(source)
    return source.describe() if own is None else f"{source.describe()} ({own})"


@click.command(name="tasks")
@common.MODULES_OPTION
@click.option("--json", "as_json", is_flag=True)
def tasks_cmd(modules, as_json):
    """List registered tasks and mixtures."""
    common.import_modules(modules)
    task_rows = []
    for name in tasks.TaskRegistry.names():
        t = tasks.TaskRegistry.get(name)
        source = _described(t.source) if t.splits is None else \
            "; ".join(f"{split}: {_described(t.source_for(split))}" for split in t.splits)
        task_rows.append({"name": name, "source": source, "splits": list(t.splits) if t.splits else None,
                          "features": sorted(t.output_features), "packing": t.packing,
                          "metrics": function_names(t.metric_fns)})
    mixture_rows = []
    for name in tasks.MixtureRegistry.names():
        m = tasks.MixtureRegistry.get(name)
        mixture_rows.append({"name": name, "tasks": list(m.task_names)})
    if as_json:
        click.echo(json.dumps({"tasks": task_rows, "mixtures": mixture_rows}, indent=2))
        return
    console = Console(emoji=False)
    t = common.CutTable("name", "splits", "source", "features", "packing", title="tasks")
    for r in task_rows:
        t.add_row(r["name"], ", ".join(r["splits"]) if r["splits"] else "any", r["source"], ", ".join(r["features"]),
                  str(r["packing"]))
    console.print(t, markup=False)  # the sources' globs and paths: not markup
    m = common.CutTable("name", "tasks", title="mixtures")
    for r in mixture_rows:
        m.add_row(r["name"], ", ".join(r["tasks"]))
    console.print(m, markup=False)
