"""The manifest model: the one definition of manifest.json, of
shard-checksums.json and of source-table.json, and the one place that reads,
checks and writes them.

- The fields: the attributes of the dataclass ``Manifest``, in the order they
  are written, each carrying its ``Field``; ``MANIFEST_FIELDS`` lists them.
  Nested objects are tuples of ``Field``. Keys a definition does not list are
  allowed everywhere.
- Reading: ``Manifest.read`` and ``Manifest.parse`` check every field against
  its definition, then the counts and the fingerprint, and give a typed
  ``Manifest``. Every failure is one ``CacheError`` line naming the field
  (``manifest.json: statistics.tokens is 'x', expected a JSON object``).
- Writing: ``Manifest.create`` assembles a build's manifest (refusing a field
  the definition lacks, and any manifest ``parse`` would refuse; the
  per-file source table goes to its own file, ``SourceTable``);
  ``Manifest.write`` writes the shard checksum file, the source table file,
  then manifest.json, each atomically.
- The source table (format version 3): ``read_source_table`` (or
  ``Manifest.read_source_table``) reads and checks it, only when asked.
- The JSON Schema: ``json_schema()``, published as ``manifest.schema.json``
  beside this module (``python -m seqcache.manifest --write`` regenerates it,
  ``--check`` compares).
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import datetime
import hashlib
import json
import math
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from seqcache import __version__, bounded_json, codec, fs, layout
from seqcache.codec import (MANIFEST_NAME, SHARD_CHECKSUMS_NAME, SOURCE_TABLE_NAME, CacheError, FeatureSpec,
                            IncompleteCacheError, ShardTable)

# JSON type name -> the Python test of a value decoded by ``json.loads``.
_IS = {"string": lambda v: isinstance(v, str), "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
       "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
       "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
       "array": lambda v: isinstance(v, list), "null": lambda v: v is None}
_SHA256_PATTERN = "^[0-9a-f]{64}$"
_BASE64_PATTERN = "^[A-Za-z0-9+/]*={0,2}$"
SCHEMA_NAME = "manifest.schema.json"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a JSON object of the cache format.

    Attributes:
      name: the key.
      type: the JSON types its value may have (the keys of ``_IS``).
      required: a reader refuses the object without it (``missing field``).
      since: the ``format_version`` that introduced it.
      description: one line, for the JSON Schema and the docs.
      keywords: further JSON Schema keywords of its value; ``check_value``
        tests ``minimum``, ``maximum``, ``pattern``, ``enum``, ``minItems``
        and ``maxItems``.
      fields: the fields of the value (an object), or of each item (an array
        of objects).
      values: the field of each member of an object keyed by name
        (``additionalProperties``); its ``name`` is unused.
      items: the field of each item of an array of non-objects; its ``name``
        is unused.
      check: the reader's own check instead of ``check_value``:
        ``check(value, {"path", "check_shards"})`` raises ``CacheError`` with
        the field's own message and may return a decoded value.
    """

    name: str
    type: tuple[str, ...]
    required: bool
    since: int
    description: str
    keywords: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fields: tuple["Field", ...] = ()
    values: "Field | None" = None
    items: "Field | None" = None
    check: Callable[[Any, Mapping[str, Any]], Any] | None = None

    def __post_init__(self):
        unknown = [t for t in self.type if t not in _IS]
        if unknown:
            raise ValueError(f"field {self.name!r}: unknown JSON type(s) {unknown} (expected some of {sorted(_IS)})")

    def schema(self) -> dict:
        """This field's JSON Schema (draft 2020-12) fragment."""
        out: dict[str, Any] = {"type": list(self.type) if len(self.type) > 1 else self.type[0],
                               "description": self.description}
        if self.since > 1:
            out["$comment"] = f"since format version {self.since}"
        out.update(self.keywords)
        if self.fields:
            obj = object_schema(self.fields)
            if "array" in self.type:
                out["items"] = {"type": "object", **obj}
            else:
                out.update(obj)
        if self.values is not None:
            out["additionalProperties"] = self.values.schema()
        if self.items is not None:
            out["items"] = self.items.schema()
        return out


def _each(types: tuple[str, ...], description: str, keywords: Mapping[str, Any] | None = None, **kw) -> Field:
    """The ``Field`` of each member (``values``) or item (``items``) of a value."""
    return Field("", types, False, 1, description, dict(keywords or {}), **kw)


def object_schema(fields: Sequence[Field]) -> dict:
    """The JSON Schema of an object with ``fields`` (others allowed)."""
    out: dict[str, Any] = {"properties": {f.name: f.schema() for f in fields}}
    required = [f.name for f in fields if f.required]
    if required:
        out["required"] = required
    return out


_WORDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
          "object": "a JSON object", "array": "a JSON list", "null": "null"}
_short = bounded_json.short


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _what(types: Sequence[str]) -> str:
    return _either([_WORDS[t] for t in types])


# A count (an integer with a ``minimum``) is below MAX_INTEGER unless its
# definition gives a ``maximum``; any other integer lies in the int64 range.
MAX_INTEGER = bounded_json.MAX_COUNT
# The largest shard count, shard record count and sequence length a reader accepts.
MAX_SHARDS = 2**20
MAX_SHARD_RECORDS = 2**40
MAX_SEQUENCE_LENGTH = bounded_json.MAX_SEQUENCE_LENGTH


