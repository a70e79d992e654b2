"""The steps of the build pipeline, portable across Beam runners.

The pipeline is one straight line with one leaf::

    Create(work unit indices) ──Reshuffle──> ReadUnit ──(key, value)──> GroupByKey
        ──> SpreadCopies ──(key, value)──> GroupByKey
        ──> WriteGroup ──(0, result)──> GroupByKey ──> WriteSummary

- ``ReadUnit`` reads one work unit (a few splits of input files, see plan.py;
  the units and the files' paths are in the build's ``WorkTable``),
  preprocesses its records in batches and emits, keyed by an integer:
  ``(shard, batch)`` for the examples of each shard (a batch's bytes, or where
  a spill file holds them: spill.py), ``(QUARANTINE_KEY, chunk path)`` for the
  records its source skipped or repaired (or that overlap a benchmark the
  build excludes: exclusion.py), and ``(COUNTS_KEY, (unit, records read,
  per-file counts, bad-input counts))``. Everything is emitted from
  ``process`` (no ``finish_bundle`` outputs, tagged outputs or metrics, which
  some runners, Dask, lose or mix).
- ``SpreadCopies`` gets one key with all its values and emits them again
  (the runner's shuffle carries them twice), adding, for a shard, the
  copies of identical records after the first, each under its own key
  (``shuffle.copy_keys``) to the shard that key falls in: identical records
  share their first key, so all copies meet in one shard first. Under the
  source's ``on_error={"duplicate": "skip"}`` it moves nothing and emits,
  for the copies after the first, quarantine chunks and a count instead.
- ``WriteGroup`` gets one key with all its values: it leaves out the copies
  ``SpreadCopies`` moved (recomputed from the same entries), sorts, packs and
  writes a shard, merges the quarantine chunks into quarantine.jsonl, or adds up the
  record counts, and emits a small JSON-able result.
- ``WriteSummary`` gathers every result in one element and writes
  ``_tmp/summary.json``, from which the driver writes the manifest.

Under ``near_duplicate=skip`` the line has a branch that joins it again
(near.py): ``SpreadCopies`` also emits each distinct record's band hashes and
member info (``bytes`` keys), which go through the band buckets and the
clusters' rounds; their quarantine chunks, counts and removed keys are
flattened with ``SpreadCopies``' other values into the second GroupByKey.
Still one leaf.

Every step is a plain picklable object whose state is the task and a few
paths; randomness comes only from the record keys.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import pickle
import zlib
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np

from seqcache import format as fmt
from seqcache import fs, process
from seqcache.pipelines import near as near_mod
from seqcache.pipelines import packed_shard, shuffle, spill, stall, stats as stats_mod, work as work_mod, writer
from seqcache.pipelines.spill import ragged_take
from seqcache.tasks import Split, pack_first_fit
from seqcache.tasks.sources.base import RecordBatch, describe_record
from seqcache.tasks.sources.policy import with_path
from seqcache.tasks.vocabularies import ENCODING_THREADS_ENV, encoding_threads

log = logging.getLogger(__name__)

QUARANTINE_KEY = -1
COUNTS_KEY = -2
SUMMARY_NAME = "summary.json"


def storage_dtype(feature) -> str:
    """The dtype a token feature is stored in: the smallest that holds every id of
    its vocabulary (uint16 up to 65,536 ids). Readers widen it back (the feeder
    gives int32), so this is a cache-size choice, not a model one."""
    if feature.dtype in ("int32", "int64", "uint32") and feature.vocabulary.vocab_size <= 1 << 16:
        return "uint16"
    return feature.dtype


def features_in(task) -> list[fmt.FeatureSpec]:
    """The features of one preprocessed example, as the read step encodes it:
    the token features, then (a task with metrics, unpacked) the source text of
    each of ``task.pretokenized_features`` (``<feature>_pretokenized``, uint8)."""
    specs = [fmt.FeatureSpec(name, storage_dtype(f)) for name, f in task.output_features.items()]
    return specs + [fmt.FeatureSpec(name + fmt.PRETOKENIZED_SUFFIX, fmt.TEXT_DTYPE)
                    for name in getattr(task, "pretokenized_features", ())]


def features_out(task, sequence_length=None) -> list[fmt.FeatureSpec]:
    """The features of a cached record. Packed caches add ``<feature>_segment_ids``
    (uint16 when the sequence length allows, else int32); positions are not stored:
    they restart at 0 with every segment, so readers derive them from the segment
    ids (4 bytes a token instead of 12 for uint16 tokens). ``first_fit`` adds
    segment ids for every feature, in feature order after the features."""
    specs = features_in(task)
    if task.packing in ("lm", "first_fit"):
        for name in task.output_features:
            length = (sequence_length or {}).get(name, 1 << 31)
            specs.append(fmt.FeatureSpec(f"{name}_segment_ids", "uint16" if length < 1 << 16 else "int32"))
    return specs


# Raw record bytes preprocessed together at most: a batch's tokens and their
# copies are the read step's largest transient memory (about 14 bytes a raw
# byte with the byte vocabulary), and a tokenizer call of 1 MiB of text costs
# no more per byte than one of 4 MiB.
BATCH_BYTES = 1 << 20


class ReadPreprocess:
    """Reads splits of the task's source and preprocesses their records in
    batches of ``batch_records`` and at most ``batch_bytes`` of raw records
    (one tokenizer call per batch), filled across the splits it is given.
    Which records share a batch never changes an example: preprocessing is
    per record, its randomness drawn from the record's key.

    ``read(splits)`` (a ``Split`` or a sequence of them, read in order) yields
    ``("records", n)`` per batch of n source records; ``("examples",
    EncodedExamples)`` per batch; ``("issue", (file_index, record_number,
    action, message, kind))`` per record its source skipped or repaired, or the
    task's checks skipped (``on_error``: quarantined, never dropped silently);
    ``("kept", (records, {kind: records}))`` per batch with records whose bad
    input the policy keeps (``SourceRecord.kept``: counted); and, with an
    ``exclusion`` (``exclusion.Exclusion``), ``("excluded", (file_index,
    record_number, message, entry fields))`` per record that overlaps one of
    its benchmarks (quarantined, never preprocessed). With ``note_kept`` (a
    build under ``duplicate=skip``), also ``("note", (file_index,
    record_number, kinds))`` per record whose bad input the policy keeps, so
    that a copy skipped later counts once (``spill.QuarantineBuffer.add_note``).
    With ``near`` (``NearDuplicates``: a build under ``near_duplicate=skip``),
    each example carries its record's MinHash signature as a last feature
    (``near.SIGNATURE_FEATURE``, in ``features``).
    """

    def __init__(self, task, *, seed, sequence_length, num_shards, batch_records=2048, batch_bytes=BATCH_BYTES,
                 exclusion=None, note_kept: bool = False, near=None):
        self.task, self.exclusion, self.seed, self.num_shards = task, exclusion, seed, num_shards
        self.note_kept, self.near = bool(note_kept), near
        self.batch_records, self.batch_bytes = batch_records, int(batch_bytes)
        self.sequence_length = dict(sequence_length) if sequence_length else None
        self.features = features_in(task) + ([near_mod.signature_spec()] if near is not None else [])
        # An unpacked cache built to a sequence length holds no longer example (its
        # manifest says it is trimmed to it): the limits per feature, in feature order.
        self.limits = None
        if self.sequence_length and getattr(task, "packing", None) is None:
            self.limits = np.asarray([self.sequence_length.get(f.name, np.iinfo(np.uint32).max)
                                      for f in self.features], dtype=np.int64)

    def read(self, splits, *, skip: int = 0) -> Iterator[tuple[str, Any]]:
        """The outputs of the class docstring for ``splits``; with ``skip``,
        for the records after the first ``skip`` (read, not preprocessed: a
        unit resumed at a checkpoint).

        Raises:
          ValueError: a source error (naming the file and record), or a
            preprocessing error, prefixed with the path of the record's file.
        """
        splits = [splits] if isinstance(splits, Split) else list(splits)
        key = shuffle.seed_key(self.seed)
        for batch in self._batches(splits, skip):
            try:
                yield from self._flush(batch, key)
            except ValueError as e:
                raise self._named_error(batch, key, {int(s.file_index): str(s.path) for s in splits}, e) from None

    def _batches(self, splits, skip: int = 0) -> Iterator[RecordBatch]:
        """The records of ``splits`` after the first ``skip``, in batches of at
        most ``batch_records`` records and ``batch_bytes`` raw bytes (a larger
        record is a batch of its own), each as full as the records allow,
        across splits."""
        limit_records, limit_bytes = self.batch_records, self.batch_bytes
        pending: list[RecordBatch] = []
        count = size = 0
        for batch in self.task.source.read_batches_of(splits, self.batch_records):
            if skip:
                if len(batch) <= skip:
                    skip -= len(batch)
                    continue
                batch, skip = batch.take(skip, len(batch)), 0
            n = len(batch)
            sums = [0, *itertools.accumulate(map(len, batch.raws))]
            i = 0
            while i < n:
                stop = min(n, i + limit_records - count)
                # The records from i on that fit in what the pending batch has left.
                j = bisect.bisect_right(sums, sums[i] + limit_bytes - size, i, stop + 1) - 1
                if j == i:
                    if pending:
                        yield RecordBatch.concat(pending)
                        pending, count, size = [], 0, 0
                        continue
                    j = i + 1  # a record larger than batch_bytes: a batch of its own
                pending.append(batch if i == 0 and j == n else batch.take(i, j))
                count, size, i = count + j - i, size + sums[j] - sums[i], j
                if count >= limit_records or size >= limit_bytes:
                    yield RecordBatch.concat(pending)
                    pending, count, size = [], 0, 0
        if pending:
            yield RecordBatch.concat(pending)

    def _named_error(self, batch: RecordBatch, key, paths: dict, error: ValueError) -> ValueError:
        """``error`` (raised preprocessing ``batch``) prefixed with the path of
        the file it came from: for a batch of several files, each file's
        records are preprocessed again alone to find the one that fails."""
        def named(file_index, e):
            path = paths.get(int(file_index), f"file {file_index}")
            return with_path(e, path)

        if batch.file_indices is None:
            return named(batch.file_index, error)
        indices = batch.file_indices
        start = 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[start]:
                continue
            try:
                for _ in self._flush(batch.take(start, k), key):
                    pass
            except ValueError as e:
                return named(indices[start], e)
            start = k
        first, last = paths.get(int(indices[0]), ""), paths.get(int(indices[-1]), "")
        return with_path(error, f"{first} to {last} (one batch of several files)")

    def _flush(self, records: RecordBatch, key):
        yield "records", len(records)
        skipped, kept, records_kept = [], collections.Counter(), 0
        for i, r in records.special():
            issue = r.issue
            if issue is not None:
                yield "issue", (r.file_index, r.record_number, issue.action, issue.message, issue.kind)
                if issue.action == "skipped":
                    skipped.append(i)
                    continue
            if r.kept:
                records_kept += 1
                kept.update(r.kept)
                if self.note_kept:
                    yield "note", (r.file_index, r.record_number, r.kept)
        if records_kept:
            yield "kept", (records_kept, dict(kept))
        if self.exclusion is not None:
            drop = set(skipped)
            for i, message, fields in self.exclusion.find(records, [i for i in range(len(records)) if i not in drop]):
                yield "excluded", (records[i].file_index, records[i].record_number, message, fields)
                skipped.append(i)
            skipped.sort()
        live = LiveRecords(records, skipped)
        if not len(live):
            return
        keys = shuffle.record_keys(live.raws, key)
        rejected: list = []
        batch = self.task.preprocess_columns(live, keys, seed=self.seed, sequence_length=self.sequence_length,
                                             skipped=rejected)
        for idx, message in rejected:
            r = live[idx]
            yield "issue", (r.file_index, r.record_number, "skipped", message, "bad_value")
        if not len(batch):
            return
        if self.near is not None:
            locator = getattr(self.task.source, "locator", "record")
            batch.columns[near_mod.SIGNATURE_FEATURE] = near_mod.signature_column(
                self.near, live, batch.index,
                lambda r: describe_record(None, locator, r.record_number, stable=True))
        try:
            data, offsets = fmt.encode_batch(self.features, batch.columns, ranges=batch.ranges)
        except (KeyError, ValueError):
            # Find the record, example by example (this error path only).
            for idx, example in batch.examples():
                record = live[idx]
                try:
                    fmt.encode_example(self.features[:len(self.features) - (self.near is not None)], example)
                except (KeyError, ValueError) as e:
                    raise ValueError(
                        f"task {self.task.name!r}: file {record.file_index} record {record.record_number}: {e}"
                    ) from None
            raise
        lengths = batch.lengths([f.name for f in self.features])
        if self.limits is not None:
            self._check_lengths(lengths, batch, live)
        index = batch.index
        key_bytes = b"".join(keys)
        key_array = np.frombuffer(key_bytes, dtype="V16")[index]
        yield "examples", EncodedExamples(
            shard=shard_of_keys(key_bytes, self.num_shards)[index],
            key=key_array,
            sub_index=_sub_index(index),
            file_index=live.file_index_column()[index],
            record_number=np.asarray(live.record_numbers, dtype=np.uint64)[index],
            truncated=batch.truncated.astype(np.uint32),
            lengths=lengths.astype(np.uint32),
            data=data,
            offsets=offsets,
        )

    def _check_lengths(self, lengths: np.ndarray, batch, live) -> None:
        """ValueError for the first example longer than its feature's sequence
        length in an unpacked cache: the task neither packs nor trims, and a
        manifest that records the length would say the cache is trimmed to it."""
        over = np.argwhere(lengths > self.limits)
        if not len(over):
            return
        row, column = (int(x) for x in over[0])
        name, record = self.features[column].name, live[int(batch.index[row])]
        raise ValueError(
            f"task {self.task.name!r}: file {record.file_index} record {record.record_number}: feature {name!r} "
            f"has {int(lengths[row, column])} tokens, more than its sequence length {int(self.limits[column])}; "
            "the task neither packs nor trims: add seqcache.tasks.trim() (or append_eos_after_trim()) to its "
            "preprocessors, give it packing, or leave the sequence length out")


class LiveRecords:
    """The records of a ``RecordBatch`` less those at ``skipped`` (positions, in
    order): a sequence of ``SourceRecord`` with the batch's columns
    (``raws``, ``record_numbers``, ``text_values``) for the fast paths."""

    __slots__ = ("batch", "positions", "raws", "record_numbers", "file_index")

    def __init__(self, batch: RecordBatch, skipped: Sequence[int]):
        self.batch, self.file_index = batch, batch.file_index
        if skipped:
            drop = set(skipped)
            self.positions = [i for i in range(len(batch)) if i not in drop]
            self.raws = [batch.raws[i] for i in self.positions]
            self.record_numbers = [batch.record_numbers[i] for i in self.positions]
        else:
            self.positions = None
            self.raws, self.record_numbers = batch.raws, batch.record_numbers

    def __len__(self) -> int:
        return len(self.raws)

    def __getitem__(self, i: int):
        return self.batch[i if self.positions is None else self.positions[i]]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def file_index_column(self) -> np.ndarray:
        """uint32 (n,): each live record's ``file_index``."""
        indices = self.batch.file_indices
        if indices is None:
            return np.full(len(self), self.file_index, dtype=np.uint32)
        if self.positions is not None:
            indices = [indices[i] for i in self.positions]
        return np.asarray(indices, dtype=np.uint32)

    def text_values(self, key: str, index: Sequence[int]) -> list | None:
        """``RecordBatch.text_values`` of the live records at ``index``."""
        if self.positions is not None:
            index = [self.positions[i] for i in index]
        return self.batch.text_values(key, index)


