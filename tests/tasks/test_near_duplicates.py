"""MinHash signatures and LSH bands of near-duplicate detection (tasks/near_duplicates.py).

Vocabulary: a *shingle* is a run of n words after the normalisation; a
*signature* is the bands x rows minimum hashes of a text's shingles."""

from __future__ import annotations

import numpy as np
import pytest

from seqcache.tasks import near_duplicates
from seqcache.tasks.near_duplicates import (NearDuplicates, estimated_similarity, jaccard, mix64, normalize,
                                            removed_in_sample, shingle_hashes)


def test_the_normalisation_drops_case_punctuation_and_spacing():
    assert normalize("The  CAT, sat\ton the mat!\n") == ["the", "cat", "sat", "on", "the", "mat"]
    assert normalize("Ｆｕｌｌ－width_and snake_case") == ["full", "width", "and", "snake", "case"]  # NFKC, "_"
    assert normalize("¡¿...!?") == []
    assert NearDuplicates().signature("...  ,, !") is None
    for text in ("The  CAT, sat\ton the mat!\n", "Ｆｕｌｌ－width_and snake_case", "İstanbul ǅemal ﬁne \u212a",
                 "e\u0301te\u0301 café 𝐀bc 𐐀x 中文,字 x²"):
        words = normalize(text)  # the batch path hashes these words
        assert shingle_hashes([text], 1)[0].tolist() == shingle_hashes(words, 1)[0].tolist()


def test_shingle_hashes_are_per_run_of_words_whatever_the_text():
    s, counts = shingle_hashes(["a bb a ccc é", "x a bb", "one two", "", "...", "A, BB!"], 2)
    assert s.dtype == np.uint32
    assert counts.tolist() == [4, 2, 1, 0, 0, 1]  # fewer words than n: one shingle
    assert s[5] == s[0] and s[7] == s[0]  # "a bb" in any text, after the normalisation
    assert len(set(s[:4].tolist())) == 4
    assert shingle_hashes(["a bb a ccc é"], 2)[0].tolist() == s[:4].tolist()  # a text's alone as in a batch
    astral = shingle_hashes(["𝐀bc 𐐀x y", "𝐀bc 𐐨x y", "abc 𐐨x y"], 3)[0]  # NFKC, lower case past the BMP
    assert astral[0] == astral[1] == astral[2]
    assert shingle_hashes([], 5)[0].shape == (0,)


def test_golden_signature_values():
    """Changing these changes which records a cache keeps as near duplicates:
    it needs a new SCHEME_VERSION (in every fingerprint)."""
    assert mix64(np.asarray([0, 1], dtype=np.uint64)).tolist() == [0xE220A8397B1DCDAF, 0x910A2DEC89025CC1]
    sig = NearDuplicates().signature("the quick brown fox jumps over the lazy dog")
    assert sig.dtype == np.uint32 and sig.shape == (112,)
    assert sig[:4].tolist() == [667467727, 41208019, 526578631, 399611056]
    assert NearDuplicates().band_hashes(sig)[:2].tolist() == [0x99D3C7781BD3465F, 0xF9DEFF97E8B5BAC5]
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
    assert ha.dtype == np.uint64 and ha.shape == (4,)
    assert (ha == hb).tolist() == [True, True, False, True]
    assert len(set(params.band_hashes(np.zeros(8, np.uint32)).tolist())) == 4  # equal values in two bands differ
    assert np.array_equal(params.band_hashes(np.stack([a, b])), np.stack([ha, hb]))  # (n, bands) at once


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
    assert NearDuplicates().to_json() == {"version": 2, "ngram": 5, "bands": 14, "rows": 8, "seed": 0, "fields": []}
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


@pytest.mark.parametrize("batch_chars", [1 << 18, 500])
def test_signatures_of_a_batch_are_those_of_each_text(batch_chars, monkeypatch):
    monkeypatch.setattr(near_duplicates, "_BATCH_CHARS", batch_chars)  # texts hashed in one batch, or many
    rng = np.random.default_rng(2)
    vocab = [f"w{i}" for i in range(300)] + ["é", "中文", "naïve"]
    texts = [" ".join(rng.choice(vocab, int(n))) for n in rng.integers(0, 40, 60)] + ["", "...", "a b", "x " * 9000]
    for params in (NearDuplicates(), NearDuplicates(ngram=1), NearDuplicates(ngram=3, bands=3, rows=2, seed=7)):
        one, (many, has) = [params.signature(t) for t in texts], params.signatures(texts)
        assert [s is not None for s in one] == has.tolist()
        assert all(np.array_equal(a, b) for a, b in zip(one, many) if a is not None)
        assert not many[~has].any()