def check_value(field: Field, value: Any, path: str, where: str = "", *, name: str | None = None) -> None:
    """The generic reader check of one field's value: its JSON type and
    keywords, then its ``fields``, ``values`` and ``items``, recursively.

    Args:
      name: how messages name the value (default ``where`` + ``field.name``),
        e.g. ``statistics.tokens.targets`` or ``sources[0].path``.

    Raises:
      seqcache.format.CacheError: ``{path}: {name} is {value}, expected {what}``.
    """
    name = f"{where}{field.name}" if name is None else name
    kw = field.keywords
    ok = any(_IS[t](value) for t in field.type)
    if ok and "minimum" in kw and _IS["number"](value):
        ok = value >= kw["minimum"]
    if ok and _IS["integer"](value):
        hi = kw.get("maximum", MAX_INTEGER if "minimum" in kw else 2**63)
        if not -2**63 <= value < hi:
            lo = f"{kw['minimum']}" if "minimum" in kw else "-2^63"
            raise CacheError(f"{path}: {name} = {_short(value)}, expected an integer in "
                                 f"[{lo}, {bounded_json.bound(hi)})")
    if ok and isinstance(value, float) and not math.isfinite(value):
        ok = False
    if ok and "pattern" in kw and isinstance(value, str):
        ok = re.search(kw["pattern"], value) is not None
    if ok and "enum" in kw:
        ok = value in kw["enum"]
    if ok and isinstance(value, list):
        ok = kw.get("minItems", 0) <= len(value) <= kw.get("maxItems", len(value))
    if not ok:
        if "enum" in kw:
            expected = _either(["null" if v is None else repr(v) for v in kw["enum"]])
        else:
            expected = _what(field.type) + (f" >= {kw['minimum']}" if "minimum" in kw else "")
            if "minItems" in kw and kw.get("maxItems") == kw["minItems"]:
                expected += f" of {kw['minItems']} items"
        raise CacheError(f"{path}: {name} is {_short(value)}, expected {expected}")
    if field.fields:
        items = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        for i, item in enumerate(items):
            prefix = f"{name}[{i}]." if isinstance(value, list) else f"{name}."
            if not isinstance(item, dict):
                raise CacheError(f"{path}: {prefix[:-1]} is {_short(item)}, expected a JSON object")
            for sub in field.fields:
                if sub.name in item:
                    check_value(sub, item[sub.name], path, prefix)
                elif sub.required:
                    raise CacheError(f"{path}: {prefix[:-1]}: missing field {sub.name!r}")
    if field.values is not None and isinstance(value, dict):
        for key, member in value.items():
            check_value(field.values, member, path, name=f"{name}.{key}")
    if field.items is not None and isinstance(value, list):
        for i, item in enumerate(value):
            check_value(field.items, item, path, name=f"{name}[{i}]")


# -- The readers' own checks (their messages are part of the format's interface).

def _check_format(value, ctx):
    codec.require(value == codec.FORMAT_NAME, ctx["path"], f"format is {_short(value)}, expected {codec.FORMAT_NAME!r}")


def _check_format_version(value, ctx):
    codec.require(value in codec.READ_FORMAT_VERSIONS and not isinstance(value, bool), ctx["path"],
                   f"format_version is {_short(value)}, this seqcache reads format version "
                   f"{_either(list(map(str, codec.READ_FORMAT_VERSIONS)))}: read the cache with the seqcache release "
                   "that "
                   "wrote it, or rebuild it with this one (seqcache build ... --overwrite)")


def _check_features(value, ctx):
    path = ctx["path"]
    codec.require(isinstance(value, list), path, f"bad features entry: features is {type(value).__name__}, "
                 "expected a JSON list")
    try:
        for f in value:
            for key, types in (("name", ("string",)), ("vocabulary", ("string",)), ("add_eos", ("boolean",))):
                if key in f and not any(_IS[t](f[key]) for t in types):
                    raise ValueError(f"{key} is {_short(f[key])}, expected {_what(types)}")
        return tuple(codec.FeatureSpec(f["name"], f["dtype"]) for f in value)
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"{path}: bad features entry: {e}") from None


def _check_shards(value, ctx):
    path = ctx["path"]
    if isinstance(value, dict):
        count = value.get("num_shards")
        codec.require(not (_IS["integer"](count) and count >= MAX_SHARDS), path,
                     f"shards.num_shards = {_short(count)}, expected an integer in [0, {bounded_json.bound(MAX_SHARDS)})")
    table = ShardTable(value, path=path)
    encoding = value.get("encoding")
    codec.require(encoding is None or isinstance(encoding, str), path,
                   f"shards.encoding is {_short(encoding)}, expected a string")
    if ctx["check_shards"]:
        table.check_all()
    return table


def _is_token_count(v) -> bool:
    return v is None or (_IS["integer"](v) and 0 < v < MAX_SEQUENCE_LENGTH)


def _check_sequence_length(value, ctx):
    codec.require(_is_token_count(value) or (isinstance(value, dict) and all(map(_is_token_count, value.values()))),
                 ctx["path"], f"sequence_length is {_short(value)}, expected null, a token count in [1, "
                 f"{bounded_json.bound(MAX_SEQUENCE_LENGTH)}) or {{feature: token count}}")


def _check_quarantine(value, ctx):
    codec.require(value in (None, codec.QUARANTINE_NAME), ctx["path"], f"quarantine is {_short(value)}, expected "
                   f"{codec.QUARANTINE_NAME!r} or null (a plain file name inside the cache folder)")


def _check_quarantine_num_bytes(value, ctx):
    codec.require(value is None or (_IS["integer"](value) and 0 <= value < MAX_INTEGER), ctx["path"], f"quarantine_num_bytes is {_short(value)}, expected a byte count in [0, 2^53)")


def _check_quarantine_sha256(value, ctx):
    codec.require(value is None or (isinstance(value, str) and codec.SHA256_RE.fullmatch(value) is not None),
                 ctx["path"], f"quarantine_sha256 is {_short(value)}, expected 64 hex digits")


# -- The fields.

FEATURE_FIELDS = (
    Field("name", ("string",), True, 1, "feature name, e.g. targets or targets_segment_ids"),
    Field("dtype", ("string",), True, 1, "storage dtype of its elements", {"enum": sorted(codec.DTYPES)}),
    Field("vocabulary", ("string",), False, 1, "the key of its entry in vocabularies (token features)"),
    Field("add_eos", ("boolean",), False, 1, "whether the task appends EOS to it (token features)"),
)