def _sub_index(index: np.ndarray) -> np.ndarray:
    """uint32: the number of earlier examples from the same record (``index``
    is in input order, so equal values are consecutive)."""
    if not len(index):
        return np.zeros(0, np.uint32)
    first = np.flatnonzero(np.concatenate([[True], index[1:] != index[:-1]]))
    starts = np.repeat(first, np.diff(np.concatenate([first, [len(index)]])))
    return (np.arange(len(index)) - starts).astype(np.uint32)


def shard_of_keys(keys: bytes, num_shards: int) -> np.ndarray:
    """``shuffle.shard_of`` of many 16-byte keys at once (int64 array; ``shuffle.shards_of``)."""
    return shuffle.shards_of(np.frombuffer(keys, dtype=">u8")[::2], num_shards)


@dataclasses.dataclass
class EncodedExamples:
    """The examples of one batch, encoded, as columns (n examples, F read features).

    Attributes:
      shard: int64 ``(n,)``: the shard of each example's key.
      key: ``V16`` ``(n,)``: the shuffle keys.
      sub_index: uint32 ``(n,)``: the example's number among its record's examples.
      file_index: uint32 ``(n,)``; record_number: uint64 ``(n,)``: provenance.
      truncated: uint32 ``(n,)``: tokens trimmed from the example.
      lengths: uint32 ``(n, F)``: tokens per read feature.
      data: uint8: the encoded records, one after the other
        (``seqcache.format.encode_batch``); offsets: int64 ``(n + 1,)`` into it.
    """

    shard: np.ndarray
    key: np.ndarray
    sub_index: np.ndarray
    file_index: np.ndarray
    record_number: np.ndarray
    truncated: np.ndarray
    lengths: np.ndarray
    data: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.shard)

    def by_shard(self) -> Iterator[tuple[int, "EncodedExamples"]]:
        """``(shard, the examples of that shard)`` for each shard present, in shard
        order; the examples keep their order."""
        order = np.argsort(self.shard, kind="stable")
        shards = self.shard[order]
        cuts = np.flatnonzero(np.diff(shards)) + 1
        starts = np.concatenate([[0], cuts]).tolist()
        stops = np.concatenate([cuts, [len(order)]]).tolist()
        data, offsets = ragged_take(self.data, self.offsets, order)
        for a, b in zip(starts, stops):
            rows = order[a:b]
            yield int(shards[a]), EncodedExamples(
                shards[a:b], *(getattr(self, name)[rows] for name in _ROW_COLUMNS),
                data[offsets[a]:offsets[b]], offsets[a:b + 1] - offsets[a])


