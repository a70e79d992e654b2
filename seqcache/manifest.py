"""The fields of manifest.json and of shard-checksums.json: the one definition.

``MANIFEST_FIELDS`` lists every field a manifest may hold, in the order the
writer writes them: its name, JSON type(s), whether a reader requires it, the
format version that introduced it and a one-line description. Everything else
comes from it:

- the writer builds the manifest through ``assemble`` (a field not listed here
  cannot be written, and the keys come out in this order);
- the readers check a manifest through ``check_manifest``, called by
  ``seqcache.format.parse_manifest`` (the feeder, ``verify``, ``info``,
  ``show``, ``which``, ``report``): every field's JSON type, and for the fields
  with a ``check`` that field's own rules and messages;
- the published JSON Schema ``manifest.schema.json`` (installed with the
  package) is ``json_schema()``; regenerate it with
  ``python -m seqcache.manifest --write`` (``--check`` says whether it is up to
  date);
- docs/cache-format.md's field tables are tested against it.

Nested objects are lists of ``Field`` too: the shard table (format version 2),
its checksum file entry, a shard entry (format version 1), a feature, the
build's sharding summary, and the shard checksum file. Their readers'
checks live with the code that decodes them (``seqcache.format.ShardTable``,
``FeatureSpec``, ``read_shard_checksums``); tests check that their field names
are these. A vocabulary entry, a source file entry and the keys of
``statistics`` that the commands read (with their own nested objects) are
checked by ``check_manifest`` itself, the generic way: a reader refuses a
wrong value there with one ``CacheError`` naming it
(``manifest.json: statistics.tokens is 'x', expected a JSON object``), before
any command uses it. Keys a definition does not list are allowed everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

from seqcache import bounded_json
from seqcache import codec

# JSON type name -> the Python test of a value decoded by ``json.loads``.
_IS = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}
_SHA256_PATTERN = "^[0-9a-f]{64}$"
_BASE64_PATTERN = "^[A-Za-z0-9+/]*={0,2}$"
SCHEMA_NAME = "manifest.schema.json"


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a JSON object of the cache format.

    Attributes:
      name: the key.
      type: the JSON types its value may have (``"string"``, ``"integer"``,
        ``"number"``, ``"boolean"``, ``"object"``, ``"array"``, ``"null"``).
      required: a reader refuses the object without it (``missing field``).
      since: the ``format_version`` that introduced it.
      description: one line, for the JSON Schema and the docs.
      keywords: further JSON Schema keywords of its value (``const``, ``enum``,
        ``minimum``, ``pattern``, ``items``, ``additionalProperties``...).
        Readers without a ``check`` test ``minimum``, ``pattern``, ``enum``,
        ``minItems`` and ``maxItems`` too.
      fields: the fields of the value (an object), or of each item (an array
        of objects).
      values: the field of each member of an object keyed by name (feature ->
        tokens, ...); its ``name`` is unused. JSON Schema ``additionalProperties``.
      items: the field of each item of an array whose items are not objects
        with ``fields`` (numbers, lists); its ``name`` is unused.
      check: the reader's check of the value instead of the generic one:
        ``check(value, context)`` raises ``seqcache.format.CacheError`` with
        the field's own message and may return a decoded value (``context``:
        ``path``, ``version``, ``check_shards``).
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
    """The JSON Schema of an object with ``fields`` (others allowed: readers
    ignore fields they do not know)."""
    out: dict[str, Any] = {"properties": {f.name: f.schema() for f in fields}}
    required = [f.name for f in fields if f.required]
    if required:
        out["required"] = required
    return out


def _what(types: Sequence[str]) -> str:
    words = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
             "object": "a JSON object", "array": "a JSON list", "null": "null"}
    names = [words[t] for t in types]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _short(value: Any) -> str:
    return bounded_json.short(value)


# Every count of a manifest (an integer with a ``minimum``) is below this
# (exact in a double, summable in int64) unless its definition gives a
# ``maximum``; any other integer lies in the int64 range.
MAX_INTEGER = bounded_json.MAX_COUNT
# The largest shard count, record count of one shard and sequence length a
# reader accepts (far above what a build writes; far below what overflows).
MAX_SHARDS = 2**20
MAX_SHARD_RECORDS = 2**40
MAX_SEQUENCE_LENGTH = bounded_json.MAX_SEQUENCE_LENGTH


def _allowed(values: Sequence[Any]) -> str:
    names = ["null" if v is None else repr(v) for v in values]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_value(field: Field, value: Any, path: str, where: str = "", *, name: str | None = None) -> None:
    """The generic reader check of one field's value: its JSON type, then
    ``minimum``, ``pattern``, ``enum``, ``minItems`` and ``maxItems`` where
    given, then its ``fields`` (an object's, or each item's of an array), its
    ``values`` (each member's) and its ``items`` (each item's).

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
        # A count (a minimum of 0 or more) is below 2^53, any other integer in int64.
        hi = kw.get("maximum", MAX_INTEGER if "minimum" in kw else 2**63)
        if not -2**63 <= value < hi:
            lo = f"{kw['minimum']}" if "minimum" in kw else "-2^63"
            raise codec.CacheError(f"{path}: {name} = {_short(value)}, expected an integer in "
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
            expected = _allowed(kw["enum"])
        else:
            expected = _what(field.type) + (f" >= {kw['minimum']}" if "minimum" in kw else "")
            if "minItems" in kw and kw.get("maxItems") == kw["minItems"]:
                expected += f" of {kw['minItems']} items"
        raise codec.CacheError(f"{path}: {name} is {_short(value)}, expected {expected}")
    if field.fields:
        items = value if isinstance(value, list) else [value] if isinstance(value, dict) else []
        for i, item in enumerate(items):
            prefix = f"{name}[{i}]." if isinstance(value, list) else f"{name}."
            if not isinstance(item, dict):
                raise codec.CacheError(f"{path}: {prefix[:-1]} is {_short(item)}, expected a JSON object")
            for sub in field.fields:
                if sub.name in item:
                    check_value(sub, item[sub.name], path, prefix)
                elif sub.required:
                    raise codec.CacheError(f"{path}: {prefix[:-1]}: missing field {sub.name!r}")
    if field.values is not None and isinstance(value, dict):
        for key, member in value.items():
            check_value(field.values, member, path, name=f"{name}.{key}")
    if field.items is not None and isinstance(value, list):
        for i, item in enumerate(value):
            check_value(field.items, item, path, name=f"{name}[{i}]")


# -- The readers' own checks of some fields (their messages are part of the format's interface).

def _check_format(value, ctx):
    codec._require(value == codec.FORMAT_NAME, ctx["path"], f"format is {_short(value)}, expected {codec.FORMAT_NAME!r}")


def _check_format_version(value, ctx):
    codec._require(
        value in codec.READ_FORMAT_VERSIONS and not isinstance(value, bool),
        ctx["path"],
        f"format_version is {_short(value)}, this seqcache reads versions "
        f"{', '.join(map(str, codec.READ_FORMAT_VERSIONS))}: read the cache with the seqcache release that wrote it, "
        "or rebuild it with this one (seqcache build ... --overwrite)",
    )


def _check_features(value, ctx):
    path = ctx["path"]
    codec._require(isinstance(value, list), path, f"bad features entry: features is {type(value).__name__}, "
                 "expected a JSON list")
    try:
        for f in value:
            for key, types in (("name", ("string",)), ("vocabulary", ("string",)), ("add_eos", ("boolean",))):
                if key in f and not any(_IS[t](f[key]) for t in types):
                    raise ValueError(f"{key} is {_short(f[key])}, expected {_what(types)}")
        return tuple(codec.FeatureSpec(f["name"], f["dtype"]) for f in value)
    except (KeyError, TypeError, ValueError) as e:
        raise codec.CacheError(f"{path}: bad features entry: {e}") from None


def _check_shards(value, ctx):
    path = ctx["path"]
    if isinstance(value, dict):
        count = value.get("num_shards")
        codec._require(not (_IS["integer"](count) and count >= MAX_SHARDS), path,
                     f"shards.num_shards = {_short(count)}, expected an integer in [0, {bounded_json.bound(MAX_SHARDS)})")
    table = codec.ShardTable(value, path=path, version=ctx["version"])
    if table.version == 2:
        encoding = value.get("encoding")
        codec._require(encoding is None or isinstance(encoding, str), path,
                     f"shards.encoding is {_short(encoding)}, expected a string")
    if ctx["check_shards"]:
        table.check_all()
    return table


def _is_token_count(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 < v < MAX_SEQUENCE_LENGTH)


def _check_sequence_length(value, ctx):
    codec._require(_is_token_count(value) or (isinstance(value, dict) and all(map(_is_token_count, value.values()))),
                 ctx["path"], f"sequence_length is {_short(value)}, expected null, a token count in [1, "
                 f"{bounded_json.bound(MAX_SEQUENCE_LENGTH)}) or {{feature: token count}}")


def _check_quarantine(value, ctx):
    codec._require(
        value in (None, codec.QUARANTINE_NAME),
        ctx["path"],
        f"quarantine is {_short(value)}, expected {codec.QUARANTINE_NAME!r} or null (a plain file name inside the cache folder)",
    )


def _check_quarantine_num_bytes(value, ctx):
    codec._require(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                   and 0 <= value < MAX_INTEGER),
                 ctx["path"], f"quarantine_num_bytes is {_short(value)}, expected a byte count in [0, 2^53)")