CHECKSUM_FILE_FIELDS = (
    Field("file", ("string",), True, 2, "the shard checksum file's name", {"const": SHARD_CHECKSUMS_NAME}),
    Field("num_bytes", ("integer",), True, 2, "its size (bytes)", {"minimum": 0}),
    Field("sha256", ("string",), True, 2, "its sha256, hex", {"pattern": _SHA256_PATTERN}),
)

SHARD_TABLE_FIELDS = (
    Field("num_shards", ("integer",), True, 2, "S, the shard count (shard names follow from index and S)",
          {"minimum": 0}),
    Field("encoding", ("string",), False, 2, "how the integer columns are stored, for humans"),
    Field("num_records", ("string",), True, 2, "records per shard (records), base64 of S little-endian int64",
          {"pattern": _BASE64_PATTERN}),
    Field("num_bytes", ("string",), True, 2, "byte size of each data shard file (bytes), base64 of S int64",
          {"pattern": _BASE64_PATTERN}),
    Field("provenance_num_bytes", ("string",), True, 2,
          "byte size of each provenance shard file (bytes), base64 of S int64", {"pattern": _BASE64_PATTERN}),
    Field("checksums", ("object",), True, 2, "the shard checksum file: name, size and sha256",
          fields=CHECKSUM_FILE_FIELDS),
)

SHARDING_FIELDS = (
    Field("num_shards", ("integer",), True, 1, "the shard count the build chose or was given", {"minimum": 0}),
    Field("shard_size", ("integer", "null"), False, 1, "the target shard size (bytes) it was given, or null"),
    Field("input_bytes", ("integer",), False, 1, "the source files' total size (bytes)", {"minimum": 0}),
    Field("content_bytes", ("integer", "null"), False, 1,
          "the sources' decompressed content size (bytes) where measured, or null"),
)

# The task's evaluation (``seqcache.tasks.Task.evaluation``): what an evaluator runs on the cache.
EVALUATION_FIELDS = (
    Field("metrics", ("array",), True, 3, "the task's metric functions' names, in order",
          {"items": {"type": "string"}}),
    Field("postprocess_fn", ("string", "null"), True, 3, "the task's postprocess function's name, or null"),
    Field("pretokenized", ("array",), True, 3, "the stored features holding the source's text "
          "(<feature>_pretokenized, uint8 UTF-8 bytes)", {"items": {"type": "string"}}),
)

# shard-checksums.json (format version 2), written by ``shard_checksums_json``.
SHARD_CHECKSUMS_FIELDS = (
    Field("num_shards", ("integer",), True, 2, "S, the shard count", {"minimum": 0}),
    Field("sha256", ("array",), True, 2, "sha256 of data shard s at position s, hex",
          {"items": {"type": "string", "pattern": _SHA256_PATTERN}}),
    Field("provenance_sha256", ("array",), True, 2, "sha256 of provenance shard s at position s, hex",
          {"items": {"type": "string", "pattern": _SHA256_PATTERN}}),
)

# The packings (``seqcache.tasks.task.PACKING_MODES``) and vocabulary kinds
# (``seqcache.tasks.vocabulary_from_json``) a manifest may hold; tests compare them.
PACKINGS = ("lm", "first_fit", None)
VOCABULARY_KINDS = ("byte", "sentencepiece", "hf_tokenizer")

# One entry of ``vocabularies`` (``Vocabulary.to_json()``, ``file`` renamed by the build).
VOCABULARY_FIELDS = (
    Field("kind", ("string",), False, 1, "the vocabulary's kind", {"enum": list(VOCABULARY_KINDS)}),
    Field("vocab_size", ("integer",), False, 1, "ids in the vocabulary, extra ids included", {"minimum": 1}),
    Field("extra_ids", ("integer",), False, 1, "sentinel ids appended to the model's", {"minimum": 0}),
    Field("file", ("string",), False, 1, "the model file stored in the cache folder (sentencepiece, hf_tokenizer)"),
    Field("sha256", ("string", "null"), False, 1, "the model file's sha256, hex", {"pattern": _SHA256_PATTERN}),
    Field("eos_token", ("string", "null"), False, 1, "the EOS token's text (hf_tokenizer)"),
    Field("pad_token", ("string", "null"), False, 1, "the pad token's text (hf_tokenizer)"),
    Field("unk_token", ("string", "null"), False, 1, "the unk token's text (hf_tokenizer)"),
)

# One entry of ``sources``, the source file table (``seqcache.tasks.SourceFile`` and the source's locator).
SOURCE_FIELDS = (
    Field("path", ("string",), True, 1, "the file's path or URL"),
    Field("num_bytes", ("integer",), False, 1, "its size (bytes)", {"minimum": 0}),
    Field("mtime_ns", ("integer",), False, 1, "its modification time (nanoseconds since the epoch)"),
    Field("locator", ("string",), False, 1, "what a provenance record's record_number counts in it "
          "(byte_offset, line, row, record, file); record when absent"),
)

_RECORDS = _each(("integer",), "records", {"minimum": 0})
_TOKENS = _each(("integer",), "tokens", {"minimum": 0})
_BY_FEATURE_TOKENS = _each(("array",), "tokens, one per source file", items=_TOKENS)
_HISTOGRAM = _each(("array",), "the non-empty buckets [lo, hi, examples], lo ascending, hi exclusive (tokens)",
                   items=_each(("array",), "[lo, hi, examples]", {"minItems": 3, "maxItems": 3},
                               items=_each(("integer",), "tokens or examples", {"minimum": 0})))

BAD_INPUT_FIELDS = (
    Field("skipped", ("object",), False, 1, "kind -> records skipped (records)", values=_RECORDS),
    Field("replaced", ("object",), False, 1, "kind -> records repaired (records)", values=_RECORDS),
    Field("kept", ("object",), False, 1, "kind -> records kept unchanged (records)", values=_RECORDS),
    Field("records", ("object",), False, 1, "action -> records (records)", values=_RECORDS),
)