_ROW_COLUMNS = ("key", "sub_index", "file_index", "record_number", "truncated", "lengths")


def driver_encoding_threads() -> int | None:
    """The SentencePiece threads a build gives its read step's workers
    (``ReadUnit``): ``$SEQCACHE_ENCODING_THREADS`` when the driver sets it
    (a distributed runner's workers do not inherit the driver's
    environment), else None: each worker uses the CPUs it may run on (a
    worker's threads use the CPU the other leaves idle: benchmarks/README.md,
    "Worker processes").

    Raises:
      ValueError: ``$SEQCACHE_ENCODING_THREADS`` is not a positive integer.
    """
    return encoding_threads() if os.environ.get(ENCODING_THREADS_ENV, "").strip() else None


class WorkTable:
    """What every step needs of the whole build: the input files' paths
    (``paths``, by file index), their sizes as listed (``sizes``, bytes, or
    None), the work units' splits (``units``, by unit index: int64 arrays of
    ``(file_index, start, stop)`` rows, ``plan.plan_units``) and, for a build
    that keeps its work (work.py), each unit's address (``addresses``, or None).

    ``WorkTable.store`` writes it once, pickled and zlib-compressed, to a
    file in a folder every worker reads (the build's spill folder); the table
    then pickles as that file's URL and sha256, and a worker process reads
    the file once, at its first look, checking the sha256 (``ValueError``
    naming the file when it is gone or changed). Beam pickles a step,
    bz2-compressed, each time it looks at it, and encodes ``Create``'s
    elements at each step boundary: carrying the paths and splits of 50,000
    small files that way took 0.2 s of a 2 s build. A table made with the
    constructor pickles whole.
    """

    __slots__ = ("_columns", "url", "sha256", "_unit_files")

    def __init__(self, paths: Sequence[str] = (), sizes: Sequence[int] | None = None, units: Sequence = (),
                 url: str | None = None, sha256: str | None = None, addresses: Sequence[str] | None = None):
        if sizes is not None and len(sizes) != len(paths):
            raise ValueError(f"{len(paths)} paths but {len(sizes)} sizes")
        if addresses is not None and len(addresses) != len(units):
            raise ValueError(f"{len(units)} units but {len(addresses)} addresses")
        self._columns = None if url else (list(paths), None if sizes is None else list(sizes), list(units),
                                          None if addresses is None else list(addresses))
        self.url, self.sha256, self._unit_files = url, sha256, {}

    @classmethod
    def store(cls, folder: str, paths: Sequence[str], sizes: Sequence[int] | None, units: Sequence,
              addresses: Sequence[str] | None = None) -> "WorkTable":
        """The table of ``paths``, ``sizes``, ``units`` and ``addresses``,
        written to ``{folder}/work-table-<sha256>.pickle.z``."""
        columns = cls(paths, sizes, units, addresses=addresses)._columns
        data = zlib.compress(pickle.dumps(columns, protocol=pickle.HIGHEST_PROTOCOL), 1)
        sha256 = hashlib.sha256(data).hexdigest()
        url = fs.join(folder, f"work-table-{sha256[:16]}.pickle.z")
        fs.write_bytes(url, data)
        return cls(url=url, sha256=sha256)

    def _loaded(self) -> tuple[list, list | None, list, list | None]:
        if self._columns is None:
            self._columns = _read_work_table(self.url, self.sha256)
        return self._columns

    paths = property(lambda self: self._loaded()[0], doc="The input files' paths by file index.")
    sizes = property(lambda self: self._loaded()[1], doc="Their sizes as listed (bytes), or None.")
    units = property(lambda self: self._loaded()[2], doc="The work units' splits by unit index.")
    addresses = property(lambda self: self._loaded()[3], doc="The units' addresses (work.py), or None.")

    def unit_files(self, unit_index: int) -> np.ndarray:
        """uint32 (k,): the file indices of unit ``unit_index``'s splits, in
        increasing order: a section the unit wrote names its i-th file i
        (work.py, "File indices").

        Raises:
          ValueError: no such unit.
        """
        files = self._unit_files.get(unit_index)
        if files is None:
            units = self.units
            if not 0 <= unit_index < len(units):
                raise ValueError(f"work unit {unit_index} is not in the build's work table ({len(units)} units)")
            rows = np.asarray(units[unit_index], dtype=np.int64).reshape(-1, 3)
            files = self._unit_files[unit_index] = np.unique(rows[:, 0]).astype(np.uint32)
        return files

    def __reduce__(self):
        if self.url is None:
            paths, sizes, units, addresses = self._columns
            return (WorkTable, (paths, sizes, units, None, None, addresses))
        return (WorkTable, ((), None, (), self.url, self.sha256))


@functools.lru_cache(maxsize=2)
def _read_work_table(url: str, sha256: str) -> tuple[list, list | None, list, list | None]:
    """The columns ``WorkTable.store`` wrote to ``url``, once per process;
    ValueError when the file is missing or not the one written."""
    try:
        data = fs.read_bytes(url)
    except OSError as e:
        raise ValueError(f"{url}: the build's work table cannot be read ({e}); was the build's _tmp/ removed "
                         "while it ran?") from None
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{url}: the build's work table changed since the build wrote it (sha256 differs)")
    return pickle.loads(zlib.decompress(data))


