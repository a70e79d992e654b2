"""Benchmark contamination: n-gram overlap of normalised words.

An item of a benchmark (a test set) *overlaps* a text when the two share at
least one n-gram of ``n`` consecutive normalised words, ``n = 13`` by default:
the test of GPT-3's contamination study (Brown et al. 2020, "Language Models
are Few-Shot Learners", appendix C: 13-grams over lower-cased words with
punctuation removed). PaLM's study (Chowdhery et al. 2022, section 8) used
8-grams and a share of an example's 8-grams; ``n`` is settable, the rule here
is one shared n-gram.

Normalisation (``normalize_words``, version ``NORMALIZATION_VERSION``):

1. Unicode NFKC (compatibility forms fold: full-width letters, ligatures,
   superscript digits, non-breaking spaces);
2. ``str.casefold()`` (case differences do not matter; ``"ß"`` -> ``"ss"``);
3. words are the maximal runs of letters, digits and combining marks (Unicode
   ``\\w`` minus the underscore, plus the characters of general category M:
   Devanagari, Thai and Myanmar vowel signs, Hebrew points, viramas, accents
   NFKC left uncomposed stay in their word); everything else (whitespace,
   punctuation, symbols, the underscore) separates words and is dropped.
   Scripts written without spaces (Chinese, Japanese, Thai) give one word per
   run between punctuation or spaces, so ``n`` words there are ``n`` such runs.

So two texts that differ only in case, whitespace, punctuation or Unicode
compatibility forms have the same words. Paraphrases, translations and changed
words do not match: the test is exact on words.

Hashes (``word_hashes``, ``ngram_hashes_of``): a word's hash is the first 8 bytes
of BLAKE2b of its UTF-8 bytes, read little-endian as uint64; an n-gram's is the
polynomial ``sum_k w[i+k] * P^(n-1-k) mod 2^64`` of its words' hashes (fixed
odd ``P``). Both depend on the words only: the same in every process, on every
platform and in every Python (no ``hash()`` seeding). A hash hit is confirmed
word by word (by the words' 64-bit hashes), so a collision of n-gram hashes
never reports a match.

Short items: an item with fewer than ``n`` words but at least ``min_words``
(default 8) is matched whole: it overlaps a text that holds all its words,
consecutively. An item with fewer than ``min_words`` words cannot be matched;
``Benchmark.too_short`` counts them (they are reported, never silently dropped).
A record whose text is empty, whitespace or null is no item; ``Benchmark.empty``
counts those records.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
import unicodedata
from typing import NamedTuple, Sequence

import numpy as np

from seqcache.tasks.sources.spec import parse_source_spec

# Bump when normalize_words, word_hashes or ngram_hashes_of change: it enters every
# Benchmark.fingerprint (and so the fingerprint of a cache built with --exclude).
NORMALIZATION_VERSION = 2
DEFAULT_N = 13
DEFAULT_MIN_WORDS = 8

_PATTERNS: tuple[re.Pattern, re.Pattern, re.Pattern] | None = None  # _patterns()
_CHUNK = re.compile(r"\S+")
# Every ASCII character that is not a letter or digit, as a space.
_ASCII_SEPARATORS = str.maketrans({chr(c): " " for c in range(128) if not chr(c).isalnum()})
# The polynomial's base: a fixed odd 64-bit constant (the golden ratio's, as in splitmix64).
_BASE = np.uint64(0x9E3779B97F4A7C15)
# Word hashes already computed in this process; cleared when it holds _CACHE_WORDS words.
_CACHE: dict[str, int] = {}
_CACHE_WORDS = 1 << 18


def _ranges(code_points: Sequence[int]) -> str:
    """Sorted code points as the ranges of a regular-expression class."""
    out, first = [], None
    for k, c in enumerate(code_points):
        if first is None:
            first = c
        if k + 1 == len(code_points) or code_points[k + 1] != c + 1:
            out.append(f"{re.escape(chr(first))}-{re.escape(chr(c))}" if c > first else re.escape(chr(c)))
            first = None
    return "".join(out)


def _patterns() -> tuple[re.Pattern, re.Pattern, re.Pattern]:
    """``(maybe_mark, plain_word, marked_word)``, built on first use from this
    Python's ``unicodedata`` (one pass over the code points, about 0.15 s):
    a search for a combining mark (category M) of the BMP or any character
    beyond it; the words of a text without marks (``[^\\W_]+``, the fast
    class); the words of a text with marks whose underscores are spaces
    (``\\w`` or category M)."""
    global _PATTERNS
    if _PATTERNS is None:
        category = unicodedata.category
        marks = [c for c in range(0x110000) if category(chr(c))[0] == "M"]
        bmp = _ranges([c for c in marks if c < 0x10000])
        _PATTERNS = (re.compile(f"[{bmp}\U00010000-\U0010ffff]"), re.compile(r"[^\W_]+"),
                     re.compile(f"[\\w{_ranges(marks)}]+"))
    return _PATTERNS


def _words(text: str) -> list[str]:
    """The words of an NFKC-normalised, casefolded text: the maximal runs of
    ``\\w`` and combining marks, the underscore a separator. A text without
    marks (the common case; the search runs at over 100 MB/s) takes the
    faster class of letters and digits, which then gives the same words."""
    maybe_mark, plain, marked = _patterns()
    if maybe_mark.search(text) is None:
        return plain.findall(text)
    return marked.findall(text.replace("_", " "))


def normalize_words(text: str) -> list[str]:
    """The normalised words of ``text``: NFKC, casefold, then the maximal runs of
    letters, digits and combining marks (Unicode ``\\w`` minus the underscore,
    plus category M), in order. See the module docstring.

    Example: ``normalize_words("The  QUICK, brown-fox!")`` is
    ``["the", "quick", "brown", "fox"]``.
    """
    if text.isascii():
        # The same words, faster: ASCII is NFKC-stable, its casefold is lower(),
        # and its letters and digits are [a-zA-Z0-9].
        return text.lower().translate(_ASCII_SEPARATORS).split()
    return _words(unicodedata.normalize("NFKC", text).casefold())


def words_with_offsets(text: str) -> tuple[list[str], list[int], list[int]]:
    """``normalize_words(text)`` with, for each word, the character offsets
    ``[start, end)`` in ``text`` of the whitespace-delimited chunk it comes from
    (a chunk such as ``"fox!"`` can give several words, which share its offsets).

    The words are those of ``normalize_words``: NFKC never composes across
    whitespace, so normalising chunk by chunk gives the same words.

    Returns:
      (words, starts, ends), three lists of the same length.
    """
    words: list[str] = []
    starts: list[int] = []
    ends: list[int] = []
    for chunk in _CHUNK.finditer(text):
        found = _words(unicodedata.normalize("NFKC", chunk.group()).casefold())
        words.extend(found)
        starts.extend([chunk.start()] * len(found))
        ends.extend([chunk.end()] * len(found))
    return words, starts, ends


def word_hashes(words: Sequence[str]) -> np.ndarray:
    """The 64-bit hash of each word: BLAKE2b (8-byte digest) of its UTF-8 bytes,
    little-endian. Shape ``(len(words),)``, dtype uint64."""
    cache = _CACHE
    try:
        return np.fromiter(map(cache.__getitem__, words), dtype=np.uint64, count=len(words))
    except KeyError:
        pass
    if len(cache) + len(words) > _CACHE_WORDS:
        cache.clear()
    for word in set(words).difference(cache):
        cache[word] = int.from_bytes(hashlib.blake2b(word.encode("utf-8"), digest_size=8).digest(), "little")
    return np.fromiter(map(cache.__getitem__, words), dtype=np.uint64, count=len(words))


def ngram_hashes_of(hashes: np.ndarray, n: int) -> np.ndarray:
    """The hash of each n-gram of words, from the words' hashes (``word_hashes``).

    Element ``i`` is the hash of words ``[i, i + n)``. Shape
    ``(max(0, len(hashes) - n + 1),)``, dtype uint64.

    Raises:
      ValueError: ``n < 1``.
    """
    if n < 1:
        raise ValueError(f"n-gram length must be >= 1 (got n={n})")
    return _extend(hashes, hashes, 1, n)  # the 1-gram hashes are the words' own


def _extend(grams: np.ndarray, hashes: np.ndarray, k0: int, k: int) -> np.ndarray:
    """The k-gram hashes from the k0-gram hashes ``grams`` (``k >= k0``) and the
    words' ``hashes``: Horner's rule, one word at a time, in base ``_BASE``."""
    m = len(hashes) - k + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    out = grams[:m].copy()
    for j in range(k0, k):
        out *= _BASE  # uint64 arithmetic wraps: mod 2^64
        out += hashes[j:j + m]
    return out


class BenchmarkItem(NamedTuple):
    """One benchmark item.

    Attributes:
      number: 0-based index of the item in the benchmark (source order: files
        sorted by path, records in file order).
      path: the file it was read from.
      locator: what ``record_number`` counts (``"byte_offset"``, ``"row"``, ...;
        see ``seqcache.tasks.sources.describe_record``).
      record_number: the record's id in its file.
      text: the item's text: its fields' values joined by newlines, in the
        order of the source's record keys (sorted by key for several fields).
    """

    number: int
    path: str
    locator: str
    record_number: int
    text: str


@dataclasses.dataclass(frozen=True)
class Match:
    """A span of a scanned text that overlaps a benchmark item.

    Attributes:
      item: the item's number (``BenchmarkItem.number``).
      start, end: character offsets ``[start, end)`` of the span in the scanned
        text (whole whitespace-delimited chunks: punctuation next to a word is
        included).
      words: the span's normalised words joined by single spaces (overlapping
        and adjacent matched n-grams of the same item merge into one span).
      ngram: the first matched n-gram's words joined by single spaces (for an
        item matched whole, the item's words).
      ngrams: how many n-grams of the span matched the item.
    """

    item: int
    start: int
    end: int
    words: str
    ngram: str
    ngrams: int


class Benchmark:
    """The n-gram table of a benchmark: what a scan looks texts up in.

    Memory: about 35 bytes per n-gram of the items (the sorted uint64 hashes,
    their item numbers, start words and lengths, and a filter of 8 to 16 bytes)
    plus 8 bytes per item word, the item texts and a dict of the items'
    distinct words (about 100 bytes each); nothing grows with what is scanned.

    Args:
      items: the items (``BenchmarkItem``), numbered 0.. in order.
      n: n-gram length in words (>= 1).
      min_words: items with fewer than ``n`` words but at least ``min_words``
        are matched whole; items with fewer words are ``too_short``.
      name: a name for reports (e.g. the source spec).
      empty: records of the source that gave no item (an empty, whitespace-only
        or null value): counted here, not numbered.

    Attributes:
      n, min_words, name, items.
      too_short: numbers of the items that cannot match (fewer than
        ``min_words`` words), sorted.
      empty: the ``empty`` argument (reported with ``too_short``).
      fingerprint: sha256 hex of n, min_words, the normalisation version and the
        item texts.
      size_bytes: UTF-8 bytes of the item texts.
      num_ngrams: n-grams in the table (distinct per item).

    Raises:
      ValueError: ``n < 1`` or ``min_words < 1`` (a ``min_words`` over ``n``
        is taken as ``n``).
    """

    def __init__(self, items: Sequence[BenchmarkItem], *, n: int = DEFAULT_N,
                 min_words: int = DEFAULT_MIN_WORDS, name: str = "benchmark", empty: int = 0):
        if n < 1:
            raise ValueError(f"n-gram length must be >= 1 (got n={n})")
        min_words = min(min_words, n)
        if min_words < 1:
            raise ValueError(f"min_words must be >= 1 (got min_words={min_words})")
        self.n, self.min_words, self.name, self.empty = n, min_words, name, int(empty)
        self.items = list(items)
        for i, item in enumerate(self.items):
            if item.number != i:
                raise ValueError(f"benchmark items must be numbered 0.. in order (item {i} has number {item.number})")
        self.size_bytes = sum(len(item.text.encode("utf-8")) for item in self.items)
        self.fingerprint = self._fingerprint()
        self._build_table()

    def _fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps({"n": self.n, "min_words": self.min_words,
                                       "normalization": NORMALIZATION_VERSION}, sort_keys=True).encode())
        for item in self.items:
            data = item.text.encode("utf-8")
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def _build_table(self) -> None:
        """The sorted table: hash -> (item, start word, length), one row per
        distinct (n-gram, item); and every item's word hashes."""
        hashes, items, starts, lengths, words = [], [], [], [], []
        too_short = []
        offsets = [0]
        for item in self.items:
            wh = word_hashes(normalize_words(item.text))
            words.append(wh)
            offsets.append(offsets[-1] + len(wh))
            k = self.n if len(wh) >= self.n else len(wh)
            if k < self.min_words:
                too_short.append(item.number)
                continue
            h = ngram_hashes_of(wh, k)
            _, first = np.unique(h, return_index=True)  # one row per distinct n-gram of the item
            hashes.append(h[first])
            starts.append(first.astype(np.uint32))
            items.append(np.full(len(first), item.number, dtype=np.uint32))
            lengths.append(np.full(len(first), k, dtype=np.uint8))
        cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype=dtype))
        table = cat(hashes, np.uint64)
        order = np.argsort(table, kind="stable")
        self._hashes = table[order]
        self._item = cat(items, np.uint32)[order]
        self._start = cat(starts, np.uint32)[order]
        self._length = cat(lengths, np.uint8)[order]
        self._words = cat(words, np.uint64)
        self._offsets = np.asarray(offsets, dtype=np.int64)
        # word -> hash, for the words of the items: a scanned text's other words
        # get 0 (``Benchmark.word_hashes``), and no n-gram holding one can match.
        self._vocabulary = {}
        for item in self.items:
            for w, h in zip(normalize_words(item.text), self.item_words(item.number).tolist()):
                self._vocabulary[w] = h
        # A filter of the table: one byte per slot, 8 slots per n-gram (at least 2^16), slot = the
        # hash's top bits; a text's n-gram is looked up in the table only where its slot is set.
        bits = max(16, int(8 * max(1, len(table))).bit_length())
        self._shift = np.uint64(64 - bits)
        self._filter = np.zeros(1 << bits, dtype=bool)
        self._filter[self._hashes >> self._shift] = True
        self.lengths = sorted({int(k) for k in np.unique(self._length)})
        self.too_short = too_short
        self.num_ngrams = len(self._hashes)

    @classmethod
    def load(cls, spec: str, *, n: int = DEFAULT_N, min_words: int = DEFAULT_MIN_WORDS,
             name: str | None = None) -> "Benchmark":
        """Reads the items of a source spec (any form
        ``seqcache.tasks.sources.parse_source_spec`` accepts: ``jsonl:PATTERN#FIELD``,
        ``jsonl:PATTERN#question=q,answer=a``, ``parquet:...``, ``text:...``,
        ``hf:PATH@SPLIT#COLUMN``, ...; a ``hf:`` or ``tfds:`` spec without
        ``@SPLIT`` reads ``test``). Each record is one item; its text is
        its values joined by newlines (in the record's key order); a value that
        is not a string (a number, a boolean) is its Python text (``42``,
        ``3.5``, ``True``), a null value is left out. A record whose text is
        empty or whitespace (a blank line of a ``text:`` file, ``""``, null) is
        no item: it is counted in ``empty``.

        Raises:
          ValueError: a bad spec or record (as ``parse_source_spec`` and the
            source), a record without a selected field (names the record, the
            field and the record's fields), or a spec with no items (names the
            spec).
          FileNotFoundError: a pattern that matches nothing.
        """
        source = parse_source_spec(spec, split="test", on_error={"missing_field": "skip"})
        items, empty = _read_items(source)
        if not items:
            what = f"no items: its {empty:,} record(s) are empty" if empty else "no records"
            raise ValueError(f"benchmark {spec!r} has {what}: point it at the test set's files and fields")
        return cls(items, n=n, min_words=min_words, name=name or spec, empty=empty)

    def describe(self) -> dict:
        """JSON-able summary: name, fingerprint, n, min_words, items, n-grams,
        bytes, the normalisation version, the too-short items' count and the
        empty records' count."""
        return {"name": self.name, "fingerprint": self.fingerprint, "n": self.n, "min_words": self.min_words,
                "normalization": NORMALIZATION_VERSION, "items": len(self.items), "ngrams": self.num_ngrams,
                "size_bytes": self.size_bytes, "too_short": len(self.too_short), "empty": self.empty}

    def item_words(self, number: int) -> np.ndarray:
        """Item ``number``'s word hashes, shape ``(words,)``, uint64."""
        return self._words[self._offsets[number]:self._offsets[number + 1]]

    def word_hashes(self, words: Sequence[str]) -> np.ndarray:
        """``word_hashes(words)`` for the words the items hold, 0 for any other
        word (no n-gram that holds one can match): the same hits, faster, and
        no memory beyond the benchmark's. Shape ``(len(words),)``, uint64."""
        return np.fromiter(map(self._vocabulary.get, words, itertools.repeat(0)), dtype=np.uint64,
                           count=len(words))

    def hits(self, hashes: np.ndarray, *, ends: np.ndarray | None = None) -> list[tuple[int, int, int]]:
        """The confirmed hits of a text given its words' hashes.

        Args:
          hashes: shape ``(words,)``, uint64: ``word_hashes(normalize_words(text))``
            or ``Benchmark.word_hashes`` of the same words (0: a word no item
            holds).
          ends: for several texts concatenated in ``hashes``, the end of each
            (sorted word indices, the last ``len(hashes)``); an n-gram across
            two texts is not a hit. None: one text.

        Returns:
          Sorted ``(item, start word in hashes, length in words)`` triples, one
          per matched n-gram (confirmed word by word); ``[]`` when none.
        """
        hashes = np.asarray(hashes, dtype=np.uint64)
        if not len(self._hashes) or len(hashes) < self.lengths[0]:
            return []
        unknown = np.concatenate([[0], np.cumsum(hashes == 0)])  # (words + 1,): 0s before each word
        text_of = None if ends is None else np.searchsorted(np.asarray(ends), np.arange(len(hashes)), side="right")
        found = set()
        grams, k0 = None, 0
        for k in self.lengths:
            # The k-grams from the k0-grams (ngram_hashes_of's polynomial).
            grams = ngram_hashes_of(hashes, k) if grams is None else _extend(grams, hashes, k0, k)
            k0, m = k, len(grams)
            if not m:
                break
            # Windows of known words inside one text whose slot in the filter is
            # set (one cached read each); the sorted table for those.
            ok = (unknown[k:k + m] == unknown[:m]) & self._filter[grams >> self._shift]
            if text_of is not None:
                ok &= text_of[:m] == text_of[k - 1:k - 1 + m]
            candidates = np.flatnonzero(ok)
            if len(candidates):
                found.update(self._confirm(hashes, grams, candidates, k))
        return sorted(found)

    def _confirm(self, hashes: np.ndarray, grams: np.ndarray, candidates: np.ndarray, k: int):
        """The ``(item, start, k)`` hits among the k-gram windows ``candidates``:
        hash in the table, then the same words as the item's."""
        lo = np.searchsorted(self._hashes, grams[candidates], side="left")
        hit = self._hashes[np.minimum(lo, len(self._hashes) - 1)] == grams[candidates]
        for pos, row in zip(candidates[hit].tolist(), lo[hit].tolist()):
            while row < len(self._hashes) and self._hashes[row] == grams[pos]:
                item, start = int(self._item[row]), int(self._start[row])
                if int(self._length[row]) == k and np.array_equal(
                        self.item_words(item)[start:start + k], hashes[pos:pos + k]):
                    yield item, int(pos), k
                row += 1

    def match(self, text: str) -> list[Match]:
        """The spans of ``text`` that overlap benchmark items; a pure function of
        ``text`` and the benchmark.

        Returns:
          ``Match`` objects sorted by (item, start); ``[]`` when nothing
          overlaps. Overlapping or adjacent matched n-grams of one item merge
          into one span.
        """
        return self.match_many([text])[0]

    def match_many(self, texts: Sequence[str]) -> list[list[Match]]:
        """``[match(t) for t in texts]``, with the words of all texts looked up
        at once (one ``hits`` call): the fast way to scan many short texts."""
        words = [normalize_words(t) for t in texts]
        ends = np.cumsum([len(w) for w in words], dtype=np.int64)
        hits = self.hits(self.word_hashes(list(itertools.chain.from_iterable(words))), ends=ends)
        by_text: dict[int, list] = {}
        for item, start, k in hits:
            t = int(np.searchsorted(ends, start, side="right"))
            by_text.setdefault(t, []).append((item, start - int(ends[t] - len(words[t])), k))
        out: list[list[Match]] = [[] for _ in texts]
        for t, found in by_text.items():
            out[t] = _spans(texts[t], words[t], found)
        return out