SOURCE_FILES_FIELDS = (
    Field("examples", ("array",), True, 1, "source examples per source file (records)", items=_RECORDS),
    Field("tokens", ("object",), True, 1, "feature -> tokens per source file, before packing (tokens)",
          values=_BY_FEATURE_TOKENS),
    Field("units", ("string",), False, 1, "the units, for humans"),
)

# The manifest's ``source_table`` (format version 3): the file that holds the
# per-file source table, checked like the shard checksum file.
SOURCE_TABLE_FILE_FIELDS = (
    Field("file", ("string",), True, 3, "the source table file's name", {"enum": [SOURCE_TABLE_NAME]}),
    Field("num_bytes", ("integer",), True, 3, "its size (bytes)", {"minimum": 0}),
    Field("sha256", ("string",), True, 3, "its sha256, hex", {"pattern": _SHA256_PATTERN}),
    Field("num_files", ("integer",), True, 3, "the source files it lists (files)", {"minimum": 0}),
    Field("fingerprint_files", ("array",), False, 3, "the keys, from the top, of the value of fingerprint_inputs "
          "that it holds (['task', 'source', 'files']); absent when it holds none",
          items=_each(("string",), "a key")),
    Field("inputs_sha256", ("string",), False, 3, "with fingerprint_files: the sha256 of the canonical JSON of "
          "{fingerprint, fingerprint_inputs} as this manifest records them (what opening a cache checks, where "
          "the fingerprint itself needs the file)", {"pattern": _SHA256_PATTERN}),
)

# source-table.json (format version 3), written by ``SourceTable.to_bytes``:
# one column per field of ``SOURCE_FIELDS`` and ``SOURCE_FILES_FIELDS``.
SOURCE_TABLE_FIELDS = (
    Field("num_files", ("integer",), True, 3, "N, the source files (files)", {"minimum": 0}),
    Field("path", ("array",), True, 3, "file i's path or URL at position i (i is a provenance record's "
          "source_index)", items=_each(("string",), "a path or URL")),
    Field("num_bytes", ("array",), False, 3, "each file's size (bytes), null where not recorded",
          items=_each(("integer", "null"), "bytes", {"minimum": 0})),
    Field("mtime_ns", ("array",), False, 3, "each file's modification time (nanoseconds since the epoch), null "
          "where not recorded", items=_each(("integer", "null"), "nanoseconds")),
    Field("locator", ("string", "array"), False, 3, "what record_number counts in the files: one locator for "
          "every file, or one per file (null: record)"),
    Field("examples", ("array",), False, 3, "source examples per file (records); absent when not counted",
          items=_RECORDS),
    Field("tokens", ("object",), False, 3, "feature -> tokens per file, before packing (tokens)",
          values=_BY_FEATURE_TOKENS),
    Field("fingerprint_files", ("object",), False, 3, "the value of fingerprint_inputs at the manifest's "
          "source_table.fingerprint_files: {\"value\": V}, or {\"from_columns\": true} for the list of "
          "{path, num_bytes, mtime_ns} of each file"),
)

# The keys of ``statistics`` that the commands read (``seqcache.pipelines.stats``).
STATISTICS_FIELDS = (
    Field("examples", ("integer",), False, 1, "cached examples (records)", {"minimum": 0}),
    Field("segments", ("integer",), False, 1, "segments, the pieces packed into them (records)", {"minimum": 0}),
    Field("source_examples", ("integer",), False, 1, "preprocessed examples before packing (records)",
          {"minimum": 0}),
    Field("tokens", ("object",), False, 1, "feature -> tokens in the cached examples (tokens)", values=_TOKENS),
    Field("max_length", ("object",), False, 1, "feature -> the longest cached example (tokens)", values=_TOKENS),
    Field("mean_length", ("object",), False, 1, "feature -> the mean cached example (tokens)",
          values=_each(("number",), "tokens", {"minimum": 0})),
    Field("truncated_tokens", ("integer",), False, 1, "tokens trimmed to the sequence length (tokens)",
          {"minimum": 0}),
    Field("length_histogram", ("object",), False, 1, "feature -> histogram of source example lengths",
          values=_HISTOGRAM),
    Field("skipped_records", ("integer",), False, 1, "source records skipped as bad input (records)", {"minimum": 0}),
    Field("units", ("string",), False, 1, "the units, for humans"),
    Field("source_records", ("integer",), False, 1, "source records read (records)", {"minimum": 0}),
    Field("source_files", ("object",), False, 1, "per source file: source examples and tokens",
          fields=SOURCE_FILES_FIELDS),
    Field("replaced_records", ("integer",), False, 1, "source records repaired (records)", {"minimum": 0}),
    Field("bad_input_records", ("object",), False, 1, "records per kind of bad input, by action",
          fields=BAD_INPUT_FIELDS),
    Field("excluded_records", ("integer",), False, 1, "source records excluded for overlapping a benchmark "
          "(records)", {"minimum": 0}),
    Field("excluded_by_benchmark", ("object",), False, 1, "benchmark name -> excluded records that overlap it "
          "(records)", values=_RECORDS),
)


def _field(types: tuple[str, ...], description: str, keywords: Mapping[str, Any] | None = None, *,
           required: bool = False, default: Any = None, show: bool = False, since: int = 1, **kw):
    """A ``Manifest`` attribute that is a field: its ``Field`` in the metadata;
    ``default`` (a value, or a type to call) for an optional one; ``show``: in the repr."""
    meta = {"field": Field("", types, required, since, description, dict(keywords or {}), **kw)}
    given = {} if required else {"default_factory": default} if isinstance(default, type) else {"default": default}
    return dataclasses.field(repr=show, metadata=meta, **given)


