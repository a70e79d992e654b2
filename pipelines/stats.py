"""Build statistics: what each shard writer counts, and their merge into the
manifest's ``statistics`` (units: examples and segments in records; tokens and
lengths in tokens).

Length histograms use fixed, data-independent buckets so that the shards'
counts merge by addition: a length n below 16 has its own bucket [n, n + 1);
above, each power of two [2^e, 2^(e+1)) is cut into 8 buckets of width
2^(e-3) (about 9 % of the length: the layout of HdrHistogram with three
significant bits). A histogram is a list of ``[lo, hi, count]`` (tokens,
tokens, examples) for its non-empty buckets, ``lo`` ascending, ``hi`` exclusive.
"""

from __future__ import annotations

import collections
from typing import Any, Mapping, Sequence

import numpy as np

from seqcache.codec import PRETOKENIZED_SUFFIX


# The actions a build counts records under, per kind of bad input.
BAD_INPUT_ACTIONS = ("skipped", "replaced", "kept")


class BadInputCounts:
    """Records per kind of bad input, by what was done with them (records):
    ``"skipped"`` (no example; listed in the quarantine file), ``"replaced"``
    (repaired; listed too) and ``"kept"`` (accepted as it is under the policy's
    ``"keep"``, e.g. control characters; counted only).

    ``to_json()`` is ``{"skipped": {kind: records}, "replaced": {...}, "kept":
    {...}, "records": {"skipped": n, "replaced": n, "kept": n}}``: a record
    with two kinds counts once under each kind and once in ``records``. The
    manifest's ``statistics.bad_input_records`` is that of the whole build.
    """

    __slots__ = ("counts", "records")

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {action: {} for action in BAD_INPUT_ACTIONS}
        self.records: dict[str, int] = dict.fromkeys(BAD_INPUT_ACTIONS, 0)

    def add(self, action: str, kinds) -> None:
        """Counts one record under ``action`` and each kind in ``kinds`` (``add_counts``)."""
        self.add_counts(action, 1, collections.Counter(kinds))

    def add_counts(self, action: str, records: int, kinds: Mapping[str, int]) -> None:
        """Counts ``records`` records under ``action`` and ``kinds[kind]`` under
        each kind (a batch's counts at once).

        Raises:
          ValueError: an action not in ``BAD_INPUT_ACTIONS``."""
        if action not in self.counts:
            raise ValueError(f"bad-input action must be one of {BAD_INPUT_ACTIONS} (got {action!r})")
        have = self.counts[action]
        for kind, n in kinds.items():
            have[kind] = have.get(kind, 0) + int(n)
        self.records[action] += int(records)

    def to_json(self) -> dict[str, dict[str, int]]:
        """See the class docstring; kinds sorted (those counted to 0 left out), every action present."""
        out = {action: {k: n for k, n in sorted(self.counts[action].items()) if n}
               for action in BAD_INPUT_ACTIONS}
        out["records"] = dict(self.records)
        return out

    @staticmethod
    def merge(parts, minus: Mapping | None = None) -> dict[str, dict[str, int]]:
        """The sum of several ``to_json()`` results (units or builds), less
        ``minus`` (the same form: the counts of records skipped later as copies,
        ``spill.QuarantineSummary.uncounted``), as ``to_json()``; None parts
        count as nothing."""
        total = BadInputCounts()
        for part, sign in [*((p, 1) for p in parts), (minus, -1)]:
            part = part or {}
            for action in BAD_INPUT_ACTIONS:
                total.add_counts(action, sign * int((part.get("records") or {}).get(action, 0)),
                                 {k: sign * int(n) for k, n in (part.get(action) or {}).items()})
        return total.to_json()


class ShardStats:
    """Statistics of one written shard: examples and segments (records), tokens
    and the longest example per feature (tokens), tokens trimmed away."""

    def __init__(self, features):
        # Token features only: not segment ids, positions, nor source text (``_pretokenized``, stored
        # after the token features, so these names are the first columns of the lengths).
        self.names = [f.name for f in features if not f.name.endswith(("_segment_ids", "_positions",
                                                                        PRETOKENIZED_SUFFIX))]
        self.examples = self.segments = self.source_examples = self.truncated_tokens = 0
        self.tokens = dict.fromkeys(self.names, 0)
        self.max_length = dict.fromkeys(self.names, 0)
        # feature -> {bucket lo: examples}: lengths of the source examples (before packing).
        self.length_counts = {name: {} for name in self.names}

    def add_source_lengths(self, lengths, names) -> None:
        """Counts the lengths of a shard's source examples (before packing) in the
        length histogram. ``lengths``: (n, F) tokens, columns named by ``names``
        (only ``self.names`` are counted)."""
        lengths = np.asarray(lengths)
        for k, name in enumerate(names):
            if name not in self.length_counts or not lengths.shape[0]:
                continue
            lo, counts = _bucket_counts(bucket_lo(lengths[:, k]))
            hist = self.length_counts[name]
            for b, c in zip(lo.tolist(), counts.tolist()):
                hist[b] = hist.get(b, 0) + c

    def add(self, example, segments):
        """One example (feature -> array) of ``segments`` segments."""
        self.examples += 1
        self.segments += segments
        for name in self.names:
            n = int(example[name].size)
            self.tokens[name] += n
            self.max_length[name] = max(self.max_length[name], n)

    def add_many(self, lengths, segments=None):
        """Many examples at once, the counts of ``add`` on each: ``lengths``
        (n, F) tokens in ``self.names`` order; ``segments`` (n,) segments of
        each (packed rows), or None for one each (unpacked examples)."""
        n = int(lengths.shape[0])
        self.examples += n
        self.segments += n if segments is None else int(np.sum(segments, dtype=np.int64))
        for k, name in enumerate(self.names):
            if n:
                self.tokens[name] += int(lengths[:, k].sum(dtype=np.int64))
                self.max_length[name] = max(self.max_length[name], int(lengths[:, k].max()))

    def to_json(self):
        return {
            "examples": self.examples,
            "segments": self.segments,
            "source_examples": self.source_examples,
            "truncated_tokens": self.truncated_tokens,
            "tokens": self.tokens,
            "max_length": self.max_length,
            "length_histogram": {name: [[lo, bucket_hi(lo), c] for lo, c in sorted(h.items())]
                                 for name, h in self.length_counts.items()},
        }


