"""The entries of the manifest model (``seqcache.manifest``): the nested
objects of manifest.json, shard-checksums.json and source-table.json, each a
``msgspec.Struct`` with its bounds and descriptions in ``msgspec.Meta``
(``Feature``, ``Shards``, ``Vocabulary``, ``Source``, ``Statistics``, ...), and
``convert``, which reads a JSON value into one of them and words a refusal as
one ``CacheError`` line naming the file and the field path
(``manifest.json: statistics.tokens is 'x': expected `object```; msgspec's
text read by ``bounded_json.read_validation_error``).
"""

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta, Struct

from seqcache import bounded_json, codec
from seqcache.codec import MANIFEST_NAME, SHARD_CHECKSUMS_NAME, SOURCE_TABLE_NAME, CacheError, ShardTable

_SHA256_PATTERN = "^[0-9a-f]{64}$"
_BASE64_PATTERN = "^[A-Za-z0-9+/]*={0,2}$"
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


def doc(text: str, since: int = 1) -> Meta:
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

    name: Annotated[str, doc("feature name, e.g. targets or targets_segment_ids")]
    dtype: Annotated[Literal[tuple(sorted(codec.DTYPES))], doc("storage dtype of its elements")]
    vocabulary: Annotated[str, doc("the key of its entry in vocabularies (token features)")] = None
    add_eos: Annotated[bool, doc("whether the task appends EOS to it (token features)")] = None

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(codec.DTYPES[self.dtype])


class ChecksumFile(Entry, kw_only=True):
    """``shards.checksums``: the shard checksum file (format version 2)."""

    file: Annotated[Literal[SHARD_CHECKSUMS_NAME], doc("the shard checksum file's name", 2)]
    num_bytes: Annotated[Count, doc("its size (bytes)", 2)]
    sha256: Annotated[Sha256, doc("its sha256, hex", 2)]


class Shards(Entry, kw_only=True):
    """``shards``: the shard table (format version 2); read as a ``codec.ShardTable``."""

    num_shards: Annotated[int, Meta(ge=0, lt=MAX_SHARDS), doc("S, the shard count (shard names follow from index "
                                                               "and S)", 2)]
    encoding: Annotated[str, doc("how the integer columns are stored, for humans", 2)] = None
    num_records: Annotated[Base64, doc("records per shard (records), base64 of S little-endian int64", 2)]
    num_bytes: Annotated[Base64, doc("byte size of each data shard file (bytes), base64 of S int64", 2)]
    provenance_num_bytes: Annotated[Base64, doc("byte size of each provenance shard file (bytes), base64 of S "
                                                 "int64", 2)]
    checksums: Annotated[ChecksumFile, doc("the shard checksum file: name, size and sha256", 2)]


class Sharding(Entry, kw_only=True):
    """``sharding``: how the build chose its shard count."""

    num_shards: Annotated[Count, doc("the shard count the build chose or was given")]
    shard_size: Annotated[Int64 | None, doc("the target shard size (bytes) it was given, or null")] = None
    input_bytes: Annotated[Count, doc("the source files' total size (bytes)")] = None
    content_bytes: Annotated[Int64 | None, doc("the sources' decompressed content size (bytes) where measured, "
                                                "or null")] = None


class Work(Entry, kw_only=True):
    """``work``: what the build's work folder gave it (a build that kept its
    work: a rerun after it died, a build of a grown corpus). It describes how
    this cache was made, like ``created``: two builds of the same inputs,
    one of them resumed, have equal shards, statistics and source table, and
    different ``work``."""

    units: Annotated[Count, doc("work units of the build")]
    units_reused: Annotated[Count, doc("units taken whole from the work folder (not read)")] = 0
    units_resumed: Annotated[Count, doc("units read on from a checkpoint in the work folder")] = 0
    checkpoints_reused: Annotated[Count, doc("checkpoints of units taken from the work folder")] = 0
    checkpoints_rejected: Annotated[Count, doc("checkpoints found whose files did not match their sha256 "
                                                "(torn or changed): read again")] = 0
    shards_reused: Annotated[Count, doc("shards written by an earlier run of the same build, kept")] = 0


