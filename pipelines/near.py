"""Near-duplicate removal inside the build: MinHash LSH candidates, exact
clusters, one member kept (``on_error={"near_duplicate": "skip"}``).

The steps, each a plain picklable callable (build.py wires them)::

    ReadPreprocess ── each example carries its record's signature as a last
        feature, SIGNATURE_FEATURE (uint32 (bands * rows,); kept in the work
        folder like any feature, stripped before a shard is written)
    SpreadCopies (its shard's entries) ──> per distinct record (copy k = 0),
        gathered by group (``groups_of``: a key range, as many as shards):
        (b"B" + group, rows of band hash and key)  one row per band  ``member_outputs``
        (b"M" + group, ("members", rows))  key, provenance, counts, signature
    GroupByKey(band group) ──> ``StarEdges``: each bucket's keys joined to its smallest
    ROUNDS x [GroupByKey(node group) ──> ``LargeStar`` ; GroupByKey ──> ``SmallStar``]
    GroupByKey(b"M" + node group: the edges and the member rows) ──> ``JoinLabels``:
        every node's component label (the smallest key of its component),
        checked to be final, joined to its member row
    GroupByKey(b"C" + shard of the label) ──> ``ResolveClusters``: per cluster
        the label's record is kept, every other member is removed: a
        quarantine entry naming the kept record and the estimated similarity,
        its examples and tokens taken off the counts, and its key sent to the
        shard that holds it (``(shard, ("near", keys))``), where ``WriteGroup``
        leaves its entries out.

Every value of these steps is one byte string of fixed-width rows (or a
tagged one) per group and sender, and every step is numpy over its rows
(sorts, run starts, masks): no Python object or loop per band, edge or
record, but for the quarantine entries of the records removed.

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
that the graph is that fixed point (``JoinLabels``): a node with a smaller
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
distinct records; a record skipped counts once, as skipped. A copy's entry
is written once its record's cluster is known (``member_outputs`` sends it
as a ``COPY_ROW``, ``JoinLabels`` labels it, ``ResolveClusters`` words it),
so that it names the record the cache holds: its first copy, or where that
one was removed as a near duplicate, the record kept in its stead.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache import fs
from seqcache.pipelines import shuffle, spill, stats as stats_mod
from seqcache.tasks.near_duplicates import NearDuplicates
from seqcache.tasks.sources.base import describe_record

SIGNATURE_FEATURE = "near_duplicate_signature"
SIGNATURE_DTYPE = "uint32"
BAND_TAG, MEMBER_TAG, CLUSTER_TAG = b"B", b"M", b"C"
REMOVED_TAG = "near"
KIND = "near_duplicate"
# Rows of the cluster steps, each a plain byte string in a runner's values:
# a band hash (big-endian, so its key range is its value's) and a record key;
# an edge (u, v) between two record keys, sorted as bytes: by u, then v.
_BAND_ROW = np.dtype([("band", ">u8"), ("key", "S16")])
# A skipped exact copy (k >= 1) of a record with a signature: its key (its
# record's) and its own provenance, worded by ``ResolveClusters`` once its
# record's cluster, and so the record kept, is known.
COPY_ROW = np.dtype([("key", "S16"), ("file", "<u4"), ("record", "<u8")])
_EDGE_ROW = np.dtype([("u", "S16"), ("v", "S16")])


def signature_spec() -> fmt.FeatureSpec:
    """The read step's last feature when near duplicates are removed."""
    return fmt.FeatureSpec(SIGNATURE_FEATURE, SIGNATURE_DTYPE)


def member_dtype(num_features: int, params: NearDuplicates) -> np.dtype:
    """A clustered record's member info, one row of the member values:
    ``key`` (its shuffle key), ``file`` and ``record`` (its provenance),
    ``examples`` and ``tokens`` (int64 (num_features,), per read feature)
    over the examples of copy k = 0, and ``signature`` (uint32 (bands * rows,))."""
    return np.dtype([("key", "S16"), ("file", "<u4"), ("record", "<u8"), ("examples", "<i8"),
                     ("tokens", "<i8", (num_features,)), ("signature", "<u4", (params.num_hashes,))])


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
    def text(record) -> str:
        try:
            return params.text_of(record.data)
        except ValueError:  # again, naming the record (``where`` only on this path)
            return params.text_of(record.data, where(record))

    distinct, inverse = np.unique(np.asarray(index, dtype=np.int64), return_inverse=True)
    sigs, has = params.signatures([text(records[i]) for i in distinct.tolist()])
    carries = has[inverse]
    offsets = np.zeros(len(inverse) + 1, dtype=np.int64)
    np.cumsum(np.where(carries, params.num_hashes, 0), out=offsets[1:])
    return sigs[inverse[carries]].reshape(-1), offsets


