"""Near duplicates: MinHash signatures of word n-grams, and their LSH bands.

Two texts are near duplicates when the sets of their word n-grams (shingles)
have a high Jaccard similarity J = |A ∩ B| / |A ∪ B|. MinHash (Broder 1997,
"On the resemblance and containment of documents") estimates J: for a random
hash function h, P[min h(A) = min h(B)] = J, so a signature of K = bands x rows
minimum hashes agrees with another's in about J·K places. Locality-sensitive
hashing (Indyk and Motwani 1998; the banding of Leskovec, Rajaraman and
Ullman, "Mining of Massive Datasets", ch. 3.4) cuts the signature into
``bands`` bands of ``rows`` values; two texts whose signatures agree on a
whole band share that band's bucket and become a candidate pair, with
probability ``candidate_probability(J) = 1 - (1 - J**rows)**bands``. The
defaults, word 5-grams and 14 bands of 8 rows (112 hashes), are those of
FineWeb's deduplication (datatrove): the curve crosses 0.5 at J = 0.68 (the
rule of thumb (1/bands)**(1/rows) says 0.72) and gives 0.92 at J = 0.8.

Everything here is numpy over one text's shingles at once (no Python loop per
hash): the words' hashes from their UTF-8 bytes (``word_hashes``), the
shingles' from the words' (``shingle_hashes``), the K hash functions as K
seeded multiply-adds of each shingle hash (``signature``). All arithmetic is on
unsigned 64-bit integers modulo 2**64, so a signature is the same on every
machine; ``NearDuplicates.version`` names the scheme in a cache's fingerprint.

The normalisation (``normalize``), like datatrove's ``simplify_content``:
Unicode NFKC, lower case, every character that is not a letter, a digit or
whitespace (punctuation, symbols, ``_``) replaced by a space, then words are
the runs between whitespace. A text with no word has no signature and is
never a near duplicate.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import unicodedata
from typing import Mapping, Sequence

import numpy as np

# The signature scheme (normalisation, hashes, band hashes): in the fingerprint.
SCHEME_VERSION = 1
_NOT_WORD_RE = re.compile(r"[^\w\s]|_")
_U64 = np.uint64
# splitmix64's constants (Steele, Lea and Flood 2014, "Fast splittable
# pseudorandom number generators"): its finaliser is a bijection of 64-bit words.
_GAMMA, _M1, _M2 = _U64(0x9E3779B97F4A7C15), _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
# Odd multipliers of the polynomial hashes of a word's bytes and of a shingle's words.
_BYTE_BASE, _WORD_BASE = 0x100000001B3, 0xC2B2AE3D27D4EB4F
# Shingles hashed against the K functions at a time (bounds memory: rows x K x 8 bytes).
_BLOCK_ROWS = 4096
_PARAMS = ("ngram", "bands", "rows", "seed", "fields", "rounds")


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each uint64 of ``x`` (a bijection; any shape)."""
    z = np.asarray(x, dtype=_U64) + _GAMMA
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    return z ^ (z >> _U64(31))


def normalize(text: str) -> list[str]:
    """The words of ``text`` after the module's normalisation (NFKC, lower
    case, punctuation and symbols to spaces, split on whitespace)."""
    return _NOT_WORD_RE.sub(" ", unicodedata.normalize("NFKC", text).lower()).split()


def word_hashes(words: Sequence[str]) -> np.ndarray:
    """uint64 (len(words),): a 64-bit hash of each word's UTF-8 bytes, for all
    words at once: the polynomial sum of byte_k * B**k (mod 2**64) over its
    bytes, then ``mix64`` of that sum plus the word's length in bytes."""
    if not words:
        return np.zeros(0, _U64)
    # The words joined by spaces (a word holds no whitespace, and byte 0x20 is
    # part of no other UTF-8 character): the spaces mark where words start.
    raw = np.frombuffer(" ".join(words).encode("utf-8"), dtype=np.uint8)
    spaces = np.flatnonzero(raw == 0x20)
    starts = np.concatenate([[0], spaces + 1])
    sizes = np.concatenate([spaces, [len(raw)]]) - starts
    position = np.arange(len(raw), dtype=np.int64) - np.repeat(starts, sizes + 1)[:len(raw)]
    powers = _powers(_BYTE_BASE, int(sizes.max()) + 1)
    terms = raw.astype(_U64) * powers[position]
    terms[spaces] = 0
    sums = np.add.reduceat(terms, starts)
    return mix64(sums + sizes.astype(_U64))


