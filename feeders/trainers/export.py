"""Exports of the global stream for trainers that read files, not Python: MaxText.

MaxText (its grain input pipeline) has no hook for a Python iterator; it reads
ArrayRecord files of serialized ``tf.train.Example`` protos. ``export_maxtext``
writes N steps of the Feeder's global stream, from a start step S (0, or the
step of a saved feeder state) to S + N - 1, into one such file, laid out so
that MaxText with shuffling off reads, at its step t, exactly the Feeder's
global batch of step S + t.

How MaxText reads the file (``grain_file_type=arrayrecord``,
``enable_data_shuffling=false``, ``packing=false``,
``grain_use_elastic_iterator=true``): grain's ``ElasticIterator`` over the
records as one ``MapDataset``. After ``g`` records consumed in total
(``{"global_next_index": g}``, its whole state) process ``p`` of ``P`` reads
records ``g + p, g + p + P, g + p + 2P, ...`` and batches ``B / P`` of them; every
process adds ``B`` to ``g`` per step. So step ``t`` of MaxText reads records
``[t*B, (t+1)*B)`` on any process count, and process ``p`` holds records
``t*B + p + j*P`` for ``j`` in ``[0, B/P)``, an interleaved share.

The Feeder's host ``h`` of ``H`` owns the contiguous rows ``[h*B/H, (h+1)*B/H)``
(G5). The export is laid out for a host count ``H`` (``host_count``, default 1):

    record  (s-S)*B + h + j*H   holds   row h*(B/H) + j of step s
                                        (global position s*B + h*(B/H) + j)

so MaxText on ``P = H`` processes gives process ``h`` exactly the Feeder's host
``h`` rows, in order. On any other process count every step still reads exactly
the rows of the Feeder's step ``s`` (the layout only permutes records inside a
step), in another order within the step. With ``S = 0`` and ``H = 1`` record
``i`` is global position ``i``. ``global_next_index`` ``g`` is always ``t*B``;
the Feeder's position is ``S*B + g`` (``Feeder.position``,
``state()["position"]``): with ``S = 0``, ``g`` itself.

Records: a ``tf.train.Example`` with int64 features, keys in sorted order (as
TensorFlow's deterministic serialization writes a map):

    <column>     L ids: the Feeder's ``<feature>`` row (zeros after the end of
                 a record, as the Feeder gives it)
    position     the global position of the row
    cache_index  the Feeder's ``cache_index`` (-1 on a padding row)
    task_index   the Feeder's ``task_index`` (-1 on a padding row)
    epoch        the Feeder's ``epoch`` (-1 on a padding row)

MaxText parses only ``train_data_columns`` (default ``['text']``); the other
features ride along for provenance. The protos are encoded here from the
protocol buffer wire format (https://protobuf.dev/programming-guides/encoding/;
``tf.train.Example`` is tensorflow/core/example/example.proto and feature.proto),
so the export needs neither TensorFlow nor generated protobuf classes.

The export folder holds ``<name>.array_record`` (written under a temporary name
and renamed) and ``export.json`` (written last): the Feeder's state at the
start step (caches with fingerprints, rates, seed, global batch, sequence
length, position S*B), the start step and position, the number of steps and
records, the layout, the file's sha256 and the MaxText flags that read it.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from seqcache import bounded_json, fs
from seqcache import format as fmt
from seqcache.feeders.feeder import Feeder

EXPORT_FORMAT_VERSION = 1
EXPORT_NAME = "export.json"
MAXTEXT_FILE = "train.array_record"
# Provenance features written beside the token column (one int64 each).
PROVENANCE_FEATURES = ("position", "cache_index", "task_index", "epoch")
# ArrayRecord writer options: uncompressed, one record per chunk. MaxText's
# processes read records one by one (every P-th), a random read decodes one
# chunk, and grain's ArrayRecordDataSource logs an error for every file written
# with a group size other than 1.
WRITER_OPTIONS = "group_size:1,uncompressed"

# Protocol buffer wire types and the field numbers of tf.train.Example
# (example.proto: Example.features = 1; feature.proto: Features.feature = 1 (a
# map: entry key = 1, value = 2), Feature.int64_list = 3, Int64List.value = 1,
# packed).
_WIRE_LEN = 2


def _tag(field: int, wire_type: int) -> bytes:
    return bytes([field << 3 | wire_type])


_TAG_1_LEN = _tag(1, _WIRE_LEN)  # Example.features, Features.feature, entry key, Int64List.value
_TAG_2_LEN = _tag(2, _WIRE_LEN)  # map entry value
_TAG_3_LEN = _tag(3, _WIRE_LEN)  # Feature.int64_list


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value's base-128 varint (1 to 10): int64 (n,) of int64 (n,)
    values, negatives as their 64-bit two's complement (10 bytes), as protocol
    buffers encode int64."""
    u = np.asarray(values, dtype=np.int64).view(np.uint64)
    bits = np.zeros(u.shape, dtype=np.int64)
    x = u.copy()
    for _ in range(10):
        nz = x != 0
        bits += nz
        x >>= np.uint64(7)
    return np.maximum(bits, 1)


