"""The manifest model: the one definition of manifest.json, of
shard-checksums.json and of source-table.json, and the one place that reads,
checks and writes them.

- The fields: the ``msgspec.Struct`` ``Manifest``, its attributes in the order
  they are written; each nested object is a Struct of its own (``Feature``,
  ``Shards``, ``Vocabulary``, ``Source``, ``Statistics``, ``Sharding``,
  ``Evaluation``, ``SourceTableRecord``, ...), bounds and descriptions in
  ``msgspec.Meta``. Keys a definition does not list are allowed everywhere (and
  ignored). An optional field a manifest lacks has the attribute's default
  (None, or an empty container).
- Reading: ``Manifest.read`` and ``Manifest.parse`` check the format and its
  version, then every field (``msgspec.convert``), then the counts and the
  fingerprint, and give a typed ``Manifest``. Every failure is one
  ``CacheError`` line naming the file and the field path
  (``manifest.json: statistics.tokens is 'x': expected `object```).
- Writing: ``Manifest.create`` assembles a build's manifest (refusing a field
  the definition lacks, and any manifest ``parse`` would refuse; the
  per-file source table goes to its own file, ``SourceTable``);
  ``Manifest.write`` writes the shard checksum file, the source table file,
  then manifest.json, each atomically.
- The source table (format version 3): ``read_source_table`` (or
  ``Manifest.read_source_table``) reads and checks it, only when asked.
- The JSON Schema: ``json_schema()``, generated from the Structs by
  ``msgspec.json.schema_components`` and published as ``manifest.schema.json``
  beside this module (``python -m seqcache.manifest --write`` regenerates it,
  ``--check`` compares).
"""

import collections.abc
import contextlib
import datetime
import hashlib
import json
import os
import re
import sys
from typing import Annotated, Any, Literal, Mapping, Sequence

import msgspec
import numpy as np
from msgspec import Meta, Struct

from seqcache import __version__, bounded_json, codec, fs, layout, process
from seqcache.codec import (MANIFEST_NAME, SHARD_CHECKSUMS_NAME, SOURCE_TABLE_NAME, CacheError, IncompleteCacheError,
                            ShardTable)

_SHA256_PATTERN = "^[0-9a-f]{64}$"
_BASE64_PATTERN = "^[A-Za-z0-9+/]*={0,2}$"
SCHEMA_NAME = "manifest.schema.json"
_short = bounded_json.short

# A count is below MAX_INTEGER unless its definition says otherwise; any other
# integer lies in the int64 range.
MAX_INTEGER = bounded_json.MAX_COUNT
# The largest shard count, shard record count and sequence length a reader accepts.
MAX_SHARDS = 2**20
MAX_SHARD_RECORDS = 2**40
MAX_SEQUENCE_LENGTH = bounded_json.MAX_SEQUENCE_LENGTH

# The packings (``seqcache.tasks.task.PACKING_MODES``) and vocabulary kinds
# (``seqcache.tasks.vocabulary_from_json``) a manifest may hold; tests compare them.
PACKINGS = ("lm", "first_fit", None)
VOCABULARY_KINDS = ("byte", "sentencepiece", "hf_tokenizer")


def _doc(text: str, since: int = 1) -> Meta:
    """A field's description (and ``$comment``: the format version that introduced it)."""
    return Meta(description=text, extra_json_schema={"$comment": f"since format version {since}"} if since > 1 else None)


Count = Annotated[int, Meta(ge=0, lt=MAX_INTEGER)]
Int64 = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]
Sha256 = Annotated[str, Meta(pattern=_SHA256_PATTERN)]
# A shard table column: decoded (and checked) by ``codec.ShardTable``, the size
# columns at a shard's first read; the pattern is the JSON Schema's only.
Base64 = Annotated[str, Meta(extra_json_schema={"pattern": _BASE64_PATTERN})]
TokenCount = Annotated[int, Meta(ge=1, lt=MAX_SEQUENCE_LENGTH)]
Records = dict[str, Count]


class Entry(Struct, kw_only=True, omit_defaults=True):
    """A nested object of the format: keys it does not list are allowed and
    ignored; an optional key it lacks reads as None. ``to_json()``: the keys
    it holds (None ones left out), as plain JSON values."""

    def to_json(self) -> dict:
        return msgspec.to_builtins(self)


class Feature(Entry, frozen=True, kw_only=True):
    """One entry of ``features``: a record feature (``np_dtype``: its numpy dtype)."""

    name: Annotated[str, _doc("feature name, e.g. targets or targets_segment_ids")]
    dtype: Annotated[Literal[tuple(sorted(codec.DTYPES))], _doc("storage dtype of its elements")]
    vocabulary: Annotated[str, _doc("the key of its entry in vocabularies (token features)")] = None
    add_eos: Annotated[bool, _doc("whether the task appends EOS to it (token features)")] = None

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(codec.DTYPES[self.dtype])


