"""The numbers of ``seqcache report``: what a person checks by eye in a new cache.

Everything comes from what the build recorded (manifest.json, the source table
file and, streamed, quarantine.jsonl); no data or provenance record is read. ``cache_report`` gives
one cache's sections, ``mixture_report`` the stream of a mixture (or a saved
feeder state) over its first steps: JSON-able dicts that ``seqcache report
--json`` prints and ``seqcache.cli.report_html`` draws. Units: examples and records
in records, lengths in tokens, sizes in bytes, shares and efficiencies as
fractions in [0, 1]; step s, global batch B, global position p = s * B.

Caches without ``statistics.length_histogram`` and ``statistics.source_files``
report everything else; those sections say ``"recorded": false`` and why.
"""

from __future__ import annotations

import collections
import json
import math
from typing import Any, Mapping, Sequence

from seqcache import format as fmt
from seqcache import fs, layout
from seqcache import lengths as lengths_lib
from seqcache.feeders import mixing
from seqcache.tasks import describe_record

REPORT_VERSION = 1
TOP_FILES = 20
FIRST_ENTRIES = 5
# Points of the share curve over the first steps (the curve is exact at each point).
SHARE_POINTS = 200

NOT_RECORDED = ("not recorded by the build of this cache (built by seqcache {version}); rebuild it with a newer "
                "seqcache (--overwrite) to see it")


def token_features(manifest: fmt.Manifest) -> list[str]:
    """The token features of a cache (no ``_segment_ids``, ``_positions`` or
    ``_pretokenized`` source text), in record order."""
    return [f.name for f in manifest.features if not f.name.endswith(("_segment_ids", "_positions",
                                                                      fmt.PRETOKENIZED_SUFFIX))]


def cache_report(cache_dir: str, *, top_files: int = TOP_FILES, first_entries: int = FIRST_ENTRIES) -> dict:
    """The report of one cache.

    Args:
      cache_dir: a cache folder (with manifest.json), local or gs://, s3://, hdfs://.
      top_files: source files listed one by one (the most tokens first); the
        rest are added up in one row.
      first_entries: quarantine entries kept per (action, kind).

    Returns:
      ``{"cache_dir", "summary", "lengths", "packing", "sources", "quarantine",
      "shards", "problem"}``; ``summary`` holds the same values as
      ``seqcache info --json`` under the same names (``statistics.*`` nested).

    Raises:
      seqcache.format.CacheError: no readable manifest, a source table file
        that is missing or does not match the manifest, or a quarantine file
        that is missing or not JSON lines (naming the file and line).
    """
    m = fmt.read_manifest(cache_dir, check_shards=True)  # checked as verify checks it
    try:
        fmt.check_shard_files(cache_dir, m)
        problem = None
    except fmt.CacheError as e:
        problem = str(e)
    names = token_features(m)
    return {"cache_dir": cache_dir, "summary": _summary(m), "lengths": _lengths(m, names),
            "packing": _packing(m, names), "sources": _sources(m, cache_dir, names, top_files),
            "quarantine": quarantine_summary(cache_dir, m, first_entries=first_entries), "shards": _shards(m),
            "problem": problem}


def _summary(m: fmt.Manifest) -> dict:
    stats = m.statistics.to_json()
    keep = ("examples", "segments", "source_records", "source_examples", "truncated_tokens", "skipped_records",
            "replaced_records", "tokens", "mean_length", "max_length")
    return {"task": m.task, "split": m.split, "fingerprint": m.fingerprint, "seed": m.seed,
            "sequence_length": m.sequence_length, "packing": m.packing, "num_examples": m.num_examples,
            "num_shards": len(m.shards), "num_bytes": sum(s.num_bytes for s in m.shards),
            "num_sources": m.num_sources, "created": m.created,
            "seqcache_version": m.seqcache_version, "statistics": {k: stats[k] for k in keep if k in stats}}


def _sequence_length(m: fmt.Manifest, name: str) -> int | None:
    return lengths_lib.built_lengths(m).get(name)


