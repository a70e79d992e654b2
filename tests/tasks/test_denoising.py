"""T5 objectives: span corruption statistics on real text, lengths, exact rebuild."""

import hashlib

import numpy as np
import pytest

from seqcache.tasks import ByteVocabulary, Feature, PreprocessContext
from seqcache.tasks import denoising as D

VOCAB = ByteVocabulary(extra_ids=100)
FEATURES = {"inputs": Feature(VOCAB), "targets": Feature(VOCAB)}


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _ctx(n, *, seed=0, sequence_length=None):
    return PreprocessContext(output_features=FEATURES, sequence_length=sequence_length, seed=seed,
                             keys=[_key(i) for i in range(n)])


@pytest.fixture(scope="module")
def c4_tokens(corpora):
    texts = corpora.c4_texts().to_pylist()
    return VOCAB.encode_batch(texts)


def test_random_spans_helper_matches_t5():
    # T5's span_corruption task: inputs 512 -> 568 raw tokens, targets 114.
    assert D.random_spans_helper(512) == (568, 114)
    assert D.random_spans_helper(256)[1] < 114
    assert D.inputs_length_for_targets(114) == (512, 568) or D.random_spans_helper(
        D.inputs_length_for_targets(114)[0])[1] == 114
    inputs_length, tokens_length = D.inputs_length_for_targets(114)
    assert D.random_spans_helper(inputs_length) == (tokens_length, 114)
    assert D.random_spans_helper(inputs_length - 1)[1] < 114


def test_sentinels_are_the_last_ids_descending():
    tokens = np.arange(10, 30, dtype=np.int32)
    mask = np.zeros(20, dtype=bool)
    mask[[3, 4, 10, 15, 16, 17]] = True
    inputs = D.noise_span_to_unique_sentinel(tokens, mask, VOCAB)
    targets = D.nonnoise_span_to_unique_sentinel(tokens, mask, VOCAB)
    s0, s1, s2 = VOCAB.vocab_size - 1, VOCAB.vocab_size - 2, VOCAB.vocab_size - 3
    assert [VOCAB.sentinel_id(i) for i in range(3)] == [s0, s1, s2]
    assert inputs.tolist() == [10, 11, 12, s0, 15, 16, 17, 18, 19, s1, 21, 22, 23, 24, s2, 28, 29]
    assert targets.tolist() == [s0, 13, 14, s1, 20, s2, 25, 26, 27, VOCAB.vocab_size - 4]
    assert D.resolve_sentinels(inputs, targets, VOCAB).tolist() == tokens.tolist()


def test_random_spans_noise_mask_shape_and_counts():
    rng = np.random.default_rng(0)
    for length in (1, 2, 3, 10, 100, 568):
        mask = D.random_spans_noise_mask(length, rng)
        assert mask.shape == (length,) and mask.dtype == bool
        if length >= 2:
            assert not mask[0] and mask[-1]  # starts with non-noise, ends with noise (T5)
            assert mask.sum() == min(max(round(length * 0.15), 1), length - 1)


def test_span_corruption_statistics_on_c4(c4_tokens):
    """Per example: noise within 1 token of noise_density * length; over the
    sample: mean noise span length within 5% of 3.0; every example rebuilds."""
    p = D.span_corruption()
    lengths = {"inputs": 512, "targets": 114}
    ctx = _ctx(len(c4_tokens), seed=7, sequence_length=lengths)
    examples = [{"inputs": np.zeros(0, np.int32), "targets": t} for t in c4_tokens]
    out = p.process_batch(examples, ctx)
    total_noise = total_spans = 0
    worst = 0.0
    first_sentinel = VOCAB.base_vocab_size
    for i, (src, ex) in enumerate(zip(c4_tokens, out)):
        assert ex is not None
        original = D.select_random_chunk(src, 568, ctx.rng(i, salt="span_corruption"))
        n = len(original)
        assert n == min(len(src), 568)
        spans = int((ex["targets"] >= first_sentinel).sum())
        noise = len(ex["targets"]) - spans
        assert spans == int((ex["inputs"] >= first_sentinel).sum())
        worst = max(worst, abs(noise - 0.15 * n))
        assert abs(noise - 0.15 * n) <= 1.0, (i, n, noise)
        total_noise += noise
        total_spans += spans
        assert D.resolve_sentinels(ex["inputs"], ex["targets"], VOCAB).tolist() == original.tolist()
        # With EOS the features fit the sequence lengths exactly as T5 derives them.
        assert len(ex["inputs"]) + 1 <= 512 and len(ex["targets"]) + 1 <= 114
    mean_span = total_noise / total_spans
    assert abs(mean_span - 3.0) / 3.0 < 0.05, mean_span
    assert worst <= 0.5