class ChecksumFile(Entry, kw_only=True):
    """``shards.checksums``: the shard checksum file (format version 2)."""

    file: Annotated[Literal[SHARD_CHECKSUMS_NAME], _doc("the shard checksum file's name", 2)]
    num_bytes: Annotated[Count, _doc("its size (bytes)", 2)]
    sha256: Annotated[Sha256, _doc("its sha256, hex", 2)]


class Shards(Entry, kw_only=True):
    """``shards``: the shard table (format version 2); read as a ``codec.ShardTable``."""

    num_shards: Annotated[int, Meta(ge=0, lt=MAX_SHARDS), _doc("S, the shard count (shard names follow from index "
                                                               "and S)", 2)]
    encoding: Annotated[str, _doc("how the integer columns are stored, for humans", 2)] = None
    num_records: Annotated[Base64, _doc("records per shard (records), base64 of S little-endian int64", 2)]
    num_bytes: Annotated[Base64, _doc("byte size of each data shard file (bytes), base64 of S int64", 2)]
    provenance_num_bytes: Annotated[Base64, _doc("byte size of each provenance shard file (bytes), base64 of S "
                                                 "int64", 2)]
    checksums: Annotated[ChecksumFile, _doc("the shard checksum file: name, size and sha256", 2)]


class Sharding(Entry, kw_only=True):
    """``sharding``: how the build chose its shard count."""

    num_shards: Annotated[Count, _doc("the shard count the build chose or was given")]
    shard_size: Annotated[Int64 | None, _doc("the target shard size (bytes) it was given, or null")] = None
    input_bytes: Annotated[Count, _doc("the source files' total size (bytes)")] = None
    content_bytes: Annotated[Int64 | None, _doc("the sources' decompressed content size (bytes) where measured, "
                                                "or null")] = None


class Work(Entry, kw_only=True):
    """``work``: what the build's work folder gave it (a build that kept its
    work: a rerun after it died, a build of a grown corpus). It describes how
    this cache was made, like ``created``: two builds of the same inputs,
    one of them resumed, have equal shards, statistics and source table, and
    different ``work``."""

    units: Annotated[Count, _doc("work units of the build")]
    units_reused: Annotated[Count, _doc("units taken whole from the work folder (not read)")] = 0
    units_resumed: Annotated[Count, _doc("units read on from a checkpoint in the work folder")] = 0
    checkpoints_reused: Annotated[Count, _doc("checkpoints of units taken from the work folder")] = 0
    checkpoints_rejected: Annotated[Count, _doc("checkpoints found whose files did not match their sha256 "
                                                "(torn or changed): read again")] = 0
    shards_reused: Annotated[Count, _doc("shards written by an earlier run of the same build, kept")] = 0


class Evaluation(Entry, kw_only=True):
    """``evaluation`` (format version 3): what an evaluator runs on the cache
    (``seqcache.tasks.Task.evaluation``)."""

    metrics: Annotated[list[str], _doc("the task's metric functions' names, in order", 3)]
    postprocess_fn: Annotated[str | None, _doc("the task's postprocess function's name, or null", 3)]
    pretokenized: Annotated[list[str], _doc("the stored features holding the source's text "
                                            "(<feature>_pretokenized, uint8 UTF-8 bytes)", 3)]


class ShardChecksums(Entry, kw_only=True):
    """shard-checksums.json (format version 2), written by ``shard_checksums_json``."""

    num_shards: Annotated[Count, _doc("S, the shard count", 2)]
    sha256: Annotated[list[Sha256], _doc("sha256 of data shard s at position s, hex", 2)]
    provenance_sha256: Annotated[list[Sha256], _doc("sha256 of provenance shard s at position s, hex", 2)]


class Vocabulary(Entry, kw_only=True):
    """One entry of ``vocabularies`` (``Vocabulary.to_json()``, ``file`` renamed by the build)."""

    kind: Annotated[Literal[VOCABULARY_KINDS], _doc("the vocabulary's kind")] = None
    vocab_size: Annotated[int, Meta(ge=1, lt=MAX_INTEGER), _doc("ids in the vocabulary, extra ids included")] = None
    extra_ids: Annotated[Count, _doc("sentinel ids appended to the model's")] = None
    file: Annotated[str, _doc("the model file stored in the cache folder (sentencepiece, hf_tokenizer)")] = None
    sha256: Annotated[Sha256 | None, _doc("the model file's sha256, hex")] = None
    eos_token: Annotated[str | None, _doc("the EOS token's text (hf_tokenizer)")] = None
    pad_token: Annotated[str | None, _doc("the pad token's text (hf_tokenizer)")] = None
    unk_token: Annotated[str | None, _doc("the unk token's text (hf_tokenizer)")] = None


