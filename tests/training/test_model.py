"""The Transformer: packed-sequence masking, positions, input shifting, dtypes."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import model as M

# A larger init scale than the default makes attention peaked, so that a change
# that leaks through a mask would move the logits far above float rounding.
CFG = C.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, init_std=0.3)


@pytest.fixture(scope="module")
def tiny():
    return M.split_params(M.create(CFG, seed=0))


_APPLY = {}


def _logits(tiny, targets, segments, positions):
    graphdef, params = tiny
    if id(graphdef) not in _APPLY:
        def run(params, targets, segments, positions):
            inputs = M.shift_right_by_segment(targets, segments)
            return M.apply(graphdef, params, inputs, segments, positions)

        _APPLY[id(graphdef)] = jax.jit(run)
    as_row = lambda x: jnp.asarray(x, jnp.int32)[None]
    return np.asarray(_APPLY[id(graphdef)](params, as_row(targets), as_row(segments), as_row(positions)))[0]


# One row: segment 1 (5 tokens), segment 2 (4 tokens), 3 padding tokens.
TARGETS = [5, 9, 13, 2, 7, 40, 41, 42, 43, 0, 0, 0]
SEGMENTS = [1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0]
POSITIONS = [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 0, 0]
SEG1, SEG2 = slice(0, 5), slice(5, 9)


def test_later_segment_does_not_see_earlier_segment(tiny):
    base = _logits(tiny, TARGETS, SEGMENTS, POSITIONS)
    changed = list(TARGETS)
    changed[0:5] = [60, 61, 62, 63, 1]
    out = _logits(tiny, changed, SEGMENTS, POSITIONS)
    # Not causality: segment 2 comes after segment 1, only the segment mask hides it.
    np.testing.assert_array_equal(out[SEG2], base[SEG2])
    assert np.abs(out[SEG1] - base[SEG1]).max() > 1e-3  # the perturbation is real


def test_perturbing_segment_two_leaves_segment_one_unchanged(tiny):
    base = _logits(tiny, TARGETS, SEGMENTS, POSITIONS)
    changed = list(TARGETS)
    changed[5:9] = [1, 2, 3, 4]
    changed[9:12] = [33, 34, 35]  # padding tokens too
    out = _logits(tiny, changed, SEGMENTS, POSITIONS)
    np.testing.assert_array_equal(out[SEG1], base[SEG1])
    assert np.abs(out[SEG2] - base[SEG2]).max() > 1e-3


def test_positions_restart_per_segment(tiny):
    packed = _logits(tiny, TARGETS, SEGMENTS, POSITIONS)
    alone = _logits(tiny, TARGETS[5:9] + [0] * 8, [1] * 4 + [0] * 8, [0, 1, 2, 3] + [0] * 8)
    # The same segment alone at the start of a row gives the same logits (float
    # rounding only: the softmax rows are identical up to masked exact zeros).
    np.testing.assert_allclose(packed[SEG2], alone[0:4], rtol=1e-5, atol=1e-5)
    # Negative control: rotary angles depend only on position differences, so a
    # constant offset changes nothing, but other positions must change the logits.
    shifted = _logits(tiny, TARGETS, SEGMENTS, POSITIONS[:5] + [7, 8, 9, 10] + [0] * 3)
    np.testing.assert_allclose(shifted[SEG2], alone[0:4], rtol=1e-5, atol=1e-5)
    scrambled = _logits(tiny, TARGETS, SEGMENTS, POSITIONS[:5] + [0, 3, 1, 2] + [0] * 3)
    assert np.abs(scrambled[SEG2] - alone[0:4]).max() > 1e-3


def test_shift_right_by_segment():
    targets = jnp.array([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]], jnp.int32)
    segments = jnp.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], jnp.int32)
    expected = [[0, 5, 0, 7, 8, 0], [0, 1, 2, 3, 4, 5]]
    np.testing.assert_array_equal(np.asarray(M.shift_right_by_segment(targets, segments)), expected)


def test_attention_mask_is_causal_and_same_segment():
    mask = np.asarray(M.attention_mask(jnp.array([[1, 1, 2, 0]], jnp.int32)))[0]
    expected = np.array(
        [[1, 0, 0, 0],
         [1, 1, 0, 0],
         [0, 0, 1, 0],
         [0, 0, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(mask, expected)


def test_bfloat16_compute_keeps_float32_params_and_logits(tiny):
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    graphdef, params = M.split_params(M.create(cfg, seed=0))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    # Same seed -> same float32 parameters as the float32 model.
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(tiny[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = _logits((graphdef, params), TARGETS, SEGMENTS, POSITIONS)
    assert out.dtype == np.float32
    ref = _logits(tiny, TARGETS, SEGMENTS, POSITIONS)
    # bfloat16 keeps 8 significant bits (relative rounding 2**-8 ~ 0.4%) per
    # operation; through two blocks the logits stay within 5% of their scale.
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()
    assert np.abs(out - ref).max() > 0  # it really computed in bfloat16


def test_untied_embeddings_add_an_output_matrix():
    _, tied = M.split_params(M.create(CFG, seed=0))
    _, untied = M.split_params(M.create(dataclasses.replace(CFG, tie_embeddings=False), seed=0))
    assert "unembedding" not in tied
    assert untied["unembedding"].shape == (32, 64)
    assert M.count_params(untied) - M.count_params(tied) == 32 * 64
    # Parameter count of the tied model, by hand: embedding, per block 4 attention
    # matrices + 3 MLP matrices + 2 norms, final norm.
    assert M.count_params(tied) == 64 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 64 + 2 * 32) + 32