def test_full_length_chunks_fill_the_derived_lengths(c4_tokens):
    long = [t for t in c4_tokens if len(t) >= 568][:50]
    out = D.span_corruption().process_batch([{"targets": t} for t in long],
                                            _ctx(len(long), sequence_length={"inputs": 512, "targets": 114}))
    assert {len(ex["inputs"]) + 1 for ex in out} == {512}
    assert {len(ex["targets"]) + 1 for ex in out} == {114}


def test_span_corruption_draws_only_from_the_record_key(c4_tokens):
    toks = c4_tokens[:20]
    lengths = {"inputs": 128}
    a = D.span_corruption().process_batch([{"targets": t} for t in toks], _ctx(20, sequence_length=lengths))
    # The same records in another batch, reversed: the same corruption per record.
    ctx = PreprocessContext(output_features=FEATURES, sequence_length=lengths, seed=0,
                            keys=[_key(i) for i in reversed(range(20))])
    b = D.span_corruption().process_batch([{"targets": t} for t in reversed(toks)], ctx)[::-1]
    assert all(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, b))
    c = D.span_corruption().process_batch([{"targets": t} for t in toks], _ctx(20, seed=1, sequence_length=lengths))
    assert sum(np.array_equal(x["inputs"], y["inputs"]) for x, y in zip(a, c)) < 3


def test_span_corruption_refuses_short_targets_and_few_sentinels():
    with pytest.raises(ValueError, match=r"targets of 114 tokens.*use targets=114"):
        D.span_corruption().process_batch([{"targets": np.arange(3, 600)}],
                                          _ctx(1, sequence_length={"inputs": 512, "targets": 100}))
    few = {"inputs": Feature(ByteVocabulary(extra_ids=2)), "targets": Feature(ByteVocabulary(extra_ids=2))}
    ctx = PreprocessContext(output_features=few, sequence_length=None, seed=0, keys=[_key(0)])
    with pytest.raises(ValueError, match="noise spans need as many sentinels.*2 extra ids"):
        D.span_corruption().process_batch([{"targets": np.arange(3, 200)}], ctx)


def test_prefix_lm_splits_at_a_point_drawn_per_example(c4_tokens):
    toks = [t for t in c4_tokens if len(t) >= 200][:200]
    out = D.prefix_lm().process_batch([{"targets": t} for t in toks], _ctx(len(toks), sequence_length={"inputs": 101}))
    splits = []
    for src, ex in zip(toks, out):
        assert len(ex["inputs"]) >= 1 and len(ex["targets"]) >= 1
        joined = np.concatenate([ex["inputs"], ex["targets"]])
        assert len(joined) == 100 and joined.tolist() == D.select_random_chunk(
            src, 100, _ctx(len(toks)).rng(len(splits), salt="prefix_lm")).tolist()
        splits.append(len(ex["inputs"]))
    # Uniform on [1, 99]: mean near 50, and many different split points.
    assert abs(np.mean(splits) - 50) < 5 and len(set(splits)) > 50


def test_denoise_choices():
    toks = np.arange(3, 203, dtype=np.int32)
    iid = D.denoise(noise_mask="iid", inputs_fn="noise_token_to_sentinel", targets_fn="identity")
    (ex,) = iid.process_batch([{"targets": toks}], _ctx(1))
    assert len(ex["inputs"]) == 200 and ex["targets"].tolist() == toks.tolist()
    masked = ex["inputs"] == VOCAB.sentinel_id(0)
    assert 10 <= masked.sum() <= 50 and (ex["inputs"][~masked] == toks[~masked]).all()
    drop = D.denoise(inputs_fn="drop_noise_tokens", targets_fn="drop_nonnoise_tokens")
    (ex,) = drop.process_batch([{"targets": toks}], _ctx(1))
    assert len(ex["targets"]) == 30 and sorted(np.concatenate([ex["inputs"], ex["targets"]])) == toks.tolist()
    with pytest.raises(ValueError, match=r"unknown noise_mask 'gauss' \(choose one of"):
        D.denoise(noise_mask="gauss")
    assert drop.params()["inputs_fn"] == "drop_noise_tokens"
    assert D.span_corruption().params() == {"noise_density": 0.15, "mean_noise_span_length": 3.0,
                                            "input_feature": "targets"}