class Source(Entry, kw_only=True):
    """One entry of ``sources`` (format version 2), the source file table
    (``seqcache.tasks.SourceFile`` and the source's locator)."""

    path: Annotated[str, _doc("the file's path or URL")]
    num_bytes: Annotated[Count, _doc("its size (bytes)")] = None
    mtime_ns: Annotated[Int64, _doc("its modification time (nanoseconds since the epoch)")] = None
    locator: Annotated[str, _doc("what a provenance record's record_number counts in it (byte_offset, line, row, "
                                 "record, file); record when absent")] = None


class BadInput(Entry, kw_only=True):
    """``statistics.bad_input_records``: records per kind of bad input, by action."""

    skipped: Annotated[Records, _doc("kind -> records skipped (records)")] = None
    replaced: Annotated[Records, _doc("kind -> records repaired (records)")] = None
    kept: Annotated[Records, _doc("kind -> records kept unchanged (records)")] = None
    records: Annotated[Records, _doc("action -> records (records)")] = None


class SourceFiles(Entry, kw_only=True):
    """``statistics.source_files`` (format version 2): per source file, source examples and tokens."""

    examples: Annotated[list[Count], _doc("source examples per source file (records)")]
    tokens: Annotated[dict[str, list[Count]], _doc("feature -> tokens per source file, before packing (tokens)")]
    units: Annotated[str, _doc("the units, for humans")] = None


Histogram = list[Annotated[list[Count], Meta(min_length=3, max_length=3)]]


class Statistics(Entry, kw_only=True):
    """``statistics``: counts of the build (``seqcache.pipelines.stats``); None where not counted."""

    examples: Annotated[Count, _doc("cached examples (records)")] = None
    segments: Annotated[Count, _doc("segments, the pieces packed into them (records)")] = None
    source_examples: Annotated[Count, _doc("preprocessed examples before packing (records)")] = None
    tokens: Annotated[dict[str, Count], _doc("feature -> tokens in the cached examples (tokens)")] = None
    max_length: Annotated[dict[str, Count], _doc("feature -> the longest cached example (tokens)")] = None
    mean_length: Annotated[dict[str, Annotated[float, Meta(ge=0)]], _doc("feature -> the mean cached example "
                                                                         "(tokens)")] = None
    truncated_tokens: Annotated[Count, _doc("tokens trimmed to the sequence length (tokens)")] = None
    length_histogram: Annotated[dict[str, Histogram], _doc(
        "feature -> histogram of source example lengths: the non-empty buckets [lo, hi, examples], lo ascending, "
        "hi exclusive (tokens)")] = None
    skipped_records: Annotated[Count, _doc("source records skipped as bad input (records)")] = None
    units: Annotated[str, _doc("the units, for humans")] = None
    source_records: Annotated[Count, _doc("source records read (records)")] = None
    source_files: Annotated[SourceFiles, _doc("per source file: source examples and tokens")] = None
    replaced_records: Annotated[Count, _doc("source records repaired (records)")] = None
    bad_input_records: Annotated[BadInput, _doc("records per kind of bad input, by action")] = None
    excluded_records: Annotated[Count, _doc("source records excluded for overlapping a benchmark (records)")] = None
    excluded_by_benchmark: Annotated[Records, _doc("benchmark name -> excluded records that overlap it "
                                                   "(records)")] = None


class SourceTableRecord(Entry, kw_only=True):
    """The manifest's ``source_table`` (format version 3): the file that holds
    the per-file source table, checked like the shard checksum file."""

    file: Annotated[Literal[SOURCE_TABLE_NAME], _doc("the source table file's name", 3)]
    num_bytes: Annotated[Count, _doc("its size (bytes)", 3)]
    sha256: Annotated[Sha256, _doc("its sha256, hex", 3)]
    num_files: Annotated[Count, _doc("the source files it lists (files)", 3)]
    fingerprint_files: Annotated[list[str], _doc(
        "the keys, from the top, of the value of fingerprint_inputs that it holds (['task', 'source', 'files']); "
        "absent when it holds none", 3)] = None
    inputs_sha256: Annotated[Sha256, _doc(
        "with fingerprint_files: the sha256 of the canonical JSON of {fingerprint, fingerprint_inputs} as this "
        "manifest records them (what opening a cache checks, where the fingerprint itself needs the file)", 3)] = None


