"""The global shuffle: a keyed hash of each raw record, and key-range shards.

Every source record gets a 128-bit key, ``blake2b(raw, key=seed, digest_size=16)``
(BLAKE2, RFC 7693, in keyed mode). Keys of distinct records behave as independent
uniform draws, so sorting all records by key is a uniformly random permutation of
the corpus (G2), and it depends only on the multiset of raw records and the seed:
not on file order, file boundaries, workers or bundles (G1).

Shard ``s`` of ``S`` holds the keys in ``[s * 2**64 / S, (s + 1) * 2**64 / S)`` of
the key's first 64 bits, so shards are contiguous key ranges: concatenating the
shards in index order gives the global sorted order. Inside a shard, records are
sorted by (key, example index within the record, example bytes, provenance), a
total order that does not depend on arrival order.

Identical records share that first key, so they would sit side by side and fill
packed rows with one text. Each copy gets its own place instead: the k-th copy
(k = 0, 1, ...; copies ranked by provenance, file index and record number) keeps
the first key when k = 0 and is re-keyed to ``copy_keys(first key, k)`` =
``blake2b(first key || k, key=seed, person=COPY_PERSON)`` otherwise, a key of
its own, in whatever shard holds it (``transforms.SpreadCopies`` moves it
there). The keys of a record's c copies, the first key and ``copy_keys(first,
k)`` for 1 <= k < c, depend only on the record and its count in the multiset,
so G1 holds; since copies are identical, which copy is the k-th changes
provenance only.
``SHUFFLE_VERSION`` names this scheme in a cache's fingerprint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

KEY_BYTES = 16
# The shuffle scheme, in every cache's fingerprint inputs: 1 gave identical
# records one shared key; 2 gives each copy its own (``copy_keys``). Changing it
# changes which example sits at which cache index: caches must be rebuilt.
SHUFFLE_VERSION = 2
# BLAKE2's personalisation for copy keys: no raw record's key can equal one.
COPY_PERSON = b"seqcache copy"


def seed_key(seed: int) -> bytes:
    """The BLAKE2 key for a shuffle seed (an integer in [0, 2**64))."""
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed must be in [0, 2**64) (got {seed=})")
    return seed.to_bytes(8, "little")


def record_key(raw: bytes, key: bytes) -> bytes:
    """The 16-byte shuffle key of one raw record under the BLAKE2 key ``key``."""
    return hashlib.blake2b(raw, key=key, digest_size=KEY_BYTES).digest()


def record_keys(raws: Iterable[bytes], key: bytes) -> list[bytes]:
    """``[record_key(raw, key) for raw in raws]``, computed from one keyed BLAKE2
    state: a keyed hash first compresses the key's padded block, so each record
    starts from a copy of that state instead (the same digests, about half the
    cost per short record)."""
    keyed = hashlib.blake2b(key=key, digest_size=KEY_BYTES)
    copy = keyed.copy
    out = []
    append = out.append
    for raw in raws:
        h = copy()
        h.update(raw)
        append(h.digest())
    return out


def copy_ranks(keys: np.ndarray, sub_index: np.ndarray) -> np.ndarray:
    """uint32 (n,): for entries sorted by (key, sub-index, provenance), the number
    of earlier entries with the same key and sub-index: each entry's copy number k
    among the identical records (0 for a record with no copy). ``keys`` is ``V16``
    (n,), ``sub_index`` (n,)."""
    n = len(keys)
    if n < 2:
        return np.zeros(n, np.uint32)
    same = np.concatenate([[False], (keys[1:] == keys[:-1]) & (sub_index[1:] == sub_index[:-1])])
    if not same.any():
        return np.zeros(n, np.uint32)
    starts = np.flatnonzero(~same)
    first = np.repeat(starts, np.diff(np.concatenate([starts, [n]])))
    return (np.arange(n) - first).astype(np.uint32)


def copy_keys(first: np.ndarray, copies: np.ndarray, key: bytes) -> np.ndarray:
    """``V16`` (n,): the keys of copies ``copies`` (uint, (n,), each >= 1) of the
    records whose first keys are ``first`` (``V16`` (n,)), under the BLAKE2 key
    ``key``: ``blake2b(first || k as 8 bytes little-endian, key=key,
    person=COPY_PERSON, digest_size=16)``."""
    keyed = hashlib.blake2b(key=key, digest_size=KEY_BYTES, person=COPY_PERSON)
    # Each copy's message, first key then k, as one 24-byte row: one update per
    # copy from a copy of the keyed state (the same digests as two updates).
    rows = np.empty(len(first), dtype=[("first", "V16"), ("k", "<u8")])
    rows["first"] = first
    rows["k"] = copies
    copy = keyed.copy
    out = []
    append = out.append
    for message in rows.view("V24").tolist():
        h = copy()
        h.update(message)
        append(h.digest())
    return np.frombuffer(b"".join(out), dtype="V16")


def shard_of(key: bytes, num_shards: int) -> int:
    """The shard whose key range holds ``key``: floor(key_hi64 * S / 2**64)."""
    return (int.from_bytes(key[:8], "big") * num_shards) >> 64


def shards_of(first: np.ndarray, num_shards: int) -> np.ndarray:
    """``shard_of`` of many keys at once: int64 (n,), from the first 8 bytes of
    each key as a uint64 (n,) (big-endian bytes read as a number):
    floor(a * S / 2**64) in 64-bit integer arithmetic, from 32-bit halves,
    floor((a_hi * S + floor(a_lo * S / 2**32)) / 2**32), exact for S < 2**31."""
    first = np.asarray(first, dtype=np.uint64)
    if num_shards >= 1 << 31:
        return np.asarray([(int(a) * num_shards) >> 64 for a in first.tolist()], dtype=np.int64)
    s = np.uint64(num_shards)
    a_hi, a_lo = first >> np.uint64(32), first & np.uint64(0xFFFFFFFF)
    return ((a_hi * s + ((a_lo * s) >> np.uint64(32))) >> np.uint64(32)).astype(np.int64)


DEFAULT_SHARD_BYTES = 128 << 20


def choose_num_shards(total_bytes: int, *, target_shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """Shard count derived from the raw corpus size: ``ceil(total / target)``.

    One shard is sorted (and packed) in one worker's memory; its size in memory is
    about its raw text size (int32 tokens take ~4 bytes per ~4 characters), so
    ``target_shard_bytes`` of raw input bounds a worker's memory, whatever the
    corpus size. There is no cap: a 10 TB corpus gets 81,920 shards of 128 MiB,
    not fewer, larger ones. Returns at least 1.
    """
    if target_shard_bytes < 1:
        raise ValueError(f"target_shard_bytes must be >= 1 (got {target_shard_bytes})")
    return max(1, -(-int(total_bytes) // int(target_shard_bytes)))
