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
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

KEY_BYTES = 16


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


def shard_of(key: bytes, num_shards: int) -> int:
    """The shard whose key range holds ``key``: floor(key_hi64 * S / 2**64)."""
    return (int.from_bytes(key[:8], "big") * num_shards) >> 64


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