class SourceTableFile(Entry, kw_only=True):
    """source-table.json (format version 3), written by ``SourceTable.to_bytes``:
    one column per field of ``Source`` and ``SourceFiles``."""

    num_files: Annotated[Count, _doc("N, the source files (files)", 3)]
    path: Annotated[list[str], _doc("file i's path or URL at position i (i is a provenance record's "
                                    "source_index)", 3)]
    num_bytes: Annotated[list[Count | None], _doc("each file's size (bytes), null where not recorded", 3)] = None
    mtime_ns: Annotated[list[Int64 | None], _doc("each file's modification time (nanoseconds since the epoch), "
                                                 "null where not recorded", 3)] = None
    locator: Annotated[str | list[str | None], _doc("what record_number counts in the files: one locator for "
                                                    "every file, or one per file (null: record)", 3)] = None
    examples: Annotated[list[Count], _doc("source examples per file (records); absent when not counted", 3)] = None
    tokens: Annotated[dict[str, list[Count]], _doc("feature -> tokens per file, before packing (tokens)", 3)] = None
    fingerprint_files: Annotated[dict[str, Any], _doc(
        "the value of fingerprint_inputs at the manifest's source_table.fingerprint_files: {\"value\": V}, or "
        "{\"from_columns\": true} for the list of {path, num_bytes, mtime_ns} of each file", 3)] = None


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

    format: Annotated[Literal[codec.FORMAT_NAME], _doc("the format's name")]
    format_version: Annotated[Literal[codec.READ_FORMAT_VERSIONS], _doc(
        "the version of the cache as a whole: what a reader must understand")]
    task: Annotated[str, _doc("the task's name")]
    split: Annotated[str, _doc("the split's name")]
    fingerprint: Annotated[str, _doc("sha256 of the canonical JSON of fingerprint_inputs")]
    seed: Annotated[Int64, _doc("the shuffle seed")] = None
    sequence_length: Annotated[dict[str, TokenCount | None] | None, _doc(
        "feature -> tokens, or null (an int, which manifests of earlier releases may hold, is read as every "
        "feature's)")] = None
    packing: Annotated[Literal["lm", "first_fit"] | None, _doc("the packing: lm, first_fit or null")] = None
    writer_options: Annotated[str, _doc("the ArrayRecord writer options")] = None
    record_encoding: Annotated[str, _doc("the record encoding, for humans")] = None
    features: Annotated[tuple[Feature, ...], _doc("the record features, in record order")]
    vocabularies: Annotated[dict[str, Vocabulary], _doc("feature -> its vocabulary: kind, vocab_size, extra_ids, "
                                                         "...")] = {}
    num_examples: Annotated[Count, _doc("total examples (records); absent: the shard table's total")] = None
    shards: Annotated[ShardTable, _doc("the shard table: the shard count and one column per shard field", 2)]
    statistics: Annotated[Statistics, _doc("counts of the build: examples, tokens, lengths, bad input")] = \
        msgspec.field(default_factory=Statistics)
    sources: Annotated[list[Source], _doc("(format version 2) the source file table, indexed by a provenance "
                                          "record's source_index; version 3 keeps it in source_table's file")] = []
    source_table: Annotated[SourceTableRecord, _doc("the source table file: per source file its path, size, mtime, "
                                                    "locator, examples and tokens (read only by what needs them)",
                                                    3)] = None
    fingerprint_inputs: Annotated[dict[str, Any], _doc("what the fingerprint is computed from")] = None
    created: Annotated[str, _doc("when it was written, ISO 8601, UTC")] = None
    seqcache_version: Annotated[str, _doc("the seqcache release that wrote it")] = None
    quarantine: Annotated[Literal[codec.QUARANTINE_NAME] | None, _doc(
        "quarantine.jsonl when records were skipped, repaired or excluded, else null")] = None
    quarantine_num_bytes: Annotated[Count | None, _doc("the quarantine file's size (bytes)")] = None
    quarantine_sha256: Annotated[Sha256 | None, _doc("the quarantine file's sha256, hex")] = None
    sharding: Annotated[Sharding, _doc("how the build chose its shard count")] = None
    evaluation: Annotated[Evaluation | None, _doc("the task's metrics and postprocess function, or null for a "
                                                  "task without", 3)] = None
    work: Annotated[Work, _doc("what the build's work folder gave it: units and shards reused (absent: a build "
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
        sources, sources_bytes = _detach_source_table(fields, fingerprint_known=fingerprint_known)
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


# -- Reading: msgspec.convert, and its refusals as one line naming the field path.

class _Refused(Exception):
    """A refusal inside a nested conversion (the shard table): the inner
    ValidationError, the value converted and how messages name it."""

    def __init__(self, error: msgspec.ValidationError, value: Any, prefix: str):
        super().__init__(str(error))
        self.error, self.value, self.prefix = error, value, prefix


def convert(value: Any, model: Any, *, path: str = MANIFEST_NAME, prefix: str = "") -> Any:
    """``msgspec.convert(value, model)`` (strict: no coercion), a ``ShardTable``
    made and checked where the model has one.

    Args:
      prefix: how messages name ``value`` (``sources``; empty: the manifest).

    Raises:
      CacheError: ``{path}: {field path} is {value}: {msgspec's words}``
        (``manifest.json: seed is '7': expected `int```), or
        ``{path}: {object}: object missing required field `x```, or the shard
        table's own message.
    """
    def hook(kind, obj):  # the shard table: the codec's checks and messages, then the rest of ``Shards``
        if kind is not ShardTable:
            raise NotImplementedError(kind)  # msgspec's answer for a type the hook does not handle
        count = obj.get("num_shards") if isinstance(obj, dict) else None
        codec.require(not (type(count) is int and count >= MAX_SHARDS), path, f"shards.num_shards = "
                      f"{_short(count)}, expected an integer in [0, {bounded_json.bound(MAX_SHARDS)})")
        table = ShardTable(obj, path=path)
        try:
            msgspec.convert(obj, Shards)
        except msgspec.ValidationError as e:
            raise _Refused(e, obj, "shards") from None
        return table

    try:
        return msgspec.convert(value, model, dec_hook=hook)
    except msgspec.ValidationError as e:
        raise _refusal(e, value, path, prefix) from None
    except _Refused as e:
        raise _refusal(e.error, e.value, path, e.prefix) from None


def _refusal(error: msgspec.ValidationError, value: Any, path: str, prefix: str) -> CacheError:
    """The ``CacheError`` line of msgspec's ``error`` (converting ``value``):
    its field path (``$.statistics.tokens[...]``) after ``prefix``, a dict key
    named where the dict has only one, and the value found there."""
    text, _, where = str(error).partition(" - at `$")
    name, found = prefix, True
    for key, index in re.findall(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]", where):
        if index == "..." and isinstance(value, dict) and len(value) == 1:
            key = next(iter(value))
        if key:
            name += f".{key}"
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        else:
            name += f"[{index}]"
            found = found and index.isdigit() and isinstance(value, list) and int(index) < len(value)
            value = value[int(index)] if found else None
    name = name.removeprefix(".")
    text = text[:1].lower() + text[1:]
    if not found or text.startswith("object missing"):
        return CacheError(f"{path}: {name + ': ' if name else ''}{text}")
    text = re.sub(r", got `[^`]*`$|(?<=^invalid enum value) .*", "", text)  # the value is shown
    return CacheError(f"{path}: {name} is {_short(value)}: {text}")


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
    path, data = _read_recorded_file(cache_dir, recorded, "shard checksum file")
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


# Where a build's fingerprint inputs keep the file list (``Task.fingerprint``'s
# ``source``, ``FileSource.fingerprint``'s ``files``): moved to the source table file.
FINGERPRINT_FILES_KEYS = ("task", "source", "files")


class SourceTable(collections.abc.Sequence):
    """The per-file source table of a cache: entry ``i`` (``table[i]``) is
    ``{path, num_bytes?, mtime_ns?, locator?}`` of the file whose provenance
    records carry ``source_index`` i, as the ``sources`` of a format-2
    manifest; with the read step's counts per file (``examples``, records;
    ``tokens``, feature -> tokens before packing; None when not counted) and
    the value moved out of the fingerprint inputs (``fingerprint_value``).

    Held as columns (``paths``, ``num_bytes``, ``mtime_ns``, ``locators``;
    ``from_columns``), each entry made when asked for: a table of a million
    files is a few lists, not a million dicts. In format version 3 it is the
    file ``SOURCE_TABLE_NAME`` (``to_bytes``: one line of JSON, a column per
    field, ``SourceTableFile``), checked against the manifest's
    ``source_table`` by ``read_source_table``.
    """

    def __init__(self, entries: Sequence[Mapping[str, Any]] = (), *, examples: Sequence[int] | None = None,
                 tokens: Mapping[str, Sequence[int]] | None = None, fingerprint_files: Mapping[str, Any] | None = None,
                 path: str = SOURCE_TABLE_NAME, prefix: str = "", columns: Sequence[Any] | None = None):
        """``entries`` (mappings), or ``columns``: ``(paths, num_bytes,
        mtime_ns, locators)`` (``from_columns``). Raises CacheError (naming
        ``path`` and the column, after ``prefix``): counts of another length
        than the entries."""
        if columns is None:
            entries = [dict(e) for e in entries]
            columns = ([e["path"] for e in entries], *([e.get(k) for e in entries] for k in ("num_bytes", "mtime_ns")),
                       [e.get("locator") for e in entries])
        paths, sizes, times, locators = columns
        self.paths = list(paths)
        n = len(self.paths)
        # None for a column with no value; a locator shared by every file as one string.
        self.num_bytes, self.mtime_ns = ((None if c is None or all(v is None for v in c) else list(c))
                                         for c in (sizes, times))
        if locators is not None and not isinstance(locators, str):
            locators = list(locators)
            distinct = set(locators)
            locators = None if distinct <= {None} else (locators[0] if len(distinct) == 1 and n else locators)
        self.locators = locators
        self.examples = None if examples is None else list(examples)
        self.tokens = None if tokens is None else {k: list(v) for k, v in tokens.items()}
        self.fingerprint_files = None if fingerprint_files is None else dict(fingerprint_files)
        for what, values in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns),
                             ("locator", None if isinstance(locators, str) else locators)):
            codec.require(values is None or len(values) == n, path,
                           f"{prefix}{what} has {len(values or ())} entries for {n} source files; rebuild the cache")
        for what, values in (("examples", self.examples), *((f"tokens.{k}", v) for k, v in (self.tokens or {}).items())):
            codec.require(values is None or len(values) == n, path,
                           f"{prefix}{what} has {0 if values is None else len(values)} entries for {n} source files "
                           "(edited or damaged); rebuild the cache")

    @classmethod
    def from_columns(cls, paths: Sequence[str], num_bytes: Sequence[int | None] | None = None,
                     mtime_ns: Sequence[int | None] | None = None, locators: "str | Sequence[str | None] | None" = None,
                     **kw) -> "SourceTable":
        """The table of files given as columns (a build's listing): ``paths``
        (str), ``num_bytes`` and ``mtime_ns`` (ints or None each, or None for
        none), ``locators`` (one for every file, a list, or None); ``kw`` as
        the constructor's. No dict per file is made."""
        return cls(columns=(paths, num_bytes, mtime_ns, locators), **kw)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entry = {"path": self.paths[index]}
        for key, column in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns)):
            if column is not None and column[index] is not None:
                entry[key] = column[index]
        locator = self.locators if isinstance(self.locators, str) or self.locators is None else self.locators[index]
        if locator is not None:
            entry["locator"] = locator
        return entry

    def __eq__(self, other) -> bool:
        if isinstance(other, SourceTable):
            return (list(self), self.examples, self.tokens) == (list(other), other.examples, other.tokens)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # mutable entries

    def __repr__(self) -> str:
        return f"SourceTable({len(self)} files)"

    @property
    def statistics(self) -> dict | None:
        """``{"examples": [...], "tokens": {feature: [...]}}`` (records, tokens;
        one per file), the former ``statistics.source_files``; None when the
        build did not count them."""
        if self.examples is None:
            return None
        return {"examples": self.examples, "tokens": self.tokens or {}}

    def fingerprint_value(self) -> Any:
        """The value of the fingerprint inputs this table holds: the list of
        ``{path, num_bytes, mtime_ns}`` of each file (``from_columns``), or the
        value stored as it was. CacheError when it holds none."""
        moved = self.fingerprint_files
        if moved is None:
            raise CacheError(f"{SOURCE_TABLE_NAME}: holds no fingerprint_files, but the manifest's "
                             "source_table.fingerprint_files says it does; rebuild the cache")
        if moved.get("from_columns") is True:
            return [{"path": p, "num_bytes": b, "mtime_ns": t} for p, b, t in self._file_rows()]
        return moved.get("value")

    def _file_rows(self):
        """``(path, num_bytes, mtime_ns)`` of each file (None where not known)."""
        nothing = [None] * len(self)
        return zip(self.paths, self.num_bytes or nothing, self.mtime_ns or nothing)

    def same_files(self, value: Any) -> bool:
        """Whether ``value`` is the list of ``{path, num_bytes, mtime_ns}`` of
        each file (what ``fingerprint_value`` gives ``from_columns``): compared
        column by column, without a dict per file."""
        if not isinstance(value, list) or len(value) != len(self):
            return False
        if value and (set(map(type, value)) != {dict} or set(map(len, value)) != {3}):
            return False
        nothing = [None] * len(self)
        try:  # three keys each, these three: no other
            return ([v["path"] for v in value] == self.paths
                    and [v["num_bytes"] for v in value] == (self.num_bytes or nothing)
                    and [v["mtime_ns"] for v in value] == (self.mtime_ns or nothing))
        except KeyError:
            return False

    def to_json(self) -> dict:
        """The object of the source table file: ``num_files``, then one column
        per field (``SourceTableFile``); a locator shared by every file is
        written once."""
        obj: dict[str, Any] = {"num_files": len(self), "path": self.paths}
        for key, column in (("num_bytes", self.num_bytes), ("mtime_ns", self.mtime_ns)):
            if column is not None:
                obj[key] = column
        if self.locators is not None:
            obj["locator"] = self.locators
        if self.examples is not None:
            obj["examples"] = self.examples
            obj["tokens"] = self.tokens or {}
        if self.fingerprint_files is not None:
            obj["fingerprint_files"] = self.fingerprint_files
        return obj

    def to_bytes(self) -> bytes:
        """The bytes of ``SOURCE_TABLE_NAME``: ``to_json`` as compact JSON
        (UTF-8, msgspec: a tenth of ``json.dumps``'s time for 50,000 files),
        one line and a newline; as deterministic as the file listing."""
        return msgspec.json.encode(self.to_json()) + b"\n"

    @classmethod
    def from_json(cls, obj: Any, *, path: str = SOURCE_TABLE_NAME) -> "SourceTable":
        """The table of a decoded source table file, checked column by column.

        Raises:
          CacheError: ``{path}: ...`` naming the first bad field: not an object,
            a missing column, a column of another length than ``num_files`` or
            holding a value of the wrong type.
        """
        codec.require(isinstance(obj, dict), path, "the source table file is not a JSON object")
        t = convert(obj, SourceTableFile, path=path)  # each column's type (msgspec), then its length
        n = t.num_files
        columns = {"path": t.path, "num_bytes": t.num_bytes, "mtime_ns": t.mtime_ns, "examples": t.examples,
                   "locator": None if isinstance(t.locator, str) else t.locator,
                   **{f"tokens.{k}": v for k, v in (t.tokens or {}).items()}}
        for key, column in columns.items():
            codec.require(column is None or len(column) == n, path,
                          f"{key} has {len(column or ())} entries, expected num_files = {n}")
        codec.require((t.tokens is None) == (t.examples is None), path,
                      "examples and tokens go together: one of them is missing")
        moved = t.fingerprint_files
        codec.require(moved is None or moved.get("from_columns") is True or "value" in moved, path,
                      f"fingerprint_files is {_short(moved)}, expected {{\"value\": ...}} or {{\"from_columns\": true}}")
        return cls.from_columns(t.path, t.num_bytes, t.mtime_ns, t.locator, examples=t.examples, tokens=t.tokens,
                                fingerprint_files=moved, path=path)


