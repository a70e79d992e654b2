"""The connected components of near-duplicate candidates (pipelines/near.py):
large-star and small-star rounds, each step run here as Beam runs it, with
a GroupByKey between steps made of a dict."""

from __future__ import annotations

import collections
import random

import numpy as np
import pytest

from seqcache.pipelines import near
from seqcache.tasks.near_duplicates import NearDuplicates


GROUPS = 4
MEMBERS = near.member_dtype(1, NearDuplicates(bands=1, rows=1))


def _group(pairs):
    """GroupByKey: (key, value) pairs to (key, [values]), in key order."""
    out = collections.defaultdict(list)
    for k, v in pairs:
        out[k].append(v)
    return sorted(out.items())


def _keys(keys) -> np.ndarray:
    return np.frombuffer(b"".join(keys), dtype="S16")


def _labels(edges, rounds: int) -> dict[bytes, bytes]:
    """Each node's label after ``rounds`` pairs of rounds, as the build computes
    it: the rounds' edges joined with a member row per node."""
    pairs = list(near._routed(_keys([a for a, _ in edges]), _keys([b for _, b in edges]), GROUPS))
    for _ in range(rounds):
        pairs = [p for element in _group(pairs) for p in near.LargeStar(GROUPS)(element)]
        pairs = [p for element in _group(pairs) for p in near.SmallStar(GROUPS)(element)]
    members = np.zeros(len({x for e in edges for x in e}), dtype=MEMBERS)
    members["key"] = np.sort(_keys(sorted({x for e in edges for x in e})))
    pairs += near._by_group(near.MEMBER_TAG, members, GROUPS, lambda rows: ("members", rows))
    labels = {}
    for element in _group(pairs):
        for _, blob in near.JoinLabels(rounds, 1, MEMBERS)(element):
            rows = np.frombuffer(blob, dtype=[("label", "S16"), ("member", MEMBERS)])
            keys, found = rows["member"]["key"].tobytes(), rows["label"].tobytes()
            labels.update((keys[at:at + 16], found[at:at + 16]) for at in range(0, len(keys), 16))
    return labels


def _components(edges) -> dict[bytes, bytes]:
    """The reference: union-find, each node labelled with its component's smallest node."""
    parent = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return {x: find(x) for x in list(parent)}


def _key(rng) -> bytes:
    return rng.randbytes(16)


def test_random_graphs_give_exactly_the_components_of_union_find():
    rng = random.Random(3)
    for trial in range(30):
        nodes = [_key(rng) for _ in range(rng.randrange(2, 120))]
        edges = [(rng.choice(nodes), rng.choice(nodes)) for _ in range(rng.randrange(1, 150))]
        edges = [(a, b) for a, b in edges if a != b]
        if not edges:
            continue
        assert _labels(edges, rounds=12) == _components(edges), trial


def test_a_long_chain_needs_more_rounds_and_too_few_stop_with_the_parameter():
    rng = random.Random(4)
    nodes = [_key(rng) for _ in range(200)]
    chain = list(zip(nodes, nodes[1:]))  # keys in random order along the chain: the worst case of the tests
    needed = next(r for r in range(1, 40) if _settles(chain, r))
    assert 2 <= needed <= 12, needed  # O(log² n) (Kiveris et al.); measured: a few rounds for 200 nodes
    few = needed - 1
    with pytest.raises(ValueError, match=rf"did not settle in {few} rounds?\b.*rounds={max(6, 4 * few)}"):
        _labels(chain, needed - 1)
    labels = _labels(chain, needed)
    assert set(labels.values()) == {min(nodes)}


def _settles(edges, rounds) -> bool:
    try:
        _labels(edges, rounds)
    except ValueError:
        return False
    return True


def test_buckets_become_stars_on_their_smallest_key():
    a, b, c = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    h, other = b"h" * 8, b"o" * 8
    rows = [h + c + h + a, h + b + h + a + other + c]  # bucket h: c, a, b, a; bucket "o": c alone
    out = list(near.StarEdges(1)((b"B" + bytes(4), rows)))
    assert out == [(b"M" + bytes(4), a + b + a + c + b + a + c + a)]
    assert list(near.StarEdges(1)((b"B" + bytes(4), [h + c + h + c]))) == []


def test_a_node_without_its_member_row_is_a_lost_value():
    a, b = b"\x01" * 16, b"\x02" * 16
    edges = [p for _, p in near._routed(_keys([a]), _keys([b]), 1)]
    members = np.zeros(1, dtype=MEMBERS)
    members["key"] = _keys([a])
    with pytest.raises(ValueError, match=f"record key {b.hex()} is in a cluster but has no member info"):
        list(near.JoinLabels(1, 1, MEMBERS)((b"M" + bytes(4), [*edges, ("members", members.tobytes())])))
