"""Full verification of a cache on disk: counts, checksums and decodability.

``open``-time checks (``seqcache.format.check_shard_files``) are cheap: sizes and
presence. ``verify_cache`` reads every byte: each shard's sha256 (against the
manifest's shard checksum file), its record count and every record decoded
(token ids in [0, vocab_size)), the quarantine file against the manifest's
statistics, and the source table file against the manifest and the fingerprint; every problem names the file and the expected and actual value.
A cache at a URL (``gs://``, ``s3://``) is verified like a local one, each shard
downloaded to a temporary file, checked and deleted before the next one.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import numpy as np
from array_record.python.array_record_module import ArrayRecordReader

from seqcache import bounded_json
from seqcache import format as fmt
from seqcache import fs, layout


@dataclasses.dataclass
class ShardReport:
    file: str
    ok: bool
    problems: list[str]
    num_records: int | None = None


@dataclasses.dataclass
class VerifyReport:
    cache_dir: str
    ok: bool
    problems: list[str]
    shards: list[ShardReport]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def vocabulary_limits(manifest: fmt.Manifest) -> dict[str, int]:
    """feature -> ``vocabularies.<feature>.vocab_size`` for each record feature
    that has a vocabulary with a size: its token ids must lie in [0, size)."""
    names = {f.name for f in manifest.features}
    return {name: int(desc.vocab_size) for name, desc in manifest.vocabularies.items()
            if name in names and desc.vocab_size is not None}


def _out_of_vocabulary(path: str, start: int, decoded: list[dict], limits: dict[str, int]) -> str | None:
    """The first token id outside [0, vocab_size) in a batch of decoded records, as a problem line, or None."""
    for name, size in limits.items():
        arrays = [d[name] for d in decoded]
        if not arrays:
            continue
        flat = np.concatenate(arrays)
        bad = (flat >= size) | (flat < 0) if flat.dtype.kind == "i" else flat >= size
        if bad.any():
            first = int(np.argmax(bad))
            record = start + int(np.searchsorted(np.cumsum([len(a) for a in arrays]), first, side="right"))
            return (f"{path} record {record}: feature {name!r} holds token id {int(flat[first])}, outside the "
                    f"vocabulary's [0, {size}) (vocabularies.{name}.vocab_size in the manifest; {int(bad.sum())} "
                    f"such tokens in records {start}..{start + len(arrays) - 1}): the manifest or the shard was "
                    "edited or damaged; rebuild the cache")
    return None


def _check_file(cache_dir, name, num_bytes, sha256, num_records, features, decode_batch, listed,
                limits=None) -> ShardReport:
    try:  # nothing outside the cache is opened
        path = layout.cache_file(cache_dir, name, what="shard file")
    except layout.UnsafeCachePathError as e:
        return ShardReport(str(name), False, [str(e)])
    problems = []
    size = fs.size(path) if listed is None else listed.get(name)
    if size is None:
        return ShardReport(name, False, [f"{path}: missing (expected {num_bytes} bytes, {num_records} records)"])
    if size != num_bytes:
        problems.append(f"{path}: size {size} bytes, expected {num_bytes}")
    with fs.local_copy(path, suffix=f"-{name}") as local:
        actual_sha = fmt.file_sha256(local)
        if sha256 is not None and actual_sha != sha256:  # None: no readable checksum file (reported once)
            problems.append(f"{path}: sha256 {actual_sha}, expected {sha256}")
        count = None
        try:
            reader = ArrayRecordReader(local, "readahead_buffer_size:0")
        except Exception as e:  # the ArrayRecord library raises plain RuntimeError/ValueError
            problems.append(f"{path}: not a readable ArrayRecord file: {e}")
            return ShardReport(name, False, problems)
        try:
            count = reader.num_records()
            if count != num_records:
                problems.append(f"{path}: {count} records, expected {num_records}")
            for start in range(0, count, decode_batch):
                indices = list(range(start, min(count, start + decode_batch)))
                decoded = [fmt.decode_example(features, record, where=f"{path} record {i}")
                           for i, record in zip(indices, reader.read(indices))]
                bad = _out_of_vocabulary(path, start, decoded, limits) if limits else None
                if bad:
                    problems.append(bad)
                    limits = None  # the first per shard
        except fmt.CacheError as e:
            problems.append(str(e))
        except Exception as e:
            problems.append(f"{path}: cannot read records: {e}")
        finally:
            try:
                reader.close()
            except Exception as e:  # a corrupt file can fail again on close
                if not problems:
                    problems.append(f"{path}: corrupt ArrayRecord file: {e}")
    return ShardReport(name, not problems, problems, count)


def verify_cache(cache_dir: str, *, decode_batch: int = 1024) -> VerifyReport:
    """Verifies every shard of the cache at ``cache_dir`` (a local path or a URL).

    Returns:
      A ``VerifyReport`` whose ``problems`` name each bad file with the expected
      and actual value (size, sha256, record count, the undecodable record, the
      first record per shard with a token id >= its feature's vocab_size, the
      shard checksum file), and each disagreement of the quarantine file
      (``check_quarantine``) and of the source table (``check_source_table``)
      with the manifest.

    Raises:
      CacheError / IncompleteCacheError: the manifest is missing or invalid.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached or
        refused a request.
    """
    # Every field, the features its fields name, every shard's entry and its sizes against its records.
    manifest = fmt.read_manifest(cache_dir, check_shards=True)
    manifest_path = fs.join(cache_dir, fmt.MANIFEST_NAME)
    # One listing of an object-store folder gives every size (one request per file otherwise).
    listed = None if fs.is_local(cache_dir) else fs.sizes_in(cache_dir)
    checksum_problems = []
    try:
        sha256, provenance_sha256 = fmt.read_shard_checksums(cache_dir, manifest)
    except fmt.CacheError as e:
        # Sizes, counts and records are still checked; the checksums cannot be.
        checksum_problems.append(f"{e}; the shards' checksums were not compared")
        sha256 = provenance_sha256 = [None] * len(manifest.shards)
    limits = vocabulary_limits(manifest)
    shards = []
    for i, s in enumerate(manifest.shards):
        shards.append(_check_file(cache_dir, s.file, s.num_bytes, sha256[i], s.num_records, manifest.features,
                                  decode_batch, listed, limits))
        shards.append(
            _check_file(cache_dir, s.provenance_file, s.provenance_num_bytes, provenance_sha256[i], s.num_records,
                        fmt.PROVENANCE_FEATURES, decode_batch, listed)
        )
    problems = checksum_problems + [p for s in shards for p in s.problems]
    for name, desc in manifest.vocabularies.items():
        if desc.file is None:
            if desc.kind in ("sentencepiece", "hf_tokenizer"):
                what = "SentencePiece" if desc.kind == "sentencepiece" else "tokenizer.json"
                problems.append(f"{manifest_path}: the {what} vocabulary of feature {name!r} names no model file")
            continue
        try:  # nothing outside the cache is opened
            path = layout.cache_file(cache_dir, desc.file, what=f"vocabulary model of feature {name!r}")
        except layout.UnsafeCachePathError as e:
            problems.append(str(e))
            continue
        if not fs.isfile(path):
            problems.append(f"{path}: vocabulary file of feature {name!r} is missing (or not a file)")
        elif desc.sha256:
            with fs.open_read(path) as f:  # streamed (a local file or a URL)
                actual = hashlib.file_digest(f, "sha256").hexdigest()
            if actual != desc.sha256:
                problems.append(f"{path}: vocabulary model of feature {name!r} has sha256 {actual}, "
                                f"the manifest expects {desc.sha256}")
    problems.extend(check_quarantine(cache_dir, manifest))
    problems.extend(check_source_table(cache_dir, manifest))
    return VerifyReport(cache_dir, not problems, problems, shards)


def check_source_table(cache_dir: str, manifest: fmt.Manifest) -> list[str]:
    """Checks the source table against the manifest: its file's size and
    sha256 as ``source_table`` records them and its columns
    (``seqcache.format.read_source_table``); the fingerprint recomputed from
    ``fingerprint_inputs`` with the part the file holds put back (opening a
    cache cannot check it); its examples per file adding up to
    ``statistics.source_examples``.

    Returns:
      The problems, each naming the file and the expected and actual value
      (empty when all is well).
    """
    try:
        table = manifest.read_source_table(cache_dir)
    except fmt.CacheError as e:
        return [f"{e}; the source table's file list and the fingerprint were not checked"]
    record = manifest.source_table
    where = fs.join(cache_dir, fmt.MANIFEST_NAME if record is None else record.file)
    problems = []
    if record is not None and record.fingerprint_files:
        actual = fmt.fingerprint_of(manifest.full_fingerprint_inputs(cache_dir))
        if actual != manifest.fingerprint:
            problems.append(f"{where}: the sha256 of fingerprint_inputs with this file's fingerprint_files is "
                            f"{actual}, the manifest's fingerprint is {manifest.fingerprint}: the file or the "
                            "manifest was edited or damaged; rebuild the cache")
    per_file = table.statistics
    total = manifest.statistics.source_examples
    if per_file is not None and isinstance(total, int) and sum(per_file["examples"]) != total:
        problems.append(f"{where}: its examples per source file add up to {sum(per_file['examples']):,}, the "
                        f"manifest's statistics.source_examples is {total:,}")
    return problems


_MAX_BAD_LINES = 5


def check_quarantine(cache_dir: str, manifest: fmt.Manifest) -> list[str]:
    """Checks the quarantine file against the manifest: it exists when the
    manifest names one (else no record is counted skipped, replaced or
    excluded); its size and sha256 match ``quarantine_num_bytes`` /
    ``quarantine_sha256`` where recorded; every line is a JSON object whose
    ``action`` is ``"skipped"`` (also a line without one), ``"replaced"`` or
    ``"excluded"``; the entries per action equal ``statistics.<action>_records``
    (absent: 0), per action and kind ``statistics.bad_input_records`` (when the
    totals agree), and the excluded ones per benchmark
    ``statistics.excluded_by_benchmark``.

    Returns:
      The problems, each naming the file and the expected and actual value
      (empty when all is well). Reads the file once, streaming.
    """
    manifest_path = fs.join(cache_dir, fmt.MANIFEST_NAME)
    problems: list[str] = []
    declared = {action: getattr(manifest.statistics, key) or 0 for action, key in _QUARANTINE_COUNTS}
    name = manifest.quarantine
    if name is None:
        if any(declared.values()):
            problems.append(
                f"{manifest_path}: statistics count {declared['skipped']} skipped and {declared['replaced']} replaced "
                f"records{_and_excluded(declared)}, but the manifest names no quarantine file (quarantine is null)"
            )
        return problems
    try:  # nothing outside the cache is opened
        path = layout.cache_file(cache_dir, name, what="quarantine file")
    except layout.UnsafeCachePathError as e:
        problems.append(str(e))
        return problems
    if not fs.isfile(path):
        problems.append(
            f"{path}: quarantine file is missing (the manifest names it, for {declared['skipped']} skipped and "
            f"{declared['replaced']} replaced records{_and_excluded(declared)})"
        )
        return problems
    scan = _scan_quarantine(path, problems)
    problems.extend(_quarantine_differences(path, manifest, declared, scan))
    return problems


def _and_excluded(declared: dict[str, int]) -> str:
    """``" and N excluded"`` for a manifest that counts excluded records, else ``""``."""
    return f" and {declared['excluded']} excluded" if declared.get("excluded") else ""


_QUARANTINE_COUNTS = (("skipped", "skipped_records"), ("replaced", "replaced_records"),
                      ("excluded", "excluded_records"))


@dataclasses.dataclass
class _QuarantineScan:
    """What one streaming read of a quarantine file found."""

    counts: collections.Counter  # action -> entries
    by_kind: dict[str, collections.Counter]  # action -> kind -> entries
    sha256: str
    num_bytes: int


def _scan_quarantine(path: str, problems: list[str]) -> _QuarantineScan:
    """Reads the quarantine file once; lines that are not entries are appended to ``problems``."""
    counts: collections.Counter = collections.Counter()
    by_kind: dict[str, collections.Counter] = {action: collections.Counter() for action, _ in _QUARANTINE_COUNTS}
    digest = hashlib.sha256()
    num_bytes = 0
    bad = 0
    with fs.open_read(path) as f:
        for number, line in enumerate(f, start=1):
            digest.update(line)
            num_bytes += len(line)
            if not line.strip():
                continue
            try:
                entry = bounded_json.loads(line, path=path, error=ValueError, what="quarantine entry")
                action = entry.get("action", "skipped")
            except (ValueError, AttributeError):
                entry, action = None, None
            if action not in by_kind:
                bad += 1
                if bad <= _MAX_BAD_LINES:
                    shown = line[:80].decode("utf-8", "replace").rstrip("\n")
                    problems.append(f"{path}: line {number} is not a quarantine entry with action 'skipped', "
                                    f"'replaced' or 'excluded': {shown!r}")
                continue
            counts[action] += 1
            kinds = entry.get("benchmarks") if action == "excluded" else str(entry.get("kind") or "").split(",")
            for kind in kinds if isinstance(kinds, list) else ["(no benchmarks)"]:  # a repair lists its kinds
                if kind:
                    by_kind[action][str(kind)] += 1
    if bad > _MAX_BAD_LINES:
        problems.append(f"{path}: {bad - _MAX_BAD_LINES} more lines that are not quarantine entries")
    return _QuarantineScan(counts=counts, by_kind=by_kind, sha256=digest.hexdigest(), num_bytes=num_bytes)


def _quarantine_differences(path: str, manifest: fmt.Manifest, declared: dict[str, int],
                            scan: _QuarantineScan) -> list[str]:
    """Where the scanned quarantine file differs from the manifest."""
    problems = []
    expected_bytes = manifest.quarantine_num_bytes
    if expected_bytes is not None and expected_bytes != scan.num_bytes:
        problems.append(f"{path}: size {scan.num_bytes} bytes, expected {expected_bytes}")
    expected_sha = manifest.quarantine_sha256
    if expected_sha is not None and expected_sha != scan.sha256:
        problems.append(f"{path}: sha256 {scan.sha256}, expected {expected_sha}")
    counts = scan.counts
    for action, key in _QUARANTINE_COUNTS:
        if counts[action] != declared[action]:
            problems.append(
                f"{path}: {counts[action]} entries with action {action!r}, the manifest's statistics.{key} "
                f"is {declared[action]}"
            )
    per_kind = manifest.statistics.bad_input_records
    if per_kind is not None:  # absent in caches written before it was recorded
        for action in ("skipped", "replaced"):
            expected = getattr(per_kind, action) or {}
            found = dict(sorted(scan.by_kind[action].items()))
            if found != expected and counts[action] == declared[action]:  # else the totals said it
                problems.append(f"{path}: entries with action {action!r} per kind {found}, the manifest's "
                                f"statistics.bad_input_records.{action} is {expected}")
    per_benchmark = manifest.statistics.excluded_by_benchmark
    found = dict(sorted(scan.by_kind["excluded"].items()))
    if isinstance(per_benchmark, dict) and {k: v for k, v in per_benchmark.items() if v} != found:
        problems.append(f"{path}: excluded entries per benchmark {found}, the manifest's "
                        f"statistics.excluded_by_benchmark is {per_benchmark}")
    return problems