class ReadUnit:
    """The read step (a ``beam.FlatMap`` callable): one work unit in, ``(key,
    value)`` pairs out (see the module docstring). A unit is its index in
    the ``WorkTable``'s units, or ``(unit_index, splits)``: ``((file_index,
    start, stop), ...)`` (``stop`` None for the file's end) or an int64 array
    of such rows (``stop`` -1), as ``plan.plan_units`` gives.

    A unit named by its index writes its sections with its own file indices
    (``WorkTable.unit_files``) and names itself in its values (``(unit,
    bytes)`` through the runner's shuffle, ``(path, offset, length, unit, -1,
    -1)`` for a spill file's section; ``load_batches`` maps them back); a
    unit given with its splits writes the build's file indices (unit -1).

    With ``work_dir`` (a build that keeps its work, work.py), a unit named by
    its index keeps its output in the work folder, checkpointed every
    ``checkpoint_bytes`` of examples; a unit whose ledger is found there is
    read from its checkpoints (checked by sha256) and read from the source
    only past the last one. Its counts value then says so (``"work"``).

    Memory: the shard buffers (about ``flush_bytes``: default
    ``spill.SPILL_BYTES`` for the spill exchange, ``spill.RUNNER_FLUSH_BYTES``
    for the runner's), one preprocessing batch (``BATCH_BYTES`` of raw
    records and their tokens) and at most ``spill.QUARANTINE_BYTES`` of
    quarantine entries, however large the unit.

    ``encoding_threads``: the SentencePiece threads of the worker that runs
    it (``$SEQCACHE_ENCODING_THREADS`` there), or None to leave the worker's
    own (``driver_encoding_threads``). ``paths``: the input files by file
    index, a ``WorkTable`` (whose units the elements may then name by their
    index alone) or a sequence of paths; ``sizes``: with a sequence, the
    files' sizes as listed (bytes, by file index), or None; a whole small
    file of that size is then read without asking its size first.
    ``heartbeat`` (stall.py): beaten as a unit starts, at each batch of
    records read and as the unit ends; None beats nothing.
    """

    def __init__(self, reader: ReadPreprocess, *, paths: "WorkTable | Sequence[str]", spill_dir: str, exchange: str,
                 flush_bytes: int | None = None, fs_options: Sequence[str] = (),
                 encoding_threads: int | None = None, sizes: Sequence[int] | None = None,
                 work_dir: str | None = None, checkpoint_bytes: int | None = None,
                 heartbeat: stall.Heartbeat | None = None):
        if exchange not in ("runner", "spill"):
            raise ValueError(f"exchange must be 'runner' or 'spill' (got {exchange!r})")
        self.heartbeat = heartbeat or stall.Heartbeat(None)
        self.work = paths if isinstance(paths, WorkTable) else WorkTable(paths, sizes)
        self.reader, self.spill_dir, self.exchange = reader, spill_dir, exchange
        if flush_bytes is None:
            flush_bytes = spill.SPILL_BYTES if exchange == "spill" else spill.RUNNER_FLUSH_BYTES
        self.flush_bytes, self.fs_options = int(flush_bytes), list(fs_options)
        self.encoding_threads = None if encoding_threads is None else int(encoding_threads)
        self.work_dir, self.fault = work_dir, os.environ.get(process.FAULT_VARIABLE)
        if work_dir and checkpoint_bytes is None:
            checkpoint_bytes = work_mod.checkpoint_bytes(reader.num_shards, self.flush_bytes)
        self.checkpoint_bytes = int(checkpoint_bytes) if work_dir else self.flush_bytes

    def __call__(self, unit) -> Iterator[tuple[int, Any]]:
        set_worker_options(self.fs_options)
        settle_worker()
        process.inherit_fault(self.fault)
        self.heartbeat.beat()
        if self.encoding_threads is not None:
            os.environ[ENCODING_THREADS_ENV] = str(self.encoding_threads)
        named = isinstance(unit, int)
        unit_index, ranges = (unit, self.work.units[unit]) if named else unit
        if isinstance(ranges, np.ndarray):
            ranges = [(f, a, None if b < 0 else b) for f, a, b in ranges.tolist()]
        state = _UnitState(f"{unit_index:07d}-{os.urandom(6).hex()}", unit_index,
                           self.work.unit_files(unit_index) if named else None)
        ledger = None
        if named and self.work_dir and self.work.addresses is not None:
            ledger = work_mod.UnitLedger(self.work_dir, self.work.addresses[unit_index])
            ledger.restore(len(state.files))
            for cp in ledger.checkpoints:
                yield from self._replay(ledger, cp, state)
            if ledger.complete:
                yield COUNTS_KEY, state.counts_value(ledger)
                return
        # A Split per range, made without its keyword defaults; a whole file's with its listed size
        # (a small file is then read without asking its size: lines.small_whole_files).
        paths, sizes, make = self.work.paths, self.work.sizes, tuple.__new__
        splits = [make(Split, (file_index, paths[file_index], start, stop,
                               sizes[file_index] if sizes is not None and stop is None and not start else 0))
                  for file_index, start, stop in ranges]
        skip = ledger.records_done() if ledger is not None else 0
        for kind, payload in self.reader.read(splits, skip=skip) if splits else ():
            if kind == "records":  # the batches before it are done: a checkpoint may cover them
                if state.buffered >= self.checkpoint_bytes or state.quarantine.nbytes >= spill.QUARANTINE_BYTES:
                    yield from self._checkpoint(state, ledger, complete=False)
                state.records += payload
                self.heartbeat.beat()
                process.fault_point("read:batch")
            elif kind == "examples":
                state.add_examples(payload)
            elif kind == "kept":
                state.bad_input.add_counts("kept", *payload)
            else:
                state.add_issue(kind, payload, paths)
        yield from self._checkpoint(state, ledger, complete=True)
        yield COUNTS_KEY, state.counts_value(ledger)
        self.heartbeat.beat()

    def _checkpoint(self, state: "_UnitState", ledger, *, complete: bool) -> Iterator[tuple[int, Any]]:
        """Hands on what the unit holds. Without a ledger, as a build that
        keeps nothing: the shard buffers past the flush size (or at the end)
        as a spill file or runner elements, the quarantine entries past
        ``QUARANTINE_BYTES`` (or at the end) as a chunk. With one, everything,
        into the work folder, then the ledger (``UnitLedger.commit``)."""
        if ledger is None:
            if state.buffered >= self.flush_bytes or (complete and state.buffered):
                yield from emit_buffers(state.buffers, exchange=self.exchange, num_features=len(self.reader.features),
                                        path=fs.join(self.spill_dir, f"{state.token}-{state.flushes:05d}.bin"),
                                        unit=state.unit)
                state.flushes += 1
                state.new_buffers()
            if state.quarantine.nbytes >= spill.QUARANTINE_BYTES or (complete and state.quarantine):
                yield QUARANTINE_KEY, self._write_quarantine(state)
            return
        k = len(ledger.checkpoints)
        run, out = None, []
        if state.buffered:
            name = ledger.run_name(state.token, k, work_mod.RUN_SUFFIX)
            url = ledger.url(work_mod.RUNS_DIR, name)
            with fs.open_write(url) as f:
                writer = spill.FlushWriter(f, len(self.reader.features))
                for shard in sorted(state.buffers):
                    buffer = state.buffers.pop(shard)
                    if self.exchange == "runner":
                        section = buffer.to_bytes(len(self.reader.features))
                        writer.add_bytes(shard, section)
                        yield shard, (state.unit, section)
                    else:
                        offset = writer.num_bytes
                        out.append((shard, (url, offset, writer.add(shard, buffer), state.unit, -1, -1)))
                writer.close()
            run = work_mod.FileRecord(name, writer.num_bytes, writer.sha256())
        chunk = None
        if state.quarantine:
            name = ledger.run_name(state.token, k, work_mod.CHUNK_SUFFIX)
            data = state.quarantine.to_bytes()
            fs.write_bytes(ledger.url(work_mod.RUNS_DIR, name), data)
            chunk = work_mod.FileRecord(name, len(data), hashlib.sha256(data).hexdigest())
            out.append((QUARANTINE_KEY, ledger.url(work_mod.RUNS_DIR, name)))
        process.fault_point("unit:files")
        ledger.commit(state.checkpoint(run, chunk, self.reader.num_shards), complete=complete)
        process.fault_point("unit:ledger")
        yield from out

    def _replay(self, ledger, cp, state: "_UnitState") -> Iterator[tuple[int, Any]]:
        """The values of a checkpoint found in the work folder (its files
        checked), its counts added to the unit's."""
        num_features, num_shards = len(self.reader.features), self.reader.num_shards
        if cp.run is not None:
            for shard, value in work_mod.replay_run(ledger.url(work_mod.RUNS_DIR, cp.run.name), cp.run.num_bytes,
                                                    unit=state.unit, written_for=cp.num_shards, num_shards=num_shards,
                                                    num_features=num_features, exchange=self.exchange,
                                                    shard_of_keys=shard_of_keys):
                yield shard, value
        if cp.chunk is not None:
            yield QUARANTINE_KEY, work_mod.replay_chunk(ledger.url(work_mod.RUNS_DIR, cp.chunk.name), cp.chunk_files,
                                                        state.files, scratch_dir=self.spill_dir)
        state.add_checkpoint(cp)

    def _write_quarantine(self, state) -> str:
        path = fs.join(self.spill_dir, f"{spill.QUARANTINE_PREFIX}{state.token}-{state.quarantine_chunks:05d}.txt")
        fs.write_bytes(path, state.quarantine.to_bytes())
        state.quarantine_chunks += 1
        state.quarantine = spill.QuarantineBuffer()
        return path


