"""Benchmark overlap: which examples of a cache share an n-gram with a benchmark item.

What is scanned is what the model sees: the cache's examples, decoded with the
vocabulary stored in the cache, segment by segment (a packed example holds
several source records), every text feature (``inputs`` and ``targets`` of a
supervised cache each on its own; a span-corrupted example's two put back
together into its text), with each segment's
provenance (source file and record) from the cache's provenance sidecar. The
matching is ``seqcache.tasks.contamination.Benchmark.match``.

The pipeline is one straight line with one leaf, portable across Beam runners
(the build's runners, ``seqcache.pipelines.runner``)::

    Create(work units) ──Reshuffle──> ScanUnit ──(0, unit)──> GroupByKey ──> WriteDone

- a work unit is a range of cache indices of one task's cache (at most
  ``UNIT_EXAMPLES``, never across a shard), so the work spreads over the
  shards and over the workers;
- ``ScanUnit`` loads the benchmark's n-gram table once per worker process
  (from its source spec; its fingerprint must be the driver's), reads its
  range in batches of ``READ_BATCH`` records and writes its matches to
  ``unit-NNNNNNN.json`` in a scratch folder (atomically): memory is the
  benchmark's table plus one batch of records, whatever the corpus's size;
- ``WriteDone`` gets every unit number in one element and writes
  ``done.json``; the driver checks that every unit reported, merges the unit
  files and sorts the matches (``collect``), so the result does not depend on
  the runner, the number of workers or the order the units ran in.

Nothing is emitted from ``finish_bundle``, there are no tagged outputs and no
metrics (the Dask runner loses or mixes those).

The run: for a feeder's stream (a saved state, or a seed and a global batch) the
first time an example is read is its position in epoch 0
(``seqcache.feeders.inverse.position_in_epoch``: the permutation inverted, then
the mixing), O(1) per example for one task and O(log T) for a mixture; a task
left out of the stream before reaching it (a schedule) never reads it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from seqcache import format as fmt
from seqcache import fs, process
from seqcache.feeders import compat
from seqcache.feeders.inverse import position_in_epoch
from seqcache.feeders.provenance import segments_of
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import runner as runner_mod
from seqcache.pipelines.transforms import set_worker_options, settle_worker
from seqcache.tasks import decode_with_sentinels, describe_record
from seqcache.tasks.contamination import Benchmark

OVERLAP_VERSION = 1
# Cache indices per work unit (at most; a unit never crosses a shard); fewer for
# a small scan, so that its work still spreads over MIN_UNITS units.
UNIT_EXAMPLES = 4096
MIN_UNITS = 16
# Records read and decoded together inside a unit.
READ_BATCH = 256
DONE_NAME = "done.json"
# Keys of one match, in order; ``collect`` sorts by them.
MATCH_KEYS = ("item", "task_index", "cache_index", "feature", "segment", "start", "end", "source_index", "source",
              "locator", "record_number", "token_offset", "span", "ngram", "ngrams")


def text_features(manifest) -> list[str]:
    """The features of a cache that hold text: token features (no
    ``_segment_ids`` / ``_positions``) whose vocabulary the manifest describes,
    in record order."""
    vocabularies = manifest.vocabularies
    return [f.name for f in manifest.features
            if not f.name.endswith(("_segment_ids", "_positions")) and vocabularies.get(f.name)]


def plan_units(paths: Sequence[str], shard_starts: Sequence[np.ndarray], *, fingerprints: Sequence[str] | None = None,
               unit_examples: int = UNIT_EXAMPLES) -> list[tuple[int, int, str, str | None, int, int]]:
    """The work units of a scan: ``(unit, task_index, cache path, cache
    fingerprint, start, stop)``, cache indices ``[start, stop)`` of one shard of
    one cache, at most ``unit_examples`` each, numbered 0.. in (task, index)
    order.

    Args:
      paths: the caches, in mixture order.
      shard_starts: per cache, its manifest's ``shard_starts`` (int64,
        ``(num_shards + 1,)``).
      fingerprints: per cache, its fingerprint (a worker refuses a cache
        rebuilt since), or None.

    Raises:
      ValueError: ``unit_examples < 1``.
    """
    if unit_examples < 1:
        raise ValueError(f"unit_examples must be >= 1 (got {unit_examples})")
    fingerprints = list(fingerprints) if fingerprints is not None else [None] * len(paths)
    units = []
    for t, (path, starts) in enumerate(zip(paths, shard_starts)):
        bounds = [int(x) for x in starts]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            for start in range(lo, hi, unit_examples):
                units.append((len(units), t, path, fingerprints[t], start, min(hi, start + unit_examples)))
    return units


class BenchmarkRef:
    """How a worker gets the benchmark: its source spec, n and min_words, and the
    fingerprint the driver computed. ``load`` builds the n-gram table once per
    process (kept for the process's later units) and refuses a benchmark whose
    files changed since the driver read them."""

    _loaded: dict[tuple, Any] = {}
    _lock = threading.Lock()

    def __init__(self, spec: str, *, n: int, min_words: int, fingerprint: str):
        self.spec, self.n, self.min_words, self.fingerprint = spec, int(n), int(min_words), fingerprint

    def keep(self, bench) -> None:
        """Makes ``bench`` (loaded from this spec, with this fingerprint) the
        one ``load`` returns in this process."""
        if bench.fingerprint != self.fingerprint:
            raise ValueError(f"benchmark {self.spec!r}: fingerprint {bench.fingerprint[:12]} is not the scan's")
        with self._lock:
            self._loaded.clear()
            self._loaded[(self.spec, self.n, self.min_words, self.fingerprint)] = bench

    def load(self):
        """The ``Benchmark``.

        Raises:
          ValueError: the items read here have another fingerprint (the files
            changed while the scan ran), naming the spec.
        """
        key = (self.spec, self.n, self.min_words, self.fingerprint)
        with self._lock:
            bench = self._loaded.get(key)
            if bench is None:
                bench = Benchmark.load(self.spec, n=self.n, min_words=self.min_words)
                if bench.fingerprint != self.fingerprint:
                    raise ValueError(f"benchmark {self.spec!r}: its files changed while the scan ran (fingerprint "
                                     f"{bench.fingerprint[:12]}, the scan started with {self.fingerprint[:12]}); "
                                     "run the scan again")
                self._loaded.clear()  # one benchmark per process at a time: memory is one table
                self._loaded[key] = bench
            return bench


def scan_range(bench, reader, *, task_index: int, start: int, stop: int,
               features: Sequence[str] | None = None) -> tuple[list[dict], dict]:
    """The matches of cache indices ``[start, stop)`` of one cache.

    Each example is decoded with the cache's vocabulary, each segment of each
    text feature on its own (``seqcache.feeders.provenance.segments_of``;
    sentinels shown as ``<extra_id_i>``), and looked up with ``bench.match``.
    A span-corrupted example (``inputs`` and ``targets`` of one vocabulary with
    extra ids, both holding sentinels) is scanned as one text, feature
    ``"inputs+targets"``: its noise spans put back into the inputs
    (``merge_span_corruption``), the document as the model saw it in two parts.

    Args:
      bench: a ``seqcache.tasks.contamination.Benchmark``.
      reader: the cache's ``seqcache.feeders.reader.CacheReader``.
      task_index: the cache's index in the mixture (copied into each match).
      features: the text features to scan (default ``text_features``).

    Returns:
      ``(matches, counts)``: one dict per (item, example, feature, segment,
      span) with the keys ``MATCH_KEYS`` (segment 1-based; source, locator,
      record_number and token_offset from the provenance sidecar; start/end:
      character offsets in the segment's decoded text; span: that text), and
      counts of what was scanned: examples, segments, tokens, characters.

    Raises:
      seqcache.format.CacheError: a record or provenance record cannot be read.
      ValueError: the vocabulary cannot be rebuilt from the cache.
    """
    features = list(text_features(reader.manifest) if features is None else features)
    vocabs = {f: reader.vocabulary(f) for f in features}  # rebuilt from the cache
    merge = _span_corruption_pair(reader.manifest, features)
    counts = {"examples": 0, "segments": 0, "tokens": 0, "characters": 0}
    found: list[tuple[int, str, int, str, list]] = []
    for lo in range(start, stop, READ_BATCH):
        idx = np.arange(lo, min(stop, lo + READ_BATCH), dtype=np.int64)
        segments = []  # (cache index, feature, segment, token ids)
        for i, record in zip(idx.tolist(), reader.read(idx)):
            counts["examples"] += 1
            # The record's name for errors, without reader.decode's shard look-up per record.
            example = fmt.decode_example(reader.features, record, where=f"{reader.cache_dir}: cache index {i}")
            segments.extend((i, label, j, ids) for label, j, ids in _segments(example, features, merge))
        counts["tokens"] += sum(len(ids) for *_, ids in segments)
        batch = [(i, label, j, text) for (i, label, j, _), text in zip(segments, _decode(vocabs, segments))]
        counts["segments"] += len(batch)
        counts["characters"] += sum(len(text) for *_, text in batch)
        for (i, label, j, text), matches in zip(batch, bench.match_many([text for *_, text in batch])):
            if matches:
                found.append((i, label, j, text, matches))
    return _with_sources(reader, found, task_index), counts


def _decode(vocabs: Mapping, segments: Sequence[tuple]) -> list[str]:
    """The text of each ``(index, feature, segment, ids)``: ``decode_batch`` of
    each feature's segments at once; a segment that holds sentinel ids one by
    one with ``decode_with_sentinels`` (``<extra_id_i>``)."""
    texts: list[str | None] = [None] * len(segments)
    by_feature: dict[str, list[int]] = {}
    for k, (_, label, _, ids) in enumerate(segments):
        vocab = vocabs[label.partition("+")[0]]
        extra = int(getattr(vocab, "extra_ids", 0) or 0)
        if extra and len(ids) and bool((np.asarray(ids) >= vocab.base_vocab_size).any()):
            texts[k] = decode_with_sentinels(vocab, [int(t) for t in ids])
        else:
            by_feature.setdefault(label, []).append(k)
    for label, ks in by_feature.items():
        decoded = vocabs[label.partition("+")[0]].decode_batch([segments[k][3] for k in ks])
        for k, text in zip(ks, decoded):
            texts[k] = text
    return texts


def _span_corruption_pair(manifest, features: Sequence[str]) -> tuple[int, int] | None:
    """The sentinel id range ``[first, end)`` when ``inputs`` and ``targets`` are
    both scanned and share a vocabulary with extra ids (the same entry but for
    the model's file name; span corruption's layout: ``_segments`` then merges
    them where both hold sentinels), else None."""
    vocabularies = manifest.vocabularies
    if not {"inputs", "targets"} <= set(features):
        return None
    # Each feature's model file has its own name (vocabulary-inputs.model, ...): one vocabulary is
    # the same kind, model bytes (sha256), size and extra ids.
    same = {k: v for k, v in vocabularies["inputs"].to_json().items() if k != "file"}
    if same != {k: v for k, v in vocabularies["targets"].to_json().items() if k != "file"}:
        return None
    extra = int(vocabularies["inputs"].extra_ids or 0)
    size = vocabularies["inputs"].vocab_size
    if not extra or not size:
        return None
    return int(size) - extra, int(size)


def merge_span_corruption(inputs: Sequence[int], targets: Sequence[int], first: int, end: int) -> list[int] | None:
    """The text T5's span corruption cut into ``inputs`` and ``targets``, put
    back: each sentinel of ``inputs`` (ids in ``[first, end)``) replaced by the
    ids that follow the same sentinel in ``targets``. None when either holds no
    sentinel (not span corruption). Raffel et al. 2020, section 3.1.4."""
    spans: dict[int, list[int]] = {}
    current = None
    for t in targets:
        if first <= t < end:
            current = spans.setdefault(t, [])
        elif current is not None:
            current.append(t)
    if not spans or not any(first <= t < end for t in inputs):
        return None
    out: list[int] = []
    for t in inputs:
        if first <= t < end:
            out.extend(spans.get(t, ()))
        else:
            out.append(t)
    return out


def _segments(example: Mapping, features: Sequence[str], merge) -> Iterator[tuple[str, int, Any]]:
    """``(feature, segment index, token ids)`` of each segment of each scanned
    feature of one decoded example; for span corruption (``merge``: the sentinel
    range) one ``"inputs+targets"`` text per segment, the spans put back."""
    per = {f: segments_of(example, f) for f in features}
    if merge is not None:
        merged = [merge_span_corruption(a.tolist(), b.tolist(), *merge)
                  for a, b in zip(per["inputs"], per["targets"])]
        if merged and all(m is not None for m in merged):
            per = {"inputs+targets": merged, **{f: v for f, v in per.items() if f not in ("inputs", "targets")}}
    for f, segs in per.items():
        for j, ids in enumerate(segs):
            yield f, j, ids


def _with_sources(reader, found: list, task_index: int) -> list[dict]:
    """The match dicts of ``scan_range``, each with its segment's source (one
    batched provenance read for the examples that matched)."""
    if not found:
        return []
    indices = sorted({i for i, *_ in found})
    sources = dict(zip(indices, reader.read_sources(indices)))
    out = []
    for i, feature, j, text, matches in found:
        segs = sources[i]
        seg = segs[j] if j < len(segs) else {}
        for m in matches:
            out.append({"item": m.item, "task_index": int(task_index), "cache_index": int(i), "feature": feature,
                        "segment": j + 1, "start": m.start, "end": m.end, "source_index": seg.get("source_index"),
                        "source": seg.get("path"), "locator": seg.get("locator"),
                        "record_number": seg.get("record_number"), "token_offset": seg.get("token_offset"),
                        "span": text[m.start:m.end], "ngram": m.ngram, "ngrams": m.ngrams})
    return out


class ScanUnit:
    """The scan step (a ``beam.FlatMap`` callable): a work unit ``(unit,
    task_index, cache, fingerprint, start, stop)`` in, its matches and counts written to
    ``scratch_dir/unit-NNNNNNN.json``, ``(0, unit)`` out. Readers stay open in
    the worker process for its later units of the same cache."""

    _readers: dict[str, Any] = {}

    def __init__(self, bench: BenchmarkRef, *, scratch_dir: str, fs_options: Sequence[str] = ()):
        self.bench = bench
        self.scratch_dir = scratch_dir
        self.fs_options = list(fs_options)

    def _reader(self, path: str, fingerprint: str | None):
        """The process's open reader of ``path`` (the last few caches stay open),
        refused when the cache is not the one the scan was planned on."""
        reader = self._readers.get(path)
        if reader is not None and fingerprint is not None and reader.fingerprint != fingerprint:
            self._readers.pop(path).close()
            reader = None
        if reader is None:
            if len(self._readers) >= 8:
                self._readers.pop(next(iter(self._readers))).close()
            reader = self._readers[path] = CacheReader(path, open_shards=False)
        if fingerprint is not None and reader.fingerprint != fingerprint:
            raise ValueError(f"{path}: the cache was rebuilt while the scan ran (fingerprint {reader.fingerprint[:12]}, "
                             f"the scan started with {fingerprint[:12]}); run the scan again")
        return reader

    def __call__(self, unit) -> Iterator[tuple[int, int]]:
        set_worker_options(self.fs_options)
        settle_worker()
        number, task_index, path, fingerprint, start, stop = unit
        bench = self.bench.load()
        matches, counts = scan_range(bench, self._reader(path, fingerprint), task_index=task_index, start=start,
                                     stop=stop)
        counts["unit"] = number
        _write_json_atomically(unit_path(self.scratch_dir, number), {"counts": counts, "matches": matches})
        yield 0, int(number)


class WriteDone:
    """The last step: every unit number in one element; writes ``done.json``
    (the sorted unit numbers) into the scratch folder."""

    def __init__(self, *, scratch_dir: str):
        self.scratch_dir = scratch_dir

    def __call__(self, element) -> Iterator[int]:
        _, numbers = element
        done = sorted(int(u) for u in numbers)
        _write_json_atomically(os.path.join(self.scratch_dir, DONE_NAME), {"units": done})
        yield len(done)


def unit_path(scratch_dir: str, number: int) -> str:
    """Where work unit ``number`` writes its matches: ``unit-NNNNNNN.json``."""
    return os.path.join(scratch_dir, f"unit-{int(number):07d}.json")


def _write_json_atomically(path: str, obj: Any) -> None:
    fs.write_bytes_atomic(path, json.dumps(obj, ensure_ascii=False).encode("utf-8"))


def run_scan(units: Sequence[tuple], bench: BenchmarkRef, *, scratch_dir: str, pipeline_args=None) -> None:
    """Runs the scan pipeline over ``units`` (``plan_units``) on the runner of
    ``pipeline_args`` (Beam options; none: the local engine), writing the unit
    files and ``done.json`` into ``scratch_dir`` (a local folder every worker
    can write).

    Raises:
      seqcache.pipelines.runner.RunnerError: the runner could not start or lost
        its workers (one line).
      The error a unit raised (a damaged cache, a changed benchmark).
    """
    beam = process.import_beam()
    options, runner = runner_mod.pipeline_options(pipeline_args)
    runner_mod.check_runner_available(runner, options)
    fs.set_options(options)
    scan = ScanUnit(bench, scratch_dir=scratch_dir, fs_options=runner_mod.fs_options(pipeline_args))
    engine = runner_mod.local_engine(options) if runner == runner_mod.LOCAL_ENGINE else None
    pipeline = beam.Pipeline(runner=engine, options=options)
    _ = (
        pipeline
        | "ListUnits" >> beam.Create(list(units))
        | "SpreadUnits" >> beam.Reshuffle()
        | "ScanUnit" >> beam.FlatMap(scan)
        | "GatherUnits" >> beam.GroupByKey()
        | "WriteDone" >> beam.FlatMap(WriteDone(scratch_dir=scratch_dir))
    )
    runner_mod.run(pipeline, runner)


def collect(scratch_dir: str, num_units: int) -> tuple[list[dict], dict]:
    """The scan's matches, sorted by ``MATCH_KEYS`` (item, task, cache index,
    feature, segment, start, ...), and the summed counts, from the unit files.

    Raises:
      RuntimeError: ``done.json`` or a unit file is missing (the runner lost
        work), naming the scratch folder.
    """
    done_path = os.path.join(scratch_dir, DONE_NAME)
    if not os.path.exists(done_path):
        raise RuntimeError(f"{scratch_dir}: the runner finished but {DONE_NAME} is missing; the scan lost work, "
                           "run it again")
    with open(done_path, encoding="utf-8") as f:
        done = json.load(f)["units"]
    if done != list(range(num_units)):
        raise RuntimeError(f"{scratch_dir}: {len(done)} of {num_units} work units reported; the runner lost work, "
                           "run the scan again")
    matches: list[dict] = []
    counts = {"examples": 0, "segments": 0, "tokens": 0, "characters": 0}
    for number in range(num_units):
        with open(unit_path(scratch_dir, number), encoding="utf-8") as f:
            part = json.load(f)
        matches.extend(part["matches"])
        for k in counts:
            counts[k] += int(part["counts"][k])
    matches.sort(key=_sort_key)
    return matches, counts


def _sort_key(m: Mapping[str, Any]) -> tuple:
    return tuple((v is None, v if v is not None else 0) for v in (m[k] for k in MATCH_KEYS))


# --- the run: when each overlapping example was or will be read --------------------


def first_seen(stream, *, task: int, cache_index: int, global_batch_size: int, host_count: int = 1) -> dict | None:
    """The first time the run reads example ``cache_index`` of ``task``: its
    position in epoch 0 (``seqcache.feeders.inverse.position_in_epoch``), as a
    dict of Python ints (epoch, ordinal, position, step, row, host, host_row;
    host of ``host_count``), or None when the run never reads it (a schedule
    that leaves the task out before then; a finite run that ends first).

    Raises:
      ValueError: a bad task, cache index or host count.
    """
    b = int(global_batch_size)
    compat.check_hosts(b, 0, host_count)
    k, p = position_in_epoch(stream, task=task, cache_index=cache_index, epoch=0)
    if p is None or (stream.end_position is not None and p >= stream.end_position):
        return None
    step, row = divmod(p, b)
    host, host_row = divmod(row, b // int(host_count))
    return {"epoch": 0, "ordinal": k, "position": p, "step": step, "row": row, "host": host, "host_row": host_row}


def record_locations(records) -> dict[tuple, str]:
    """``(path, locator, record_number) -> "line 12 (byte 1,234)"`` / ``"row 7"``
    (``seqcache.tasks.describe_record``'s words), for many records: the byte
    offsets of one local file are turned into lines in one pass over it."""
    by_file: dict[tuple, set] = {}
    for path, locator, number in records:
        if path is not None and number is not None:
            by_file.setdefault((path, locator or "record"), set()).add(int(number))
    out: dict[tuple, str] = {}
    for (path, locator), numbers in sorted(by_file.items()):
        lines = _lines_at(path, sorted(numbers)) if locator == "byte_offset" and fs.is_local(path) else {}
        for n in numbers:
            line = lines.get(n)
            out[(path, locator, n)] = (f"line {line + 1:,} (byte {n:,})" if line is not None
                                       else describe_record(path, locator, n))
    return out


def _lines_at(path: str, offsets: Sequence[int]) -> dict[int, int]:
    """0-based line numbers of the lines that begin at the sorted byte
    ``offsets`` of ``path`` (decompressed), read once; offsets where no line
    begins are left out (``describe_record`` words them)."""
    out: dict[int, int] = {}
    try:
        with fs.open_binary(path) as f:
            count, pos, last = 0, 0, b"\n"
            for target in offsets:
                while pos < target:
                    chunk = f.read(min(1 << 20, target - pos))
                    if not chunk:
                        return out
                    count += chunk.count(b"\n")
                    pos += len(chunk)
                    last = chunk[-1:]
                if last == b"\n":
                    out[target] = count
    except (OSError, EOFError, ValueError):
        return out
    return out


# --- the result --------------------------------------------------------------------

# Matches listed per item (``max_matches``); the counts are always whole.
MAX_MATCHES = 100
# The metadata key of a Parquet result: the JSON result without the matches.
PARQUET_KEY = b"seqcache.overlap"


def assemble(bench, caches: Sequence[Mapping], matches: Sequence[Mapping], counts: Mapping[str, int], *,
             run: Mapping | None = None, seen: Mapping[tuple, dict | None] | None = None,
             before_step: int | None = None, max_matches: int = MAX_MATCHES) -> dict:
    """The JSON-able result of a scan (docs/overlap.md, "Reading the output").

    Args:
      bench: the ``Benchmark``.
      caches: per cache, in mixture order: task_index, task, cache, fingerprint,
        num_examples, features.
      matches: ``collect``'s sorted matches.
      counts: ``collect``'s counts of what was scanned.
      run: the run's parameters (seed, global_batch_size, hosts, ...), or None.
      seen: ``(task_index, cache_index) -> first_seen(...)`` for every example
        of ``matches`` (None without a run).
      before_step: N for the summary's ``items_seen_before_step``.
      max_matches: matches listed per item (its counts are whole).

    Returns:
      ``{"overlap_version", "benchmark", "caches", "run", "summary", "items"}``;
      ``items`` holds only the items with an overlap, in item order.
    """
    by_item: dict[int, list] = {}
    for m in matches:
        by_item.setdefault(int(m["item"]), []).append(m)
    records = [(m["source"], m["locator"], m["record_number"]) for m in matches]
    records += [(bench.items[i].path, bench.items[i].locator, bench.items[i].record_number) for i in by_item]
    where = record_locations(records)
    items = [_item_entry(bench.items[i], ms, where, caches, seen, max_matches) for i, ms in sorted(by_item.items())]
    summary = {
        "items": len(bench.items),
        "items_with_overlap": len(items),
        "too_short": len(bench.too_short),
        "empty": bench.empty,
        "overlapping_examples": len({(m["task_index"], m["cache_index"]) for m in matches}),
        "matches": len(matches),
        "before_step": before_step,
        "items_seen": None if seen is None else sum(1 for it in items if it["first_seen"] is not None),
        "items_seen_before_step": None if seen is None or before_step is None else sum(
            1 for it in items if it["first_seen"] is not None and it["first_seen"]["step"] < before_step),
        "scanned": dict(counts),
    }
    return {"overlap_version": OVERLAP_VERSION,
            "benchmark": dict(bench.describe(), too_short_items=list(bench.too_short)),
            "caches": [dict(c) for c in caches], "run": None if run is None else dict(run),
            "summary": summary, "items": items}


def _item_entry(item, ms: Sequence[Mapping], where: Mapping, caches: Sequence[Mapping], seen, max_matches: int):
    """One item of ``assemble``'s result, with its first ``max_matches`` matches."""
    examples = sorted({(m["task_index"], m["cache_index"]) for m in ms})
    first = None
    if seen is not None:
        firsts = [dict(seen[e], task_index=e[0], task=caches[e[0]]["task"], cache_index=e[1])
                  for e in examples if seen.get(e) is not None]
        first = min(firsts, key=lambda d: d["position"]) if firsts else None
    listed = []
    for m in ms[:max_matches]:
        entry = {"task_index": m["task_index"], "task": caches[m["task_index"]]["task"]}
        entry.update({k: m[k] for k in MATCH_KEYS if k not in ("item", "task_index")})
        entry["location"] = where.get((m["source"], m["locator"], m["record_number"]))
        if seen is not None:
            entry["first_seen"] = seen.get((m["task_index"], m["cache_index"]))
        listed.append(entry)
    return {"item": item.number, "source": item.path, "locator": item.locator,
            "record_number": item.record_number,
            "location": where.get((item.path, item.locator, item.record_number)), "text": item.text,
            "num_examples": len(examples), "num_matches": len(ms), "first_seen": first, "matches": listed}


def to_json_bytes(result: Mapping) -> bytes:
    """The result as UTF-8 JSON (indented, keys in a fixed order): the same bytes
    for the same scan on any runner."""
    return (json.dumps(result, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


# Columns of a Parquet result, one row per listed match: the item, the match
# (``_item_entry``'s keys, in order), then its example's first read.
_MATCH_COLUMNS = ("task_index", "task", "cache_index", "feature", "segment", "start", "end", "source_index", "source",
                  "locator", "record_number", "token_offset", "span", "ngram", "ngrams", "location")
_SEEN_COLUMNS = ("epoch", "ordinal", "position", "step", "row", "host", "host_row")
PARQUET_COLUMNS = ("item",) + _MATCH_COLUMNS + _SEEN_COLUMNS
_STRING_COLUMNS = {"task", "feature", "source", "locator", "span", "ngram", "location"}


def to_parquet_table(result: Mapping):
    """The result as a pyarrow Table: one row per listed match (``PARQUET_COLUMNS``;
    epoch .. host_row null without a run or for an example the run never
    reads), and the rest of the result (``items`` without their matches) as
    JSON under the schema's metadata key ``PARQUET_KEY``; ``read_result``
    puts the two back together."""
    rows: dict[str, list] = {c: [] for c in PARQUET_COLUMNS}
    for it in result["items"]:
        for m in it["matches"]:
            seen = m.get("first_seen") or {}
            rows["item"].append(it["item"])
            for c in _MATCH_COLUMNS:
                rows[c].append(m.get(c))
            for c in _SEEN_COLUMNS:
                rows[c].append(seen.get(c))
    schema = pa.schema([(c, pa.string() if c in _STRING_COLUMNS else pa.int64()) for c in PARQUET_COLUMNS])
    header = dict(result, items=[{k: v for k, v in it.items() if k != "matches"} for it in result["items"]])
    schema = schema.with_metadata({PARQUET_KEY: json.dumps(header, ensure_ascii=False).encode("utf-8")})
    return pa.table(rows, schema=schema)


def _matches_from_table(table, with_run: bool) -> dict[int, list]:
    """item -> its listed matches, from a Parquet result's rows."""
    out: dict[int, list] = {}
    for row in table.to_pylist():
        m = {c: row[c] for c in _MATCH_COLUMNS}
        if with_run:
            m["first_seen"] = None if row["epoch"] is None else {c: row[c] for c in _SEEN_COLUMNS}
        out.setdefault(row["item"], []).append(m)
    return out


def write_result(result: Mapping, path: str) -> None:
    """Writes the result to ``path``: JSON for ``.json``, Parquet for
    ``.parquet`` (``to_parquet_table``; either suffix in any case), atomically.

    Raises:
      ValueError: another suffix (names the path and the two forms).
    """
    if path.lower().endswith(".json"):
        fs.write_bytes_atomic(path, to_json_bytes(result))
    elif path.lower().endswith(".parquet"):
        with fs.atomic_path(path) as tmp:
            pq.write_table(to_parquet_table(result), tmp)
    else:
        raise ValueError(f"{path}: the output is a .json or a .parquet file")


def read_result(path: str) -> dict:
    """A result written by ``write_result``, as ``assemble`` gave it (from a
    Parquet file: its metadata, and each item's matches from the rows).

    Raises:
      ValueError: not a result of ``seqcache overlap`` (names the file).
    """
    if path.lower().endswith(".parquet"):
        table = pq.read_table(path)
        meta = table.schema.metadata or {}
        if PARQUET_KEY not in meta or tuple(table.column_names) != PARQUET_COLUMNS:
            raise ValueError(f"{path}: not an overlap result (no {PARQUET_KEY.decode()} metadata or other "
                             "columns); write one with seqcache overlap --output FILE.parquet")
        data = json.loads(meta[PARQUET_KEY])
        matches = _matches_from_table(table, data.get("run") is not None)
        for it in data.get("items", []):
            it["matches"] = matches.get(it["item"], [])
    else:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    if not isinstance(data, dict) or "overlap_version" not in data or "summary" not in data:
        raise ValueError(f"{path}: not an overlap result of seqcache overlap (no overlap_version/summary)")
    return data


# --- the whole scan ------------------------------------------------------------------


def caches_info(opened) -> list[dict]:
    """Per cache of an ``OpenedMixture``, in mixture order: task_index, task,
    cache, fingerprint, num_examples and the text features scanned."""
    return [{"task_index": t, "task": r.manifest.task, "cache": path, "fingerprint": r.fingerprint,
             "num_examples": r.num_examples, "features": text_features(r.manifest)}
            for t, (path, r) in enumerate(zip(opened.paths, opened.readers))]


def find_overlap(bench, opened, *, pipeline_args=None, scratch_parent: str | None = None, stream=None,
                 run: Mapping | None = None, before_step: int | None = None, max_matches: int = MAX_MATCHES,
                 unit_examples: int | None = None) -> dict:
    """Scans the caches of ``opened`` for ``bench``'s items and returns
    ``assemble``'s result.

    Args:
      bench: a ``Benchmark`` loaded with ``Benchmark.load(spec)`` (the workers
        load the same spec; its ``name`` is the spec).
      opened: the caches (``seqcache.feeders.stream.open_mixture``).
      pipeline_args: Beam pipeline options (none: the local engine).
      scratch_parent: a local folder for the scan's scratch folder (removed at
        the end); default: the system's temporary folder.
      stream: the run's ``IndexStream`` (``opened.stream(...)``), or None.
      run: the run's parameters; ``run["global_batch_size"]`` and
        ``run["hosts"]`` place the first reads. Needed with ``stream``.
      unit_examples: cache indices per work unit (default: ``UNIT_EXAMPLES``,
        fewer for a scan of under ``MIN_UNITS`` such units). Never changes
        the result.

    Raises:
      ValueError: no text feature in a cache (names it); a bad host count.
      RuntimeError: the runner lost work.
      seqcache.pipelines.runner.RunnerError: the runner could not start.
    """
    infos = caches_info(opened)
    for info in infos:
        if not info["features"]:
            raise ValueError(f"{info['cache']}: no token feature with a stored vocabulary to decode; the scan "
                             "reads text")
    if unit_examples is None:
        total = sum(r.num_examples for r in opened.readers)
        unit_examples = max(256, min(UNIT_EXAMPLES, -(-total // MIN_UNITS)))
    units = plan_units(opened.paths, [r.shard_starts for r in opened.readers],
                       fingerprints=[r.fingerprint for r in opened.readers], unit_examples=unit_examples)
    ref = BenchmarkRef(bench.name, n=bench.n, min_words=bench.min_words, fingerprint=bench.fingerprint)
    ref.keep(bench)  # a worker in this process (the local engine's default) uses this table, not a second one
    scratch = tempfile.mkdtemp(prefix=".overlap-", dir=scratch_parent)
    try:
        run_scan(units, ref, scratch_dir=scratch, pipeline_args=pipeline_args)
        matches, counts = collect(scratch, len(units))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seen = None
    if stream is not None:
        b, hosts = int(run["global_batch_size"]), int(run.get("hosts", 1))
        seen = {e: first_seen(stream, task=e[0], cache_index=e[1], global_batch_size=b, host_count=hosts)
                for e in sorted({(m["task_index"], m["cache_index"]) for m in matches})}
    return assemble(bench, infos, matches, counts, run=run, seen=seen, before_step=before_step,
                    max_matches=max_matches)