# The order ``Manifest.parse`` checks the fields in: the format and version first.
_CHECK_ORDER = ("format", "format_version", "features", "shards", "quarantine", "vocabularies", "sources",
                "source_table", "statistics", "sequence_length", "quarantine_num_bytes", "quarantine_sha256")


@dataclasses.dataclass(kw_only=True)
class Manifest:
    """manifest.json of one cache: the typed model, and the one definition of
    its fields. Each attribute up to ``evaluation`` is a field, in the order it
    is written, its ``Field`` in the attribute's metadata. An optional field a
    manifest lacks has the attribute's default.

    Attributes beyond the fields:
      raw: the whole JSON object, as read or as it is written (keys the
        definition does not list included).
      shard_checksums: (a manifest from ``create``) the bytes of its shard
        checksum file, which ``write`` writes beside it; None when read.
    """

    format: str = _field(("string",), "the format's name", {"const": codec.FORMAT_NAME}, required=True,
                         check=_check_format)
    format_version: int = _field(("integer",), "the version of the cache as a whole: what a reader must understand",
                                 {"enum": list(codec.READ_FORMAT_VERSIONS)}, required=True, check=_check_format_version)
    task: str = _field(("string",), "the task's name", required=True, show=True)
    split: str = _field(("string",), "the split's name", required=True, show=True)
    fingerprint: str = _field(("string",), "sha256 of the canonical JSON of fingerprint_inputs", required=True,
                              show=True)
    seed: int | None = _field(("integer",), "the shuffle seed")
    sequence_length: dict[str, int | None] | int | None = _field(
        ("object", "integer", "null"), "feature -> tokens, or null",
        {"minimum": 1, "additionalProperties": {"type": ["integer", "null"], "minimum": 1}},
        check=_check_sequence_length)
    packing: str | None = _field(("string", "null"), "the packing: lm, first_fit or null", {"enum": list(PACKINGS)})
    writer_options: str | None = _field(("string",), "the ArrayRecord writer options")
    record_encoding: str | None = _field(("string",), "the record encoding, for humans")
    features: tuple[FeatureSpec, ...] = _field(("array",), "the record features, in record order", required=True,
                                               show=True, fields=FEATURE_FIELDS, check=_check_features)
    vocabularies: dict[str, dict] = _field(
        ("object",), "feature -> its vocabulary: kind, vocab_size, extra_ids, ...", default=dict,
        values=_each(("object",), "a vocabulary (Vocabulary.to_json())", fields=VOCABULARY_FIELDS))
    num_examples: int = _field(("integer",), "total examples (records)", {"minimum": 0}, default=0)
    shards: ShardTable = _field(("object",), "the shard table: the shard count and one column per shard field",
                                required=True, show=True, fields=SHARD_TABLE_FIELDS, check=_check_shards)
    statistics: dict[str, Any] = _field(("object",), "counts of the build: examples, tokens, lengths, bad input",
                                        default=dict, fields=STATISTICS_FIELDS)
    sources: list[dict] = _field(("array",), "(format version 2) the source file table, indexed by a provenance "
                                 "record's source_index; version 3 keeps it in source_table's file",
                                 default=list, fields=SOURCE_FIELDS)
    source_table: dict | None = _field(("object",), "the source table file: per source file its path, size, "
                                       "mtime, locator, examples and tokens (read only by what needs them)",
                                       fields=SOURCE_TABLE_FILE_FIELDS, since=3)
    fingerprint_inputs: dict | None = _field(("object",), "what the fingerprint is computed from")
    created: str | None = _field(("string",), "when it was written, ISO 8601, UTC")
    seqcache_version: str | None = _field(("string",), "the seqcache release that wrote it")
    quarantine: str | None = _field(("string", "null"), "quarantine.jsonl when records were skipped, repaired or "
                                    "excluded, else null", {"enum": [codec.QUARANTINE_NAME, None]},
                                    check=_check_quarantine)
    quarantine_num_bytes: int | None = _field(("integer", "null"), "the quarantine file's size (bytes)",
                                              {"minimum": 0}, check=_check_quarantine_num_bytes)
    quarantine_sha256: str | None = _field(("string", "null"), "the quarantine file's sha256, hex",
                                           {"pattern": _SHA256_PATTERN}, check=_check_quarantine_sha256)
    sharding: dict | None = _field(("object",), "how the build chose its shard count", fields=SHARDING_FIELDS)
    evaluation: dict | None = _field(("object", "null"), "the task's metrics and postprocess function, or null "
                                     "for a task without", fields=EVALUATION_FIELDS, since=3)

    raw: dict = dataclasses.field(default_factory=dict, repr=False)  # the whole JSON: too long to print
    shard_checksums: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    source_table_bytes: bytes | None = dataclasses.field(default=None, repr=False, compare=False)
    cache_dir: str | None = dataclasses.field(default=None, repr=False, compare=False)
    _sources: "SourceTable | None" = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def num_sources(self) -> int:
        """The source files of the cache (files), from the manifest alone:
        ``source_table.num_files``, or the length of an inline ``sources``."""
        if self.source_table is not None:
            return int(self.source_table["num_files"])
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
        keys = (self.source_table or {}).get("fingerprint_files")
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
        """Checks a decoded manifest.json field by field against
        ``MANIFEST_FIELDS``, then its counts (``num_examples`` and
        ``statistics.examples`` against the shard table; with ``check_shards``,
        each shard's byte sizes against its records) and its fingerprint
        (``check_fingerprint``). Cost: O(number of shards) in numpy operations.

        Args:
          raw: the decoded manifest.json.
          path: the manifest's path, for messages.
          check_shards: decode and check the shard byte-size columns now (else
            each shard's sizes at its first read: what ``read`` does).

        Raises:
          CacheError: ``{path}: ...`` naming the first bad field: not an object;
            wrong format or format_version (a version-1 cache is refused with
            the advice to rebuild it); a required field missing (``missing
            field 'task'``); a field of the wrong JSON type or value; counts or
            a fingerprint that contradict each other.
        """
        codec.require(isinstance(raw, dict), path, "manifest is not a JSON object")
        ctx = {"path": path, "check_shards": check_shards}
        decoded: dict[str, Any] = {}
        order = list(_CHECK_ORDER) + [f.name for f in MANIFEST_FIELDS if f.name not in _CHECK_ORDER]
        for i, name in enumerate(order):
            if i == 2:  # after format and format_version: every required field is there
                for f in MANIFEST_FIELDS:
                    codec.require(not f.required or f.name in raw, path, f"missing field {f.name!r}")
            field = FIELDS_BY_NAME[name]
            if name not in raw and not field.required:
                continue
            value = raw.get(name)
            if field.check is not None:
                result = field.check(value, ctx)
                if result is not None:
                    decoded[name] = result
            else:
                check_value(field, value, path)
        _check_counts(raw, decoded["shards"], path, decoded["features"], check_shards=check_shards)
        check_fingerprint(raw, path, decoded["features"])
        values = {name: decoded.get(name, raw[name]) for name in FIELDS_BY_NAME if name in raw}
        values["num_examples"] = int(decoded["shards"].starts[-1])
        return cls(**values, raw=raw)

    @classmethod
    def read(cls, cache_dir: str) -> "Manifest":
        """Reads ``cache_dir/manifest.json`` (a local path or a URL) through
        ``seqcache.bounded_json`` and ``parse``-s it (``check_shards=False``).

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
        manifest = cls.parse(raw, path=path, check_shards=False)
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
        keys their definitions list.

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
            "features": [assemble(f, FEATURE_FIELDS, what=f"features[{i}]") for i, f in enumerate(features)],
            "num_examples": int(sum(int(s["num_records"]) for s in shards)), "shards": table,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seqcache_version": __version__, **fields}
        if "sharding" in values:
            values["sharding"] = assemble(values["sharding"], SHARDING_FIELDS, what="sharding")
        manifest = cls.parse(assemble(values))
        manifest.shard_checksums = checksums
        manifest.source_table_bytes = sources_bytes
        manifest._sources = sources
        return manifest

    def to_json(self) -> str:
        """manifest.json's text: ``raw`` indented by 2, keys in their order, and a newline."""
        return json.dumps(self.raw, indent=2, ensure_ascii=False) + "\n"

    def write(self, cache_dir: str) -> None:
        """Writes the shard checksum file, the source table file, then
        manifest.json, each atomically
        (``seqcache.fs.write_bytes_atomic``): the last step of every build, so a
        build killed before it leaves no folder that looks complete (G7).

        Raises:
          ValueError: a manifest that was read, not made by ``create``.
        """
        if self.shard_checksums is None or self.source_table_bytes is None:
            raise ValueError(f"{cache_dir}: only a manifest from Manifest.create is written (this one was read)")
        fs.write_bytes_atomic(fs.join(cache_dir, SHARD_CHECKSUMS_NAME), self.shard_checksums)
        fs.write_bytes_atomic(fs.join(cache_dir, SOURCE_TABLE_NAME), self.source_table_bytes)
        fs.write_bytes_atomic(fs.join(cache_dir, MANIFEST_NAME), self.to_json().encode("utf-8"))