def _not_recorded(m: fmt.Manifest) -> str:
    return NOT_RECORDED.format(version=m.seqcache_version or "?")


def histogram_quantile(histogram: Sequence[Sequence[int]], q: float) -> int:
    """An upper bound of the q-quantile of a ``[lo, hi, count]`` histogram: the
    exclusive upper edge of the bucket that holds it, minus one (tokens)."""
    total = sum(int(c) for _, _, c in histogram)
    if not total:
        return 0
    need = q * total
    seen = 0
    for _, hi, count in histogram:
        seen += int(count)
        if seen >= need:
            return int(hi) - 1
    return int(histogram[-1][1]) - 1


def _lengths(m: fmt.Manifest, names: Sequence[str]) -> dict:
    """Per feature: the length histogram, the sequence length, the mean and max, and the examples longer."""
    stats = m.statistics
    hists = stats.length_histogram
    out = {}
    for name in names:
        L = _sequence_length(m, name)
        entry = {"sequence_length": L, "max_length": (stats.max_length or {}).get(name),
                 "mean_length": (stats.mean_length or {}).get(name),
                 "of": "source examples, before packing" if m.packing else "examples"}
        hist = None if hists is None else hists.get(name)
        if hist is None:
            entry.update(recorded=False, reason=_not_recorded(m), histogram=None)
        else:
            entry.update(recorded=True, histogram=[[int(lo), int(hi), int(c)] for lo, hi, c in hist],
                         count=sum(int(c) for _, _, c in hist), p50_at_most=histogram_quantile(hist, 0.5),
                         p90_at_most=histogram_quantile(hist, 0.9), p99_at_most=histogram_quantile(hist, 0.99))
            if L is not None:
                # Buckets are exact below 16 tokens and about 9 % wide above: a bucket
                # straddling L is counted as "at most L" (a lower bound of the longer ones).
                entry["longer_than_sequence_length_at_least"] = sum(int(c) for lo, _, c in hist if int(lo) > L)
        out[name] = entry
    return out


def _packing(m: fmt.Manifest, names: Sequence[str]) -> dict:
    """Per feature: tokens against the capacity ``examples x sequence length`` (and segments per example)."""
    stats = m.statistics
    examples = int(m.num_examples if stats.examples is None else stats.examples)
    out = {}
    for name in names:
        L = _sequence_length(m, name)
        tokens = int((stats.tokens or {}).get(name, 0))
        entry = {"packed": m.packing is not None, "tokens": tokens, "examples": examples,
                 "sequence_length": L}
        if L is None:
            entry.update(efficiency=None, reason="the cache has no sequence length for this feature: a feeder pads "
                                                 "to the length it is given")
        else:
            capacity = examples * L
            entry.update(capacity_tokens=capacity, padding_tokens=capacity - tokens,
                         efficiency=tokens / capacity if capacity else 0.0)
        if entry["packed"] and examples:
            entry["segments_per_example"] = int(examples if stats.segments is None else stats.segments) / examples
        entry["truncated_tokens"] = int(stats.truncated_tokens or 0)
        out[name] = entry
    return out


