"""``TFRecordSource``: one record per TFRecord record, as a ``tf.train.Example``
feature or as raw UTF-8 text; the TFRecord and ``tf.train.Example`` readers
that ``TfdsSource`` shares.

Nothing here imports TensorFlow. TFRecord framing, as TensorFlow writes it
(``tensorflow/core/lib/io/record_writer.cc``;
https://www.tensorflow.org/tutorials/load_data/tfrecord), per record:

    uint64 length, little-endian
    uint32 masked CRC-32C of the 8 length bytes
    byte   data[length]
    uint32 masked CRC-32C of the data

where ``masked(crc) = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32``
(CRC-32C from ``google-crc32c``). ``tf.train.Example`` is parsed with protobuf
from a copy of ``tensorflow/core/example/{example,feature}.proto`` in a private
descriptor pool (no clash with TensorFlow's own names).
"""

from __future__ import annotations

import functools
import struct
from typing import Any, Iterator, Mapping, Sequence

from seqcache import fs
from seqcache.tasks.sources.base import (
    Source,
    SourceRecord,
    Split,
    FileSource,
    read_error,
    canonical_json_bytes,
)
from seqcache.tasks.sources.spec import PIP_HINT


_MASK_DELTA = 0xA282EAD8
_HEADER = struct.Struct("<QI")


def crc32c_function():
    """``google_crc32c.value`` (CRC-32C of bytes, an int); ``ImportError`` saying
    which extra installs it."""
    try:
        import google_crc32c  # optional: google_crc32c
    except ImportError:
        raise ImportError(f"reading TFRecord files needs google-crc32c: {PIP_HINT} "
                          "(or pip install google-crc32c)") from None
    return google_crc32c.value


def masked_crc32c(data: bytes, crc=None) -> int:
    """TFRecord's masked CRC-32C of ``data`` (uint32; see the module docstring)."""
    c = (crc or crc32c_function())(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def write_tfrecords(path: str, records: Sequence[bytes]) -> None:
    """Writes ``records`` to an uncompressed TFRecord file at ``path``, built in
    memory (for tests and small fixtures)."""
    crc = crc32c_function()
    out = bytearray()
    for data in records:
        length = struct.pack("<Q", len(data))
        out += length + struct.pack("<I", masked_crc32c(length, crc)) + data + struct.pack("<I", masked_crc32c(data, crc))
    fs.write_bytes(path, bytes(out))


class TFRecordCorrupt(ValueError):
    """A TFRecord file whose framing is broken at ``record`` (a bad length CRC, or
    a file that ends inside a record): nothing after it can be read."""


def iter_tfrecords(path: str, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes, bool]]:
    """``(index, data, data_ok)`` of the records ``start <= index < stop``
    (``stop=None``: to the end) of the TFRecord file ``path`` (``.gz``:
    gzip), one at a time; ``data_ok`` is False when the data's CRC does not
    match (the records after it are still framed).

    Raises:
      TFRecordCorrupt: a length whose CRC does not match, or a file that ends
        inside a record (names the file and the record index).
      ValueError: the file cannot be read (names it).
    """
    crc = crc32c_function()
    index = 0
    try:
        with fs.open_binary(path) as f:
            read = f.read
            while stop is None or index < stop:
                head = read(12)
                if not head:
                    return
                if len(head) < 12:
                    raise TFRecordCorrupt(f"{path}: record {index}: the file ends inside the record's header "
                                          f"({len(head)} of 12 bytes): a truncated TFRecord file")
                length, length_crc = _HEADER.unpack(head)
                if masked_crc32c(head[:8], crc) != length_crc:
                    raise TFRecordCorrupt(f"{path}: record {index}: the length's CRC does not match: not a TFRecord "
                                          "file, or a damaged one")
                if index < start:
                    if f.seekable():
                        f.seek(length + 4, 1)
                    else:
                        read(length + 4)
                    index += 1
                    continue
                body = read(length + 4)
                if len(body) < length + 4:
                    raise TFRecordCorrupt(f"{path}: record {index}: the file ends inside the record "
                                          f"({len(body)} of {length + 4:,} bytes): a truncated TFRecord file")
                data = body[:length]
                yield index, data, masked_crc32c(data, crc) == struct.unpack("<I", body[length:])[0]
                index += 1
    except (EOFError, OSError) as e:
        raise read_error(path, e, f"record {index}" if index else None) from None