class Evaluation(Entry, kw_only=True):
    """``evaluation`` (format version 3): what an evaluator runs on the cache
    (``seqcache.tasks.Task.evaluation``)."""

    metrics: Annotated[list[str], doc("the task's metric functions' names, in order", 3)]
    postprocess_fn: Annotated[str | None, doc("the task's postprocess function's name, or null", 3)]
    pretokenized: Annotated[list[str], doc("the stored features holding the source's text "
                                            "(<feature>_pretokenized, uint8 UTF-8 bytes)", 3)]


class ShardChecksums(Entry, kw_only=True):
    """shard-checksums.json (format version 2), written by ``shard_checksums_json``."""

    num_shards: Annotated[Count, doc("S, the shard count", 2)]
    sha256: Annotated[list[Sha256], doc("sha256 of data shard s at position s, hex", 2)]
    provenance_sha256: Annotated[list[Sha256], doc("sha256 of provenance shard s at position s, hex", 2)]


class Vocabulary(Entry, kw_only=True):
    """One entry of ``vocabularies`` (``Vocabulary.to_json()``, ``file`` renamed by the build)."""

    kind: Annotated[Literal[VOCABULARY_KINDS], doc("the vocabulary's kind")] = None
    vocab_size: Annotated[int, Meta(ge=1, lt=MAX_INTEGER), doc("ids in the vocabulary, extra ids included")] = None
    extra_ids: Annotated[Count, doc("sentinel ids appended to the model's")] = None
    file: Annotated[str, doc("the model file stored in the cache folder (sentencepiece, hf_tokenizer)")] = None
    sha256: Annotated[Sha256 | None, doc("the model file's sha256, hex")] = None
    eos_token: Annotated[str | None, doc("the EOS token's text (hf_tokenizer)")] = None
    pad_token: Annotated[str | None, doc("the pad token's text (hf_tokenizer)")] = None
    unk_token: Annotated[str | None, doc("the unk token's text (hf_tokenizer)")] = None


class Source(Entry, kw_only=True):
    """One entry of ``sources`` (format version 2), the source file table
    (``seqcache.tasks.SourceFile`` and the source's locator)."""

    path: Annotated[str, doc("the file's path or URL")]
    num_bytes: Annotated[Count, doc("its size (bytes)")] = None
    mtime_ns: Annotated[Int64, doc("its modification time (nanoseconds since the epoch)")] = None
    locator: Annotated[str, doc("what a provenance record's record_number counts in it (byte_offset, line, row, "
                                 "record, file); record when absent")] = None


class BadInput(Entry, kw_only=True):
    """``statistics.bad_input_records``: records per kind of bad input, by action."""

    skipped: Annotated[Records, doc("kind -> records skipped (records)")] = None
    replaced: Annotated[Records, doc("kind -> records repaired (records)")] = None
    kept: Annotated[Records, doc("kind -> records kept unchanged (records)")] = None
    records: Annotated[Records, doc("action -> records (records)")] = None


class SourceFiles(Entry, kw_only=True):
    """``statistics.source_files`` (format version 2): per source file, source examples and tokens."""

    examples: Annotated[list[Count], doc("source examples per source file (records)")]
    tokens: Annotated[dict[str, list[Count]], doc("feature -> tokens per source file, before packing (tokens)")]
    units: Annotated[str, doc("the units, for humans")] = None


Histogram = list[Annotated[list[Count], Meta(min_length=3, max_length=3)]]


