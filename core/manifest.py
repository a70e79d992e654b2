"""The manifest model: the one definition of manifest.json, of
shard-checksums.json and of source-table.json, and the one place that reads,
checks and writes them.

- The fields: the ``msgspec.Struct`` ``Manifest``, its attributes in the order
  they are written; each nested object is a Struct of its own, in
  ``seqcache.manifest_entries`` (``Feature``, ``Shards``, ``Vocabulary``,
  ``Statistics``, ...), bounds and descriptions in ``msgspec.Meta``. Keys a definition does not list are allowed everywhere (and
  ignored). An optional field a manifest lacks has the attribute's default
  (None, or an empty container).
- Reading: ``Manifest.read`` and ``Manifest.parse`` check the format and its
  version, then every field (``manifest_entries.convert``), then the counts and the
  fingerprint, and give a typed ``Manifest``. Every failure is one
  ``CacheError`` line naming the file and the field path
  (``manifest.json: statistics.tokens is 'x': expected `object```).
- Writing: ``Manifest.create`` assembles a build's manifest (refusing a field
  the definition lacks, and any manifest ``parse`` would refuse; the
  per-file source table goes to its own file, ``seqcache.source_table``);
  ``Manifest.write`` writes the shard checksum file, the source table file,
  then manifest.json, each atomically.
- The source table (format version 3): ``Manifest.read_source_table``
  (``seqcache.source_table``) reads and checks it, only when asked.
- The JSON Schema: ``json_schema()``, generated from the Structs by
  ``msgspec.json.schema_components`` and published as ``manifest.schema.json``
  beside this module (``python -m seqcache.manifest --write`` regenerates it,
  ``--check`` compares).
"""

import contextlib
import datetime
import hashlib
import json
import os
import sys
from typing import Annotated, Any, Literal, Mapping, Sequence

import msgspec
import numpy as np
from msgspec import Struct

from seqcache import __version__, bounded_json, codec, fs, layout, process
from seqcache.codec import (MANIFEST_NAME, SHARD_CHECKSUMS_NAME, SOURCE_TABLE_NAME, CacheError, IncompleteCacheError,
                            ShardTable)
from seqcache.manifest_entries import (MAX_SHARD_RECORDS, Count, Evaluation, Feature, Int64, Sha256, ShardChecksums,
                                       Sharding, Shards, Source, SourceTableFile, SourceTableRecord, Statistics,
                                       TokenCount, Vocabulary, Work, convert, doc)
from seqcache.source_table import SourceTable, detach_source_table, inputs_sha256, read_source_table, with_value_at

SCHEMA_NAME = "manifest.schema.json"
_short = bounded_json.short