def with_value_at(obj: Mapping[str, Any], keys: Sequence[str], value: Any) -> dict:
    """A copy of the nested object ``obj`` with ``value`` at ``keys`` (the
    objects along the way copied, the rest shared)."""
    out = dict(obj)
    if len(keys) == 1:
        out[keys[0]] = value
    else:
        inner = out.get(keys[0])
        out[keys[0]] = with_value_at(inner if isinstance(inner, dict) else {}, keys[1:], value)
    return out


def _without_value_at(obj: Mapping[str, Any], keys: Sequence[str]) -> tuple[dict, Any] | None:
    """(a copy of ``obj`` without the value at ``keys``, that value), or None
    when there is none."""
    inner: Any = obj
    for key in keys:
        if not isinstance(inner, dict) or key not in inner:
            return None
        inner = inner[key]
    out = dict(obj)
    if len(keys) == 1:
        del out[keys[0]]
    else:
        out[keys[0]], _ = _without_value_at(obj[keys[0]], keys[1:])
    return out, inner


def _check_sources(entries: Sequence[Any]) -> None:
    """Checks a build's ``sources`` against ``Source`` (one ``msgspec.convert``:
    a million entries in well under a second).

    Raises:
      CacheError: naming the first bad entry and its field (``sources[3].path``).
    """
    convert(list(entries), list[Source], path=MANIFEST_NAME, prefix="sources")