def strip_signatures(entries: spill.ShardEntries) -> spill.ShardEntries:
    """``entries`` without their last feature (the signature: it ends every
    example, 4 bytes of length then 4 a value): the examples the task made."""
    sig_len = entries.lengths[:, -1].astype(np.int64)
    entries.end = entries.end - 4 - 4 * sig_len
    entries.lengths = np.ascontiguousarray(entries.lengths[:, :-1])
    return entries


def groups_of(rows: np.ndarray, groups: int) -> np.ndarray:
    """int64 (n,): the group (of ``groups``) of each row (a byte-string array
    whose rows start with a band hash or a record key): the key range of its
    first 8 bytes (``shuffle.shard_of``). The cluster steps work on groups,
    one element each per sender, so that a runner moves a few large values
    instead of one per band, edge or record."""
    raw = np.ascontiguousarray(rows).view(np.uint8).reshape(len(rows), rows.itemsize)
    return shuffle.shards_of(np.ascontiguousarray(raw[:, :8]).view(">u8").reshape(-1), groups)


def _tag(tag: bytes, group: int) -> bytes:
    return tag + int(group).to_bytes(4, "big")


def _by_group(tag: bytes, rows: np.ndarray, groups: int, wrap=bytes) -> Iterator[tuple[bytes, Any]]:
    """``(tag + group, wrap(bytes of its rows))`` per group of ``rows`` (sorted: groups are key ranges)."""
    g = groups_of(rows, groups)
    cuts = np.flatnonzero(g[1:] != g[:-1]) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)]):
        if hi > lo:
            yield _tag(tag, g[lo]), wrap(rows[lo:hi].tobytes())


def _unique(rows: np.ndarray, runs: bool = False) -> np.ndarray:
    """The distinct rows of a byte-string array, sorted. ``runs``: the rows
    are sorted runs (several senders' values), which a stable sort merges in
    about linear time."""
    rows = np.sort(rows, kind="stable" if runs else None)
    return rows[np.concatenate([[True], rows[1:] != rows[:-1]])] if len(rows) else rows


def _run_starts(values: np.ndarray) -> np.ndarray:
    """int64 (n,): for sorted ``values``, the index of the first of each one's run of equal values."""
    new = np.ones(len(values), dtype=bool)
    new[1:] = values[1:] != values[:-1]
    return np.flatnonzero(new)[np.cumsum(new) - 1]


def member_outputs(entries: spill.ShardEntries, params: NearDuplicates, groups: int) -> Iterator[tuple[bytes, Any]]:
    """The near-duplicate values of one shard (its entries sorted, the copies
    ranked), per group (``groups_of``), for each distinct record with a
    signature: ``(BAND_TAG + group, rows)``, 24-byte rows of a band hash and
    its key (one per band); and ``(MEMBER_TAG + group, ("members", rows))``,
    its member info (``member_dtype``) by the group of its key; and
    ``(MEMBER_TAG + group, ("copies", rows))``, ``COPY_ROW`` of each skipped
    copy k >= 1 of such a record (``SpreadCopies`` counts them; their
    quarantine entries, which name the record kept, come from ``ResolveClusters``)."""
    if not len(entries):
        return
    rank = shuffle.copy_ranks(entries.key, entries.sub_index)
    rows = np.flatnonzero(rank == 0)
    keys = entries.key[rows].view("S16")
    new = np.concatenate([[True], keys[1:] != keys[:-1]])
    starts = np.flatnonzero(new)  # each distinct record's first example, in ``rows``
    lengths = entries.lengths[rows].astype(np.int64)
    signed = lengths[starts, -1] > 0  # the records with a signature (its length: the last feature's)
    want = rows[starts[signed]]  # their first examples, as entries
    if not len(want):
        return
    size, sigs = 4 * params.num_hashes, []
    for lo, hi, data in entries.example_chunks():  # a signature: the last bytes of its example
        sigs += [data[r - lo][-size:] for r in want[np.searchsorted(want, lo):np.searchsorted(want, hi)].tolist()]
    members = np.zeros(len(want), dtype=member_dtype(lengths.shape[1], params))
    members["signature"] = np.frombuffer(b"".join(sigs), dtype="<u4").reshape(len(want), -1)
    members["key"] = keys[starts[signed]]
    members["file"] = entries.file_index[want]
    members["record"] = entries.record_number[want]
    members["examples"] = np.diff(np.append(starts, len(rows)))[signed]
    members["tokens"] = np.add.reduceat(lengths, starts, axis=0)[signed]
    bands = np.zeros((len(want), params.bands), dtype=_BAND_ROW)
    bands["band"] = params.band_hashes(members["signature"])
    bands["key"] = members["key"][:, None]
    yield from _by_group(BAND_TAG, _unique(bands.reshape(-1).view("S24")), groups)
    yield from _by_group(MEMBER_TAG, members, groups, lambda rows: ("members", rows))
    copies = np.flatnonzero((rank != 0) & (entries.sub_index == 0))  # each skipped copy's first example
    copies = copies[np.isin(entries.key[copies].view("S16"), members["key"])]
    if len(copies):
        out = np.zeros(len(copies), dtype=COPY_ROW)
        out["key"], out["file"], out["record"] = (entries.key[copies].view("S16"), entries.file_index[copies],
                                                  entries.record_number[copies])
        yield from _by_group(MEMBER_TAG, out[np.argsort(out["key"], kind="stable")], groups,
                             lambda rows: ("copies", rows))