class _UnitState:
    """What one attempt at a work unit holds: the shard buffers and the
    quarantine entries since the last checkpoint, the counts since then, and
    the unit's counts so far (its checkpoints', found or made).

    Attributes:
      token: names this attempt's files (unique to it).
      unit_index: the unit; unit: the same, or -1 when its sections carry
        the build's file indices (``files`` None).
      files: the build's file index of each of the unit's files (uint32), or None.
    """

    __slots__ = ("token", "unit_index", "unit", "files", "buffers", "buffered", "flushes", "quarantine",
                 "quarantine_chunks", "records", "per_file", "bad_input", "done_records", "done_files", "done_bad",
                 "found")

    def __init__(self, token: str, unit_index: int, files: np.ndarray | None):
        self.token, self.unit_index, self.files = token, int(unit_index), files
        self.unit = self.unit_index if files is not None else -1
        self.quarantine = spill.QuarantineBuffer()
        self.flushes = self.quarantine_chunks = self.done_records = self.found = 0
        self.done_files, self.done_bad = [], []
        self.new_buffers()
        self._new_counts()

    def new_buffers(self) -> None:
        self.buffers, self.buffered = collections.defaultdict(spill.SpillBuffer), 0

    def _new_counts(self) -> None:
        self.records, self.per_file, self.bad_input = 0, FileCounts(), stats_mod.BadInputCounts()

    def add_examples(self, payload: "EncodedExamples") -> None:
        """Buffers a batch's examples (with the unit's own file indices) and counts them per file."""
        self.per_file.add(payload.file_index, payload.lengths)
        if self.files is not None:
            payload.file_index = np.searchsorted(self.files, payload.file_index).astype(np.uint32)
        for shard, part in payload.by_shard():
            self.buffers[shard].add_batch(part)
            self.buffered += spill.batch_bytes(part)

    def add_issue(self, kind: str, payload, paths) -> None:
        """A quarantine entry: a record its source skipped or repaired, or one
        excluded; or a note of the kinds a record's policy keeps (``"note"``)."""
        if kind == "note":
            record_file, record_number, kinds = payload
            self.quarantine.add_note(record_file, record_number, kinds)
            return
        if kind == "issue":
            record_file, record_number, action, message, error_kind = payload
            self.bad_input.add(action, error_kind.split(","))
            fields = None
        else:
            (record_file, record_number, message, fields), action, error_kind = payload, kind, "benchmark"
        self.quarantine.add(record_file, record_number, action, paths[record_file], message, error_kind, fields)

    def _close_counts(self) -> None:
        """The counts since the last checkpoint become the unit's."""
        self.done_records += self.records
        self.done_files.append(self.per_file.columns())
        self.done_bad.append(self.bad_input.to_json())

    def checkpoint(self, run, chunk, num_shards: int) -> "work_mod.Checkpoint":
        """The checkpoint of what was read since the last one (its counts with
        the unit's own file indices); buffers, entries and counts start anew."""
        columns = self.per_file.columns()
        if columns and self.files is not None:
            columns = [np.searchsorted(self.files, columns[0]).tolist(), *columns[1:]]
        cp = work_mod.Checkpoint(records=self.records, run=run, num_shards=num_shards if run else 0, chunk=chunk,
                                 chunk_files=self.files.tolist() if chunk is not None else [],
                                 files=columns, bad_input=self.bad_input.to_json())
        self._close_counts()
        self._new_counts()
        self.new_buffers()
        self.quarantine = spill.QuarantineBuffer()
        return cp

    def add_checkpoint(self, cp) -> None:
        """Counts a checkpoint found in the work folder."""
        self.done_records += cp.records
        if cp.files:
            self.done_files.append([self.files[np.asarray(cp.files[0], dtype=np.int64)].tolist(), *cp.files[1:]])
        self.done_bad.append(cp.bad_input)
        self.found += 1

    def counts_value(self, ledger) -> tuple:
        """``(unit, records, per-file columns, bad-input counts, work)``: the
        unit's counts (``WriteGroup``'s ``COUNTS_KEY``). ``work``, with a
        ledger: its address, checkpoints, those found and reused, those
        rejected (redone) and the attempts whose files it names; else ``{}``."""
        self._close_counts()
        self._new_counts()
        info = {}
        if ledger is not None:
            info = {"address": ledger.address, "checkpoints": len(ledger.checkpoints), "found": self.found,
                    "rejected": ledger.rejected, "attempts": ledger.attempts()}
        return (self.unit_index, self.done_records, merge_file_columns(self.done_files),
                stats_mod.BadInputCounts.merge(self.done_bad), info)


def emit_buffers(buffers: dict, *, exchange: str, num_features: int, path: str,
                 unit: int = -1) -> Iterator[tuple[int, Any]]:
    """``(shard, value)`` for each shard of ``buffers`` (shard -> ``SpillBuffer``),
    in shard order: ``(unit, the buffer's bytes)`` (``exchange="runner"``) or
    ``(path, offset, length, unit, -1, -1)``, its section of the flush file
    written to ``path``. ``unit``: the work unit whose file indices the
    sections hold (-1: the build's)."""
    if exchange == "runner":
        for shard in sorted(buffers):
            yield shard, (unit, buffers[shard].to_bytes(num_features))
        return
    with fs.open_write(path) as f:
        sections = spill.write_flush(f, buffers, num_features)
    for shard, offset, length in sections:
        yield shard, (path, offset, length, unit, -1, -1)


