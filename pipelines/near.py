"""Near-duplicate removal inside the build: MinHash LSH candidates, exact
clusters, one member kept (``on_error={"near_duplicate": "skip"}``).

The steps, each a plain picklable callable (build.py wires them)::

    ReadPreprocess ── each example carries its record's signature as a last
        feature, SIGNATURE_FEATURE (uint32 (bands * rows,); kept in the work
        folder like any feature, stripped before a shard is written)
    SpreadCopies (its shard's entries) ──> per distinct record (copy k = 0),
        gathered by group (``group_of``: a key range, as many as shards):
        (b"B" + group, rows of band hash and key)  one row per band  ``member_outputs``
        (b"M" + group, [member info])  key, provenance, counts, signature
    GroupByKey(band group) ──> ``StarEdges``: each bucket's keys joined to its smallest
    ROUNDS x [GroupByKey(node group) ──> ``LargeStar`` ; GroupByKey ──> ``SmallStar``]
    GroupByKey(node group) ──> ``StarLabels``: every node's component label
        (the smallest key of its component), checked to be final
    GroupByKey(b"M" + group: labels and member info) ──> ``JoinLabels``
    GroupByKey(b"C" + shard of the label) ──> ``ResolveClusters``: per cluster
        the label's record is kept, every other member is removed: a
        quarantine entry naming the kept record and the estimated similarity,
        its examples and tokens taken off the counts, and its key sent to the
        shard that holds it (``(shard, ("near", keys))``), where ``WriteGroup``
        leaves its entries out.

Connected components: the large-star and small-star rounds of Kiveris,
Seshadri, Shah and Vassilvitskii (2014, "Connected Components in MapReduce and
Beyond", algorithm "Alternating"), each one shuffle (a GroupByKey on the
node's group, each node's edges in one value: a runner moves a few large
values per round, not one per edge).
Large-star links every larger neighbour of a node to the smallest node of its
neighbourhood; small-star links every smaller neighbour (and the node) to the
smallest of them. Neither changes the components, and a graph of stars, each
centred on its component's smallest node, is a fixed point of both. The paper
proves convergence to that fixed point in O(log² n) rounds for n nodes (and
observes far fewer). A Beam pipeline is a fixed graph, so the build runs a
fixed number of rounds (``NearDuplicates.rounds``), then checks, node by node,
that the graph is that fixed point (``StarLabels``): a node with a smaller
neighbour has exactly one neighbour. The clusters are then exact (a chain
A~B~C is one cluster even where A and C share no bucket); a graph that needs
more rounds stops the build with one line naming the parameter, never a
wrong cluster. Candidate edges come from buckets as stars centred on the
bucket's smallest key, so the graph has one edge per bucket member, and
components of near copies have a small diameter: the rounds needed grow with
the logarithm of a component's diameter (the tests and benchmarks/README.md
give measured counts).

Kept member: the smallest shuffle key of the cluster, a function of the
records alone (G1), so the kept set is the same on every runner. Under
``near_duplicate=skip`` exact copies are near duplicates too (similarity 1):
``SpreadCopies`` skips every copy k >= 1 (kind ``duplicate`` under
``duplicate=skip``, else ``near_duplicate``) and the clusters are made of
distinct records; a record skipped counts once, as skipped.
"""

from __future__ import annotations

import collections
import os
from typing import Any, Iterator, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache import fs
from seqcache.pipelines import shuffle, spill, stats as stats_mod
from seqcache.tasks.near_duplicates import NearDuplicates, estimated_similarity
from seqcache.tasks.sources.base import describe_record

SIGNATURE_FEATURE = "near_duplicate_signature"
SIGNATURE_DTYPE = "uint32"
BAND_TAG, MEMBER_TAG, CLUSTER_TAG = b"B", b"M", b"C"
REMOVED_TAG = "near"
KIND = "near_duplicate"


def signature_spec() -> fmt.FeatureSpec:
    """The read step's last feature when near duplicates are removed."""
    return fmt.FeatureSpec(SIGNATURE_FEATURE, SIGNATURE_DTYPE)