def _bucket_counts(lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(lo, return_counts=True)``, by ``np.bincount`` when every edge is below 2^16."""
    if len(lo) and int(lo.max()) < 1 << 16:
        counts = np.bincount(lo)
        edges = np.flatnonzero(counts)
        return edges, counts[edges]
    return np.unique(lo, return_counts=True)


def bucket_lo(lengths) -> np.ndarray:
    """The lower edge of each length's histogram bucket (see the module docstring).
    ``lengths``: integer array (n,) of tokens >= 0, below 2^53. Returns int64 (n,)."""
    n = np.asarray(lengths, dtype=np.int64)
    bits = np.frexp(np.maximum(n, 1).astype(np.float64))[1].astype(np.int64)  # bit length of n
    shift = np.maximum(bits - 4, 0)
    return np.where(n < 16, n, (n >> shift) << shift)


def bucket_hi(lo: int) -> int:
    """The exclusive upper edge of the bucket whose lower edge is ``lo``."""
    lo = int(lo)
    return lo + 1 if lo < 16 else lo + (1 << (lo.bit_length() - 4))


def merge_histograms(histograms: Sequence[Sequence[Sequence[int]]]) -> list[list[int]]:
    """Adds ``[lo, hi, count]`` histograms bucket by bucket."""
    total: dict[tuple[int, int], int] = {}
    for hist in histograms:
        for lo, hi, count in hist:
            total[(int(lo), int(hi))] = total.get((int(lo), int(hi)), 0) + int(count)
    return [[lo, hi, c] for (lo, hi), c in sorted(total.items())]


def source_file_table(columns: Sequence[Sequence[int]], num_files: int, names: Sequence[str]) -> dict:
    """The per-file counts of the source table (``seqcache.format.SourceTable``;
    ``statistics.source_files`` as the build hands it to ``Manifest.create``,
    which moves it to the source table file): per source file (indexed like
    the source table), the source examples it gave (records) and their
    tokens per feature (tokens, before packing). ``columns``: ``[file
    indices, examples, tokens of names[0], tokens of names[1], ...]``
    (``transforms.merge_file_columns``: each file at most once; an empty
    list for none), read as arrays, with no Python object per file.

    Raises:
      ValueError: a file index outside ``[0, num_files)`` or repeated, or
        columns of different lengths.
    """
    width = 2 + len(names)
    table = np.zeros((width - 1, num_files), dtype=np.int64)
    if len(columns) and len(columns[0]):
        if len(columns) != width or len({len(c) for c in columns}) != 1:
            raise ValueError(f"per-file counts: expected {width} columns of one length (got {len(columns)})")
        files = np.asarray(columns[0], dtype=np.int64)
        if files.min() < 0 or files.max() >= num_files or len(np.unique(files)) != len(files):
            raise ValueError(f"per-file counts: file indices outside [0, {num_files}) or repeated")
        table[:, files] = np.asarray(columns[1:], dtype=np.int64)
    rows = table.tolist()
    return {"examples": rows[0], "tokens": dict(zip(names, rows[1:])),
            "units": "examples in records (source examples, before packing); tokens in tokens"}


def merge_stats(per_shard: Sequence[Mapping[str, Any]], records_read: int | None) -> dict:
    names = sorted({n for s in per_shard for n in s["tokens"]})
    examples = sum(s["examples"] for s in per_shard)
    tokens = {n: sum(s["tokens"].get(n, 0) for s in per_shard) for n in names}
    out = {
        "examples": examples,
        "segments": sum(s["segments"] for s in per_shard),
        "source_examples": sum(s["source_examples"] for s in per_shard),
        "tokens": tokens,
        "max_length": {n: max((s["max_length"].get(n, 0) for s in per_shard), default=0) for n in names},
        "mean_length": {n: (tokens[n] / examples if examples else 0.0) for n in names},
        "truncated_tokens": sum(s["truncated_tokens"] for s in per_shard),
        "length_histogram": {n: merge_histograms([s.get("length_histogram", {}).get(n, []) for s in per_shard])
                             for n in names},
        "skipped_records": 0,
        "units": "examples and segments in records; tokens, lengths in tokens",
    }
    if records_read is not None:
        out["source_records"] = records_read
    return out