class SpreadCopies:
    """The copies step (a ``beam.FlatMap`` callable) between the two groupings:
    ``(key, values)`` in; every value out again under its key, and for a shard
    key, ``(shard, batch)`` of the copies it moves.

    In a shard's sorted entries, the k-th entry (k >= 1) with the key and
    sub-index of an earlier one is the k-th copy of an identical record (copies
    ranked by provenance: ``shuffle.copy_ranks``); it moves, whatever shard its
    new key ``shuffle.copy_keys`` falls in (this one too), as a section of its
    own (``emit_buffers``: bytes, or a spill file under ``spill_dir`` named
    ``copies-<shard>-<random>-<n>.bin``), and ``WriteGroup`` leaves it out of
    the shard it came from. Copies are identical, so each distinct record's
    example bytes are read once.

    ``duplicates="skip"`` (the source's ``on_error`` for ``duplicate``) moves
    nothing: each copy k >= 1 is skipped instead, one quarantine entry per
    record (action ``"skipped"``, kind ``"duplicate"``, naming the copy and, in
    ``kept``, the copy k = 0 that stays) in a chunk ``(QUARANTINE_KEY,
    path)``, and one ``(COUNTS_KEY, ("copies-<shard>", 0, per-file counts
    with the copies' examples and tokens taken off, bad-input counts))``
    (``WriteGroup`` counts it once, not as a work unit). Both come from
    ``process``, from the one shard where all copies meet, so they do not
    depend on how records were split or bundled. ``paths`` (by file index, a
    sequence or the build's ``WorkTable``) and ``locator`` (the source's)
    word the entries; required with ``"skip"``.

    With ``near`` (``NearDuplicates``: ``near_duplicate=skip``; the entries
    carry their signatures, ``near.SIGNATURE_FEATURE``) nothing moves either:
    every copy k >= 1 is skipped as above, of kind ``duplicate`` under
    ``duplicates="skip"``, else ``near_duplicate`` (an exact copy is a near
    duplicate of similarity 1); and each distinct record's band hashes and
    member info go on to the clusters (``near.member_outputs``: keys that are
    ``bytes``, where a shard's are ints).

    Memory: one shard's columns (``load_batches``) and at most ``flush_bytes``
    of moved examples at a time. ``heartbeat`` (stall.py): beaten as a key's
    values come in and once they are spread; None beats nothing.
    """

    def __init__(self, *, seed: int, num_features: int, spill_dir: str, exchange: str, num_shards: int,
                 flush_bytes: int | None = None, fs_options: Sequence[str] = (), duplicates: str = "keep",
                 paths: "WorkTable | Sequence[str]" = (), locator: str | None = None, near=None,
                 heartbeat: stall.Heartbeat | None = None):
        if exchange not in ("runner", "spill"):
            raise ValueError(f"exchange must be 'runner' or 'spill' (got {exchange!r})")
        self.heartbeat = heartbeat or stall.Heartbeat(None)
        if duplicates not in ("keep", "skip"):
            raise ValueError(f"duplicates must be 'keep' or 'skip' (got {duplicates!r})")
        self.seed, self.num_features, self.num_shards = seed, int(num_features), int(num_shards)
        self.spill_dir, self.exchange, self.fs_options = spill_dir, exchange, list(fs_options)
        self.duplicates, self.work, self.locator = duplicates, paths if isinstance(paths, WorkTable) else WorkTable(paths), locator
        self.near = near
        if flush_bytes is None:
            flush_bytes = spill.SPILL_BYTES if exchange == "spill" else spill.RUNNER_FLUSH_BYTES
        self.flush_bytes = int(flush_bytes)

    def __call__(self, element) -> Iterator[tuple[int, Any]]:
        set_worker_options(self.fs_options)
        settle_worker()
        self.heartbeat.beat()
        key, values = element
        values = list(values)
        for v in values:
            yield key, v
        if key in (QUARANTINE_KEY, COUNTS_KEY):
            return
        entries = load_batches(values, self.num_features, self.work.unit_files)
        try:
            if self.near is not None:
                yield from self._skipped(int(key), entries, near_mod.KIND if self.duplicates == "keep" else "duplicate",
                                         worded_later=True)
                yield from near_mod.member_outputs(entries, self.near, self.num_shards)
            elif self.duplicates == "skip":
                yield from self._skipped(int(key), entries)
            else:
                yield from self._moved(int(key), entries)
        finally:
            entries.close()
        self.heartbeat.beat()

    def _skipped(self, shard: int, entries: spill.ShardEntries, kind: str = "duplicate",
                 worded_later: bool = False) -> Iterator[tuple[int, Any]]:
        """The quarantine chunks and the counts of the copies k >= 1 of ``shard``
        (see the class docstring), skipped as ``kind``; nothing when the shard
        has no copy. ``worded_later`` (near duplicates): the entries of copies
        of a record with a signature are left to ``near.ResolveClusters``,
        which knows whether that record is kept or the record kept instead."""
        rank = shuffle.copy_ranks(entries.key, entries.sub_index)
        rows = np.flatnonzero(rank)
        if not len(rows):
            return
        per_file = FileCounts()
        per_file.add(entries.file_index[rows], entries.lengths[rows], sign=-1)
        records = rows[entries.sub_index[rows] == 0]  # one entry per skipped record: its first example
        kept = records - rank[records].astype(np.int64)
        token = f"copies-{shard:07d}-{os.urandom(6).hex()}"  # unique per attempt
        buffer, chunks = spill.QuarantineBuffer(), 0
        worded = entries.lengths[kept, -1] == 0 if worded_later else np.ones(len(records), dtype=bool)
        for row, first in zip(records[worded].tolist(), kept[worded].tolist()):
            fi, rn = int(entries.file_index[row]), int(entries.record_number[row])
            kfi, krn = int(entries.file_index[first]), int(entries.record_number[first])
            path, kept_path = self.work.paths[fi], self.work.paths[kfi]
            message = (f"{describe_record(path, self.locator, rn, stable=True)} is identical to {kept_path}: "
                       f"{describe_record(kept_path, self.locator, krn, stable=True)}, which is kept "
                       f"(on_error {kind}=skip)")
            extra = {"kept": {"source_index": kfi, "path": kept_path, "record_number": krn}}
            if kind != "duplicate":  # an exact copy as a near duplicate: similarity 1
                extra["similarity"] = 1.0
            buffer.add(fi, rn, "skipped", path, message, kind, extra)
            if buffer.nbytes >= spill.QUARANTINE_BYTES:
                yield QUARANTINE_KEY, self._write_quarantine(buffer, token, chunks)
                buffer, chunks = spill.QuarantineBuffer(), chunks + 1
        if buffer:
            yield QUARANTINE_KEY, self._write_quarantine(buffer, token, chunks)
        bad_input = stats_mod.BadInputCounts()
        bad_input.add_counts("skipped", len(records), {kind: len(records)})
        yield COUNTS_KEY, (f"copies-{shard}", 0, per_file.columns(), bad_input.to_json())

    def _write_quarantine(self, buffer: spill.QuarantineBuffer, token: str, chunk: int) -> str:
        path = fs.join(self.spill_dir, f"{spill.QUARANTINE_PREFIX}{token}-{chunk:05d}.txt")
        fs.write_bytes(path, buffer.to_bytes())
        return path

    def _moved(self, shard: int, entries: spill.ShardEntries) -> Iterator[tuple[int, Any]]:
        rank = shuffle.copy_ranks(entries.key, entries.sub_index)
        rows = np.flatnonzero(rank)
        if not len(rows):
            return
        first = rows - rank[rows].astype(np.int64)  # each copy's first entry: the same example bytes
        keys = shuffle.copy_keys(entries.key[first], rank[rows], shuffle.seed_key(self.seed))
        ends = np.cumsum((entries.end - entries.begin)[rows])  # example bytes up to and including each copy
        token = f"copies-{shard:07d}-{os.urandom(6).hex()}"  # unique per attempt
        lo, n, flushes = 0, len(rows), 0
        while lo < n:
            before = int(ends[lo - 1]) if lo else 0
            hi = max(lo + 1, int(np.searchsorted(ends, before + self.flush_bytes, side="right")))
            distinct, inverse = np.unique(first[lo:hi], return_inverse=True)
            data = entries.example_bytes(distinct)
            pieces = [data[j] for j in inverse.tolist()]
            offsets = np.zeros(hi - lo + 1, dtype=np.int64)
            np.cumsum([len(p) for p in pieces], out=offsets[1:])
            at = rows[lo:hi]
            key_bytes = keys[lo:hi].tobytes()
            moved = EncodedExamples(
                shard=shard_of_keys(key_bytes, self.num_shards), key=keys[lo:hi], sub_index=entries.sub_index[at],
                file_index=entries.file_index[at], record_number=entries.record_number[at],
                truncated=entries.truncated[at], lengths=entries.lengths[at],
                data=np.frombuffer(b"".join(pieces), dtype=np.uint8), offsets=offsets)
            buffers = collections.defaultdict(spill.SpillBuffer)
            for dest, part in moved.by_shard():
                buffers[dest].add_batch(part)
            yield from emit_buffers(buffers, exchange=self.exchange, num_features=self.num_features,
                                    path=fs.join(self.spill_dir, f"{token}-{flushes:05d}.bin"))
            lo, flushes = hi, flushes + 1


class FileCounts:
    """Source examples and tokens per file of a work unit (or of the copies a
    shard skips), added up batch by batch as arrays: a batch's counts are
    reduced per file at once (``add``), and ``columns`` merges them, with no
    Python object per file."""

    __slots__ = ("_files", "_rows")

    def __init__(self):
        self._files, self._rows = [], []

    def add(self, file_index: np.ndarray, lengths: np.ndarray, sign: int = 1) -> None:
        """Adds (``sign`` -1: takes off) one example per entry of
        ``file_index`` (n,) to its file, with its tokens per read feature,
        ``lengths`` (n, F)."""
        n = len(file_index)
        if not n:
            return
        lengths = np.asarray(lengths, dtype=np.int64)
        if file_index[0] == file_index[-1] and (file_index == file_index[0]).all():  # one file (no sort)
            files = np.asarray(file_index[:1], dtype=np.int64)
            rows = np.concatenate([[n], lengths.sum(axis=0)])[None, :]
        else:
            files, rows = _sum_by_file(np.asarray(file_index, dtype=np.int64),
                                       np.concatenate([np.ones((n, 1), dtype=np.int64), lengths], 1))
        self._files.append(files)
        self._rows.append(rows * sign)

    def columns(self) -> list[list[int]]:
        """``[file indices, examples, tokens of each feature]``: lists of ints,
        one entry per file counted, in file order (JSON-able); ``[]`` when
        nothing was counted."""
        if not self._files:
            return []
        files, rows = _sum_by_file(np.concatenate(self._files), np.concatenate(self._rows))
        return [files.tolist(), *rows.T.tolist()]