def signature_column(params: NearDuplicates, records: Sequence, index: np.ndarray, where) -> tuple:
    """``(values, offsets)`` of ``SIGNATURE_FEATURE`` for a batch's examples:
    example i carries the signature of record ``records[index[i]]`` (uint32
    ``(bands * rows,)``, or no value for a record with no word).

    Args:
      records: the batch's live records (each with ``data``).
      index: int (n,): each example's record.
      where: ``where(record) -> str`` names a record in an error.

    Raises:
      ValueError: a record lacks a field the parameters name (``where`` names it).
    """
    distinct = np.unique(index).tolist()
    texts = [params.text_of(records[i].data, where(records[i])) for i in distinct]
    sigs = dict(zip(distinct, params.signatures(texts)))
    empty = np.zeros(0, np.uint32)
    parts = [sigs[i] if sigs[i] is not None else empty for i in np.asarray(index).tolist()]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts) if parts else empty
    return values.astype(np.uint32), offsets


def strip_signatures(entries: spill.ShardEntries) -> spill.ShardEntries:
    """``entries`` without their last feature (the signature: it ends every
    example, 4 bytes of length then 4 a value): the examples the task made."""
    sig_len = entries.lengths[:, -1].astype(np.int64)
    entries.end = entries.end - 4 - 4 * sig_len
    entries.lengths = np.ascontiguousarray(entries.lengths[:, :-1])
    return entries


def group_of(key: bytes, groups: int) -> int:
    """The group (of ``groups``) of a band hash or a record key: the key range
    of its first 8 bytes (``shuffle.shard_of``). The cluster steps work on
    groups, one element each per sender, so that a runner moves a few large
    values instead of one per band, edge or record."""
    return shuffle.shard_of(key, groups)


def _tag(tag: bytes, group: int) -> bytes:
    return tag + group.to_bytes(4, "big")


def member_outputs(entries: spill.ShardEntries, params: NearDuplicates, groups: int) -> Iterator[tuple[bytes, Any]]:
    """The near-duplicate values of one shard (its entries sorted, the copies
    ranked), per group (``group_of``): ``(BAND_TAG + group, rows)``, 24-byte
    rows of a band hash (8) and a record key (16), one per band of each
    distinct record with a signature; and ``(MEMBER_TAG + group, [(key,
    file index, record number, examples, [tokens of each read feature],
    signature bytes)])``, the member info of each (counts over the examples
    of copy k = 0), grouped by the record key's group."""
    if not len(entries):
        return
    rank = shuffle.copy_ranks(entries.key, entries.sub_index)
    keys = entries.key
    rows = np.flatnonzero(rank == 0)
    starts = rows[np.concatenate([[True], keys[rows][1:] != keys[rows][:-1]])] if len(rows) else rows
    group = np.searchsorted(starts, rows, side="right") - 1
    examples = np.bincount(group, minlength=len(starts))
    tokens = np.zeros((len(starts), entries.lengths.shape[1]), dtype=np.int64)
    np.add.at(tokens, group, entries.lengths[rows].astype(np.int64))
    wanted = {int(r): g for g, r in enumerate(starts.tolist())}
    bands, members = collections.defaultdict(list), collections.defaultdict(list)
    for lo, hi, data in entries.example_chunks():
        for r in range(lo, hi):
            g = wanted.get(r)
            if g is None or not entries.lengths[r, -1]:
                continue
            size = 4 * int(entries.lengths[r, -1])
            sig = bytes(data[r - lo][-size:])
            key = keys[r].tobytes()
            for h in params.band_hashes(np.frombuffer(sig, dtype="<u4")):
                bands[group_of(h, groups)].append(h + key)
            members[group_of(key, groups)].append((key, int(entries.file_index[r]), int(entries.record_number[r]),
                                                   int(examples[g]), tokens[g].tolist(), sig))
    for g in sorted(bands):
        yield _tag(BAND_TAG, g), b"".join(sorted(bands[g]))
    for g in sorted(members):
        yield _tag(MEMBER_TAG, g), members[g]


def _rows(blobs, size: int) -> Iterator[bytes]:
    """The ``size``-byte rows of every blob of ``blobs``."""
    for blob in blobs:
        for at in range(0, len(blob), size):
            yield blob[at:at + size]


def _routed(edges: set, groups: int) -> Iterator[tuple[bytes, bytes]]:
    """``(group, 32-byte rows (u, v))``: the edges, each by the group of u, rows sorted."""
    out = collections.defaultdict(list)
    for u, v in edges:
        out[group_of(u, groups)].append(u + v)
    for g in sorted(out):
        yield g.to_bytes(4, "big"), b"".join(sorted(out[g]))