def _sources(m: fmt.Manifest, cache_dir: str, names: Sequence[str], top: int) -> dict:
    """Tokens and examples per source file (or, unrecorded, bytes): the ``top``
    files, then the rest in one row; from the cache's source table (its file,
    checked against the manifest, or the manifest of an older cache)."""
    files = m.read_source_table(cache_dir)
    table = files.statistics
    key = names[0] if names else None
    rows = []
    if table is not None:
        examples = table["examples"]
        tokens = {n: table["tokens"].get(n) or [0] * len(files) for n in names}
    for i, f in enumerate(files):
        row = {"source_index": i, "path": f.get("path"), "num_bytes": f.get("num_bytes")}
        if table is not None:
            row["examples"] = int(examples[i])
            row["tokens"] = {n: int(tokens[n][i]) for n in names}
        rows.append(row)
    if table is not None:
        rows.sort(key=lambda r: (-r["tokens"].get(key, 0), -r["examples"], r["source_index"]))
    else:
        rows.sort(key=lambda r: (-(r["num_bytes"] or 0), r["source_index"]))
    shown, rest = rows[:top], rows[top:]
    other = None
    if rest:
        other = {"files": len(rest), "num_bytes": sum(r["num_bytes"] or 0 for r in rest)}
        if table is not None:
            other["examples"] = sum(r["examples"] for r in rest)
            other["tokens"] = {n: sum(r["tokens"][n] for r in rest) for n in names}
    out = {"num_files": len(files), "ranked_by": f"tokens ({key})" if table is not None else "bytes",
           "top": shown, "other": other, "recorded": table is not None}
    if table is None:
        out["reason"] = _not_recorded(m)
    else:
        out["examples"] = sum(table["examples"])
        out["tokens"] = {n: sum(table["tokens"].get(n, [])) for n in names}
    return out