def _check_source_columns(table: SourceTable) -> None:
    """``_check_sources`` of a table given as columns (``SourceTable.from_columns``):
    the columns against ``SourceTableFile``, entry by entry only when one fails."""
    try:
        columns = {"num_bytes": table.num_bytes, "mtime_ns": table.mtime_ns, "locator": table.locators}
        msgspec.convert({"num_files": len(table), "path": table.paths,
                         **{k: v for k, v in columns.items() if v is not None}}, SourceTableFile)
    except msgspec.ValidationError:
        _check_sources(list(table))


def _check_source_files(per_file: Any) -> None:
    """Checks a build's ``statistics.source_files`` against ``SourceFiles``.
    Raises CacheError as ``convert``."""
    convert(per_file, SourceFiles, path=MANIFEST_NAME, prefix="statistics.source_files")


def _detach_source_table(fields: dict, *, fingerprint_known: bool = False) -> tuple[SourceTable, bytes]:
    """Moves a build's per-file source table out of its manifest fields (in
    place): ``sources``, ``statistics.source_files`` and the fingerprint
    inputs' file list (``FINGERPRINT_FILES_KEYS``) go into the returned
    ``SourceTable`` (returned with the bytes of its file), and
    ``source_table`` (its file's name, size, sha256, file count and the keys
    of what left the fingerprint inputs) comes in.

    Raises:
      CacheError: ``fingerprint`` is not the sha256 of ``fingerprint_inputs``
        (checked here, while the inputs are whole, unless ``fingerprint_known``);
        columns that disagree.
    """
    entries = fields.pop("sources", None) or []
    if isinstance(entries, SourceTable):
        _check_source_columns(entries)
    else:
        _check_sources(entries)
        entries = SourceTable(entries)
    statistics = fields.get("statistics")
    per_file = None
    if isinstance(statistics, Mapping) and "source_files" in statistics:
        statistics = dict(statistics)
        per_file = statistics.pop("source_files")
        _check_source_files(per_file)
        fields["statistics"] = statistics
    inputs, moved, keys = fields.get("fingerprint_inputs"), None, None
    if isinstance(inputs, Mapping) and isinstance(fields.get("fingerprint"), str):
        actual = fields["fingerprint"] if fingerprint_known else codec.fingerprint_of(inputs)
        codec.require(fields["fingerprint"] == actual, MANIFEST_NAME,
                       f"fingerprint = {_short(fields['fingerprint'])}, but the sha256 of fingerprint_inputs is "
                       f"{actual!r}")
        split = _without_value_at(inputs, FINGERPRINT_FILES_KEYS)
        if split is not None:
            fields["fingerprint_inputs"], value = split
            keys = list(FINGERPRINT_FILES_KEYS)
            moved = {"from_columns": True} if entries.same_files(value) else {"value": value}
    table = SourceTable.from_columns(entries.paths, entries.num_bytes, entries.mtime_ns, entries.locators,
                                     examples=None if per_file is None else per_file["examples"],
                                     tokens=None if per_file is None else per_file["tokens"], fingerprint_files=moved)
    data = table.to_bytes()
    record = {"file": SOURCE_TABLE_NAME, "num_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
              "num_files": len(table)}
    if keys is not None:
        record["fingerprint_files"] = keys
        record["inputs_sha256"] = inputs_sha256(fields["fingerprint"], fields["fingerprint_inputs"])
    fields["source_table"] = record
    return table, data


