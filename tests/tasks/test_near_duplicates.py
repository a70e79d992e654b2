"""MinHash signatures and LSH bands of near-duplicate detection (tasks/near_duplicates.py).

Vocabulary: a *shingle* is a run of n words after the normalisation; a
*signature* is the bands x rows minimum hashes of a text's shingles."""

from __future__ import annotations

import numpy as np
import pytest

from seqcache.tasks.near_duplicates import (NearDuplicates, estimated_similarity, jaccard, mix64, normalize,
                                            removed_in_sample, shingle_hashes, word_hashes)


def test_the_normalisation_drops_case_punctuation_and_spacing():
    assert normalize("The  CAT, sat\ton the mat!\n") == ["the", "cat", "sat", "on", "the", "mat"]
    assert normalize("Ｆｕｌｌ－width_and snake_case") == ["full", "width", "and", "snake", "case"]  # NFKC, "_"
    assert normalize("¡¿...!?") == []
    assert NearDuplicates().signature("...  ,, !") is None


def test_word_and_shingle_hashes_are_per_word_and_per_run():
    words = ["a", "bb", "a", "ccc", "é"]
    w = word_hashes(words)
    assert w.dtype == np.uint64 and w.shape == (5,)
    assert w[0] == w[2] and len(set(w.tolist())) == 4
    assert word_hashes(["é"])[0] == w[4]  # a word's hash depends on its bytes alone
    s = shingle_hashes(words, 2)
    assert s.shape == (4,)
    assert shingle_hashes(["x", "a", "bb"], 2)[1] == s[0]  # the same run of words, the same hash
    assert shingle_hashes(["one", "two"], 5).shape == (1,)  # fewer words than n: one shingle
    assert shingle_hashes([], 5).shape == (0,)


def test_golden_signature_values():
    """Changing these changes which records a cache keeps as near duplicates:
    it needs a new SCHEME_VERSION (in every fingerprint)."""
    assert mix64(np.asarray([0, 1], dtype=np.uint64)).tolist() == [0xE220A8397B1DCDAF, 0x910A2DEC89025CC1]
    sig = NearDuplicates().signature("the quick brown fox jumps over the lazy dog")
    assert sig.dtype == np.uint32 and sig.shape == (112,)
    assert sig[:4].tolist() == [95303507, 1741327886, 297540114, 1444760389]
    assert [h.hex() for h in NearDuplicates().band_hashes(sig)[:2]] == ["5428b282288db729", "b44884a6d557dab6"]
    again = NearDuplicates().signature("The quick, brown fox jumps over the LAZY dog.")
    assert np.array_equal(sig, again)
    assert not np.array_equal(sig, NearDuplicates(seed=1).signature("the quick brown fox jumps over the lazy dog"))


def test_the_signature_estimates_the_jaccard_similarity():
    rng = np.random.default_rng(7)
    vocab = [f"w{i}" for i in range(5000)]
    base = list(rng.choice(vocab, 400))
    params = NearDuplicates(bands=32, rows=16)  # 512 hashes: a standard error of about 0.02
    seeds = params.seeds()
    for rate in (0.0, 0.05, 0.2, 0.5):
        other = [w if rng.random() >= rate else str(rng.choice(vocab)) for w in base]
        a, b = " ".join(base), " ".join(other)
        true = jaccard(a, b, 5)
        est = estimated_similarity(params.signature(a, seeds), params.signature(b, seeds))
        assert abs(est - true) < 0.08, (rate, true, est)


def test_band_hashes_match_exactly_the_equal_bands():
    params = NearDuplicates(bands=4, rows=2)
    a = np.arange(8, dtype=np.uint32)
    b = a.copy()
    b[5] += 1  # band 2 differs
    ha, hb = params.band_hashes(a), params.band_hashes(b)
    assert [x == y for x, y in zip(ha, hb)] == [True, True, False, True]
    assert len(set(ha)) == 4  # the band index is hashed too: equal values in two bands differ
    assert all(len(h) == 8 for h in ha)


def test_the_lsh_curve_of_the_defaults():
    p = NearDuplicates()
    assert p.num_hashes == 112
    assert round(float(p.candidate_probability(0.8)), 2) == 0.92
    assert 0.68 < p.threshold() < 0.69
    assert round(float(p.candidate_probability(0.5)), 3) == 0.053


def test_parameters_parse_and_check():
    assert NearDuplicates.parse("ngram=3, bands=20,rows=5,seed=9,fields=title+text") == NearDuplicates(
        ngram=3, bands=20, rows=5, seed=9, fields=("title", "text"))
    assert NearDuplicates.parse("") == NearDuplicates()
    assert NearDuplicates().to_json() == {"version": 1, "ngram": 5, "bands": 14, "rows": 8, "seed": 0, "fields": []}
    with pytest.raises(ValueError, match="'grams=3' is not NAME=VALUE"):
        NearDuplicates.parse("grams=3")
    with pytest.raises(ValueError, match="bands must be an integer"):
        NearDuplicates.parse("bands=many")
    with pytest.raises(ValueError, match=r"rows must be an integer in \[1, 1024\] \(got rows=0\)"):
        NearDuplicates(rows=0)
    with pytest.raises(ValueError, match="at most 4096"):
        NearDuplicates(bands=100, rows=100)


def test_the_text_compared_is_the_fields_named():
    p = NearDuplicates(fields=("title", "text"))
    assert p.text_of({"text": "b", "title": "a", "n": 3}) == "a\nb"
    assert NearDuplicates().text_of({"text": "b", "title": "a", "n": 3}) == "b\na"
    with pytest.raises(ValueError, match=r"a.jsonl: line at byte 4 has no field 'title'.*fields=\.\.\."):
        p.text_of({"text": "b"}, "a.jsonl: line at byte 4")


def test_the_share_in_a_sample_counts_each_cluster_but_one():
    base = "one two three four five six seven eight nine ten eleven twelve"
    params = NearDuplicates(ngram=2, bands=16, rows=2)
    texts = [base, base + "!", base.replace("six", "6"), "entirely other words here", "...", base]
    assert removed_in_sample(texts, params) == (5, 3)  # "..." has no word; base, its copies and near copy: 1 kept
    assert removed_in_sample([], params) == (0, 0)


def test_signatures_of_a_batch_are_those_of_each_text():
    rng = np.random.default_rng(2)
    vocab = [f"w{i}" for i in range(300)] + ["é", "中文", "naïve"]
    texts = [" ".join(rng.choice(vocab, int(n))) for n in rng.integers(0, 40, 60)] + ["", "...", "a b", "x " * 9000]
    for params in (NearDuplicates(), NearDuplicates(ngram=1), NearDuplicates(ngram=3, bands=3, rows=2, seed=7)):
        one, many = [params.signature(t) for t in texts], params.signatures(texts)
        assert [s is None for s in one] == [s is None for s in many]
        assert all(np.array_equal(a, b) for a, b in zip(one, many) if a is not None)