class Statistics(Entry, kw_only=True):
    """``statistics``: counts of the build (``seqcache.pipelines.stats``); None where not counted."""

    examples: Annotated[Count, doc("cached examples (records)")] = None
    segments: Annotated[Count, doc("segments, the pieces packed into them (records)")] = None
    source_examples: Annotated[Count, doc("preprocessed examples before packing (records)")] = None
    tokens: Annotated[dict[str, Count], doc("feature -> tokens in the cached examples (tokens)")] = None
    max_length: Annotated[dict[str, Count], doc("feature -> the longest cached example (tokens)")] = None
    mean_length: Annotated[dict[str, Annotated[float, Meta(ge=0)]], doc("feature -> the mean cached example "
                                                                         "(tokens)")] = None
    truncated_tokens: Annotated[Count, doc("tokens trimmed to the sequence length (tokens)")] = None
    length_histogram: Annotated[dict[str, Histogram], doc(
        "feature -> histogram of source example lengths: the non-empty buckets [lo, hi, examples], lo ascending, "
        "hi exclusive (tokens)")] = None
    skipped_records: Annotated[Count, doc("source records skipped as bad input (records)")] = None
    units: Annotated[str, doc("the units, for humans")] = None
    source_records: Annotated[Count, doc("source records read (records)")] = None
    source_files: Annotated[SourceFiles, doc("per source file: source examples and tokens")] = None
    replaced_records: Annotated[Count, doc("source records repaired (records)")] = None
    bad_input_records: Annotated[BadInput, doc("records per kind of bad input, by action")] = None
    excluded_records: Annotated[Count, doc("source records excluded for overlapping a benchmark (records)")] = None
    excluded_by_benchmark: Annotated[Records, doc("benchmark name -> excluded records that overlap it "
                                                   "(records)")] = None


class SourceTableRecord(Entry, kw_only=True):
    """The manifest's ``source_table`` (format version 3): the file that holds
    the per-file source table, checked like the shard checksum file."""

    file: Annotated[Literal[SOURCE_TABLE_NAME], doc("the source table file's name", 3)]
    num_bytes: Annotated[Count, doc("its size (bytes)", 3)]
    sha256: Annotated[Sha256, doc("its sha256, hex", 3)]
    num_files: Annotated[Count, doc("the source files it lists (files)", 3)]
    fingerprint_files: Annotated[list[str], doc(
        "the keys, from the top, of the value of fingerprint_inputs that it holds (['task', 'source', 'files']); "
        "absent when it holds none", 3)] = None
    inputs_sha256: Annotated[Sha256, doc(
        "with fingerprint_files: the sha256 of the canonical JSON of {fingerprint, fingerprint_inputs} as this "
        "manifest records them (what opening a cache checks, where the fingerprint itself needs the file)", 3)] = None


class SourceTableFile(Entry, kw_only=True):
    """source-table.json (format version 3), written by ``SourceTable.to_bytes``:
    one column per field of ``Source`` and ``SourceFiles``."""

    num_files: Annotated[Count, doc("N, the source files (files)", 3)]
    path: Annotated[list[str], doc("file i's path or URL at position i (i is a provenance record's "
                                    "source_index)", 3)]
    num_bytes: Annotated[list[Count | None], doc("each file's size (bytes), null where not recorded", 3)] = None
    mtime_ns: Annotated[list[Int64 | None], doc("each file's modification time (nanoseconds since the epoch), "
                                                 "null where not recorded", 3)] = None
    locator: Annotated[str | list[str | None], doc("what record_number counts in the files: one locator for "
                                                    "every file, or one per file (null: record)", 3)] = None
    examples: Annotated[list[Count], doc("source examples per file (records); absent when not counted", 3)] = None
    tokens: Annotated[dict[str, list[Count]], doc("feature -> tokens per file, before packing (tokens)", 3)] = None
    fingerprint_files: Annotated[dict[str, Any], doc(
        "the value of fingerprint_inputs at the manifest's source_table.fingerprint_files: {\"value\": V}, or "
        "{\"from_columns\": true} for the list of {path, num_bytes, mtime_ns} of each file", 3)] = None


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
    """The ``CacheError`` line of msgspec's ``error`` (converting ``value``,
    ``bounded_json.read_validation_error``): ``{path}: {field} is {value}:
    {msgspec's words}``, or without the value where there is none."""
    refusal = bounded_json.read_validation_error(error, value, prefix)
    if not refusal.found:
        return CacheError(f"{path}: {refusal.field + ': ' if refusal.field else ''}{refusal.text}")
    return CacheError(f"{path}: {refusal.field} is {_short(refusal.value)}: {refusal.text}")