def _check_quarantine_sha256(value, ctx):
    codec._require(value is None or (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) is not None),
                 ctx["path"], f"quarantine_sha256 is {_short(value)}, expected 64 hex digits")


# -- The fields.

FEATURE_FIELDS = (
    Field("name", ("string",), True, 1, "feature name, e.g. targets or targets_segment_ids"),
    Field("dtype", ("string",), True, 1, "storage dtype of its elements", {"enum": sorted(codec._DTYPES)}),
    Field("vocabulary", ("string",), False, 1, "the key of its entry in vocabularies (token features)"),
    Field("add_eos", ("boolean",), False, 1, "whether the task appends EOS to it (token features)"),
)

CHECKSUM_FILE_FIELDS = (
    Field("file", ("string",), True, 2, "the shard checksum file's name", {"const": codec.SHARD_CHECKSUMS_NAME}),
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

# Format version 1: one object per shard (``seqcache.format.ShardInfo``).
SHARD_ENTRY_FIELDS = (
    Field("file", ("string",), True, 1, "the data shard's file name"),
    Field("num_records", ("integer",), True, 1, "its records (records)", {"minimum": 0}),
    Field("num_bytes", ("integer",), True, 1, "its size (bytes)", {"minimum": 0}),
    Field("sha256", ("string",), True, 1, "its sha256, hex"),
    Field("provenance_file", ("string",), True, 1, "the provenance shard's file name"),
    Field("provenance_num_bytes", ("integer",), True, 1, "its size (bytes)", {"minimum": 0}),
    Field("provenance_sha256", ("string",), True, 1, "its sha256, hex"),
)

SHARDING_FIELDS = (
    Field("num_shards", ("integer",), True, 1, "the shard count the build chose or was given", {"minimum": 0}),
    Field("shard_size", ("integer", "null"), False, 1, "the target shard size (bytes) it was given, or null"),
    Field("input_bytes", ("integer",), False, 1, "the source files' total size (bytes)", {"minimum": 0}),
    Field("content_bytes", ("integer", "null"), False, 1,
          "the sources' decompressed content size (bytes) where measured, or null"),
)

# shard-checksums.json (format version 2), written by ``seqcache.format.shard_checksums_json``.
SHARD_CHECKSUMS_FIELDS = (
    Field("num_shards", ("integer",), True, 2, "S, the shard count", {"minimum": 0}),
    Field("sha256", ("array",), True, 2, "sha256 of data shard s at position s, hex",
          {"items": {"type": "string", "pattern": _SHA256_PATTERN}}),
    Field("provenance_sha256", ("array",), True, 2, "sha256 of provenance shard s at position s, hex",
          {"items": {"type": "string", "pattern": _SHA256_PATTERN}}),
)

# The packings a cache may have (``seqcache.tasks.task.PACKING_MODES``) and the
# vocabulary kinds a manifest may describe (those ``seqcache.tasks.vocabulary_from_json``
# rebuilds); tests check both against the code that uses them.
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

# The keys of ``statistics`` that the commands read (``seqcache.pipelines.stats``);
# a manifest may hold others.
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

_V2_SHARDS = {"type": "object", **object_schema(SHARD_TABLE_FIELDS)}
_V1_SHARDS = {"type": "array", "items": {"type": "object", **object_schema(SHARD_ENTRY_FIELDS)}}

MANIFEST_FIELDS = (
    Field("format", ("string",), True, 1, "the format's name", {"const": codec.FORMAT_NAME}, check=_check_format),
    Field("format_version", ("integer",), True, 1, "the version of the cache as a whole: what a reader must understand",
          {"enum": list(codec.READ_FORMAT_VERSIONS)}, check=_check_format_version),
    Field("task", ("string",), True, 1, "the task's name"),
    Field("split", ("string",), True, 1, "the split's name"),
    Field("fingerprint", ("string",), True, 1, "sha256 of the canonical JSON of fingerprint_inputs"),
    Field("seed", ("integer",), False, 1, "the shuffle seed"),
    Field("sequence_length", ("object", "integer", "null"), False, 1, "feature -> tokens, or null",
          {"minimum": 1, "additionalProperties": {"type": ["integer", "null"], "minimum": 1}},
          check=_check_sequence_length),
    Field("packing", ("string", "null"), False, 1, "the packing: lm, first_fit or null",
          {"enum": list(PACKINGS)}),
    Field("writer_options", ("string",), False, 1, "the ArrayRecord writer options"),
    Field("record_encoding", ("string",), False, 1, "the record encoding, for humans"),
    Field("features", ("array",), True, 1, "the record features, in record order", fields=FEATURE_FIELDS,
          check=_check_features),
    Field("vocabularies", ("object",), False, 1, "feature -> its vocabulary: kind, vocab_size, extra_ids, ...",
          values=_each(("object",), "a vocabulary (Vocabulary.to_json())", fields=VOCABULARY_FIELDS)),
    Field("num_examples", ("integer",), False, 1, "total examples (records)", {"minimum": 0}),
    Field("shards", ("object", "array"), True, 1,
          "the shard table: columns (format version 2), or one object per shard (format version 1)",
          check=_check_shards),
    Field("statistics", ("object",), False, 1, "counts of the build: examples, tokens, lengths, bad input",
          fields=STATISTICS_FIELDS),
    Field("sources", ("array",), False, 1, "the source file table, indexed by a provenance record's source_index",
          fields=SOURCE_FIELDS),
    Field("fingerprint_inputs", ("object",), False, 1, "what the fingerprint is computed from"),
    Field("created", ("string",), False, 1, "when it was written, ISO 8601, UTC"),
    Field("seqcache_version", ("string",), False, 1, "the seqcache release that wrote it"),
    Field("quarantine", ("string", "null"), False, 1, "quarantine.jsonl when records were skipped, repaired or "
          "excluded, else null",
          {"enum": [codec.QUARANTINE_NAME, None]}, check=_check_quarantine),
    Field("quarantine_num_bytes", ("integer", "null"), False, 1, "the quarantine file's size (bytes)",
          {"minimum": 0}, check=_check_quarantine_num_bytes),
    Field("quarantine_sha256", ("string", "null"), False, 1, "the quarantine file's sha256, hex",
          {"pattern": _SHA256_PATTERN}, check=_check_quarantine_sha256),
    Field("sharding", ("object",), False, 1, "how the build chose its shard count", fields=SHARDING_FIELDS),
)
FIELDS_BY_NAME = {f.name: f for f in MANIFEST_FIELDS}
# The order in which ``check_manifest`` checks the fields (the format first: a
# cache of another format or version is named as such before anything else).
_CHECK_ORDER = ("format", "format_version", "features", "shards", "quarantine", "vocabularies", "sources",
                "statistics", "sequence_length", "quarantine_num_bytes", "quarantine_sha256")


def check_manifest(raw: Any, *, path: str = codec.MANIFEST_NAME, check_shards: bool = True) -> dict[str, Any]:
    """Checks a manifest dict field by field against ``MANIFEST_FIELDS``.

    Args:
      raw: the decoded manifest.json.
      path: the manifest's path, for messages.
      check_shards: check every shard entry now (else some at first use; see
        ``seqcache.format.ShardTable``).

    Returns:
      field name -> its decoded value, for the fields whose check decodes one:
      ``features`` (a tuple of ``FeatureSpec``) and ``shards`` (a ``ShardTable``).

    Raises:
      seqcache.format.CacheError: ``{path}: ...`` naming the first bad field:
        not an object; wrong format or format_version; a required field
        missing (``missing field 'task'``); a field of the wrong JSON type or
        value.
    """
    codec._require(isinstance(raw, dict), path, "manifest is not a JSON object")
    ctx = {"path": path, "version": None, "check_shards": check_shards}
    decoded: dict[str, Any] = {}
    order = list(_CHECK_ORDER) + [f.name for f in MANIFEST_FIELDS if f.name not in _CHECK_ORDER]
    for i, name in enumerate(order):
        if i == 2:  # after format and format_version: every required field is there
            ctx["version"] = raw["format_version"]
            for f in MANIFEST_FIELDS:
                codec._require(not f.required or f.name in raw, path, f"missing field {f.name!r}")
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
    return decoded


def check_fingerprint(raw: Mapping[str, Any], path: str, features) -> None:
    """Refuses a manifest whose identity contradicts itself (edited or damaged):
    ``fingerprint`` that is not the sha256 of the canonical JSON of
    ``fingerprint_inputs`` (``seqcache.format.fingerprint_of``, as the build
    computes it), or a ``features`` table whose names, dtypes or order differ
    from ``fingerprint_inputs.record_features`` (``[[name, dtype], ...]``,
    written by every build of a task). A manifest without
    ``fingerprint_inputs`` (the field is optional), or whose inputs have no
    ``record_features``, skips that part. Cost: one hash of the (small) inputs.

    Raises:
      seqcache.format.CacheError: one line naming the manifest, the field and
        both values (shortened).
    """
    inputs = raw.get("fingerprint_inputs")
    if inputs is None:
        return
    actual = codec.fingerprint_of(inputs)
    fingerprint = raw["fingerprint"]
    shown = repr(fingerprint) if len(fingerprint) <= 80 else _short(fingerprint)  # a sha256 is 64 characters
    codec._require(fingerprint == actual, path,
                 f"fingerprint = {shown}, but the sha256 of fingerprint_inputs is {actual!r}: "
                 "the manifest was edited or damaged; rebuild the cache")
    recorded = inputs.get("record_features")
    if recorded is None:
        return
    table = [[f.name, f.dtype] for f in features]
    codec._require(recorded == table, path,
                 f"features = {_short(table)} (name, dtype), but fingerprint_inputs.record_features = "
                 f"{_short(recorded)}: the features table must list the recorded features with their dtypes in "
                 "record order; the manifest was edited or damaged; rebuild the cache")


def _check_counts(raw: Mapping[str, Any], table: "codec.ShardTable", path: str, features, *,
                  check_shards: bool) -> None:
    """Refuses a manifest whose counts contradict each other: a shard's
    record count out of range; ``num_examples`` or ``statistics.examples``
    that is not the sum of the shard table's record counts; with
    ``check_shards``, a shard whose byte size cannot hold its records
    (``check_shard_sizes``).

    Raises:
      seqcache.format.CacheError: naming the manifest, the fields and both values.
    """
    import numpy as np

    counts = table.num_records
    if len(counts) and int(counts.max()) >= MAX_SHARD_RECORDS:
        i = int(np.argmax(counts >= MAX_SHARD_RECORDS))
        raise codec.CacheError(f"{path}: shards[{i}].num_records = {int(counts[i])}, expected an integer in "
                             f"[0, {bounded_json.bound(MAX_SHARD_RECORDS)})")
    total = int(counts.sum(dtype=np.int64))
    for name, value in (("num_examples", raw.get("num_examples")),
                        ("statistics.examples", (raw.get("statistics") or {}).get("examples"))):
        codec._require(value is None or value == total, path,
                     f"{name} = {value}, but the shard table's record counts add up to {total:,}: the manifest "
                     "contradicts itself (edited or damaged); rebuild the cache")
    if check_shards:
        check_shard_sizes(raw, table, path, features)


def check_shard_sizes(raw: Mapping[str, Any], table: "codec.ShardTable", path: str, features) -> None:
    """(Uncompressed shards) Refuses a shard whose byte size cannot hold its
    records: each record holds at least a 4-byte length per feature, each
    provenance record 12 bytes. Decodes every shard's sizes (what
    ``check_manifest`` does with ``check_shards``; ``seqcache info`` calls it
    too, a feeder leaves the sizes to each shard's first read).

    Raises:
      seqcache.format.CacheError: naming the manifest, the shard and both values.
    """
    import numpy as np

    counts = table.num_records
    if "uncompressed" not in str(raw.get("writer_options", "")):
        return
    if table.version == 2:
        data_bytes, prov_bytes = table._column("num_bytes"), table._column("provenance_num_bytes")
    else:
        data_bytes = np.array([s.num_bytes for s in table], np.int64)
        prov_bytes = np.array([s.provenance_num_bytes for s in table], np.int64)
    for key, sizes, per_record in (("num_bytes", data_bytes, 4 * max(len(features), 1)),
                                   ("provenance_num_bytes", prov_bytes, 4 * len(codec.PROVENANCE_FEATURES))):
        short_of = counts * per_record > sizes
        if short_of.any():
            i = int(np.argmax(short_of))
            raise codec.CacheError(
                f"{path}: shards[{i}]: {int(counts[i]):,} records need at least {int(counts[i]) * per_record:,} "
                f"bytes, but {key} = {int(sizes[i]):,}: the manifest contradicts itself (edited or damaged); "
                "rebuild the cache")


def assemble(values: Mapping[str, Any]) -> dict:
    """The manifest dict of ``values``, its keys in ``MANIFEST_FIELDS`` order
    (the order manifest.json is written in). A field given as None is written
    as null; a field not given is not written.

    Raises:
      ValueError: a key that is not a manifest field, or a required field missing.
    """
    unknown = [k for k in values if k not in FIELDS_BY_NAME]
    if unknown:
        raise ValueError(f"manifest field(s) {unknown} are not in the manifest schema (seqcache/manifest.py): "
                         f"add them there first (known: {', '.join(FIELDS_BY_NAME)})")
    missing = [f.name for f in MANIFEST_FIELDS if f.required and f.name not in values]
    if missing:
        raise ValueError(f"manifest lacks the required field(s) {missing}")
    return {f.name: values[f.name] for f in MANIFEST_FIELDS if f.name in values}


def assemble_object(fields: Sequence[Field], values: Mapping[str, Any], *, what: str) -> dict:
    """``assemble`` for a nested object of the format (``SHARD_TABLE_FIELDS``, ...).

    Raises:
      ValueError: a key not among ``fields``, or a required one missing; naming ``what``.
    """
    names = [f.name for f in fields]
    unknown = [k for k in values if k not in names]
    missing = [f.name for f in fields if f.required and f.name not in values]
    if unknown or missing:
        raise ValueError(f"{what}: unknown field(s) {unknown}, missing field(s) {missing} (fields: {', '.join(names)})")
    return {n: values[n] for n in names if n in values}


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of manifest.json, from ``MANIFEST_FIELDS``;
    ``$defs.shard_checksums`` is that of shard-checksums.json. Version 1
    manifests have a list of shard entries, later ones the shard table."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "seqcache cache manifest (manifest.json)",
        "description": f"Generated from seqcache/manifest.py (python -m seqcache.manifest --write); "
                       f"format versions {', '.join(map(str, codec.READ_FORMAT_VERSIONS))}. See docs/cache-format.md.",
        "type": "object",
        **object_schema(MANIFEST_FIELDS),
        "allOf": [{
            "if": {"properties": {"format_version": {"const": 1}}, "required": ["format_version"]},
            "then": {"properties": {"shards": _V1_SHARDS}},
            "else": {"properties": {"shards": _V2_SHARDS}},
        }],
        "$defs": {"shard_checksums": {"title": "seqcache shard checksum file (shard-checksums.json)", "type": "object",
                                      **object_schema(SHARD_CHECKSUMS_FIELDS)}},
    }
    return schema


def schema_text() -> str:
    """The bytes of the published ``manifest.schema.json`` (as text): ``json_schema()``,
    indented by 2, and a newline."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def schema_path() -> str:
    """Where the published schema lies: beside this module (installed as package data)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), SCHEMA_NAME)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m seqcache.manifest [--write | --check] [PATH]``: print the
    JSON Schema, write it to PATH (default: seqcache/manifest.schema.json of the
    source tree this module was run from), or exit 1 when PATH differs from it."""
    args = list(sys.argv[1:] if argv is None else argv)
    mode = args.pop(0) if args and args[0] in ("--write", "--check") else None
    target = args[0] if args else schema_path()
    text = schema_text()
    if mode is None:
        sys.stdout.write(text)
        return 0
    if mode == "--write":
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
        print(f"wrote {target}")
        return 0
    current = open(target, encoding="utf-8").read() if os.path.exists(target) else None
    if current != text:
        print(f"{target} is not up to date: run python -m seqcache.manifest --write {target}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