def _sum_by_file(files: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows (k, w) int64 added up per file index of ``files`` (k,): (the
    distinct file indices in order, their sums (m, w))."""
    order = np.argsort(files, kind="stable")
    files, rows = files[order], rows[order]
    starts = np.flatnonzero(np.concatenate([[True], files[1:] != files[:-1]]))
    return files[starts], np.add.reduceat(rows, starts, axis=0)


def merge_file_columns(tables: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """The per-file counts of several work units (each ``FileCounts.columns``)
    added up per file: the same columns, one entry per file, in file order.
    One numpy pass, not a Python loop per file and unit."""
    tables = [t for t in tables if len(t) and len(t[0])]
    if not tables:
        return []
    files = np.concatenate([np.asarray(t[0], dtype=np.int64) for t in tables])
    rows = np.concatenate([np.asarray(t[1:], dtype=np.int64).T for t in tables])
    files, sums = _sum_by_file(files, rows)
    return [files.tolist(), *sums.T.tolist()]


def load_batches(values, num_features: int, unit_files=None, *, drop_copies: bool = False) -> spill.ShardEntries:
    """One shard's entries from its values, sorted (``spill.load_shard``,
    with its ``drop_copies``):
    ``(unit, section bytes)`` (runner exchange; plain bytes too) or ``(path,
    offset, length, unit, lo, hi)`` sections of spill files (``(path,
    offset, length)`` too), rows ``[lo, hi)`` of it when ``lo >= 0``. A
    section of unit ``unit >= 0`` holds the unit's own file indices, mapped
    to the build's by ``unit_files(unit)`` (``WorkTable.unit_files``). A
    spill file section is loaded with its columns and at most
    ``spill.MIN_READ_BYTES`` of its example bytes; the rest is read window by
    window while the shard is written (``spill.SectionOnDisk``).

    Raises:
      ValueError: a truncated or inconsistent section (named), or a value
        of a work unit without ``unit_files``.
    """
    inline, refs = [], collections.defaultdict(list)
    for v in values:
        if isinstance(v, (bytes, bytearray, memoryview)):
            inline.append((-1, bytes(v)))
        elif len(v) == 2:
            inline.append((int(v[0]), bytes(v[1])))
        else:
            path, offset, length, *rest = v
            unit, lo, hi = rest if rest else (-1, -1, -1)
            refs[path].append((int(offset), int(length), int(unit), int(lo), int(hi)))

    def files_of(unit: int, where: str):
        if unit < 0:
            return None
        if unit_files is None:
            raise ValueError(f"{where}: a section of work unit {unit}, but no work table to map its file indices")
        return unit_files(unit)

    parts = []
    for i, (unit, data) in enumerate(sorted(inline, key=lambda x: (x[1], x[0]))):
        where = f"batch {i} of the shard"
        parts.append((where, spill.parse_section(data, num_features, where, files=files_of(unit, where))))
    files = fs.RangeReader()
    try:
        for path in sorted(refs):
            for offset, length, unit, lo, hi in sorted(refs[path]):
                where = f"{path} at byte {offset}"
                read = lambda begin, end, p=path, at=offset: files.read(p, at + begin, end - begin)  # noqa: E731
                parts.append((where, spill.load_section(read, where, length, num_features,
                                                        rows=(lo, hi) if lo >= 0 else None,
                                                        files=files_of(unit, where))))
        entries = spill.load_shard(parts, num_features, drop_copies=drop_copies)
    except BaseException:
        files.close()
        raise
    entries.closers.append(files.close)
    return entries


class WriteGroup:
    """The write step (a ``beam.FlatMap`` callable): ``(key, values)`` in, one
    ``(0, result)`` out, where ``result`` is a small JSON-able dict:

    - a shard key: the copies ``SpreadCopies`` moved away are left out (the
      entries ranked k >= 1 by ``shuffle.copy_ranks``: copies it brought have
      keys of their own, rank 0), and with ``near`` the records removed as
      near duplicates (values ``("near", keys)``, near.py) and the signature
      feature, the shard is sorted, packed if the task packs (``lm``:
      ``packed_shard.pack_lm_shard``, ``pack_lm``'s rows from the encoded examples;
      ``first_fit``: ``pack_first_fit``), and written
      with its provenance sidecar: ``{"kind": "shard", "shard": i, "entry":
      <manifest entry>, "statistics": <ShardStats>}``;
    - ``QUARANTINE_KEY``: the chunks are merged into quarantine.jsonl:
      ``{"kind": "quarantine", "summary": <QuarantineSummary>}``;
    - ``COUNTS_KEY``: ``{"kind": "counts", "records": n, "units": u, "files":
      [[file indices], [source examples], [tokens of each feature]...] (columns,
      ``merge_file_columns``), "bad_input": <BadInputCounts>, "work": <what
      the work folder gave, ``work_summary``>}``, each unit counted once.

    With ``marks_dir`` and ``fingerprint`` (a build that keeps its work), a
    written shard is recorded in ``marks_dir/<shard>.json`` with the build's
    fingerprint; a rerun of the same build finds it, checks both files'
    sizes and sha256, and returns the recorded result (``"reused": true``)
    instead of writing the shard again. ``work``: the build's ``WorkTable``
    (its ``unit_files`` map the sections of work units). ``heartbeat``
    (stall.py): beaten as a key's values come in and once its result is
    made; None beats nothing.
    """

    def __init__(self, task, *, out_dir, scratch_dir, num_shards, sequence_length, fs_options=(), work=None,
                 marks_dir: str | None = None, fingerprint: str | None = None, near: bool = False,
                 heartbeat: stall.Heartbeat | None = None):
        self.heartbeat = heartbeat or stall.Heartbeat(None)
        self.task_name, self.packing, self.near = task.name, task.packing, bool(near)
        self.features_in = features_in(task)
        self.features_out = features_out(task, sequence_length)
        self.pack_feature = next(iter(task.output_features)) if task.packing == "lm" else None
        self.pack_length = int(sequence_length[self.pack_feature]) if self.pack_feature else None
        self.fit_lengths = ({name: int(sequence_length[name]) for name in task.output_features}
                            if task.packing == "first_fit" else None)
        self.out_dir, self.scratch_dir, self.num_shards = out_dir, scratch_dir, num_shards
        self.fs_options = list(fs_options)
        self.work, self.marks_dir, self.fingerprint = work, marks_dir, fingerprint
        self.fault = os.environ.get(process.FAULT_VARIABLE)

    def __call__(self, element) -> Iterator[tuple[int, dict]]:
        set_worker_options(self.fs_options)
        settle_worker()
        process.inherit_fault(self.fault)
        self.heartbeat.beat()
        key, values = element
        if key == COUNTS_KEY:
            # A unit read twice (a retried attempt) counts once; the entries of
            # skipped copies (``SpreadCopies``, ids "copies-<shard>") are no work units.
            per_unit = {v[0]: v[1:] for v in values}
            bad_input = stats_mod.BadInputCounts.merge(v[2] for v in per_unit.values() if len(v) > 2)
            yield 0, {"kind": "counts", "records": int(sum(v[0] for v in per_unit.values())),
                      "units": sum(1 for u in per_unit if not isinstance(u, str)),
                      "files": merge_file_columns([v[1] for v in per_unit.values() if len(v) > 1]),
                      "bad_input": bad_input, "work": work_summary(v[3] for v in per_unit.values() if len(v) > 3)}
        elif key == QUARANTINE_KEY:
            yield 0, {"kind": "quarantine", "summary": self._quarantine(sorted(set(values)))}
        else:
            yield 0, self._shard(int(key), values)
        self.heartbeat.beat()

    def _quarantine(self, chunk_paths) -> dict:
        with fs.open_write_atomic(fs.join(self.out_dir, fmt.QUARANTINE_NAME)) as out:
            summary = spill.merge_quarantine(chunk_paths, out, scratch_dir=self.scratch_dir, open_read=fs.open_read,
                                             open_write=fs.open_write, join=fs.join)
        return summary.to_json()

    def _shard(self, shard: int, values) -> dict:
        found = self._written_before(shard)
        if found is not None:
            return found
        removed = None
        if self.near:
            values, removed = near_mod.split_removed(values)
        # The copies moved away are left out as the shard loads (no second copy of its columns).
        entries = load_batches(values, len(self.features_in) + self.near, self.work.unit_files if self.work else None,
                               drop_copies=True)
        try:
            stay = entries
            if self.near:
                leave = near_mod.removed_rows(entries, removed)
                stay = near_mod.strip_signatures(entries.take(np.flatnonzero(~leave)) if leave.any() else entries)
            result = self._write(shard, stay)
        finally:
            entries.close()
        if self.marks_dir is not None:
            process.fault_point("write:shard")
            mark = work_mod.seal(msgspec.json.encode({"fingerprint": self.fingerprint, "result": result}))
            fs.write_bytes_atomic(fs.join(self.marks_dir, f"{shard:07d}.json"), mark, fsync=False)
        return result

    def _written_before(self, shard: int) -> dict | None:
        """The result recorded for ``shard`` by an earlier run of this build,
        when both its files are still the ones written; else None."""
        if self.marks_dir is None:
            return None
        url = fs.join(self.marks_dir, f"{shard:07d}.json")
        try:
            if fs.size(url) is None:
                return None
            mark = msgspec.json.decode(work_mod.unseal(fs.read_bytes(url), url))
            result = mark["result"]
            entry = result["entry"]
            if mark.get("fingerprint") != self.fingerprint or result.get("shard") != shard:
                return None
            for name, size, digest in ((entry["file"], entry["num_bytes"], entry["sha256"]),
                                       (entry["provenance_file"], entry["provenance_num_bytes"],
                                        entry["provenance_sha256"])):
                if work_mod.file_sha256(fs.join(self.out_dir, name)) != (size, digest):
                    raise ValueError(f"{name} is not the file written then (size or sha256)")
        except (OSError, ValueError, KeyError, TypeError, msgspec.DecodeError) as e:
            if not isinstance(e, FileNotFoundError):  # a shard written, then damaged: said, and written again
                log.warning("shard %d of an earlier run of this build cannot be reused (%s); it is written again",
                            shard, e)
            return None
        return {**result, "reused": True}

    def _write(self, shard: int, entries: spill.ShardEntries) -> dict:
        st = stats_mod.ShardStats(self.features_out)
        st.source_examples = len(entries)
        st.truncated_tokens = int(entries.truncated.sum(dtype=np.int64))
        st.add_source_lengths(entries.lengths.reshape(len(entries), len(self.features_in)),
                              [f.name for f in self.features_in])

        def unpacked():
            st.add_many(entries.lengths)
            # Already encoded, data and provenance: written as they are.
            return writer.EncodedChunks(entries.record_chunks())

        def first_fit():
            stream = ((fmt.decode_example(self.features_in, data), prov) for data, prov in entries.items())
            for row, segments, cut in pack_first_fit(stream, sequence_length=self.fit_lengths):
                st.add(row, len(segments))
                st.truncated_tokens += cut
                yield row, [(prov[0], prov[1], offset) for prov, offset in segments]

        if self.packing == "lm":
            # Encoded examples to encoded rows, a chunk of examples at a time: the
            # bytes of pack_lm's rows as the writer encodes them, group size included.
            examples, group_size = packed_shard.pack_lm_shard(
                entries, features_in=self.features_in, features_out=self.features_out,
                sequence_length=self.pack_length, stats=st)
        elif self.packing == "first_fit":
            examples, group_size = first_fit(), None
        else:
            # Unpacked, the format's group size rule (the mean of the first 65,536
            # records) is applied here: the writer's first chunk may be fewer records.
            examples = unpacked()
            group_size = fmt.group_size_for(entries.mean_example_bytes(1 << 16)) if len(entries) else None
        entry = writer.write_shard(self.out_dir, index=shard, num_shards=self.num_shards, features=self.features_out,
                                   examples=examples, group_size=group_size)
        return {"kind": "shard", "shard": shard, "entry": entry, "statistics": st.to_json()}


def work_summary(infos) -> dict:
    """What the work folder gave a build, from its units' ``work`` (see
    ``_UnitState.counts_value``): units ``reused`` (every checkpoint
    found), ``resumed`` (some), ``read`` (none); checkpoints ``found`` and
    ``rejected`` (their files did not check out: redone); and ``attempts``:
    unit address -> the attempts whose files its ledger names (what a kept
    work folder keeps). Empty for a build that keeps no work."""
    out = {"reused": 0, "resumed": 0, "read": 0, "checkpoints": 0, "found": 0, "rejected": 0, "attempts": {}}
    seen = False
    for info in infos:
        if not info:
            continue
        seen = True
        found, total = int(info["found"]), int(info["checkpoints"])
        out["reused" if found == total else "resumed" if found else "read"] += 1
        out["checkpoints"] += total
        out["found"] += found
        out["rejected"] += int(info["rejected"])
        out["attempts"][info["address"]] = list(info["attempts"])
    return out if seen else {}


class WriteSummary:
    """The last step: every ``WriteGroup`` result in one element, written to
    ``<scratch>/summary.json`` (atomically) for the driver. Emits the number of
    results: the pipeline's only leaf is tiny (Dask sends it to the client)."""

    def __init__(self, *, scratch_dir, fs_options=()):
        self.scratch_dir, self.fs_options = scratch_dir, list(fs_options)

    def __call__(self, element) -> Iterator[int]:
        set_worker_options(self.fs_options)
        _, results = element
        results = sorted(results, key=lambda r: (r["kind"], r.get("shard", -1)))
        fs.write_bytes_atomic(fs.join(self.scratch_dir, SUMMARY_NAME), msgspec.json.encode({"results": results}))
        yield len(results)


