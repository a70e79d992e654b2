"""Identical records in the shuffle (shuffle.py, ``transforms.SpreadCopies``):
each copy takes its own key, so packed rows hold no more repeats of one text
than a uniformly random permutation of the same examples would.

Vocabulary: a *row* is one packed cache record of ``L`` tokens; a *repeat* is a
source line of which two or more segments sit in one row."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest

from seqcache.pipelines import BuildConfig, build_task, shuffle
from testsupport import shakespeare_lm_task

L = 128  # tokens (bytes and EOS) per packed row

# Golden copy keys (seed 7): changing them breaks users' reproducibility (every
# cache with a repeated record changes) and needs a shuffle version bump
# (``shuffle.SHUFFLE_VERSION``, in the cache fingerprint).
GOLDEN_COPY_KEYS = ["c3e1bd3240b359b95c21287a996cbae4", "5f4669519bea6755020e8e4c33e77dd3",
                    "1a83e1e8ed1c4344dc2ec45daa76fe9b"]


def test_copy_keys_are_pinned_and_distinct_from_record_keys():
    key = shuffle.seed_key(7)
    first = shuffle.record_key(b"QUEEN MARGARET:", key)
    firsts = np.frombuffer(first * 3, dtype="V16")
    keys = shuffle.copy_keys(firsts, np.array([1, 2, 3]), key)
    assert [k.tobytes().hex() for k in keys] == GOLDEN_COPY_KEYS
    # The definition: blake2b(first key || k, keyed by the seed, personalised).
    h = hashlib.blake2b(first + (2).to_bytes(8, "little"), key=key, digest_size=16, person=b"seqcache copy")
    assert keys[1].tobytes() == h.digest()
    # Not the key of any raw record (the personalisation separates them).
    assert keys[0].tobytes() != shuffle.record_key(first + (1).to_bytes(8, "little"), key)


def test_copy_ranks_count_earlier_entries_with_the_same_key_and_sub_index():
    a, b = b"a" * 16, b"b" * 16
    keys = np.frombuffer(a + a + a + a + b + b, dtype="V16")
    sub = np.array([0, 0, 1, 1, 0, 0], np.uint32)
    assert shuffle.copy_ranks(keys, sub).tolist() == [0, 1, 0, 1, 0, 1]
    assert shuffle.copy_ranks(keys[:1], sub[:1]).tolist() == [0]
    assert shuffle.copy_ranks(np.frombuffer(a + b, dtype="V16"), sub[:2]).tolist() == [0, 0]


def _repeats(rows: np.ndarray, texts: np.ndarray, num_rows: int) -> tuple[float, int]:
    """(fraction of rows holding some text twice or more, most segments of one text
    in one row), from one (row, text id) pair per segment (int64 (n,) each)."""
    pairs, counts = np.unique(rows * (int(texts.max()) + 1) + texts, return_counts=True)
    repeated_rows = np.unique(pairs[counts > 1] // (int(texts.max()) + 1))
    return len(repeated_rows) / num_rows, int(counts.max())


def _uniform_repeats(lengths: np.ndarray, texts: np.ndarray, rng) -> tuple[float, int]:
    """``_repeats`` of one uniformly random order of the examples (token counts
    ``lengths``, text ids ``texts``), concatenated and cut every ``L`` tokens as
    ``pack_lm`` does."""
    order = rng.permutation(len(lengths))
    ends = np.cumsum(lengths[order])
    first, last = (ends - lengths[order]) // L, (ends - 1) // L
    spans = last - first + 1
    rows = np.repeat(first, spans) + (np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans))
    return _repeats(rows, np.repeat(texts[order], spans), int(-(-ends[-1] // L)))


@pytest.mark.parametrize("num_shards", [1, 4])
def test_packed_rows_repeat_lines_no_more_than_a_uniform_shuffle(tmp_path, corpora, num_shards):
    from seqcache.feeders.provenance import provenance_segments
    from seqcache.feeders.reader import CacheReader

    (tmp_path / "src").mkdir()
    shutil.copy(corpora.shakespeare, tmp_path / "src" / "play.txt")
    result = build_task(shakespeare_lm_task(str(tmp_path / "src" / "*.txt")), cache_dir=str(tmp_path / "c"),
                        config=BuildConfig(num_shards=num_shards, sequence_length={"targets": L}))
    text = corpora.shakespeare.read_bytes()
    lines = text.split(b"\n")
    offsets = np.cumsum([0] + [len(line) + 1 for line in lines[:-1]])  # a line's record number: its first byte
    kept = [k for k, line in enumerate(lines) if line]  # empty lines are skipped
    _, text_id = np.unique(np.array(lines, dtype=object)[kept].astype(bytes), return_inverse=True)
    id_at = dict(zip(offsets[kept].tolist(), text_id.tolist()))
    with CacheReader(result.cache_dir) as reader:
        n = reader.num_examples
        rows, _, record_numbers, _ = provenance_segments(reader, np.arange(n))[:4]
    cache_rate, cache_most = _repeats(rows, np.array([id_at[int(r)] for r in record_numbers]), n)

    lengths = np.array([len(lines[k]) + 1 for k in kept])  # bytes and EOS
    rng = np.random.default_rng(0)
    uniform = np.array([_uniform_repeats(lengths, text_id, rng) for _ in range(20)])
    mean, std = uniform[:, 0].mean(), uniform[:, 0].std()
    # About 0.45% of rows for a uniform order (before copies had keys of their
    # own: 10% of rows, up to 24 copies of one line in a row).
    assert 0.002 < mean < 0.008
    assert cache_rate <= mean + 4 * max(std, np.sqrt(mean * (1 - mean) / n)), (cache_rate, mean, std)
    assert cache_most <= uniform[:, 1].max() + 1, (cache_most, uniform[:, 1])