def encode_varints(values: np.ndarray) -> bytes:
    """The concatenated base-128 varints of int64 (n,) ``values`` (the payload
    of a packed repeated int64 field); negatives as 64-bit two's complement."""
    u = np.ascontiguousarray(values, dtype=np.int64).view(np.uint64)
    n = u.size
    if n == 0:
        return b""
    groups = np.empty((n, 10), dtype=np.uint8)
    x = u.copy()
    for k in range(10):
        groups[:, k] = (x & np.uint64(0x7F)).astype(np.uint8)
        x >>= np.uint64(7)
    lengths = varint_lengths(u.view(np.int64))
    cols = np.arange(10)[None, :]
    groups |= np.where(cols < (lengths - 1)[:, None], np.uint8(0x80), np.uint8(0))
    return groups[cols < lengths[:, None]].tobytes()


def _varint(n: int) -> bytes:
    return encode_varints(np.array([n], dtype=np.int64))


def _len_field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def encode_int64_feature(packed_values: bytes) -> bytes:
    """A ``tf.train.Feature`` with an ``int64_list`` whose packed payload is
    ``packed_values`` (``encode_varints``); an empty list has no payload field,
    as protobuf writes it."""
    int64_list = _len_field(_TAG_1_LEN, packed_values) if packed_values else b""
    return _len_field(_TAG_3_LEN, int64_list)


def encode_example(features: Mapping[str, Any]) -> bytes:
    """A serialized ``tf.train.Example`` of int64 features.

    Args:
      features: feature name -> an int or a 1-D integer array (int64 values).

    Returns:
      The wire-format bytes, map entries in sorted key order (byte-identical to
      TensorFlow's ``SerializeToString(deterministic=True)``).

    Raises:
      ValueError: a value that is not an integer scalar or 1-D integer array.
    """
    entries = []
    for name in sorted(features, key=lambda k: k.encode("utf-8")):
        v = np.asarray(features[name])
        if v.ndim > 1 or not np.issubdtype(v.dtype, np.integer):
            raise ValueError(f"feature {name!r}: expected an integer or a 1-D integer array (got {v.dtype} {v.shape})")
        entry = _len_field(_TAG_1_LEN, name.encode("utf-8")) + _len_field(
            _TAG_2_LEN, encode_int64_feature(encode_varints(v.reshape(-1))))
        entries.append(_len_field(_TAG_1_LEN, entry))
    return _len_field(_TAG_1_LEN, b"".join(entries))


