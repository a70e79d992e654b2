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

The normalisation (``normalize``), close to datatrove's ``simplify_content``:
Unicode NFKC, then every character that is a letter or a digit
(``str.isalnum``) lower-cased on its own (the first character of its
``str.lower``) and every other one (punctuation, symbols, ``_``, whitespace) a
word boundary: words are the maximal runs of letters and digits. A text with
no word has no signature and is never a near duplicate.

Everything else is numpy over a batch of texts at once, with no Python loop
per text, word or shingle (``shingle_hashes``): the texts' characters as
code points (UTF-32), each folded by a table of the Basic Multilingual Plane
(a character past it on its own); each word's hash the polynomial sum of its code points c_i * B**i and
each shingle's the polynomial sum of its words' hashes w_j * C**j (mod 2**64),
both read off prefix sums (a window's sum times the inverse power of its
start: B and C are odd, so invertible mod 2**64), then ``mix64`` and its high
32 bits; the K hash functions are K odd multipliers a_k of those 32-bit
values (mod 2**32), one numpy pass over a batch's shingles each, and the
minima per text by ``np.minimum.reduceat``. All arithmetic is on unsigned
integers modulo a power of two, so a signature is the same on every machine;
``SCHEME_VERSION`` names the scheme in a cache's fingerprint.
"""

from __future__ import annotations

import dataclasses
import functools
import unicodedata
from typing import Mapping, Sequence

import numpy as np

# The signature scheme (normalisation, hashes, band hashes): in the fingerprint.
# 1: words of UTF-8 bytes, 64-bit multiply-adds, blake2b band hashes; 2: this module's.
SCHEME_VERSION = 2
_U64, _U32 = np.uint64, np.uint32
# splitmix64's constants (Steele, Lea and Flood 2014, "Fast splittable
# pseudorandom number generators"): its finaliser is a bijection of 64-bit words.
_GAMMA, _M1, _M2 = _U64(0x9E3779B97F4A7C15), _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)
# Odd bases of the polynomial hashes of a word's code points and of a shingle's words.
_CHAR_BASE, _WORD_BASE = 0x100000001B3, 0xC2B2AE3D27D4EB4F
# Characters of texts hashed at a time (one text longer than this is a batch of its own).
_BATCH_CHARS = 1 << 18
_PARAMS = ("ngram", "bands", "rows", "seed", "fields", "rounds")


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of each uint64 of ``x`` (a bijection; any shape)."""
    z = np.asarray(x, dtype=_U64) + _GAMMA
    z = (z ^ (z >> _U64(30))) * _M1
    z = (z ^ (z >> _U64(27))) * _M2
    return z ^ (z >> _U64(31))


def _fold_char(code: int) -> int:
    """The code point a character stands for in a word: its lower case (the
    first character of ``str.lower``) if it is a letter or a digit, else 0."""
    c = chr(code)
    return ord(c.lower()[0]) if c.isalnum() else 0


@functools.cache
def _fold_table() -> np.ndarray:
    """uint32 (0x10000,): ``_fold_char`` of the Basic Multilingual Plane."""
    return np.fromiter(map(_fold_char, range(0x10000)), dtype=_U32, count=0x10000)


def _folded(text: str) -> np.ndarray:
    """uint32 (len(text),): ``_fold_char`` of each character of ``text`` (0: a word boundary)."""
    cp = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    out = np.take(_fold_table(), cp, mode="clip")  # past the BMP: 0xFFFF, not a character
    astral = np.flatnonzero(cp > 0xFFFF)
    if len(astral):
        out[astral] = [_fold_char(c) for c in cp[astral].tolist()]
    return out


def _nfkc(text: str) -> str:
    """Unicode NFKC of ``text``, line by line where it is not already (a line
    feed never composes with its neighbours, so this is NFKC of the whole)."""
    if text.isascii() or unicodedata.is_normalized("NFKC", text):
        return text
    return "\n".join(line if unicodedata.is_normalized("NFKC", line) else unicodedata.normalize("NFKC", line)
                     for line in text.split("\n"))


def normalize(text: str) -> list[str]:
    """The words of ``text`` after the module's normalisation (NFKC, letters
    and digits lower-cased one by one, every other character a boundary)."""
    return "".join(chr(_fold_char(ord(c)) or 32) for c in _nfkc(text)).split()