def _adjacency(blobs) -> dict[bytes, set]:
    """node -> its neighbours, from 32-byte edge rows (u, v)."""
    around: dict[bytes, set] = collections.defaultdict(set)
    for row in _rows(blobs, 32):
        around[row[:16]].add(row[16:])
    return around


class StarEdges:
    """``(BAND_TAG + group, [rows of band hash and key])`` in: each band
    bucket's distinct keys joined to its smallest, each edge in both
    directions, out as ``_routed`` rows by the group of their first node."""

    def __init__(self, groups: int):
        self.groups = int(groups)

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        _, blobs = element
        buckets: dict[bytes, set] = collections.defaultdict(set)
        for row in _rows(blobs, 24):
            buckets[row[:8]].add(row[8:])
        edges = set()
        for keys in buckets.values():
            if len(keys) > 1:
                nodes = sorted(keys)
                for v in nodes[1:]:
                    edges.add((nodes[0], v))
                    edges.add((v, nodes[0]))
        yield from _routed(edges, self.groups)


class _Round:
    """A step over the groups of nodes (``groups``: how many; rows routed by
    ``_routed``)."""

    def __init__(self, groups: int):
        self.groups = int(groups)


class LargeStar(_Round):
    """One large-star round (Kiveris et al. 2014) over a group of nodes: for
    each node u, every neighbour v > u linked to m, the smallest of u and its
    neighbours; rows in and out as ``StarEdges``'."""

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        _, blobs = element
        edges = set()
        for u, around in _adjacency(blobs).items():
            m = min(around | {u})
            for v in around:
                if v > u and v != m:
                    edges.add((v, m))
                    edges.add((m, v))
        yield from _routed(edges, self.groups)


class SmallStar(_Round):
    """One small-star round (Kiveris et al. 2014) over a group of nodes: for
    each node u, every neighbour v < u, and u, linked to m, the smallest of
    them; rows in and out as ``StarEdges``'."""

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        _, blobs = element
        edges = set()
        for u, around in _adjacency(blobs).items():
            smaller = sorted(v for v in around if v < u)
            if not smaller:
                continue
            m = smaller[0]
            for v in [*smaller[1:], u]:
                edges.add((v, m))
                edges.add((m, v))
        yield from _routed(edges, self.groups)


class StarLabels:
    """After the rounds, a group of nodes: ``(MEMBER_TAG + group, ("labels",
    32-byte rows (node, label)))`` out, the label being the node's one smaller
    neighbour (a leaf) or the node itself (a centre).

    Raises:
      ValueError: the graph is not yet stars (a node with a smaller neighbour
        and another neighbour): more rounds are needed, named in the message.
    """

    def __init__(self, rounds: int):
        self.rounds = int(rounds)

    def __call__(self, element) -> Iterator[tuple[bytes, tuple]]:
        group, blobs = element
        out = []
        for u, around in sorted(_adjacency(blobs).items()):
            smaller = [v for v in around if v < u]
            if smaller and len(around) != 1:
                raise ValueError(f"near duplicates: the clusters of the candidate pairs did not settle in "
                                 f"{self.rounds} round{'s' if self.rounds != 1 else ''} (a record still links "
                                 f"{len(around)} others); run the build again with --near-duplicates "
                                 f"rounds={max(6, 4 * self.rounds)}")
            out.append(u + (smaller[0] if smaller else u))
        yield MEMBER_TAG + group, ("labels", b"".join(out))


class JoinLabels:
    """``(MEMBER_TAG + group, [member lists, ("labels", rows)])`` in; for each
    record in a cluster, its ``(label, key, info)`` in ``(CLUSTER_TAG + the
    label's shard, [...])`` out. ``num_shards``: the build's."""

    def __init__(self, num_shards: int):
        self.num_shards = int(num_shards)

    def __call__(self, element) -> Iterator[tuple[bytes, list]]:
        _, values = element
        labels, members = {}, []
        for v in values:
            if isinstance(v, tuple) and len(v) == 2 and v[0] == "labels":
                labels.update((row[:16], row[16:]) for row in _rows([v[1]], 32))
            else:
                members.extend(v)
        out = collections.defaultdict(list)
        for key, *info in members:
            label = labels.pop(key, None)
            if label is not None:
                out[shuffle.shard_of(label, self.num_shards)].append((label, key, tuple(info)))
        if labels:
            raise ValueError(f"near duplicates: record key {next(iter(labels)).hex()} is in a cluster but has no "
                             "member info (a lost value of the runner)")
        for shard in sorted(out):
            yield _tag(CLUSTER_TAG, shard), sorted(out[shard])