@functools.lru_cache(maxsize=None)
def example_class():
    """The protobuf message class of ``tf.train.Example``, built once per process."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # keeps protobuf out of the tasks' import

    F = descriptor_pb2.FieldDescriptorProto
    pkg = "seqcache.tf_example"
    fdp = descriptor_pb2.FileDescriptorProto(name="seqcache/tf_example.proto", package=pkg, syntax="proto3")

    def message(name, fields, nested=()):
        m = fdp.message_type.add(name=name)
        for fname, number, ftype, label, type_name, oneof in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if oneof is not None:
                f.oneof_index = oneof
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        return m

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", [("value", 1, F.TYPE_BYTES, rep, None, None)])
    message("FloatList", [("value", 1, F.TYPE_FLOAT, rep, None, None)])
    message("Int64List", [("value", 1, F.TYPE_INT64, rep, None, None)])
    feature = message("Feature", [("bytes_list", 1, F.TYPE_MESSAGE, opt, f".{pkg}.BytesList", 0),
                                  ("float_list", 2, F.TYPE_MESSAGE, opt, f".{pkg}.FloatList", 0),
                                  ("int64_list", 3, F.TYPE_MESSAGE, opt, f".{pkg}.Int64List", 0)])
    feature.oneof_decl.add(name="kind")
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt, type_name=f".{pkg}.Feature")
    entry.options.map_entry = True
    message("Features", [("feature", 1, F.TYPE_MESSAGE, rep, f".{pkg}.Features.FeatureEntry", None)], [entry])
    message("Example", [("features", 1, F.TYPE_MESSAGE, opt, f".{pkg}.Features", None)])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.Example"))


def encode_example(features: Mapping[str, Any]) -> bytes:
    """A serialized ``tf.train.Example`` of ``{name: value}``: ``str`` / ``bytes``
    (or lists of them) a ``bytes_list``, ints an ``int64_list``, floats a
    ``float_list``; ``TypeError`` for another type. For tests and fixtures."""
    ex = example_class()()
    for name, value in features.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        feat = ex.features.feature[name]
        if all(isinstance(v, (str, bytes)) for v in values) and values:
            feat.bytes_list.value.extend(v.encode("utf-8") if isinstance(v, str) else v for v in values)
        elif all(isinstance(v, int) for v in values):
            feat.int64_list.value.extend(values)
        elif all(isinstance(v, float) for v in values):
            feat.float_list.value.extend(values)
        else:
            raise TypeError(f"feature {name!r}: expected str, bytes, int or float values (got {value!r})")
    return ex.SerializeToString(deterministic=True)


def decode_example(data: bytes) -> dict[str, tuple[str, list]]:
    """The features of a serialized ``tf.train.Example``: ``{name: (kind,
    values)}`` with kind ``"bytes_list"`` (values: bytes), ``"int64_list"``
    (ints), ``"float_list"`` (floats) or ``""`` (a feature with no list).

    Raises:
      ValueError: ``data`` is not a ``tf.train.Example`` (or holds none of its fields)."""
    return {name: _values(feat) for name, feat in _feature_map(data).items()}


def _feature_map(data: bytes):
    """The ``features.feature`` map of the parsed Example (``decode_example``)."""
    from google.protobuf.message import DecodeError  # keeps protobuf out of the tasks' import

    ex = example_class()()
    try:
        ex.ParseFromString(data)
    except DecodeError:
        raise ValueError("not a tf.train.Example (its bytes do not parse as one)") from None
    if data and not ex.ListFields():
        # Text and other bytes often parse as fields unknown to Example: none of its own.
        raise ValueError("not a tf.train.Example (none of its bytes are Example fields)")
    return ex.features.feature


def _values(feat) -> tuple[str, list]:
    kind = feat.WhichOneof("kind") or ""
    return kind, (list(getattr(feat, kind).value) if kind else [])


class ExampleRecords(Source):
    """The record of a serialized ``tf.train.Example`` (``self.features``: output
    key -> feature name) or, without features, of raw UTF-8 bytes (under
    ``self.output_key``)."""

    features: dict[str, str] = {}
    output_key: str = "text"

    def _convert(self, file_index: int, number: int, path: str, data: bytes, data_ok: bool) -> SourceRecord:
        where = self.where(path, number)
        if not data_ok:
            return self._bad("malformed", file_index, number, data, where,
                             " is damaged: its data's CRC does not match (a corrupt TFRecord file)")
        if not self.features:
            repairs: list = []
            text, bad = self._decode(file_index, number, data, where, repairs)
            if bad is not None:
                return bad
            return self._record(file_index, number, data, where, {self.output_key: text}, repairs)
        try:
            feats = _feature_map(data)
        except ValueError as e:
            return self._bad("malformed", file_index, number, data, where, f" is {e}")
        out: dict[str, Any] = {}
        repairs = []
        for key, name in self.features.items():
            if name not in feats:
                have = ", ".join(sorted(feats)[:20]) or "none"
                return self._bad("missing_field", file_index, number, data, where,
                                 f" has no feature {name!r} (its features: {have})")
            kind, values = _values(feats[name])
            if kind == "int64_list":
                out[key] = values  # token ids; the task checks them against the vocabulary
            elif kind == "bytes_list" and len(values) == 1:
                try:
                    out[key] = values[0].decode("utf-8")
                except UnicodeDecodeError as e:
                    problem = f", feature {name!r}, is not valid UTF-8: {e}"
                    if self.on_error.actions["invalid_utf8"] != "replace":
                        return self._bad("invalid_utf8", file_index, number, data, where, problem)
                    repairs.append(("invalid_utf8", f"{where}{problem}"))
                    out[key] = values[0].decode("utf-8", errors="replace")
            else:
                what = f"{len(values)} bytes values" if kind == "bytes_list" else (kind or "no value list")
                return self._bad("bad_value", file_index, number, data, where,
                                 f": feature {name!r} holds {what}; expected one bytes value (text) or an "
                                 "int64 list (token ids)")
        raw = canonical_json_bytes({name: out[key] for key, name in self.features.items()})
        return self._record(file_index, number, raw, where, out, repairs)

    def _read_tfrecord(self, split: Split, start: int = 0, stop: int | None = None) -> Iterator[SourceRecord]:
        try:
            for number, data, ok in iter_tfrecords(split.path, start, stop):
                yield self._convert(split.file_index, number, split.path, data, ok)
        except TFRecordCorrupt as e:
            raise ValueError(f"{e}; replace the file, or leave it out") from None


class TFRecordSource(ExampleRecords, FileSource):
    """One record per record of TFRecord files: a ``tf.train.Example`` feature, or
    the record's bytes as UTF-8 text.

    ``record_number`` is the record's 0-based index in its file (``locator``
    ``"record"``); a file is one split; ``.gz`` files are gunzipped. With
    ``feature`` (or ``features``), each record is a ``tf.train.Example``: a
    ``bytes_list`` of one value is text, an ``int64_list`` token ids (checked
    by the task against its vocabulary, never tokenized); ``raw`` is the
    canonical JSON of ``{feature: value}``. Without a feature, a record's bytes
    are UTF-8 text and ``raw``. Reading needs google-crc32c (the ``tfds``
    extra), not TensorFlow.

    Args:
      feature: the Example feature to read, stored under ``output_key``; None
        for raw UTF-8 records.
      output_key: key of the value in ``SourceRecord.data``.
      features: optional mapping output key -> Example feature (several values).
      on_error: kinds met here: ``malformed`` (not an Example, a bad data CRC),
        ``missing_field``, ``bad_value`` (a float feature, several bytes
        values), ``invalid_utf8`` and the content kinds.

    Raises (from ``read_split`` / ``read_file``):
      ValueError: bad input whose action is ``"raise"``, or broken framing (a
        bad length CRC, a truncated file), naming the file and the record; a
        split that is not the whole file.
      ImportError: google-crc32c is not installed (says ``pip install 'seqcache[tfds]'``).
    """

    kind = "tfrecord"
    locator = "record"
    spec_forms = "'tfrecord:PATTERN[#FEATURE]' (raw UTF-8 records, or a tf.train.Example feature)"

    @classmethod
    def from_spec(cls, spec) -> "TFRecordSource":
        """``tfrecord:PATTERN[#FEATURE]``."""
        pattern, name = spec.target_and_name("google_crc32c")
        return cls(pattern, feature=name, exclude=spec.exclude, on_error=spec.on_error)

    def __init__(self, pattern: str | Sequence[str], *, feature: str | None = None, output_key: str = "text",
                 features: Mapping[str, str] | None = None, on_error: "str | Mapping[str, str]" = "raise",
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        if features is None:
            features = {output_key: feature} if feature is not None else {}
        elif feature is not None:
            raise ValueError("TFRecordSource: give feature or features, not both")
        if any(not k or not v for k, v in features.items()):
            raise ValueError(f"TFRecordSource: feature names must be non-empty (got {dict(features)})")
        self.features = dict(sorted(features.items()))
        self.output_key = output_key

    def _params(self) -> dict:
        return {"features": self.features} if self.features else {"raw": self.output_key}

    def describe(self) -> str:
        if not self.features:
            return f"TFRecord records of {self._pattern_text()} (raw UTF-8)"
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.features.items())
        return f"TFRecord tf.train.Example records of {self._pattern_text()} (feature {sel})"

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        self._require_whole(split)
        crc32c_function()  # a missing google-crc32c fails here, before the first record
        return self._read_tfrecord(split)