def read_summary(scratch_dir: str) -> dict | None:
    """What ``WriteSummary`` wrote: ``{"shards": {i: result}, "records": n or
    None, "units": u or None, "quarantine": summary dict or None, "files":
    [[file indices], [source examples], [tokens of each feature]...] (columns,
    one entry per file counted) or None, "bad_input":
    ``BadInputCounts`` JSON or None, "work": ``work_summary`` (``{}``: no
    work folder)}``; None when there is no summary (the pipeline did not
    finish)."""
    path = fs.join(scratch_dir, SUMMARY_NAME)
    if not fs.exists(path):
        return None
    results = msgspec.json.decode(fs.read_bytes(path))["results"]  # per-file columns: msgspec, 5x json's speed
    out = {"shards": {}, "records": None, "units": None, "quarantine": None, "files": None, "bad_input": None,
           "work": {}}
    for r in results:
        if r["kind"] == "shard":
            out["shards"][int(r["shard"])] = r
        elif r["kind"] == "counts":
            out["records"], out["units"] = int(r["records"]), int(r["units"])
            out["files"] = r.get("files") or []
            out["bad_input"] = r.get("bad_input")
            out["work"] = r.get("work") or {}
        elif r["kind"] == "quarantine":
            out["quarantine"] = r["summary"]
    return out


_WORKER_OPTIONS: list = []
_SETTLED: list = []


def settle_worker() -> None:
    """Once per process, at a step's first element: ``process.freeze_heap``, so that
    what a worker made to run the pipeline (the unpickled steps, Beam's bundle
    processors) is not walked again by every cyclic collection."""
    if not _SETTLED:
        _SETTLED.append(True)
        process.freeze_heap()


def set_worker_options(fs_options: Sequence[str]) -> None:
    """Hands the build's file-system options (object-store endpoints and
    credentials) to a worker, once per process: runners such as Dask start
    workers that never saw the pipeline options."""
    if not fs_options or _WORKER_OPTIONS == [tuple(fs_options)]:
        return
    fs.set_options(list(fs_options))
    _WORKER_OPTIONS[:] = [tuple(fs_options)]