def inputs_sha256(fingerprint: str, inputs: Mapping[str, Any]) -> str:
    """``source_table.inputs_sha256``: the sha256 of the canonical JSON of
    ``{"fingerprint": fingerprint, "fingerprint_inputs": inputs}`` (the inputs
    as the manifest records them, without what the source table file holds)."""
    return codec.fingerprint_of({"fingerprint": fingerprint, "fingerprint_inputs": inputs})


def read_source_table(cache_dir: str | None, manifest: "Manifest") -> SourceTable:
    """The cache's per-file source table: from ``SOURCE_TABLE_NAME`` in
    ``cache_dir`` (a local path or a URL) after checking that file's size and
    sha256 against the manifest's ``source_table`` (format version 3); or, for
    a cache that keeps it in the manifest (``sources`` and
    ``statistics.source_files``, format version 2), from the manifest without
    reading anything. Opening a cache (``info``, the feeder) never reads it;
    ``which --source``, provenance look-ups, ``report`` and ``verify`` do.

    Raises:
      CacheError: one line naming the file: missing, another size or sha256
        than the manifest records, not a source table, or listing another
        number of files than the manifest's ``source_table.num_files``.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    recorded = manifest.source_table
    if recorded is None:
        per_file = manifest.statistics.source_files or SourceFiles(examples=None, tokens=None)
        where = MANIFEST_NAME if manifest.cache_dir is None else fs.join(manifest.cache_dir, MANIFEST_NAME)
        return SourceTable([s.to_json() for s in manifest.sources], examples=per_file.examples,
                           tokens=per_file.tokens, path=where, prefix="statistics.source_files.")
    if cache_dir is None:
        raise ValueError("read_source_table: the manifest keeps its source table in a file; give the cache folder")
    path, data = _read_recorded_file(cache_dir, recorded.to_json(), "source table file",
                                     missing=f" for {recorded.num_files:,} source files); rebuild the cache")
    obj = bounded_json.loads(data, path=path, error=CacheError, what="source table file",
                             max_bytes=max(bounded_json.MAX_BYTES, len(data)),
                             max_nodes=bounded_json.MAX_NODES + 8 * recorded.num_files)
    table = SourceTable.from_json(obj, path=path)
    if len(table) != recorded.num_files:
        raise CacheError(f"{path}: lists {len(table):,} source files, the manifest's source_table.num_files is "
                         f"{recorded.num_files:,}")
    if recorded.fingerprint_files and table.fingerprint_files is None:
        raise CacheError(f"{path}: holds no fingerprint_files, but the manifest's source_table.fingerprint_files "
                         f"is {recorded.fingerprint_files}")
    return table


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


def _read_recorded_file(cache_dir: str, recorded: collections.abc.Mapping, what: str, *, missing: str = ")") -> tuple[str, bytes]:
    """``(path, bytes)`` of the cache file the manifest records as ``{file,
    num_bytes, sha256}`` (the shard checksum file, the source table), checked
    against the record.

    Raises:
      CacheError: the file is missing (the message ends with ``missing``),
        cannot be read (a folder in its place), or its size or sha256 differs
        from the record, naming the file.
    """
    path = layout.cache_file(cache_dir, recorded["file"], what=what)
    if not fs.exists(path):
        raise CacheError(f"{path}: {what} is missing (the manifest lists it with {recorded['num_bytes']} bytes{missing}")
    try:
        data = fs.read_bytes(path)
    except OSError as e:  # a folder or an unreadable file in its place
        raise CacheError(f"{path}: {what} cannot be read ({e.strerror or type(e).__name__}); rebuild the cache") \
            from None
    if len(data) != recorded["num_bytes"]:
        raise CacheError(f"{path}: {what} has {len(data)} bytes, the manifest expects {recorded['num_bytes']}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded["sha256"]:
        raise CacheError(f"{path}: {what} has sha256 {actual}, the manifest expects {recorded['sha256']}")
    return path, data
