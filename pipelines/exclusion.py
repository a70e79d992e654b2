"""Decontamination at build: source records that overlap a benchmark are left
out of the cache and listed in its quarantine.

A source record *overlaps* a benchmark when one of its text values shares at
least one n-gram of ``n`` normalised words (13 by default) with an item of the
benchmark: ``seqcache.tasks.contamination`` defines the normalisation, the
hashes and the matching (GPT-3's test, Brown et al. 2020, appendix C). The test
runs on the source record's text, before any preprocessing or tokenisation,
one text value at a time (an n-gram never spans two fields of a record).

An overlapping record is excluded: it gives no example, and its quarantine
entry (action ``"excluded"``, kind ``"benchmark"``) names every benchmark it
overlaps (``benchmarks``) and, for the first of them by name, the item
(``item``: number, path, record number, locator), the text field (``field``),
the matched n-gram (``ngram``: its normalised words) and the span of the
field's text that overlaps the item (``start``, ``end``: character offsets;
every matched n-gram of the item there, merged: ``contamination.Match``). The manifest counts excluded
records (``statistics.excluded_records``) and, per benchmark, the records that
overlap it (``statistics.excluded_by_benchmark``; a record that overlaps two
benchmarks counts for both).

The decision is a pure function of the record's text and the benchmarks, so
the cache stays a pure function of its inputs (G1); each benchmark's
``describe()`` (fingerprint, n, items) enters the cache's fingerprint. Memory:
every worker holds the benchmarks' n-gram tables (about 35 bytes an n-gram,
``Benchmark``), whatever the corpus size.
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Sequence

import numpy as np

from seqcache.tasks import contamination

# ``NAME=SPEC``: a name before the source spec, e.g. ``gsm8k=jsonl:test.jsonl#question``
# (a spec's own ``=`` comes after its scheme's colon).
_NAMED = re.compile(r"^([A-Za-z0-9_.-]+)=(?=[a-z]+:)")


def split_name(value: str) -> tuple[str | None, str]:
    """``"NAME=SPEC"`` -> ``(NAME, SPEC)``; a bare spec -> ``(None, SPEC)``."""
    m = _NAMED.match(value)
    return (m.group(1), value[m.end():]) if m else (None, value)


def load_benchmarks(values: Sequence[Any], *, n: int | None = None) -> list:
    """The benchmarks of ``BuildConfig.exclude_benchmarks``, sorted by name.

    Args:
      values: ``seqcache.tasks.contamination.Benchmark`` objects, or strings
        ``SPEC`` / ``NAME=SPEC`` where SPEC is any source spec
        ``seqcache.tasks.sources.parse_source_spec`` reads (each record one
        item; see ``Benchmark.load``). A bare spec is named by itself.
      n: n-gram length in words for the specs (default
        ``contamination.DEFAULT_N``, 13); a ``Benchmark`` object keeps its own.

    Raises:
      ValueError: a bad spec or record, a spec with no records, or two
        benchmarks with the same name (the message names them).
      FileNotFoundError: a spec whose pattern matches no file.
    """
    out = []
    for value in values:
        if isinstance(value, contamination.Benchmark):
            out.append(value)
            continue
        if not isinstance(value, str):
            raise ValueError(f"exclude_benchmarks: {value!r} is neither a Benchmark nor a source spec string")
        name, spec = split_name(value)
        try:
            out.append(contamination.Benchmark.load(spec, n=n or contamination.DEFAULT_N, name=name or spec))
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"benchmark {value!r}: {e}") from None
    names = [b.name for b in out]
    twice = sorted({x for x in names if names.count(x) > 1})
    if twice:
        raise ValueError(f"two benchmarks named {twice[0]!r}: give each its own name (NAME=SPEC)")
    return sorted(out, key=lambda b: b.name)


class Exclusion:
    """The benchmarks one build leaves out (a picklable part of the read step).

    Args:
      benchmarks: ``Benchmark`` objects with distinct names (``load_benchmarks``).
    """

    def __init__(self, benchmarks: Sequence[Any]):
        self.benchmarks = sorted(benchmarks, key=lambda b: b.name)

    def describe(self) -> list[dict]:
        """Each benchmark's ``describe()`` (name, fingerprint, n, items, ...), by
        name: what the cache's fingerprint records."""
        return [b.describe() for b in self.benchmarks]

    def find(self, records, positions: Sequence[int]) -> Iterator[tuple[int, str, dict]]:
        """The records at ``positions`` of ``records`` (a ``RecordBatch``) that
        overlap a benchmark, in order: ``(position, message, entry fields)``,
        where the entry fields are those of the module docstring.

        The words of every text value of the batch are looked up in each
        benchmark at once (``Benchmark.word_hashes``, then one ``Benchmark.hits``
        call over their concatenation, which drops an n-gram that spans two
        texts).
        """
        texts = []  # (position, field, text), in record then field order
        words: list[str] = []
        bounds = [0]
        for i in positions:
            for key, value in records[i].data.items():
                if isinstance(value, str):
                    texts.append((i, key, value))
                    words.extend(contamination.normalize_words(value))
                    bounds.append(len(words))
        if not words:
            return
        ends = np.asarray(bounds[1:], dtype=np.int64)
        overlapping: dict[int, list] = {}  # text number -> benchmarks it overlaps, by name
        for benchmark in self.benchmarks:
            # The benchmark's own word hashes (0 for a word no item holds), as Benchmark.match_many looks up.
            hits = benchmark.hits(benchmark.word_hashes(words), ends=ends)
            hit = {int(np.searchsorted(ends, start, side="right")) for _, start, _ in hits}
            for t in sorted(hit):
                overlapping.setdefault(t, []).append(benchmark)
        by_record: dict[int, list] = {}
        for t in sorted(overlapping):
            by_record.setdefault(texts[t][0], []).append(t)
        for i, numbers in by_record.items():
            yield (i, *_first_match(texts, numbers, overlapping))


def _first_match(texts, numbers: list[int], overlapping: dict[int, list]) -> tuple[str, dict]:
    """The entry of a record whose texts ``numbers`` (indices into ``texts``)
    overlap the benchmarks ``overlapping[number]``: every benchmark by name,
    and the first match (by start, then item) of the first benchmark in the
    first of its texts that overlaps it."""
    benchmarks = {b.name: b for t in numbers for b in overlapping[t]}
    names = sorted(benchmarks)
    first = benchmarks[names[0]]
    t = next(t for t in numbers if first in overlapping[t])
    _, key, text = texts[t]
    match = min(first.match(text), key=lambda m: (m.start, m.item))
    return _entry(names, first, key, match)


def _entry(names: list[str], benchmark, field: str, match) -> tuple[str, dict]:
    """(the quarantine message, the entry's fields) of an excluded record."""
    item = benchmark.items[match.item]
    more = f" (and {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    message = (f"overlaps item {item.number} of benchmark {benchmark.name!r}{more} "
               f"({len(match.ngram.split())} words): {match.ngram!r}")
    fields = {
        "benchmarks": names,
        "benchmark": benchmark.name,
        "item": {"number": item.number, "path": item.path, "record_number": int(item.record_number),
                 "locator": item.locator},
        "field": field,
        "ngram": match.ngram,
        "start": match.start,
        "end": match.end,
    }
    return message, fields