class ResolveClusters:
    """``(CLUSTER_TAG + shard, [[(label, key, info)], ...])`` in: the clusters whose
    kept record (the label) falls in that shard. For every member that is not
    the label: a quarantine entry (action ``skipped``, kind
    ``near_duplicate``, naming the kept record and the estimated similarity,
    ``kept`` and ``similarity`` fields), in one chunk ``(QUARANTINE_KEY,
    path)``; its key in ``(shard, ("near", keys))`` to the shard that holds
    it; and one ``(COUNTS_KEY, ("near-<shard>", 0, per-file counts taken off,
    bad-input counts))``. ``paths`` (by file index, a sequence or the build's
    ``WorkTable``) and ``locator`` word the entries."""

    def __init__(self, *, paths, locator: str | None, spill_dir: str, num_shards: int, quarantine_key: int,
                 counts_key: int):
        self.paths, self.locator, self.spill_dir, self.num_shards = paths, locator, spill_dir, int(num_shards)
        self.quarantine_key, self.counts_key = quarantine_key, counts_key

    def __call__(self, element) -> Iterator[tuple[int, Any]]:
        tagged, lists = element
        shard = int.from_bytes(tagged[1:], "big")
        clusters = collections.defaultdict(dict)
        for members in lists:
            for label, key, info in members:
                clusters[label][key] = info
        buffer, removed = spill.QuarantineBuffer(), collections.defaultdict(list)
        files, rows = [], []
        paths = self.paths.paths if hasattr(self.paths, "paths") else self.paths
        for label in sorted(clusters):
            cluster = clusters[label]
            kfi, krn, _, _, ksig = cluster[label]
            kept_path = paths[kfi]
            kept_sig = np.frombuffer(ksig, dtype="<u4")
            for key in sorted(k for k in cluster if k != label):
                fi, rn, examples, tokens, sig = cluster[key]
                similarity = round(estimated_similarity(np.frombuffer(sig, dtype="<u4"), kept_sig), 4)
                path = paths[fi]
                message = (f"{describe_record(path, self.locator, rn, stable=True)} is a near duplicate of "
                           f"{kept_path}: {describe_record(kept_path, self.locator, krn, stable=True)} (estimated "
                           f"similarity {similarity}), which is kept (on_error near_duplicate=skip)")
                buffer.add(fi, rn, "skipped", path, message, KIND,
                           {"kept": {"source_index": kfi, "path": kept_path, "record_number": krn},
                            "similarity": similarity})
                removed[shuffle.shard_of(key, self.num_shards)].append(key)
                files.append(fi)
                rows.append([-examples, *(-t for t in tokens)])
        if not len(buffer):
            return
        chunk = fs.join(self.spill_dir, f"{spill.QUARANTINE_PREFIX}near-{shard:07d}-{os.urandom(6).hex()}.txt")
        fs.write_bytes(chunk, buffer.to_bytes())
        yield self.quarantine_key, chunk
        for target in sorted(removed):
            yield target, (REMOVED_TAG, b"".join(sorted(removed[target])))
        bad_input = stats_mod.BadInputCounts()
        bad_input.add_counts("skipped", len(buffer), {KIND: len(buffer)})
        columns = [files, *np.asarray(rows, dtype=np.int64).T.tolist()]
        yield self.counts_key, (f"near-{shard}", 0, columns, bad_input.to_json())


def split_removed(values) -> tuple[list, np.ndarray]:
    """A shard's values for ``WriteGroup``: (the sections, the keys of the
    records removed as near duplicates, ``V16`` (k,), sorted)."""
    sections, keys = [], []
    for v in values:
        if isinstance(v, tuple) and len(v) == 2 and v[0] == REMOVED_TAG:
            keys.append(v[1])
        else:
            sections.append(v)
    removed = np.frombuffer(b"".join(keys), dtype="V16") if keys else np.zeros(0, "V16")
    return sections, np.sort(removed.view("S16")).view("V16") if len(removed) else removed


def removed_rows(entries: spill.ShardEntries, removed: np.ndarray) -> np.ndarray:
    """bool (n,): the entries whose key is one of ``removed`` (``V16``)."""
    if not len(removed) or not len(entries):
        return np.zeros(len(entries), dtype=bool)
    return np.isin(entries.key.view("S16"), removed.view("S16"))