MANIFEST_FIELDS = tuple(dataclasses.replace(f.metadata["field"], name=f.name) for f in dataclasses.fields(Manifest)
                        if "field" in f.metadata)
FIELDS_BY_NAME = {f.name: f for f in MANIFEST_FIELDS}


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
    table = assemble(fields=SHARD_TABLE_FIELDS, values={
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
    obj = assemble({"num_shards": len(sha256), "sha256": sha256, "provenance_sha256": provenance_sha256},
                   SHARD_CHECKSUMS_FIELDS, what=SHARD_CHECKSUMS_NAME)
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


def _is_column(values: Any, test: Callable[[Any], bool]) -> bool:
    return isinstance(values, list) and all(map(test, values))


def _is_count_or_null(v) -> bool:
    return v is None or (type(v) is int and 0 <= v < MAX_INTEGER)


def _is_int_or_null(v) -> bool:
    return v is None or (type(v) is int and -2**63 <= v < 2**63)


def _is_count_value(v) -> bool:
    return type(v) is int and 0 <= v < MAX_INTEGER


def _is_int_column(values: Any, low: int, high: int, *, nulls: bool = False) -> bool:
    """``values`` is a list of ints in ``[low, high)`` (and None, with
    ``nulls``): one pass over the types, then min and max (what
    ``_is_column`` tests one value at a time)."""
    if not isinstance(values, list):
        return False
    types = set(map(type, values))
    if not types <= ({int, type(None)} if nulls else {int}):
        return False
    ints = [v for v in values if v is not None] if type(None) in types else values
    return not ints or (min(ints) >= low and max(ints) < high)


def _is_count_column(values: Any) -> bool:
    """``_is_column(values, _is_count_value)``, in one pass over the types."""
    return _is_int_column(values, 0, MAX_INTEGER)


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
    field, ``SOURCE_TABLE_FIELDS``), checked against the manifest's
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
        per field (``SOURCE_TABLE_FIELDS``); a locator shared by every file is
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
        (UTF-8), one line and a newline; as deterministic as the file listing."""
        return (json.dumps(self.to_json(), separators=(",", ":"), ensure_ascii=False) + "\n").encode("utf-8")

    @classmethod
    def from_json(cls, obj: Any, *, path: str = SOURCE_TABLE_NAME) -> "SourceTable":
        """The table of a decoded source table file, checked column by column.

        Raises:
          CacheError: ``{path}: ...`` naming the first bad field: not an object,
            a missing column, a column of another length than ``num_files`` or
            holding a value of the wrong type.
        """
        codec.require(isinstance(obj, dict), path, "the source table file is not a JSON object")
        n = obj.get("num_files")
        codec.require(_is_count_value(n), path, f"num_files is {_short(n)}, expected an integer >= 0")
        checks = (("path", lambda v: isinstance(v, str), True, "strings"),
                  ("num_bytes", _is_count_or_null, False, "integers >= 0 or null"),
                  ("mtime_ns", _is_int_or_null, False, "integers or null"),
                  ("examples", _is_count_value, False, "integers >= 0"))
        quick = {"num_bytes": lambda c: _is_int_column(c, 0, MAX_INTEGER, nulls=True),
                 "mtime_ns": lambda c: _is_int_column(c, -2**63, 2**63, nulls=True), "examples": _is_count_column}
        for key, test, required, what in checks:
            if key not in obj:
                codec.require(not required, path, f"missing field {key!r}")
                continue
            column = obj[key]
            ok = quick[key](column) if key in quick else _is_column(column, test)
            codec.require(ok and len(column) == n, path,
                           f"{key} is {_short(column)}, expected a JSON list of {n} {what}")
        locator = obj.get("locator")
        codec.require(locator is None or isinstance(locator, str)
                       or (_is_column(locator, lambda v: v is None or isinstance(v, str)) and len(locator) == n),
                       path, f"locator is {_short(locator)}, expected a string or a JSON list of {n} strings or null")
        tokens = obj.get("tokens")
        if tokens is not None:
            codec.require(isinstance(tokens, dict), path, f"tokens is {_short(tokens)}, expected a JSON object")
            for name, column in tokens.items():
                codec.require(_is_count_column(column) and len(column) == n, path,
                               f"tokens.{name} is {_short(column)}, expected a JSON list of {n} integers >= 0")
        codec.require((tokens is None) == ("examples" not in obj), path,
                       "examples and tokens go together: one of them is missing")
        moved = obj.get("fingerprint_files")
        codec.require(moved is None or (isinstance(moved, dict) and (moved.get("from_columns") is True
                                                                    or "value" in moved)), path,
                       f"fingerprint_files is {_short(moved)}, expected {{\"value\": ...}} or "
                       "{\"from_columns\": true}")
        return cls.from_columns(obj["path"], obj.get("num_bytes"), obj.get("mtime_ns"), locator,
                                examples=obj.get("examples"), tokens=tokens, fingerprint_files=moved, path=path)


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
    """``check_value`` of each entry of a build's ``sources`` against
    ``SOURCE_FIELDS``, for the entries that fail a quick test of every field
    at once (one pass of comprehensions: a build of a million files checks
    them in well under a second, where a ``check_value`` of each takes ten).

    Raises:
      CacheError: naming the first bad entry and its field (``sources[3].path``).
    """
    plausible = [(type(e) is dict or isinstance(e, Mapping)) and type(e.get("path")) is str  # one pass
                 and type(e.get("num_bytes", 0)) is int and 0 <= e.get("num_bytes", 0) < MAX_INTEGER
                 and type(e.get("mtime_ns", 0)) is int and -2**63 <= e.get("mtime_ns", 0) < 2**63
                 and type(e.get("locator", "")) is str for e in entries]
    for i in (i for i, ok in enumerate(plausible) if not ok):  # only the bad ones (if any) in detail
        e = entries[i]
        if not isinstance(e, Mapping):
            raise CacheError(f"{MANIFEST_NAME}: sources[{i}] is {_short(e)}, expected a JSON object")
        for f in SOURCE_FIELDS:
            if f.name in e:
                check_value(f, e[f.name], MANIFEST_NAME, f"sources[{i}].")
            elif f.required:
                raise CacheError(f"{MANIFEST_NAME}: sources[{i}]: missing field {f.name!r}")
        raise CacheError(f"{MANIFEST_NAME}: sources[{i}] is {_short(e)}, expected a source file entry")


def _check_source_columns(table: SourceTable) -> None:
    """``_check_sources`` of a table given as columns (``SourceTable.from_columns``):
    one pass over each column's types, entry by entry only when one fails."""
    locators = table.locators
    if (set(map(type, table.paths)) <= {str}
            and (table.num_bytes is None or _is_int_column(table.num_bytes, 0, MAX_INTEGER, nulls=True))
            and (table.mtime_ns is None or _is_int_column(table.mtime_ns, -2**63, 2**63, nulls=True))
            and (locators is None or isinstance(locators, str) or set(map(type, locators)) <= {str, type(None)})):
        return
    _check_sources(list(table))


def _check_source_files(per_file: Any) -> None:
    """``check_value`` of a build's ``statistics.source_files``, its long
    columns first tested in one pass each. Raises CacheError as ``check_value``."""
    field = next(f for f in STATISTICS_FIELDS if f.name == "source_files")
    if (isinstance(per_file, dict) and _is_count_column(per_file.get("examples"))
            and isinstance(per_file.get("tokens"), dict)
            and all(_is_count_column(v) for v in per_file["tokens"].values())):
        short = {k: v for k, v in per_file.items() if k not in ("examples", "tokens")}
        check_value(field, {**short, "examples": [], "tokens": {}}, MANIFEST_NAME, "statistics.")
        return
    check_value(field, per_file, MANIFEST_NAME, "statistics.")


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
        per_file = manifest.statistics.get("source_files")
        per_file = per_file if isinstance(per_file, dict) else {}
        where = MANIFEST_NAME if manifest.cache_dir is None else fs.join(manifest.cache_dir, MANIFEST_NAME)
        return SourceTable(manifest.sources, examples=per_file.get("examples"), tokens=per_file.get("tokens"),
                           path=where, prefix="statistics.source_files.")
    if cache_dir is None:
        raise ValueError("read_source_table: the manifest keeps its source table in a file; give the cache folder")
    path, data = _read_recorded_file(cache_dir, recorded, "source table file",
                                     missing=f" for {recorded['num_files']:,} source files); rebuild the cache")
    obj = bounded_json.loads(data, path=path, error=CacheError, what="source table file",
                             max_bytes=max(bounded_json.MAX_BYTES, len(data)),
                             max_nodes=bounded_json.MAX_NODES + 8 * recorded["num_files"])
    table = SourceTable.from_json(obj, path=path)
    if len(table) != recorded["num_files"]:
        raise CacheError(f"{path}: lists {len(table):,} source files, the manifest's source_table.num_files is "
                         f"{recorded['num_files']:,}")
    if recorded.get("fingerprint_files") and table.fingerprint_files is None:
        raise CacheError(f"{path}: holds no fingerprint_files, but the manifest's source_table.fingerprint_files "
                         f"is {recorded['fingerprint_files']}")
    return table


def check_fingerprint(raw: Mapping[str, Any], path: str, features) -> None:
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
    inputs = raw.get("fingerprint_inputs")
    if inputs is None:
        return
    fingerprint = raw["fingerprint"]
    shown = repr(fingerprint) if len(fingerprint) <= 80 else _short(fingerprint)  # a sha256 is 64 characters
    record = raw.get("source_table") or {}
    if record.get("fingerprint_files"):
        # Part of the inputs is in the source table file, which opening does not
        # read: the manifest's own digest of the rest here, the fingerprint in verify.
        actual = inputs_sha256(fingerprint, inputs)
        codec.require(record.get("inputs_sha256") == actual, path,
                       f"fingerprint = {shown}, but the sha256 of fingerprint_inputs (its file list in "
                       f"{SOURCE_TABLE_NAME}) with the fingerprint is {actual!r}, not source_table.inputs_sha256 = "
                       f"{_short(record.get('inputs_sha256'))}: the manifest was edited or damaged; rebuild the cache")
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


def _check_counts(raw: Mapping[str, Any], table: ShardTable, path: str, features, *, check_shards: bool) -> None:
    """Refuses a shard record count out of range, ``num_examples`` or
    ``statistics.examples`` other than the shard table's total and, with
    ``check_shards``, what ``check_shard_sizes`` refuses."""
    counts = table.num_records
    if len(counts) and int(counts.max()) >= MAX_SHARD_RECORDS:
        i = int(np.argmax(counts >= MAX_SHARD_RECORDS))
        raise CacheError(f"{path}: shards[{i}].num_records = {int(counts[i])}, expected an integer in "
                             f"[0, {bounded_json.bound(MAX_SHARD_RECORDS)})")
    total = int(counts.sum(dtype=np.int64))
    for name, value in (("num_examples", raw.get("num_examples")),
                        ("statistics.examples", (raw.get("statistics") or {}).get("examples"))):
        codec.require(value is None or value == total, path,
                     f"{name} = {value}, but the shard table's record counts add up to {total:,}: the manifest "
                     "contradicts itself (edited or damaged); rebuild the cache")
    if check_shards:
        check_shard_sizes(raw, table, path, features)


def check_shard_sizes(raw: Mapping[str, Any], table: ShardTable, path: str, features) -> None:
    """(Uncompressed shards) Refuses a shard whose byte size cannot hold its
    records: each record holds at least a 4-byte length per feature, each
    provenance record 12 bytes. Decodes every shard's sizes.

    Raises:
      seqcache.format.CacheError: naming the manifest, the shard and both values.
    """
    counts = table.num_records
    if "uncompressed" not in str(raw.get("writer_options", "")):
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


def assemble(values: Mapping[str, Any], fields: Sequence[Field] | None = None, *, what: str = "manifest") -> dict:
    """The JSON object of ``values``, its keys in the order of ``fields``
    (default ``MANIFEST_FIELDS``). A field given as None is written as null; a
    field not given is not written.

    Raises:
      ValueError: a key that is not among ``fields``, or a required field
        missing; naming ``what``.
    """
    fields = MANIFEST_FIELDS if fields is None else fields
    names = [f.name for f in fields]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ValueError(f"{what} field(s) {unknown} are not in the manifest schema (core/manifest.py): "
                         f"add them there first (known: {', '.join(names)})")
    missing = [f.name for f in fields if f.required and f.name not in values]
    if missing:
        raise ValueError(f"{what} lacks the required field(s) {missing}")
    return {n: values[n] for n in names if n in values}


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of manifest.json, from ``MANIFEST_FIELDS``;
    ``$defs.shard_checksums`` is that of shard-checksums.json, ``$defs.source_table``
    that of source-table.json."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "seqcache cache manifest (manifest.json)",
        "description": f"Generated from core/manifest.py (python -m seqcache.manifest --write); "
                       f"format version {', '.join(map(str, codec.READ_FORMAT_VERSIONS))}. See docs/cache-format.md.",
        "type": "object",
        **object_schema(MANIFEST_FIELDS),
        "$defs": {"shard_checksums": {"title": "seqcache shard checksum file (shard-checksums.json)", "type": "object",
                                      **object_schema(SHARD_CHECKSUMS_FIELDS)},
                  "source_table": {"title": f"seqcache source table file ({SOURCE_TABLE_NAME})", "type": "object",
                                   **object_schema(SOURCE_TABLE_FIELDS)}},
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
      CacheError: the file is missing (the message ends with ``missing``), or
        its size or sha256 differs from the record, naming the file.
    """
    path = layout.cache_file(cache_dir, recorded["file"], what=what)
    if not fs.exists(path):
        raise CacheError(f"{path}: {what} is missing (the manifest lists it with {recorded['num_bytes']} bytes{missing}")
    data = fs.read_bytes(path)
    if len(data) != recorded["num_bytes"]:
        raise CacheError(f"{path}: {what} has {len(data)} bytes, the manifest expects {recorded['num_bytes']}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded["sha256"]:
        raise CacheError(f"{path}: {what} has sha256 {actual}, the manifest expects {recorded['sha256']}")
    return path, data