def _routed(u: np.ndarray, v: np.ndarray, groups: int) -> Iterator[tuple[bytes, bytes]]:
    """``(MEMBER_TAG + group, 32-byte rows (u, v))``: the edges u -> v and v -> u
    (``S16`` (n,) each), each by the group of its first node, rows distinct and sorted."""
    edges = np.zeros(2 * len(u), dtype=_EDGE_ROW)
    edges["u"], edges["v"] = np.concatenate([u, v]), np.concatenate([v, u])
    yield from _by_group(MEMBER_TAG, _unique(edges.view("S32")), groups)


def _edges(blobs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(u, v, first)`` of the distinct 32-byte edge rows of ``blobs``, sorted
    by u then v: ``S16`` (n,) twice, and int64 (n,), the row of u's smallest neighbour."""
    edges = _unique(np.frombuffer(b"".join(blobs), dtype="S32"), runs=True).view(_EDGE_ROW)
    return edges["u"], edges["v"], _run_starts(edges["u"])


class StarEdges:
    """``(BAND_TAG + group, [rows of band hash and key])`` in: each band
    bucket's distinct keys joined to its smallest, each edge in both
    directions, out as ``_routed`` rows by the group of their first node."""

    def __init__(self, groups: int):
        self.groups = int(groups)

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        _, blobs = element
        rows = _unique(np.frombuffer(b"".join(blobs), dtype="S24"), runs=True).view(_BAND_ROW)
        first = _run_starts(rows["band"])
        leaf = first != np.arange(len(rows))
        yield from _routed(rows["key"][first[leaf]], rows["key"][leaf], self.groups)


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
        u, v, first = _edges(element[1])
        m = np.where(v[first] < u, v[first], u)
        larger = v > u
        yield from _routed(v[larger], m[larger], self.groups)


class SmallStar(_Round):
    """One small-star round (Kiveris et al. 2014) over a group of nodes: for
    each node u, every neighbour v < u, and u, linked to m, the smallest of
    them; rows in and out as ``StarEdges``'."""

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        u, v, first = _edges(element[1])
        m, head = v[first], first == np.arange(len(u))
        linked = np.where(head, m < u, v < u)  # u itself on its first row (v = m), every other smaller v on its own
        yield from _routed(np.where(head, u, v)[linked], m[linked], self.groups)


class JoinLabels:
    """After the rounds, a group of nodes: ``(MEMBER_TAG + group, [edge rows,
    ("members", rows), ("copies", rows)])`` in (the rounds' edges and
    ``member_outputs``' member info and copies); each node's label, its one
    smaller neighbour (a leaf) or itself (a centre), joined to its member
    info: ``(CLUSTER_TAG + the label's shard, rows of label (16 bytes) and
    member info)`` out, a record in no cluster that has copies as a cluster of
    its own; and each copy with its record's label, ``(CLUSTER_TAG + the
    label's shard, ("copies", rows of label and COPY_ROW))``. ``members``:
    ``member_dtype``.

    Raises:
      ValueError: the graph is not yet stars (a node with a smaller neighbour
        and another neighbour): more rounds are needed, named in the message;
        or a node has no member info (a value the runner lost).
    """

    def __init__(self, rounds: int, num_shards: int, members: np.dtype):
        self.rounds, self.num_shards, self.members = int(rounds), int(num_shards), members

    def __call__(self, element) -> Iterator[tuple[bytes, bytes]]:
        _, values = element
        u, v, first = _edges([x for x in values if isinstance(x, bytes)])
        head = first == np.arange(len(u))
        links = np.diff(np.append(np.flatnonzero(head), len(u)))[np.cumsum(head) - 1]
        leaf = v[first] < u
        unsettled = np.flatnonzero(leaf & (links != 1))
        if len(unsettled):
            raise ValueError(f"near duplicates: the clusters of the candidate pairs did not settle in "
                             f"{self.rounds} round{'s' if self.rounds != 1 else ''} (a record still links "
                             f"{links[unsettled[0]]} others); run the build again with --near-duplicates "
                             f"rounds={max(6, 4 * self.rounds)}")
        nodes, labels = u[head], np.where(leaf, v[first], u)[head]
        members = np.frombuffer(b"".join(x[1] for x in values if isinstance(x, tuple) and x[0] == "members"),
                                dtype=self.members)
        copies = np.frombuffer(b"".join(x[1] for x in values if isinstance(x, tuple) and x[0] == "copies"),
                               dtype=COPY_ROW)
        at = np.searchsorted(nodes, members["key"])
        found = at < len(nodes)
        found[found] = nodes[at[found]] == members["key"][found]
        if found.sum() != len(nodes):
            lost = nodes[~np.isin(nodes, members["key"][found])][:1]
            raise ValueError(f"near duplicates: record key {lost.tobytes().hex()} is in a cluster but has no "
                             "member info (a lost value of the runner)")
        # A record in no cluster that has exact copies is a cluster of its own: its copies' entries name it.
        alone = ~found & np.isin(members["key"], copies["key"])
        rows = np.zeros(int(found.sum() + alone.sum()), dtype=[("label", "S16"), ("member", self.members)])
        rows["label"] = np.concatenate([labels[at[found]], members["key"][alone]])
        rows["member"] = np.concatenate([members[found], members[alone]])
        order = np.argsort(rows["label"], kind="stable")
        yield from _by_group(CLUSTER_TAG, rows[order], self.num_shards)
        if len(copies):
            by_key = np.argsort(rows["member"]["key"], kind="stable")
            keyed, label_of = rows["member"]["key"][by_key], rows["label"][by_key]
            at = np.searchsorted(keyed, copies["key"])
            if not np.all((at < len(keyed)) & (keyed[np.minimum(at, len(keyed) - 1)] == copies["key"])):
                raise ValueError("near duplicates: an exact copy's record has no member info (a lost value of "
                                 "the runner)")
            out = np.zeros(len(copies), dtype=[("label", "S16"), ("copy", COPY_ROW)])
            out["label"], out["copy"] = label_of[at], copies
            yield from _by_group(CLUSTER_TAG, out[np.argsort(out["label"], kind="stable")], self.num_shards,
                                 lambda rows: ("copies", rows))


class ResolveClusters:
    """``(CLUSTER_TAG + shard, [rows of label and member info, ("copies",
    rows of label and COPY_ROW)])`` in: the clusters whose kept record (the
    label) falls in that shard. For every member that is not the label: a
    quarantine entry (action ``skipped``, kind ``near_duplicate``, naming the
    kept record and the estimated similarity, ``kept`` and ``similarity``
    fields); its key in ``(shard, ("near", keys))`` to the shard that holds
    it; and one ``(COUNTS_KEY, ("near-<shard>", 0, per-file counts taken off,
    bad-input counts))``. For every exact copy k >= 1 of a member (counted by
    ``SpreadCopies``): an entry of kind ``duplicates`` ("duplicate" under
    ``duplicate=skip``, else ``near_duplicate`` of similarity 1) that names
    the record it is identical to and, where that record was removed in turn,
    the record kept: ``kept`` is always a record the cache holds. The entries
    go in one chunk ``(QUARANTINE_KEY, path)``. ``paths`` (by file index, a
    sequence or the build's ``WorkTable``) and ``locator`` word the entries;
    ``members``: ``member_dtype``.

    Raises:
      ValueError: a cluster without its kept record's member info (a value the runner lost).
    """

    def __init__(self, *, paths, locator: str | None, spill_dir: str, num_shards: int, quarantine_key: int,
                 counts_key: int, members: np.dtype, duplicates: str = "keep"):
        self.paths, self.locator, self.spill_dir, self.num_shards = paths, locator, spill_dir, int(num_shards)
        self.quarantine_key, self.counts_key, self.members = quarantine_key, counts_key, members
        self.copy_kind = "duplicate" if duplicates == "skip" else KIND

    def __call__(self, element) -> Iterator[tuple[int, Any]]:
        tagged, blobs = element
        shard = int.from_bytes(tagged[1:], "big")
        blobs = list(blobs)
        rows = np.frombuffer(b"".join(b for b in blobs if isinstance(b, bytes)),
                             dtype=[("label", "S16"), ("member", self.members)])
        copies = np.frombuffer(b"".join(b[1] for b in blobs if isinstance(b, tuple)),
                               dtype=[("label", "S16"), ("copy", COPY_ROW)])
        rows = rows[np.lexsort((rows["member"]["key"], rows["label"]))]
        label, members = rows["label"], rows["member"]
        first = _run_starts(label)  # the label is its cluster's smallest key: its row comes first
        if not np.array_equal(members["key"][first], label):
            raise ValueError(f"near duplicates: the kept record of cluster {label[:1].tobytes().hex()} has no "
                             "member info (a lost value of the runner)")
        removed = np.flatnonzero(first != np.arange(len(rows)))
        kept = first[removed]
        similarity = (members["signature"] == members["signature"][first]).mean(axis=1)
        paths = self.paths.paths if hasattr(self.paths, "paths") else self.paths
        files, records = members["file"].tolist(), members["record"].tolist()
        words: dict[int, str] = {}

        def named(i: int) -> str:  # a member, as the entries name it
            if i not in words:
                words[i] = f"{paths[files[i]]}: {describe_record(paths[files[i]], self.locator, records[i], stable=True)}"
            return words[i]

        def kept_field(i: int) -> dict:
            return {"source_index": files[i], "path": paths[files[i]], "record_number": records[i]}

        buffer = spill.QuarantineBuffer()
        for r, k in zip(removed.tolist(), kept.tolist()):
            s = round(float(similarity[r]), 4)
            message = (f"{describe_record(paths[files[r]], self.locator, records[r], stable=True)} is a near "
                       f"duplicate of {named(k)} (estimated similarity {s}), which is kept "
                       "(on_error near_duplicate=skip)")
            buffer.add(files[r], records[r], "skipped", paths[files[r]], message, KIND,
                       {"kept": kept_field(k), "similarity": s})
        if len(copies):
            order = np.argsort(members["key"], kind="stable")
            of = order[np.searchsorted(members["key"][order], copies["copy"]["key"])]  # each copy's record
            for c, m in zip(copies["copy"].tolist(), of.tolist()):
                _, fi, rn = c
                k, path = int(first[m]), paths[fi]
                record = describe_record(path, self.locator, rn, stable=True)
                extra = {"kept": kept_field(k)}
                if k == m:
                    message = f"{record} is identical to {named(m)}, which is kept (on_error {self.copy_kind}=skip)"
                    if self.copy_kind == KIND:
                        extra["similarity"] = 1.0
                else:
                    s = round(float(similarity[m]), 4)
                    message = (f"{record} is identical to {named(m)}, a near duplicate of {named(k)} (estimated "
                               f"similarity {s}), which is kept (on_error {self.copy_kind}=skip)")
                    extra["similarity"] = s
                buffer.add(fi, rn, "skipped", path, message, self.copy_kind, extra)
        if buffer:
            chunk = fs.join(self.spill_dir, f"{spill.QUARANTINE_PREFIX}near-{shard:07d}-{os.urandom(6).hex()}.txt")
            fs.write_bytes(chunk, buffer.to_bytes())
            yield self.quarantine_key, chunk
        if not len(removed):
            return
        keys = np.sort(members["key"][removed])
        for target, blob in _by_group(b"", keys, self.num_shards):
            yield int.from_bytes(target, "big"), (REMOVED_TAG, blob)
        bad_input = stats_mod.BadInputCounts()
        bad_input.add_counts("skipped", len(removed), {KIND: len(removed)})
        counts = np.column_stack([members["examples"][removed], members["tokens"][removed]])
        yield self.counts_key, (f"near-{shard}", 0, [members["file"][removed].tolist(), *(-counts).T.tolist()],
                                bad_input.to_json())


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