def _powers(base: int, n: int) -> np.ndarray:
    """uint64 (n,): base**k mod 2**64 for k in [0, n)."""
    out = np.ones(max(n, 1), dtype=_U64)
    if n > 1:
        out[1:] = _U64(base)
        out = np.cumprod(out, dtype=_U64)
    return out[:n] if n else out[:0]


def shingle_hashes(words: Sequence[str], ngram: int) -> np.ndarray:
    """uint64 (max(len(words) - ngram + 1, 1),) or (0,) for no words: a hash
    of each run of ``ngram`` consecutive words (one shingle of every word when
    there are fewer), from the words' hashes: ``mix64`` of sum_j w[i + j] * C**j."""
    w = word_hashes(words)
    if not len(w):
        return w
    n = min(ngram, len(w))
    count = len(w) - n + 1
    acc = np.zeros(count, dtype=_U64)
    power = 1
    for j in range(n):  # n multiply-adds over all shingles: no loop per shingle
        acc += w[j:j + count] * _U64(power)
        power = power * _WORD_BASE % 2**64
    return mix64(acc ^ _U64(n))


@dataclasses.dataclass(frozen=True)
class NearDuplicates:
    """The parameters of near-duplicate detection (in the cache's fingerprint).

    Attributes:
      ngram: words per shingle (default 5).
      bands: LSH bands (default 14).
      rows: minimum hashes per band (default 8); the signature has
        ``bands * rows`` uint32 values.
      seed: seeds the hash functions, in [0, 2**64) (default 0).
      fields: the record's fields whose text is compared, joined by a newline
        in this order; empty (the default): every text field of the record,
        in key order. A record without a named field is an error naming it.
      rounds: the pairs of shuffle rounds (large-star, small-star) that join
        candidate pairs into clusters (default 6; pipelines/near.py). Not in
        the fingerprint: the clusters are exact whatever it is, or the build
        stops saying to raise it.

    Raises:
      ValueError: a parameter out of range (``ngram``, ``bands``, ``rows``,
        ``rounds`` in [1, 1024], ``bands * rows <= 4096``), naming it and its value.
    """

    ngram: int = 5
    bands: int = 14
    rows: int = 8
    seed: int = 0
    fields: tuple[str, ...] = ()
    rounds: int = 6

    def __post_init__(self):
        for name in ("ngram", "bands", "rows", "rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise ValueError(f"near duplicates: {name} must be an integer in [1, 1024] (got {name}={value!r})")
        if self.bands * self.rows > 4096:
            raise ValueError(f"near duplicates: bands * rows must be at most 4096 hashes "
                             f"(got {self.bands} * {self.rows} = {self.bands * self.rows})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"near duplicates: seed must be an integer in [0, 2**64) (got seed={self.seed!r})")
        fields = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
        if any(not isinstance(f, str) or not f for f in fields):
            raise ValueError(f"near duplicates: fields must be non-empty names (got {self.fields!r})")
        object.__setattr__(self, "fields", fields)

    @classmethod
    def parse(cls, text: str) -> "NearDuplicates":
        """The parameters of a command-line value ``"ngram=5,bands=14,rows=8,
        seed=0,fields=text+title,rounds=6"`` (any subset; fields joined by ``+``).

        Raises:
          ValueError: an unknown name, a name given twice or a bad value, naming it.
        """
        values: dict = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep or name not in _PARAMS:
                raise ValueError(f"--near-duplicates: {part!r} is not NAME=VALUE with NAME one of {', '.join(_PARAMS)}")
            if name in values:
                raise ValueError(f"--near-duplicates: {name} given twice; give each parameter once")
            if name == "fields":
                values[name] = tuple(f for f in value.strip().split("+") if f)
                continue
            try:
                values[name] = int(value)
            except ValueError:
                raise ValueError(f"--near-duplicates: {name} must be an integer (got {value.strip()!r})") from None
        return cls(**values)

    @property
    def num_hashes(self) -> int:
        """Values in a signature: ``bands * rows``."""
        return self.bands * self.rows

    def to_json(self) -> dict:
        """Every parameter that changes the kept set, and the scheme's version
        (the fingerprint's part): all but ``rounds``."""
        return {"version": SCHEME_VERSION, "ngram": self.ngram, "bands": self.bands, "rows": self.rows,
                "seed": self.seed, "fields": list(self.fields)}

    def text_of(self, data: Mapping, where: str = "a record") -> str:
        """The text compared of a record's ``data`` (see ``fields``).

        Raises:
          ValueError: a named field is missing or not text, naming ``where``.
        """
        if not self.fields:
            return "\n".join(v for _, v in sorted(data.items()) if isinstance(v, str))
        out = []
        for name in self.fields:
            value = data.get(name)
            if not isinstance(value, str):
                what = "has no field" if name not in data else f"has a {type(value).__name__}, not text, in field"
                raise ValueError(f"{where} {what} {name!r}, which near-duplicate detection reads "
                                 f"(its fields: {sorted(data)}); set --near-duplicates fields=...")
            out.append(value)
        return "\n".join(out)

    def seeds(self) -> np.ndarray:
        """uint64 (2, bands * rows): the multipliers (odd) and the increments of
        the hash functions, from ``seed``."""
        base = mix64(np.asarray([self.seed], dtype=_U64))[0]
        k = np.arange(self.num_hashes, dtype=_U64)
        return np.stack([mix64(k + base) | _U64(1), mix64(k + (base ^ _GAMMA))])

    def signature(self, text: str, seeds: np.ndarray | None = None) -> np.ndarray | None:
        """uint32 (bands * rows,): the MinHash signature of ``text``: value k is
        the high 32 bits of min over shingles s of ``a_k * s + b_k`` (mod
        2**64; ``seeds``), None for a text with no word. The shingle hashes are
        already uniform (``mix64``), so one multiply-add per hash function
        (multiply-shift hashing, Dietzfelbinger et al. 1997) orders them as an
        independent random permutation would, at two operations a value.
        ``seeds``: ``self.seeds()``, given once for many texts."""
        shingles = shingle_hashes(normalize(text), self.ngram)
        if not len(shingles):
            return None
        return self._minima(shingles, self.seeds() if seeds is None else seeds)

    def signatures(self, texts: Sequence[str], seeds: np.ndarray | None = None) -> list:
        """``[self.signature(t) for t in texts]``, computed for all texts at
        once: one pass of word hashes over every word, the shingles of every
        text with at least ``ngram`` words from them, and the minima per text
        over blocks of about ``_BLOCK_ROWS`` shingles (``np.minimum.reduceat``),
        so that the numpy calls are per batch, not per text."""
        seeds = self.seeds() if seeds is None else seeds
        words = [normalize(t) for t in texts]
        out: list = [None] * len(texts)
        batch = [i for i, w in enumerate(words) if len(w) >= self.ngram]
        for i, w in enumerate(words):
            if w and len(w) < self.ngram:  # fewer words than a shingle: one shingle of them all
                out[i] = self._minima(shingle_hashes(w, self.ngram), seeds)
        if not batch:
            return out
        all_words = word_hashes([word for i in batch for word in words[i]])
        sizes = np.fromiter((len(words[i]) for i in batch), dtype=np.int64, count=len(batch))
        counts = sizes - self.ngram + 1  # shingles per text
        word_starts = np.zeros(len(batch), dtype=np.int64)
        np.cumsum(sizes[:-1], out=word_starts[1:])
        firsts = np.repeat(word_starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
        acc = np.zeros(len(firsts), dtype=_U64)
        power = 1
        for j in range(self.ngram):  # as shingle_hashes, over the shingles of every text at once
            acc += all_words[firsts + j] * _U64(power)
            power = power * _WORD_BASE % 2**64
        shingles = mix64(acc ^ _U64(self.ngram))
        ends = np.cumsum(counts)
        lo = k = 0
        while k < len(batch):  # texts k..m-1 in one block: at least one text, about _BLOCK_ROWS shingles
            m = max(k + 1, int(np.searchsorted(ends, lo + _BLOCK_ROWS, side="right")))
            hi = int(ends[m - 1])
            block = shingles[lo:hi, None] * seeds[0][None, :]
            block += seeds[1][None, :]
            starts = np.concatenate([[0], ends[k:m - 1] - lo])
            for i, row in zip(batch[k:m], np.minimum.reduceat(block, starts, axis=0)):
                out[i] = (row >> _U64(32)).astype(np.uint32)
            lo, k = hi, m
        return out

    @staticmethod
    def _minima(shingles: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        """uint32 (K,): the signature of a text's shingle hashes (``signature``)."""
        a, b = seeds
        out = np.full(len(a), np.iinfo(np.uint64).max, dtype=_U64)
        for lo in range(0, len(shingles), _BLOCK_ROWS):
            block = shingles[lo:lo + _BLOCK_ROWS, None] * a[None, :]  # (rows, K)
            block += b[None, :]
            np.minimum(out, block.min(axis=0), out=out)
        return (out >> _U64(32)).astype(np.uint32)

    def band_hashes(self, signature: np.ndarray) -> list[bytes]:
        """``bands`` 8-byte hashes of ``signature``'s bands (blake2b of the band's
        index and values under the seed): equal for two signatures exactly
        when (a 64-bit collision aside) that band's values are all equal."""
        sig = np.ascontiguousarray(signature, dtype="<u4")
        key = self.seed.to_bytes(8, "little")
        step = self.rows * 4
        raw = sig.tobytes()
        return [hashlib.blake2b(b.to_bytes(2, "little") + raw[b * step:(b + 1) * step], key=key,
                                digest_size=8).digest() for b in range(self.bands)]

    def candidate_probability(self, jaccard) -> np.ndarray:
        """float64, the shape of ``jaccard``: the probability that two texts at
        Jaccard similarity ``jaccard`` share at least one band's bucket,
        ``1 - (1 - J**rows)**bands``."""
        j = np.asarray(jaccard, dtype=np.float64)
        return 1.0 - (1.0 - j ** self.rows) ** self.bands

    def threshold(self) -> float:
        """The Jaccard similarity at which ``candidate_probability`` is 0.5."""
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.candidate_probability(mid) < 0.5 else (lo, mid)
        return (lo + hi) / 2


def estimated_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """The share of equal values of two signatures (uint32 (K,) each): MinHash's
    estimate of their texts' Jaccard similarity."""
    return float(np.mean(np.asarray(a) == np.asarray(b))) if len(a) else 0.0


def jaccard(a: str, b: str, ngram: int = 5) -> float:
    """The exact Jaccard similarity of the shingle sets of two texts (after
    ``normalize``), for tests and benchmarks; 0.0 when both have no word."""
    sa = set(shingle_hashes(normalize(a), ngram).tolist())
    sb = set(shingle_hashes(normalize(b), ngram).tolist())
    return len(sa & sb) / len(sa | sb) if sa or sb else 0.0


def removed_in_sample(texts, params: NearDuplicates) -> tuple[int, int]:
    """``(texts with a signature, those a build would remove)`` among ``texts``
    (an iterable of str: a sample, held in memory): every text is a record of
    its own (an exact copy is a near duplicate of similarity 1), candidate
    pairs share a band's bucket, clusters are joined by union-find, and each
    keeps one member. Pairs with a text outside the sample are not seen: for
    a sample of the first records, a lower bound of the corpus's share."""
    seeds = params.seeds()
    parent: list[int] = []
    buckets: dict[bytes, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for text in texts:
        sig = params.signature(text, seeds)
        if sig is None:
            continue
        i = len(parent)
        parent.append(i)
        for h in params.band_hashes(sig):
            j = buckets.setdefault(h, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots = sum(1 for i in range(len(parent)) if find(i) == i)
    return len(parent), len(parent) - roots