def _read_items(source) -> tuple[list[BenchmarkItem], int]:
    """The items of a source (read with ``missing_field`` skipped) and the
    count of its empty records (``Benchmark.load``).

    Raises:
      ValueError: a record without a selected field, or another record the
        source skipped (its message, naming the record).
    """
    items: list[BenchmarkItem] = []
    empty = 0
    for i, f in enumerate(source.list_files()):
        for record in source.read_file(i, f.path):
            issue = record.issue
            if issue is not None and issue.action == "skipped":
                if issue.kind in ("empty", "whitespace"):
                    empty += 1
                    continue
                if issue.kind == "missing_field":
                    raise ValueError(f"{issue.message}; every benchmark record needs the spec's field(s) "
                                     "(#FIELD or #a=FIELD,b=FIELD): name fields each record has")
                raise ValueError(issue.message)
            text = "\n".join(v if isinstance(v, str) else str(v) for v in record.data.values() if v is not None)
            if not text.strip():
                empty += 1
                continue
            items.append(BenchmarkItem(len(items), f.path, source.locator, record.record_number, text))
    return items, empty


def _spans(text: str, words: list[str], hits: list[tuple[int, int, int]]) -> list[Match]:
    """The ``Match`` objects of one text from its sorted hits ``(item, start
    word, length)``: overlapping or adjacent n-grams of one item merged."""
    _, starts, ends = words_with_offsets(text)
    out: list[Match] = []
    i = 0
    while i < len(hits):
        item, first, k = hits[i]
        last, count = first + k, 1
        i += 1
        while i < len(hits) and hits[i][0] == item and hits[i][1] <= last:
            last, count = max(last, hits[i][1] + hits[i][2]), count + 1
            i += 1
        out.append(Match(item, starts[first], ends[last - 1], " ".join(words[first:last]),
                         " ".join(words[first:first + k]), count))
    return out