_POWERS: dict = {}  # base -> uint64 powers base**k, grown on demand (at most _BATCH_CHARS + 1 kept)


def _powers(base: int, n: int) -> np.ndarray:
    """uint64 (n,): base**k mod 2**64 for k in [0, n)."""
    have = _POWERS.get(base)
    if have is not None and len(have) >= n:
        return have[:n]
    out = np.full(max(n, 1), base, dtype=_U64)
    out[0] = 1
    out = np.cumprod(out, dtype=_U64)[:n]
    if n <= _BATCH_CHARS + 1:
        _POWERS[base] = out
    return out


def _window_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray, base: int) -> np.ndarray:
    """uint64 (len(starts),): sum over i in [starts[j], ends[j]) of values[i] *
    base**(i - starts[j]) (mod 2**64), every window from one prefix sum."""
    n = len(values)
    prefix = np.zeros(n + 1, dtype=_U64)
    np.cumsum(np.multiply(values, _powers(base, n), dtype=_U64), out=prefix[1:])
    inverse = _powers(pow(base, -1, 2**64), n + 1)
    return (prefix[ends] - prefix[starts]) * inverse[starts]


def shingle_hashes(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, counts)``: uint32 (counts.sum(),), a 32-bit hash of each
    shingle of every text in turn (each run of ``ngram`` consecutive words,
    or one run of all the words of a text with fewer), and int64
    (len(texts),), each text's number of shingles (0 for a text with no word).
    A run of words has the same hash in any text (see the module docstring)."""
    texts = [_nfkc(t) for t in texts]
    folded = _folded(" " + " ".join(texts) + " ")  # texts framed by spaces: no word spans two
    in_word = folded != 0
    edges = np.flatnonzero(in_word[1:] != in_word[:-1]) + 1  # word starts and ends, alternately
    starts = edges[0::2]
    words = _window_sums(folded, starts, edges[1::2], _CHAR_BASE)
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    first = np.searchsorted(starts, np.cumsum(lengths + 1) - lengths)  # each text's first word
    sizes = np.diff(np.append(first, len(starts)))  # its words
    counts = np.maximum(sizes - ngram + 1, np.minimum(sizes, 1))
    before = np.cumsum(counts) - counts
    lo = np.repeat(first - before, counts) + np.arange(int(counts.sum()), dtype=np.int64)
    hi = np.minimum(lo + ngram, np.repeat(first + sizes, counts))
    shingles = _window_sums(words, lo, hi, _WORD_BASE)
    return (mix64(shingles) >> _U64(32)).astype(_U32), counts


def _batches(texts: Sequence[str]):
    """``(lo, hi)``: consecutive runs of ``texts`` of about ``_BATCH_CHARS`` characters (at least one text)."""
    ends = np.cumsum(np.fromiter((len(t) + 1 for t in texts), dtype=np.int64, count=len(texts)))
    lo = 0
    while lo < len(texts):
        before = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, before + _BATCH_CHARS, side="right")))
        yield lo, hi
        lo = hi


class ParameterError(ValueError):
    """A near-duplicate parameter refused: the message is ``WHERE: DETAIL``
    (``near duplicates: ngram must be ...``); ``detail`` is the part after
    ``WHERE``, for a caller that names the parameter's place itself (the
    command line's option)."""

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.detail = detail


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
                raise ParameterError("near duplicates",
                                     f"{name} must be an integer in [1, 1024] (got {name}={value!r})")
        if self.bands * self.rows > 4096:
            raise ParameterError("near duplicates", f"bands * rows must be at most 4096 hashes "
                             f"(got {self.bands} * {self.rows} = {self.bands * self.rows})")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ParameterError("near duplicates", f"seed must be an integer in [0, 2**64) (got seed={self.seed!r})")
        fields = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
        if any(not isinstance(f, str) or not f for f in fields):
            raise ParameterError("near duplicates", f"fields must be non-empty names (got {self.fields!r})")
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
                raise ParameterError("--near-duplicates",
                                     f"{part!r} is not NAME=VALUE with NAME one of {', '.join(_PARAMS)}")
            if name in values:
                raise ParameterError("--near-duplicates", f"{name} given twice; give each parameter once")
            if name == "fields":
                values[name] = tuple(f for f in value.strip().split("+") if f)
                continue
            try:
                values[name] = int(value)
            except ValueError:
                raise ParameterError("--near-duplicates",
                                     f"{name} must be an integer (got {value.strip()!r})") from None
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
        """uint32 (bands * rows,): the odd multipliers of the hash functions, from ``seed``."""
        base = mix64(np.asarray([self.seed], dtype=_U64))[0]
        k = np.arange(self.num_hashes, dtype=_U64)
        return ((mix64(k + base) >> _U64(32)) | _U64(1)).astype(_U32)

    def signature(self, text: str, seeds: np.ndarray | None = None) -> np.ndarray | None:
        """uint32 (bands * rows,): the MinHash signature of ``text``, None for
        a text with no word (``signatures``)."""
        sigs, has = self.signatures([text], seeds)
        return sigs[0] if has[0] else None

    def signatures(self, texts: Sequence[str], seeds: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(signatures, has)``: uint32 (len(texts), bands * rows), value k of
        row i the least ``a_k * s (mod 2**32)`` over the shingle hashes s of
        text i (``shingle_hashes``: already uniform, so one odd multiplier
        per hash function, multiplicative hashing (Dietzfelbinger et al. 1997),
        orders them as an independent random permutation would), and bool
        (len(texts),), whether text i has a word (a row of zeros when not).
        ``seeds``: ``self.seeds()``, given once for many calls. Computed for
        about ``_BATCH_CHARS`` characters of texts at a time: one numpy pass
        over their shingles per hash function, no loop per text."""
        seeds = self.seeds() if seeds is None else seeds
        out = np.zeros((len(texts), self.num_hashes), dtype=_U32)
        has = np.zeros(len(texts), dtype=bool)
        for lo, hi in _batches(texts):
            shingles, counts = shingle_hashes(texts[lo:hi], self.ngram)
            rows = np.flatnonzero(counts)
            if not len(rows):
                continue
            firsts = (np.cumsum(counts) - counts)[rows]
            product = np.empty_like(shingles)
            minima = np.empty((self.num_hashes, len(rows)), dtype=_U32)
            for k, a in enumerate(seeds):
                np.multiply(shingles, a, out=product)
                np.minimum.reduceat(product, firsts, out=minima[k])
            out[lo + rows] = minima.T
            has[lo + rows] = True
        return out, has

    def band_hashes(self, signatures: np.ndarray) -> np.ndarray:
        """uint64 (..., bands): a 64-bit hash of each band of each signature
        (uint32 (..., bands * rows)): ``mix64`` chained over the band's values
        from a start drawn from the seed and the band's index, so equal for
        two signatures exactly when (a 64-bit collision aside) that band's
        values are all equal, and different for equal values in two bands."""
        sig = np.asarray(signatures, dtype=_U32)
        values = sig.reshape(-1, self.bands, self.rows).astype(_U64)
        h = mix64(np.arange(self.bands, dtype=_U64) ^ mix64(np.asarray([self.seed ^ 0x5EED], dtype=_U64)))
        h = np.broadcast_to(h, values.shape[:2])
        for r in range(self.rows):  # each step a bijection of h for a given value
            h = mix64(h ^ values[:, :, r])
        return h.reshape(sig.shape[:-1] + (self.bands,))

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
    """The exact Jaccard similarity of the shingle sets of two texts (their
    ``shingle_hashes``), for tests and benchmarks; 0.0 when both have no word."""
    hashes, counts = shingle_hashes([a, b], ngram)
    sa, sb = set(hashes[:counts[0]].tolist()), set(hashes[counts[0]:].tolist())
    return len(sa & sb) / len(sa | sb) if sa or sb else 0.0


def removed_in_sample(texts, params: NearDuplicates) -> tuple[int, int]:
    """``(texts with a signature, those a build would remove)`` among ``texts``
    (an iterable of str: a sample, held in memory): every text is a record of
    its own (an exact copy is a near duplicate of similarity 1), candidate
    pairs share a band's bucket, clusters are joined by union-find, and each
    keeps one member. Pairs with a text outside the sample are not seen: for
    a sample of the first records, a lower bound of the corpus's share."""
    sigs, has = params.signatures(list(texts))
    bands = params.band_hashes(sigs[has]).tolist()
    parent = list(range(len(bands)))
    buckets: dict[int, int] = {}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, hashes in enumerate(bands):
        for h in hashes:
            j = buckets.setdefault(h, i)
            if j != i:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    roots = sum(1 for i in range(len(parent)) if find(i) == i)
    return len(parent), len(parent) - roots