class Manifest(Struct, kw_only=True, dict=True, repr_omit_defaults=True):
    """manifest.json of one cache: the typed model, and the one definition of
    its fields, in the order they are written. An optional field a manifest
    lacks has the attribute's default. ``shards`` is read as a
    ``codec.ShardTable``.

    Attributes beyond the fields:
      shard_checksums: (a manifest from ``create``) the bytes of its shard
        checksum file, which ``write`` writes beside it; None when read.
      source_table_bytes: (from ``create``) the bytes of its source table file.
      cache_dir: (from ``read``) the folder it was read from.
    """

    format: Annotated[Literal[codec.FORMAT_NAME], doc("the format's name")]
    format_version: Annotated[Literal[codec.READ_FORMAT_VERSIONS], doc(
        "the version of the cache as a whole: what a reader must understand")]
    task: Annotated[str, doc("the task's name")]
    split: Annotated[str, doc("the split's name")]
    fingerprint: Annotated[str, doc("sha256 of the canonical JSON of fingerprint_inputs")]
    seed: Annotated[Int64, doc("the shuffle seed")] = None
    sequence_length: Annotated[dict[str, TokenCount | None] | None, doc(
        "feature -> tokens, or null (an int, which manifests of earlier releases may hold, is read as every "
        "feature's)")] = None
    packing: Annotated[Literal["lm", "first_fit"] | None, doc("the packing: lm, first_fit or null")] = None
    writer_options: Annotated[str, doc("the ArrayRecord writer options")] = None
    record_encoding: Annotated[str, doc("the record encoding, for humans")] = None
    features: Annotated[tuple[Feature, ...], doc("the record features, in record order")]
    vocabularies: Annotated[dict[str, Vocabulary], doc("feature -> its vocabulary: kind, vocab_size, extra_ids, "
                                                         "...")] = {}
    num_examples: Annotated[Count, doc("total examples (records); absent: the shard table's total")] = None
    shards: Annotated[ShardTable, doc("the shard table: the shard count and one column per shard field", 2)]
    statistics: Annotated[Statistics, doc("counts of the build: examples, tokens, lengths, bad input")] = \
        msgspec.field(default_factory=Statistics)
    sources: Annotated[list[Source], doc("(format version 2) the source file table, indexed by a provenance "
                                          "record's source_index; version 3 keeps it in source_table's file")] = []
    source_table: Annotated[SourceTableRecord, doc("the source table file: per source file its path, size, mtime, "
                                                    "locator, examples and tokens (read only by what needs them)",
                                                    3)] = None
    fingerprint_inputs: Annotated[dict[str, Any], doc("what the fingerprint is computed from")] = None
    created: Annotated[str, doc("when it was written, ISO 8601, UTC")] = None
    seqcache_version: Annotated[str, doc("the seqcache release that wrote it")] = None
    quarantine: Annotated[Literal[codec.QUARANTINE_NAME] | None, doc(
        "quarantine.jsonl when records were skipped, repaired or excluded, else null")] = None
    quarantine_num_bytes: Annotated[Count | None, doc("the quarantine file's size (bytes)")] = None
    quarantine_sha256: Annotated[Sha256 | None, doc("the quarantine file's sha256, hex")] = None
    sharding: Annotated[Sharding, doc("how the build chose its shard count")] = None
    evaluation: Annotated[Evaluation | None, doc("the task's metrics and postprocess function, or null for a "
                                                  "task without", 3)] = None
    work: Annotated[Work, doc("what the build's work folder gave it: units and shards reused (absent: a build "
                               "that kept no work)", 3)] = None

    shard_checksums = None  # (not fields) set by create and read
    source_table_bytes = None
    cache_dir = None
    _sources = None
    _text = None

    def __reduce__(self):  # pickled (a feeder's worker processes) with the attributes beyond the fields
        return _restore, (type(self), msgspec.structs.asdict(self), dict(self.__dict__))

    def __copy__(self):
        return _restore(type(self), msgspec.structs.asdict(self), dict(self.__dict__))

    def __repr__(self) -> str:  # the statistics and tables are too long to print
        return (f"Manifest(task={self.task!r}, split={self.split!r}, fingerprint={self.fingerprint!r}, "
                f"features={self.features!r}, shards={self.shards!r})")

    @property
    def num_sources(self) -> int:
        """The source files of the cache (files), from the manifest alone:
        ``source_table.num_files``, or the length of an inline ``sources``."""
        if self.source_table is not None:
            return int(self.source_table.num_files)
        return len(self.sources)

    def read_source_table(self, cache_dir: str | None = None) -> "SourceTable":
        """The per-file source table (``read_source_table``), read once and
        kept: from the source table file of ``cache_dir`` (default: the folder
        this manifest was read from), or from the manifest itself for a cache
        that keeps it inline (format version 2). Opening a cache never calls it.

        Raises:
          CacheError: as ``read_source_table``; ValueError: a manifest neither
            read from a folder nor given one, whose table lies in a file.
        """
        if self._sources is None:
            folder = cache_dir if cache_dir is not None else self.cache_dir
            if folder is None and self.source_table is not None:
                raise ValueError("this manifest was not read from a cache folder: give read_source_table(cache_dir)")
            self._sources = read_source_table(folder, self)
        return self._sources

    def full_fingerprint_inputs(self, cache_dir: str | None = None) -> dict | None:
        """``fingerprint_inputs`` as hashed: with the value the source table
        file holds (``source_table.fingerprint_files``) put back in its place,
        which reads that file; the inputs as recorded when nothing was moved."""
        inputs = self.fingerprint_inputs
        keys = self.source_table.fingerprint_files if self.source_table is not None else None
        if inputs is None or not keys:
            return inputs
        return with_value_at(inputs, keys, self.read_source_table(cache_dir).fingerprint_value())

    @property
    def shard_starts(self) -> np.ndarray:
        """int64 array (num_shards + 1,), read-only: global index of each shard's
        first record, then the total."""
        return self.shards.starts

    @classmethod
    def parse(cls, raw: Any, *, path: str = MANIFEST_NAME, check_shards: bool = True) -> "Manifest":
        """Checks a decoded manifest.json: its ``format`` and
        ``format_version``, the required fields, then every field against the
        model (``msgspec.convert``, strict: no coercion), then its counts
        (``num_examples`` and ``statistics.examples`` against the shard table;
        with ``check_shards``, each shard's byte sizes against its records)
        and its fingerprint (``check_fingerprint``). Cost: O(number of shards)
        in numpy operations.

        Args:
          raw: the decoded manifest.json.
          path: the manifest's path, for messages.
          check_shards: decode and check the shard byte-size columns now (else
            each shard's sizes at its first read: what ``read`` does).

        Raises:
          CacheError: ``{path}: ...`` naming the first bad field: not an object;
            wrong format or format_version (a version-1 cache is refused with
            the advice to rebuild it); a required field missing (``missing
            field 'task'``); a field of the wrong JSON type or value
            (``statistics.tokens.targets is -1: expected `int` >= 0``);
            counts or a fingerprint that contradict each other.
        """
        codec.require(isinstance(raw, dict), path, "manifest is not a JSON object")
        fmt_name, version = raw.get("format"), raw.get("format_version")
        codec.require(fmt_name == codec.FORMAT_NAME, path,
                      f"format is {_short(fmt_name)}, expected {codec.FORMAT_NAME!r}")
        codec.require(version in codec.READ_FORMAT_VERSIONS and not isinstance(version, bool), path,
                      f"format_version is {_short(version)}, this seqcache reads format version "
                      f"{' or '.join(map(str, codec.READ_FORMAT_VERSIONS))}: read the cache with the seqcache "
                      "release that wrote it, or rebuild it with this one (seqcache build ... --overwrite)")
        for f in msgspec.structs.fields(cls):
            codec.require(not f.required or f.name in raw, path, f"missing field {f.name!r}")
        manifest = convert(_lengths_as_mapping(raw), cls, path=path)
        if check_shards:
            manifest.shards.check_all()
        _check_counts(manifest, path, check_shards=check_shards)
        check_fingerprint(manifest, path)
        check_feature_names(manifest, path)
        manifest.num_examples = int(manifest.shards.starts[-1])
        return manifest

    def check_shards(self, path: str | None = None) -> None:
        """The checks ``parse`` leaves to each shard's first read when
        ``check_shards`` is False (what ``read`` does): every shard entry
        decoded and checked, and each uncompressed shard's byte sizes against
        its records (``check_shard_sizes``). What ``seqcache verify``,
        ``info``, ``show`` and ``report`` check before they say anything of a
        cache. Cost: O(number of shards) in numpy operations.

        Raises:
          CacheError: naming ``path`` (default: the manifest's file), the shard and both values.
        """
        if path is None:
            path = MANIFEST_NAME if self.cache_dir is None else fs.join(self.cache_dir, MANIFEST_NAME)
        self.shards.check_all()
        _check_counts(self, path, check_shards=True)

    @classmethod
    def read(cls, cache_dir: str, *, check_shards: bool = False) -> "Manifest":
        """Reads ``cache_dir/manifest.json`` (a local path or a URL) through
        ``seqcache.bounded_json`` and ``parse``-s it (by default with
        ``check_shards=False``: opening a cache does not decode every shard's
        entry; ``check_shards=True`` is what the commands that describe a
        cache read it with).

        Raises:
          IncompleteCacheError: there is no manifest (an unfinished build, a
            task folder, or not a cache), naming what to give instead.
          CacheError: the manifest is not valid JSON or not a valid manifest.
          seqcache.fs.FileSystemError: (URLs) the object store cannot be reached
            or refused the request.
        """
        path = fs.join(cache_dir, MANIFEST_NAME)
        if not fs.exists(path):
            if not fs.isdir(cache_dir):
                raise IncompleteCacheError(f"{cache_dir}: no such cache folder{_siblings(cache_dir)}")
            splits = [] if fs.is_url(cache_dir) else _split_folders(cache_dir)
            if splits:
                raise IncompleteCacheError(
                    f"{cache_dir}: no {MANIFEST_NAME} here; this is a task folder (CACHE_DIR/<task>) holding the "
                    f"split cache(s) {', '.join(splits)}: give one, e.g. {fs.join(cache_dir, splits[0])}")
            raise IncompleteCacheError(
                f"{cache_dir}: no {MANIFEST_NAME}: the cache is incomplete (an unfinished or failed build) "
                "or this is not a cache folder; re-run the build")
        raw = bounded_json.read_file(path, error=CacheError, what="manifest")
        manifest = cls.parse(raw, path=path, check_shards=check_shards)
        manifest.cache_dir = cache_dir
        return manifest

    @classmethod
    def create(cls, *, shards: Sequence[Mapping[str, Any]], features: Sequence[Mapping[str, Any]],
               sequence_length: Mapping[str, int] | None = None, fingerprint_known: bool = False,
               **fields: Any) -> "Manifest":
        """The manifest of a build, not yet written: ``fields`` (the fields the
        build knows: ``task``, ``split``, ``fingerprint``, ``sources``, ...)
        with the format's own (``format``, ``format_version``,
        ``writer_options``, ``record_encoding``, ``num_examples``, ``created``,
        ``seqcache_version``), in definition order. ``shards`` are
        ``seqcache.pipelines.writer.write_shard``'s entries in shard order:
        they become the shard table and the shard checksum file
        (``shard_checksums``). ``features`` and ``sharding`` may hold only the
        keys their definitions list. The text written (``to_json``) keeps the
        key order of the values given inside each nested object.

        The per-file source table leaves the manifest for the source table
        file (``source_table_bytes``, written by ``write``; format version 3):
        ``sources``, ``statistics.source_files`` and, when
        ``fingerprint_inputs`` has one, its ``task.source.files`` (the
        fingerprint stays the sha256 of the inputs with it). So the manifest's
        size does not grow with the file count. ``fingerprint_known``: the
        caller computed ``fingerprint`` as ``codec.fingerprint_of`` of this
        very ``fingerprint_inputs`` object (a build, which hashed them when it
        planned): it is not hashed again (the canonical JSON of a 50,000-file
        list takes about 0.05 s).

        Raises:
          ValueError: a field the definition lacks, a required field missing,
            or shard entries out of shard order or with a malformed count.
          CacheError: the manifest would not pass ``parse`` (never write what
            the readers refuse); a ``fingerprint`` that is not the sha256 of
            ``fingerprint_inputs``; a source table whose columns disagree.
        """
        table, checksums = shard_table(shards)
        fields = dict(fields)
        sources, sources_bytes = detach_source_table(fields, fingerprint_known=fingerprint_known)
        values = {
            "format": codec.FORMAT_NAME, "format_version": codec.FORMAT_VERSION,
            "sequence_length": dict(sequence_length) if sequence_length else None,
            "writer_options": codec.WRITER_OPTIONS,
            "record_encoding": "features in manifest order; each a little-endian uint32 count then the elements, "
                               "little-endian",
            "features": [ordered(f, Feature, what=f"features[{i}]") for i, f in enumerate(features)],
            "num_examples": int(sum(int(s["num_records"]) for s in shards)), "shards": table,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seqcache_version": __version__, **fields}
        if "sharding" in values:
            values["sharding"] = ordered(values["sharding"], Sharding, what="sharding")
        if values.get("work") is not None:
            values["work"] = ordered(values["work"], Work, what="work")
        values = ordered(values, cls)
        manifest = cls.parse(values)
        manifest._text = json.dumps(values, indent=2, ensure_ascii=False) + "\n"
        manifest.shard_checksums = checksums
        manifest.source_table_bytes = sources_bytes
        manifest._sources = sources
        return manifest

    def to_json(self) -> str:
        """manifest.json's text (a manifest from ``create``): the fields in
        definition order, indented by 2, and a newline.

        Raises:
          ValueError: a manifest that was read, not made by ``create``.
        """
        if self._text is None or self.shard_checksums is None or self.source_table_bytes is None:
            raise ValueError("only a manifest from Manifest.create is written (this one was read)")
        return self._text

    def write(self, cache_dir: str) -> None:
        """Writes the shard checksum file, the source table file, then
        manifest.json, each atomically
        (``seqcache.fs.write_bytes_atomic``): the last step of every build, so a
        build killed before it leaves no folder that looks complete (G7).

        Raises:
          ValueError: a manifest that was read, not made by ``create``.
        """
        try:
            text = self.to_json()
        except ValueError as e:
            raise ValueError(f"{cache_dir}: {e}") from None
        fs.write_bytes_atomic(fs.join(cache_dir, SHARD_CHECKSUMS_NAME), self.shard_checksums)
        fs.write_bytes_atomic(fs.join(cache_dir, SOURCE_TABLE_NAME), self.source_table_bytes)
        process.fault_point("manifest")
        fs.write_bytes_atomic(fs.join(cache_dir, MANIFEST_NAME), text.encode("utf-8"))


def _restore(cls: type, fields: dict, attributes: dict) -> Manifest:
    """``Manifest.__reduce__``'s inverse."""
    manifest = cls(**fields)
    manifest.__dict__.update(attributes)
    return manifest


def ordered(values: Mapping[str, Any], model: type, *, what: str = "manifest") -> dict:
    """The JSON object of ``values``, its keys in the order of ``model``'s
    fields (a Struct). A field given as None is written as null; a field not
    given is not written.

    Raises:
      ValueError: a key that is not among the fields, or a required field
        missing; naming ``what``.
    """
    fields = msgspec.structs.fields(model)
    names = [f.encode_name for f in fields]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ValueError(f"{what} field(s) {unknown} are not in the manifest schema (core/manifest.py): "
                         f"add them there first (known: {', '.join(names)})")
    missing = [f.encode_name for f in fields if f.required and f.encode_name not in values]
    if missing:
        raise ValueError(f"{what} lacks the required field(s) {missing}")
    return {n: values[n] for n in names if n in values}


def _siblings(cache_dir: str) -> str:
    """``; TASK_FOLDER holds the split(s) a, b`` for a missing local split
    folder whose task folder holds other splits; empty otherwise."""
    if fs.is_url(cache_dir):
        return ""
    parent = os.path.dirname(os.path.normpath(cache_dir))
    splits = _split_folders(parent) if parent else []
    if not splits:
        return ""
    return f"; {parent} holds the split{'s' if len(splits) > 1 else ''} {', '.join(splits)}"


def _split_folders(folder: str) -> list[str]:
    """The names of the local ``folder``'s subfolders that hold a manifest, sorted."""
    with contextlib.suppress(OSError):
        return [n for n in sorted(os.listdir(folder)) if os.path.isfile(os.path.join(folder, n, MANIFEST_NAME))]
    return []


def shard_table(shards: Sequence[Mapping[str, Any]]) -> tuple[dict, bytes]:
    """The manifest's ``shards`` for ``write_shard``'s entries, in shard order
    (the shard count, ``codec.encode_int_column`` columns, the size and sha256
    of the shard checksum file), and the bytes of that file.

    Raises:
      ValueError: an entry is not shard i's (its file names are not
        ``codec.shard_name(prefix, i, len(shards))``), or a count, size or
        checksum is malformed.
    """
    count = len(shards)
    for i, s in enumerate(shards):
        for key, prefix in (("file", codec.DATA_PREFIX), ("provenance_file", codec.PROVENANCE_PREFIX)):
            if s.get(key) != codec.shard_name(prefix, i, count):
                raise ValueError(f"shard entry {i} of {count} names {key} {s.get(key)!r}, expected "
                                 f"{codec.shard_name(prefix, i, count)!r} (entries must be in shard order)")
        for key in codec.INT_FIELDS:
            if not codec.is_count(s.get(key)):
                raise ValueError(f"shard entry {i}: {key} is {s.get(key)!r}, expected an integer >= 0")
    checksums = shard_checksums_json([s["sha256"] for s in shards], [s["provenance_sha256"] for s in shards])
    table = ordered(model=Shards, values={
        "num_shards": count, "encoding": codec.INT_COLUMN_ENCODING,
        **{key: codec.encode_int_column([s[key] for s in shards]) for key in codec.INT_FIELDS},
        "checksums": {"file": SHARD_CHECKSUMS_NAME, "num_bytes": len(checksums),
                      "sha256": hashlib.sha256(checksums).hexdigest()}}, what="shards")
    return table, checksums


def shard_checksums_json(sha256: Sequence[str], provenance_sha256: Sequence[str]) -> bytes:
    """The bytes of ``SHARD_CHECKSUMS_NAME``: one JSON object ``{"num_shards":
    S, "sha256": [...], "provenance_sha256": [...]}`` (hex sha256 of data shard
    i and of provenance shard i at position i), UTF-8, one line and a newline:
    as deterministic as the shards.

    Raises:
      ValueError: the two lists differ in length or hold something other than
        64 hex digits.
    """
    sha256, provenance_sha256 = list(sha256), list(provenance_sha256)
    if len(sha256) != len(provenance_sha256):
        raise ValueError(f"{len(sha256)} data shard checksums but {len(provenance_sha256)} provenance ones")
    for key, values in (("sha256", sha256), ("provenance_sha256", provenance_sha256)):
        for i, v in enumerate(values):
            if not (isinstance(v, str) and codec.SHA256_RE.fullmatch(v)):
                raise ValueError(f"shard {i}: {key} is {v!r}, expected 64 hex digits")
    obj = ordered({"num_shards": len(sha256), "sha256": sha256, "provenance_sha256": provenance_sha256},
                  ShardChecksums, what=SHARD_CHECKSUMS_NAME)
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode("utf-8")


def read_shard_checksums(cache_dir: str, manifest: Manifest) -> tuple[list[str], list[str]]:
    """Every shard's recorded checksums: (sha256 of each data shard, sha256 of
    each provenance shard), hex, in shard order, from ``SHARD_CHECKSUMS_NAME``
    (a local path or a URL), after checking that file's byte size and sha256
    against the manifest's ``shards.checksums``. Opening a cache never reads it.

    Raises:
      CacheError: the checksum file is missing, has another size or sha256 than
        the manifest records, or is not a checksum list of this cache's shards;
        naming the file, the expected and the actual value.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    table = manifest.shards
    recorded = table.checksums
    path, data = layout.read_recorded_file(cache_dir, recorded, "shard checksum file")
    obj = bounded_json.loads(data, path=path, error=CacheError, what="shard checksum file")
    try:
        sha, prov = obj["sha256"], obj["provenance_sha256"]
        shard_checksums_json(sha, prov)  # the same checks as when it was written
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: not a shard checksum file: {bounded_json.short(e)}") from None
    if obj.get("num_shards") != len(sha):
        raise CacheError(f"{path}: num_shards = {bounded_json.short(obj.get('num_shards'))}, but it lists "
                         f"{len(sha)} shard checksums")
    if len(sha) != len(table):
        raise CacheError(f"{path}: {len(sha)} shard checksums, the manifest has {len(table)} shards")
    return sha, prov


def _lengths_as_mapping(raw: dict) -> dict:
    """``raw`` (a decoded manifest.json, not changed) with an int
    ``sequence_length``, which manifests of earlier releases may hold, as the
    mapping it meant: that length for every feature of ``features`` (as
    ``seqcache.lengths.built_lengths`` read it). The one place a manifest's
    int is read; the model then checks each length (``TokenCount``)."""
    value = raw.get("sequence_length")
    if isinstance(value, bool) or not isinstance(value, int):
        return raw
    features = raw.get("features")
    names = [f.get("name") for f in features if isinstance(f, dict)] if isinstance(features, list) else []
    return {**raw, "sequence_length": {n: value for n in names if isinstance(n, str)}}


def check_feature_names(manifest: Manifest, path: str) -> None:
    """Refuses a manifest whose fields name a feature it does not have: the
    keys of ``sequence_length``, of ``vocabularies``, of the
    per-feature statistics (``statistics.tokens``, ``max_length``,
    ``mean_length``, ``length_histogram``, ``source_files.tokens``). A build
    writes each of them for its features only; an edited or damaged manifest
    that contradicts its ``features`` would otherwise reach every reader (a
    length for no feature, a million vocabularies to load). Cost: one set
    look-up a key (``bounded_json.MAX_KEYS`` at most a field).

    Raises:
      CacheError: one line naming the manifest, the field, the first unknown
        feature (and how many more) and the features the cache has.
    """
    names = {f.name for f in manifest.features}
    stats = manifest.statistics
    fields = (("sequence_length", manifest.sequence_length),
              ("vocabularies", manifest.vocabularies), ("statistics.tokens", stats.tokens),
              ("statistics.max_length", stats.max_length), ("statistics.mean_length", stats.mean_length),
              ("statistics.length_histogram", stats.length_histogram),
              ("statistics.source_files.tokens", stats.source_files.tokens if stats.source_files else None))
    for field, keys in fields:
        unknown = [k for k in keys or () if k not in names]
        if unknown:
            more = f" (and {len(unknown) - 1:,} more)" if len(unknown) > 1 else ""
            raise CacheError(f"{path}: {field} names the feature {_short(unknown[0])}{more}, which the cache does "
                             f"not have (its features: {_short(sorted(names))}): the manifest was edited or damaged; "
                             "rebuild the cache")


def check_fingerprint(manifest: Manifest, path: str) -> None:
    """Refuses a manifest whose identity contradicts itself (edited or damaged):
    ``fingerprint`` that is not ``codec.fingerprint_of(fingerprint_inputs)``
    (when part of the inputs lies in the source table file,
    ``source_table.fingerprint_files``, which opening does not read: a
    ``source_table.inputs_sha256`` that is not ``inputs_sha256`` of the
    fingerprint and the inputs recorded; ``seqcache verify`` checks the
    fingerprint with that file), or a ``features`` table whose names, dtypes or order differ from
    ``fingerprint_inputs.record_features`` (``[[name, dtype], ...]``). Each
    part is skipped when its input is absent.

    Raises:
      seqcache.format.CacheError: one line naming the manifest, the field and
        both values (shortened).
    """
    inputs, features = manifest.fingerprint_inputs, manifest.features
    if inputs is None:
        return
    fingerprint = manifest.fingerprint
    shown = repr(fingerprint) if len(fingerprint) <= 80 else _short(fingerprint)  # a sha256 is 64 characters
    record = manifest.source_table or SourceTableRecord(file=SOURCE_TABLE_NAME, num_bytes=0, sha256="", num_files=0)
    if record.fingerprint_files:
        # Part of the inputs is in the source table file, which opening does not
        # read: the manifest's own digest of the rest here, the fingerprint in verify.
        actual = inputs_sha256(fingerprint, inputs)
        codec.require(record.inputs_sha256 == actual, path,
                       f"fingerprint = {shown}, but the sha256 of fingerprint_inputs (its file list in "
                       f"{SOURCE_TABLE_NAME}) with the fingerprint is {actual!r}, not source_table.inputs_sha256 = "
                       f"{_short(record.inputs_sha256)}: the manifest was edited or damaged; rebuild the cache")
        _check_record_features(inputs, path, features)
        return
    actual = codec.fingerprint_of(inputs)
    codec.require(fingerprint == actual, path,
                 f"fingerprint = {shown}, but the sha256 of fingerprint_inputs is {actual!r}: "
                 "the manifest was edited or damaged; rebuild the cache")
    _check_record_features(inputs, path, features)


def _check_record_features(inputs: Mapping[str, Any], path: str, features) -> None:
    """``check_fingerprint``'s test of ``features`` against ``fingerprint_inputs.record_features``."""
    recorded = inputs.get("record_features")
    if recorded is None:
        return
    table = [[f.name, f.dtype] for f in features]
    codec.require(recorded == table, path,
                 f"features = {_short(table)} (name, dtype), but fingerprint_inputs.record_features = "
                 f"{_short(recorded)}: the features table must list the recorded features with their dtypes in "
                 "record order; the manifest was edited or damaged; rebuild the cache")


def _check_counts(manifest: Manifest, path: str, *, check_shards: bool) -> None:
    """Refuses a shard record count out of range, ``num_examples`` or
    ``statistics.examples`` other than the shard table's total and, with
    ``check_shards``, what ``check_shard_sizes`` refuses."""
    table = manifest.shards
    counts = table.num_records
    if len(counts) and int(counts.max()) >= MAX_SHARD_RECORDS:
        i = int(np.argmax(counts >= MAX_SHARD_RECORDS))
        raise CacheError(f"{path}: shards[{i}].num_records = {int(counts[i])}, expected an integer in "
                             f"[0, {bounded_json.bound(MAX_SHARD_RECORDS)})")
    total = int(counts.sum(dtype=np.int64))
    for name, value in (("num_examples", manifest.num_examples), ("statistics.examples", manifest.statistics.examples)):
        codec.require(value is None or value == total, path,
                     f"{name} = {value}, but the shard table's record counts add up to {total:,}: the manifest "
                     "contradicts itself (edited or damaged); rebuild the cache")
    if check_shards:
        check_shard_sizes(manifest, path)


def check_shard_sizes(manifest: Manifest, path: str) -> None:
    """(Uncompressed shards) Refuses a shard whose byte size cannot hold its
    records: each record holds at least a 4-byte length per feature, each
    provenance record 12 bytes. Decodes every shard's sizes.

    Raises:
      seqcache.format.CacheError: naming the manifest, the shard and both values.
    """
    table, features = manifest.shards, manifest.features
    counts = table.num_records
    if "uncompressed" not in str(manifest.writer_options or ""):
        return
    data_bytes, prov_bytes = table._column("num_bytes"), table._column("provenance_num_bytes")
    for key, sizes, per_record in (("num_bytes", data_bytes, 4 * max(len(features), 1)),
                                   ("provenance_num_bytes", prov_bytes, 4 * len(codec.PROVENANCE_FEATURES))):
        short_of = counts * per_record > sizes
        if short_of.any():
            i = int(np.argmax(short_of))
            raise CacheError(
                f"{path}: shards[{i}]: {int(counts[i]):,} records need at least {int(counts[i]) * per_record:,} "
                f"bytes, but {key} = {int(sizes[i]):,}: the manifest contradicts itself (edited or damaged); "
                "rebuild the cache")


def _schema_hook(kind: Any) -> dict:
    if kind is ShardTable:
        return {"$ref": "#/$defs/Shards"}
    raise NotImplementedError(kind)  # msgspec's answer for a type the hook does not handle


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of manifest.json, generated from the
    Structs (``msgspec.json.schema_components``): the ``Manifest`` at the top,
    each nested object in ``$defs`` (``$defs.shard_checksums`` is that of
    shard-checksums.json, ``$defs.source_table`` that of source-table.json);
    each object's description is the first paragraph of its Struct's docstring."""
    _, defs = msgspec.json.schema_components([Manifest, Shards, ShardChecksums, SourceTableFile],
                                             schema_hook=_schema_hook, ref_template="#/$defs/{name}")
    for name, body in defs.items():
        body.pop("title", None)
        if "description" in body:
            body["description"] = " ".join(body["description"].split("\n\n")[0].split())
    top = defs.pop("Manifest")
    top.pop("description", None)
    defs["shard_checksums"] = {"title": "seqcache shard checksum file (shard-checksums.json)",
                               **defs.pop("ShardChecksums")}
    defs["source_table"] = {"title": f"seqcache source table file ({SOURCE_TABLE_NAME})", **defs.pop("SourceTableFile")}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "seqcache cache manifest (manifest.json)",
        "description": f"Generated from core/manifest.py (python -m seqcache.manifest --write); "
                       f"format version {', '.join(map(str, codec.READ_FORMAT_VERSIONS))}. See docs/cache-format.md.",
        **top,
        "$defs": dict(sorted(defs.items())),
    }


def schema_text() -> str:
    """The bytes of the published ``manifest.schema.json`` (as text): ``json_schema()``,
    indented by 2, and a newline."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def schema_path() -> str:
    """Where the published schema lies: beside this module (installed as package data)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), SCHEMA_NAME)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m seqcache.manifest [--write | --check] [PATH]``: print the
    JSON Schema, write it to PATH (default: ``schema_path()``), or exit 1 when
    PATH differs from it."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args and args[0] in ("--write", "--check") else None
    target = args[0] if args else schema_path()
    text = schema_text()
    if mode is None:
        sys.stdout.write(text)
    elif mode == "--write":
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {target}")
    elif not os.path.exists(target) or open(target, encoding="utf-8").read() != text:
        print(f"{target} is not up to date: run python -m seqcache.manifest --write {target}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