def record_rows(global_batch_size: int, host_count: int) -> np.ndarray:
    """The layout of one step: int64 (B,), entry t = the Feeder row r that record
    ``s*B + t`` holds, r = (t mod H) * (B/H) + t // H.

    Raises:
      ValueError: H does not divide B.
    """
    b, h = int(global_batch_size), int(host_count)
    if h < 1 or b % h:
        raise ValueError(f"host_count {h} must divide the global batch size {b}")
    t = np.arange(b, dtype=np.int64)
    return (t % h) * (b // h) + t // h


def record_index(position: int, global_batch_size: int, host_count: int = 1, start_position: int = 0) -> int:
    """The record of an export laid out for ``host_count`` H, starting at global
    position ``start_position`` = S*B (``export.json``'s), that holds global
    position p = s*B + h*(B/H) + j: (s-S)*B + h + j*H.

    Raises:
      ValueError: p is before the export's start.
    """
    b, h = int(global_batch_size), int(host_count)
    if int(position) < int(start_position):
        raise ValueError(f"position {position} is before the export's start position {start_position}")
    step, row = divmod(int(position) - int(start_position), b)
    host, j = divmod(row, b // h)
    return step * b + host + j * h


def position_of_record(index: int, global_batch_size: int, host_count: int = 1, start_position: int = 0) -> int:
    """The global position held by record ``index`` of an export starting at
    ``start_position`` (inverse of ``record_index``)."""
    b = int(global_batch_size)
    step, t = divmod(int(index), b)
    return int(start_position) + step * b + int(record_rows(b, host_count)[t])


def encode_step(batch: Mapping[str, np.ndarray], *, step: int, global_batch_size: int, feature: str,
                column: str, host_count: int) -> list[bytes]:
    """The B records of one step, in file order (``record_rows``).

    Args:
      batch: the Feeder's global batch of ``step`` (host count 1): ``feature``
        int32 (B, L), ``cache_index``, ``task_index``, ``epoch`` (B,).

    Returns:
      B serialized ``tf.train.Example``s (see the module docstring).
    """
    b = int(global_batch_size)
    rows = record_rows(b, host_count)
    tokens = np.asarray(batch[feature])[rows]  # (B, L)
    length = tokens.shape[1]
    # The token features of all rows in one pass: each row is L varints.
    lengths = varint_lengths(tokens.reshape(-1)).reshape(b, length).sum(axis=1)
    payload = encode_varints(tokens.reshape(-1))
    ends = np.cumsum(lengths)
    starts = ends - lengths
    scalars = {
        "position": step * b + rows,
        "cache_index": np.asarray(batch["cache_index"], dtype=np.int64)[rows],
        "task_index": np.asarray(batch["task_index"], dtype=np.int64)[rows],
        "epoch": np.asarray(batch["epoch"], dtype=np.int64)[rows],
    }
    names = sorted((column, *PROVENANCE_FEATURES), key=lambda k: k.encode("utf-8"))
    keys = {name: _len_field(_TAG_1_LEN, name.encode("utf-8")) for name in names}
    records = []
    for t in range(b):
        entries = []
        for name in names:
            if name == column:
                value = encode_int64_feature(payload[starts[t]:ends[t]])
            else:
                value = encode_int64_feature(_varint(int(scalars[name][t])))
            entries.append(_len_field(_TAG_1_LEN, keys[name] + _len_field(_TAG_2_LEN, value)))
        records.append(_len_field(_TAG_1_LEN, b"".join(entries)))
    return records


def maxtext_flags(export: Mapping[str, Any], data_dir: str | None = None) -> list[str]:
    """The MaxText ``key=value`` overrides that read an export (``export.json``'s
    content) in its order. ``data_dir``: where the export folder is (default: the
    folder recorded in the export). The model, ``steps`` (at most the exported
    ones) and ``per_device_batch_size`` (global batch = per_device_batch_size x
    devices) are the user's."""
    folder = data_dir if data_dir is not None else export["folder"]
    flags = [
        "dataset_type=grain",
        "grain_file_type=arrayrecord",
        f"grain_train_files={os.path.join(folder, export['file'])}",
        "tokenize_train_data=false",
        "enable_data_shuffling=false",
        "packing=false",
        "grain_use_elastic_iterator=true",
        "num_epoch=1",
        f"max_target_length={export['sequence_length']}",
    ]
    if export["column"] != "text":
        flags.append(f"train_data_columns=['{export['column']}']")
    return flags


def _steps_of(feeder, steps: int | None) -> int:
    """Steps to export from the feeder's step S: ``steps``, or the rest of a finite run."""
    start = feeder.step
    if feeder.num_steps is not None and start >= feeder.num_steps:
        raise ValueError(f"the feeder state is at step {start}, the end of this finite run ({feeder.num_epochs} "
                         f"epoch(s) take {feeder.num_steps} steps): nothing is left to export")
    if steps is None:
        if feeder.num_steps is None:
            raise ValueError("give the number of steps to export (the stream repeats forever without num_epochs)")
        return int(feeder.num_steps) - start
    steps = int(steps)
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (got {steps})")
    if feeder.num_steps is not None and start + steps > feeder.num_steps:
        raise ValueError(f"steps {steps} from step {start} is past the end of this finite run: "
                         f"{feeder.num_epochs} epoch(s) take {feeder.num_steps} steps")
    return steps


def _batches(feeder, start: int, steps: int) -> Iterator[tuple[int, dict]]:
    for step in range(start, start + steps):
        yield step, feeder.get_batch(step)


def export_maxtext(
    output: str | os.PathLike,
    *,
    global_batch_size: int | None = None,
    sequence_length: Mapping[str, int] | int | None = None,
    steps: int | None = None,
    cache: str | os.PathLike | None = None,
    mixture: Any = None,
    caches_root: str | os.PathLike | None = None,
    split: str = "train",
    seed: int = 0,
    num_epochs: int | None = None,
    feature: str = "targets",
    state: Mapping[str, Any] | None = None,
    host_count: int = 1,
    column: str = "text",
    overwrite: bool = False,
    num_threads: int | None = None,
    progress=None,
) -> dict:
    """Writes steps S .. S + ``steps`` - 1 of the Feeder's global stream as one
    ArrayRecord file of ``tf.train.Example`` records that MaxText reads in that
    order (module docstring: layout, features, flags). S is 0, or the step of
    ``state``.

    Args:
      output: the export folder (local; created).
      global_batch_size, sequence_length, cache, mixture, caches_root, split,
        seed, num_epochs, feature: the Feeder's (``seqcache.feeders.Feeder``).
      steps: steps to export (``steps * B`` records); None with ``num_epochs``:
        the rest of the finite run.
      state: instead of the stream's arguments, a saved feeder state, which
        fixes them; the export starts at its step S = position / B, so that
        MaxText's ``global_next_index`` g is the Feeder's position S*B + g.
      host_count: H, the MaxText process count whose processes should read the
        Feeder's host slices exactly (see the module docstring); any process
        count reads the same rows per step.
      column: the Example feature of the tokens (MaxText's ``train_data_columns``).
      overwrite: replace an existing export in ``output``.
      progress: optional callable (steps done, steps total).

    Returns:
      The content of ``export.json``: format, file, sha256, bytes,
      start_step (S), start_position (S*B), steps, records, tokens,
      global_batch_size, sequence_length (the tokens of a record, an int: the
      Feeder's ``sequence_length[feature]``), host_count, column, feature,
      layout, feeder_state (at step S) and maxtext_flags.

    Raises:
      ValueError: bad arguments (host count not dividing B, a column named like a
        provenance feature, no steps for an endless stream, steps past the end
        of a finite run, a URL output, an existing export without
        ``overwrite``).
      seqcache.format.CacheError: a cache is missing or inconsistent.
    """
    output = os.fspath(output)
    sidecar = _check_output(output, column, overwrite)
    feeder = _open_feeder(state=state, cache=cache, mixture=mixture, caches_root=caches_root, split=split,
                          global_batch_size=global_batch_size, sequence_length=sequence_length, seed=seed,
                          num_epochs=num_epochs, feature=feature, num_threads=num_threads)
    with feeder:
        record_rows(feeder.global_batch_size, host_count)  # checks that H divides B
        start = feeder.step
        n_steps = _steps_of(feeder, steps)
        start_state = feeder.state()
        os.makedirs(output, exist_ok=True)
        if os.path.exists(sidecar):
            os.remove(sidecar)  # overwrite: the old export is no longer complete
        path = os.path.join(output, MAXTEXT_FILE)
        options, tokens = _write_records(feeder, path, start, n_steps, column=column, host_count=host_count,
                                         progress=progress)
        export = _description(feeder, output, path, options=options, start=start, steps=n_steps, tokens=tokens,
                              column=column, host_count=host_count, state=start_state)
    export["maxtext_flags"] = maxtext_flags(export)
    with fs.open_write_atomic(sidecar) as f:
        f.write(json.dumps(export, indent=2, sort_keys=True).encode("utf-8") + b"\n")
    return export


def _check_output(output: str, column: str, overwrite: bool) -> str:
    """Refuses a bad output folder or column; returns the path of export.json."""
    if fs.is_url(output):
        raise ValueError(f"{output}: export writes a local folder; write it locally and copy it")
    if column in PROVENANCE_FEATURES:
        raise ValueError(f"column {column!r} is a provenance feature of the export; choose another name")
    if not column:
        raise ValueError("column must be a non-empty feature name")
    sidecar = os.path.join(output, EXPORT_NAME)
    if os.path.exists(sidecar) and not overwrite:
        raise ValueError(f"{output} already holds an export ({EXPORT_NAME}); pass overwrite=True "
                         "or choose another folder")
    return sidecar


def _open_feeder(*, state, global_batch_size, sequence_length, num_threads, **stream):
    """The Feeder of the whole global batch (one host): at a saved state's
    step, or at step 0 of the stream's arguments."""
    if state is not None:
        return Feeder.restore(state, host_index=0, host_count=1, num_threads=num_threads,
                              global_batch_size=global_batch_size, sequence_length=sequence_length)
    if global_batch_size is None:
        raise ValueError("give global_batch_size (or a saved feeder state)")
    return Feeder(global_batch_size=global_batch_size, sequence_length=sequence_length, host_index=0, host_count=1,
                  num_threads=num_threads, **stream)


def _write_records(feeder, path: str, start: int, n_steps: int, *, column: str, host_count: int,
                   progress) -> tuple[str, int]:
    """Writes steps start .. start + n_steps - 1 to ``path`` (a temporary name,
    then renamed); returns (ArrayRecord writer options, non-padding tokens)."""
    writer, options, tokens = None, None, 0
    with fs.atomic_path(path) as tmp:
        try:
            for step, batch in _batches(feeder, start, n_steps):
                records = encode_step(batch, step=step, global_batch_size=feeder.global_batch_size,
                                      feature=feeder.feature, column=column, host_count=host_count)
                if writer is None:
                    options = WRITER_OPTIONS
                    writer = ArrayRecordWriter(tmp, options)
                for record in records:
                    writer.write(record)
                tokens += int(np.count_nonzero(batch[f"{feeder.feature}_segment_ids"]))
                if progress is not None:
                    progress(step + 1 - start, n_steps)
        finally:
            if writer is not None:
                writer.close()
    return options, tokens


def _description(feeder, output: str, path: str, *, options: str, start: int, steps: int, tokens: int,
                 column: str, host_count: int, state: dict) -> dict:
    """The content of export.json, less the MaxText flags."""
    b = feeder.global_batch_size
    return {
        "format": "maxtext",
        "version": EXPORT_FORMAT_VERSION,
        "folder": os.path.abspath(output),
        "file": MAXTEXT_FILE,
        "sha256": fmt.file_sha256(path),
        "bytes": os.path.getsize(path),
        "writer_options": options,
        "start_step": start,
        "start_position": start * b,
        "steps": steps,
        "records": steps * b,
        "tokens": tokens,
        "global_batch_size": b,
        "sequence_length": feeder.sequence_length[feeder.feature],  # tokens per record (an int in export.json)
        "host_count": int(host_count),
        "column": column,
        "feature": feeder.feature,
        "features": sorted((column, *PROVENANCE_FEATURES)),
        "layout": "record (s-S)*B + h + j*H holds row h*(B/H) + j of step s (global position s*B + h*(B/H) + j), "
                  "S = start_step; MaxText's global_next_index g is the Feeder's position start_position + g",
        "feeder_state": state,
    }


def read_export(folder: str | os.PathLike) -> dict:
    """The ``export.json`` of an export folder.

    The file is read by ``seqcache.bounded_json`` (within its bounds, no key
    twice, a byte order mark at its first byte dropped).

    Raises:
      ValueError: no export there, a file out of bounds or not JSON (with the
        line and column), or another format version (one line naming the file).
    """
    path = os.path.join(os.fspath(folder), EXPORT_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such file: not a finished export (export.json is written last)")
    export = bounded_json.read_file(path, error=ValueError, what="export file")
    if not isinstance(export, dict) or export.get("version") != EXPORT_FORMAT_VERSION:
        raise ValueError(f"{path}: export format version {export.get('version') if isinstance(export, dict) else '?'}"
                         f", this seqcache reads version {EXPORT_FORMAT_VERSION}")
    return export


__all__: Sequence[str] = (
    "EXPORT_NAME",
    "MAXTEXT_FILE",
    "PROVENANCE_FEATURES",
    "WRITER_OPTIONS",
    "encode_example",
    "encode_step",
    "export_maxtext",
    "maxtext_flags",
    "position_of_record",
    "read_export",
    "record_index",
    "record_rows",
)