def quarantine_summary(cache_dir: str, m: fmt.Manifest, *, first_entries: int = FIRST_ENTRIES) -> dict:
    """Skipped and repaired source records by (action, kind), with the first
    ``first_entries`` of each and their location, streaming quarantine.jsonl.

    Returns ``{"file", "skipped_records", "replaced_records", "kinds": [{"action",
    "kind", "records", "first": [{"path", "record_number", "location", "error"}]}],
    "cluster_sizes": [[size, clusters], ...]}``, the counts as recorded in the
    manifest, the kinds as found in the file; ``cluster_sizes``: the clusters
    of near duplicates (kind ``near_duplicate``) by their number of records,
    the kept one included, in increasing size (memory: one count per cluster).

    Raises:
      seqcache.format.CacheError: the manifest names a quarantine file that is
        missing, or a line that is not a JSON object (file and line named).
    """
    stats = m.statistics
    out = {"file": m.quarantine, "skipped_records": int(stats.skipped_records or 0),
           "replaced_records": int(stats.replaced_records or 0), "kinds": [], "cluster_sizes": []}
    if m.quarantine is None:
        return out
    path = layout.cache_file(cache_dir, m.quarantine, what="quarantine file")
    if not fs.exists(path):
        raise fmt.CacheError(f"{path}: the quarantine file the manifest names is missing; run `seqcache verify "
                             f"{cache_dir}`")
    kinds: dict[tuple[str, str], dict] = {}
    clusters: collections.Counter = collections.Counter()
    decode = json.JSONDecoder().decode
    with fs.open_read(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = decode(line.decode("utf-8"))
                if not isinstance(entry, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                raise fmt.CacheError(f"{path}: line {number} is not a JSON object ({e})") from None
            action = entry.get("action", "skipped")  # older caches: every line a skipped record
            kind = entry.get("kind") or "unknown"
            k = kinds.get((action, kind))
            if k is None:
                k = kinds[(action, kind)] = {"action": action, "kind": kind, "records": 0, "first": []}
            k["records"] += 1
            if len(k["first"]) < first_entries:
                k["first"].append(entry)
            if kind == "near_duplicate" and isinstance(entry.get("kept"), dict):
                kept = entry["kept"]
                clusters[(kept.get("source_index"), kept.get("record_number"))] += 1
    locators = [s.get("locator", "record") for s in m.read_source_table(cache_dir)] if kinds else []
    for k in kinds.values():
        firsts = []
        for e in k["first"]:
            si = e.get("source_index")
            locator = locators[si] if isinstance(si, int) and 0 <= si < len(locators) else "record"
            firsts.append({"path": e.get("path"), "record_number": e.get("record_number"),
                           "location": describe_record(e.get("path"), locator, e.get("record_number")),
                           "error": e.get("error")})
        k["first"] = firsts
    out["kinds"] = sorted(kinds.values(), key=lambda k: (k["action"], -k["records"], k["kind"]))
    out["cluster_sizes"] = sorted([size, n] for size, n in collections.Counter(1 + r for r in clusters.values()).items())
    return out


def _shards(m: fmt.Manifest) -> dict:
    """Records and bytes per shard, and the skew: largest over mean."""
    records = [s.num_records for s in m.shards]
    sizes = [s.num_bytes for s in m.shards]
    n = len(records)

    def skew(values):
        mean = sum(values) / n if n else 0.0
        return {"min": min(values, default=0), "max": max(values, default=0), "mean": mean,
                "max_over_mean": (max(values) / mean) if mean else None}

    return {"num_shards": n, "records": records, "num_bytes": sizes, "files": [s.file for s in m.shards],
            "records_skew": skew(records), "bytes_skew": skew(sizes)}


# --- mixtures --------------------------------------------------------------------


def share_steps(steps: int, points: int = SHARE_POINTS) -> list[int]:
    """The steps at which the share curve is evaluated: 1..steps, at most
    ``points`` of them, denser at the start (geometric), always ending at ``steps``."""
    if steps < 1:
        return []
    if steps <= points:
        return list(range(1, steps + 1))
    ratio = math.log(steps) / (points - 1)
    out = sorted({max(1, min(steps, round(math.exp(i * ratio)))) for i in range(points)})
    if out[-1] != steps:
        out.append(steps)
    return out


def mixture_report(*, paths: Sequence[str], names: Sequence[str], rates: Sequence[float], weights: Sequence[int],
                   num_examples: Sequence[int], global_batch_size: int, steps: int, at_step: int | None = None,
                   num_epochs: int | None = None, position: int | None = None) -> dict:
    """Each task's share of the stream over the first ``steps`` steps against its
    target rate, and the epoch each task reaches by ``at_step``: exact, from the
    feeder's own mixing (``seqcache.feeders.mixing.Mixer``), reading no record.

    Args:
      paths, names, rates, weights, num_examples: per task, in mixture order: the
        cache folder, the task name, the rate as given, the integer weight it
        became (``mixing.integer_weights``) and the cache's examples (N_t).
      global_batch_size: B (rows per step).
      steps: the share curve covers steps [0, steps).
      at_step: the step whose epochs are reported (default ``steps``): task t,
        given c_t(at_step * B) positions, is in epoch c_t // N_t (0-based).
      num_epochs: a finite run's E: a task's epochs stop at E (its later
        positions are padding rows); None = forever.
      position: a saved state's global position, shown as its step.

    Returns:
      ``{"global_batch_size", "steps", "at_step", "num_epochs", "state_step",
      "tasks": [{"name", "path", "rate", "weight", "target_share", "num_examples",
      "share_at_steps", "max_share_error", "positions_at_step", "epochs_at_step",
      "epoch_at_step"}], "curve_steps", "epoch_curve_steps"}``.
    """
    if global_batch_size < 1 or steps < 1:
        raise ValueError(f"global_batch_size and steps must be >= 1 (got {global_batch_size=}, {steps=})")
    at_step = steps if at_step is None else int(at_step)
    mixer = mixing.Mixer(weights)
    curve = share_steps(steps)
    epoch_curve = share_steps(max(steps, at_step))
    total = sum(weights)
    tasks = []
    for t, (path, name, rate, weight, n) in enumerate(zip(paths, names, rates, weights, num_examples)):
        target = weight / total
        shares = [mixer.count_before(t, s * global_batch_size) / (s * global_batch_size) for s in curve]
        given = mixer.count_before(t, at_step * global_batch_size)
        epochs = given / n if n else 0.0
        epoch_values = [mixer.count_before(t, s * global_batch_size) / n if n else 0.0 for s in epoch_curve]
        if num_epochs is not None:
            epochs = min(epochs, float(num_epochs))
            epoch_values = [min(e, float(num_epochs)) for e in epoch_values]
        tasks.append({"name": name, "path": path, "rate": rate, "weight": int(weight), "target_share": target,
                      "num_examples": int(n), "share_at_steps": shares,
                      "max_share_error": max((abs(s - target) for s in shares), default=0.0),
                      "positions_at_step": int(given), "epochs_at_step": epochs,
                      "epoch_at_step": min(int(given // n), num_epochs - 1 if num_epochs else 1 << 62) if n else 0,
                      "epochs_over_steps": epoch_values})
    return {"global_batch_size": int(global_batch_size), "steps": int(steps), "at_step": at_step,
            "num_epochs": num_epochs,
            "state_step": None if position is None else int(position) // int(global_batch_size),
            "curve_steps": curve, "epoch_curve_steps": epoch_curve, "tasks": tasks,
            "units": "shares and target shares: fractions of the positions [0, s * B); epochs: positions given / N_t"}


def build_report(*, caches: Sequence[str], mixture: dict | None = None, top_files: int = TOP_FILES,
                 first_entries: int = FIRST_ENTRIES, overlaps: Sequence[dict] = ()) -> dict:
    """The whole report: one ``cache_report`` per cache, the ``mixture`` section
    or None, and (only when there are any) one ``overlap_report`` per overlap result."""
    out = {"report_version": REPORT_VERSION,
           "caches": [cache_report(c, top_files=top_files, first_entries=first_entries) for c in caches],
           "mixture": mixture}
    if overlaps:
        fingerprints = {c["summary"]["fingerprint"] for c in out["caches"]}
        out["overlap"] = [overlap_report(o, fingerprints) for o in overlaps]
    return out


# Benchmark items listed one by one in a report's overlap section.
OVERLAP_ITEMS = 20
# Characters of a matched span shown in the report.
SPAN_CHARS = 240


def overlap_report(result: Mapping[str, Any], fingerprints, *, items: int = OVERLAP_ITEMS) -> dict:
    """The report's section of one result of ``seqcache overlap`` (its JSON, or
    a Parquet file's metadata: ``seqcache.pipelines.overlap.read_result``).

    Args:
      result: the result.
      fingerprints: the fingerprints of the report's caches; ``problem`` says
        so when the result was computed on other caches (rebuilt since).
      items: items listed (first read first, then item order; those the run
        never reads, or without a run, in item order).

    Returns:
      ``{"benchmark", "summary", "run", "caches", "items", "first_reads",
      "problem"}``: ``items`` each with item, location, num_examples,
      num_matches, first_seen (None without a run) and its first match (span
      cut to ``SPAN_CHARS`` characters); ``first_reads``: the sorted first
      steps of the items the run reads.
    """
    listed = sorted(result.get("items", []), key=lambda it: (
        it.get("first_seen") is None, (it.get("first_seen") or {}).get("position", 0), it["item"]))
    rows = []
    for it in listed[:items]:
        m = (it.get("matches") or [None])[0]
        first = None if m is None else {
            "task": m.get("task"), "cache_index": m.get("cache_index"), "feature": m.get("feature"),
            "location": m.get("location"), "source": m.get("source"),
            "span": m["span"] if len(m["span"]) <= SPAN_CHARS else m["span"][:SPAN_CHARS] + "…"}
        rows.append({"item": it["item"], "location": it.get("location"), "num_examples": it.get("num_examples"),
                     "num_matches": it.get("num_matches"), "first_seen": it.get("first_seen"), "first_match": first})
    others = [c["cache"] for c in result.get("caches", []) if c.get("fingerprint") not in set(fingerprints)]
    problem = (f"computed on caches other than this report's (rebuilt since?): {', '.join(others)}"
               if others else None)
    steps = sorted(int(it["first_seen"]["step"]) for it in result.get("items", []) if it.get("first_seen"))
    return {"benchmark": result.get("benchmark"), "summary": result.get("summary"), "run": result.get("run"),
            "caches": result.get("caches"), "items": rows, "first_reads": steps, "problem": problem}


def to_json(report: Mapping[str, Any]) -> str:
    return json.dumps(report, indent=2, ensure_ascii=False)
