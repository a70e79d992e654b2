"""Decoding and scoring (``seqcache.training.decoding``): the key/value cache
against the model's full forward pass, sampling, EOS, log-likelihoods against
a direct forward pass, and the 8-device mesh against one device.

The models are tiny and random; the decoder's weights are drawn wider than its
default initialisation (``init_std``) so that its next-token distributions are
far from uniform and greedy choices are not near-ties.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqcache.training import config as C
from seqcache.training import decoding as D
from seqcache.training import partitioning as Pt
from seqcache.training import sampling
from seqcache.training.models import common as M

DECODER = C.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, mlp_dim=64, init_std=0.5)
T5 = C.ModelConfig(architecture="t5", vocab_size=64, d_model=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                   head_dim=8, mlp_dim=64, mlp_activation="geglu", tie_embeddings=False)
LENGTH = 7  # tokens decoded per row: one compiled program per model serves most tests
NEVER = -1  # an eos_id no token equals: every row runs to max_decode_length
# Three prompts of different lengths, padded with 0 (raw feeder examples).
INPUTS = np.array([[5, 9, 13, 2, 7, 40], [11, 3, 0, 0, 0, 0], [20, 21, 22, 23, 0, 0]], np.int32)
TARGETS = np.array([[7, 8, 9, 0], [30, 31, 32, 33], [44, 0, 0, 0]], np.int32)


@pytest.fixture(scope="module")
def decoder():
    return M.create(DECODER, seed=0)


@pytest.fixture(scope="module")
def t5():
    return M.create(T5, seed=0)


def _batch(kind):
    return {"targets": TARGETS} if kind == "lm" else {"inputs": INPUTS, "targets": TARGETS}


@pytest.mark.parametrize("kind", ["lm", "lm_prompt", "prefix_lm", "t5",
                                  # Scanned layers: a cache stacked along the layer axis, run under lax.scan.
                                  pytest.param("prefix_lm_scanned", marks=pytest.mark.slow),
                                  pytest.param("t5_scanned", marks=pytest.mark.slow)])
def test_greedy_with_the_cache_equals_the_full_forward_pass(kind, decoder, t5):
    if kind.endswith("_scanned"):
        model = M.create(dataclasses.replace(T5 if kind == "t5_scanned" else DECODER, scan_layers=True), seed=0)
    else:
        model = t5 if kind == "t5" else decoder
    batch = {"inputs": INPUTS} if kind != "lm" else {"targets": TARGETS}
    converter = "lm" if kind.startswith("lm") else None
    cfg = D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER)
    fast = D.predict(model, batch, cfg, converter=converter)
    slow = D.predict(model, batch, cfg, converter=converter, use_cache=False)
    assert fast.shape == (3, LENGTH) and fast.dtype == np.int32
    np.testing.assert_array_equal(fast, slow)
    if kind != "lm":  # without a prompt every greedy row is the same
        assert len({tuple(row) for row in fast}) > 1  # the rows read their own prompts


def test_a_prefix_lm_prompt_is_read_bidirectionally_and_a_lm_prompt_causally(decoder):
    cfg = D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER)
    prefix = D.predict(decoder, {"inputs": INPUTS}, cfg)
    causal = D.predict(decoder, {"inputs": INPUTS}, cfg, converter="lm")
    assert not np.array_equal(prefix, causal)


def test_a_row_decodes_the_same_alone_and_beside_longer_rows(decoder, t5):
    cfg = D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER)
    for model in (decoder, t5):
        together = D.predict(model, {"inputs": INPUTS}, cfg)
        alone = D.predict(model, {"inputs": INPUTS[1:2, :2]}, cfg)
        np.testing.assert_array_equal(together[1:2], alone)


def test_sampling_is_deterministic_per_seed_and_limits_reduce_to_greedy(decoder):
    batch = {"inputs": INPUTS}
    greedy = D.predict(decoder, batch, D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER))

    def sample(**kw):
        return D.predict(decoder, batch, D.DecodeConfig(max_decode_length=LENGTH, method="sample", eos_id=NEVER, **kw))

    a, b, c = sample(seed=1), sample(seed=1), sample(seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, greedy)
    np.testing.assert_array_equal(sample(seed=3, top_k=1), greedy)
    np.testing.assert_array_equal(sample(seed=3, temperature=1e-4), greedy)
    np.testing.assert_array_equal(sample(seed=3, temperature=0.0), greedy)
    np.testing.assert_array_equal(sample(seed=3, top_p=1e-6), greedy)
    # A row's draws depend on its index in the whole set (row_offset), not on the batch it is in.
    shifted = D.predict(decoder, {"inputs": INPUTS[1:]},
                        D.DecodeConfig(max_decode_length=LENGTH, method="sample", eos_id=NEVER, seed=1), row_offset=1)
    np.testing.assert_array_equal(shifted, a[1:])


def test_top_k_and_top_p_draw_only_from_the_kept_tokens():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 400, jnp.float32))
    rows = jnp.arange(400, dtype=jnp.int32)

    select = jax.jit(sampling.select_tokens)  # one program: the choices are arrays

    def draws(**kw):
        knob = sampling.knobs(D.DecodeConfig(max_decode_length=1, method="sample", **kw))
        return set(np.asarray(select(logits, knob, rows, jnp.int32(0))).tolist())

    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=2) == {0, 1}
    assert draws(top_p=0.7) == {0, 1}  # 0.5 < 0.7 <= 0.8
    assert draws(top_p=0.85) == {0, 1, 2}
    assert draws(top_k=3, top_p=0.5) == {0}


def test_positions_after_eos_are_zero(decoder, t5):
    for model in (decoder, t5):
        free = D.predict(model, {"inputs": INPUTS}, D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER))
        eos = int(free[0, 2])
        out = D.predict(model, {"inputs": INPUTS}, D.DecodeConfig(max_decode_length=LENGTH, eos_id=eos))
        for row, full in zip(out, free):
            hits = np.flatnonzero(full == eos)
            stop = hits[0] + 1 if hits.size else len(full)
            np.testing.assert_array_equal(row[:stop], full[:stop])
            assert not row[stop:].any()
        assert not out[0, 3:].any()


def _direct_scores(model, kind):
    """The model's own forward pass (``__call__``) on the rows laid out by hand,
    one example a row, then the log-softmax of each target token, summed."""
    feeds, picks = [], []
    for prompt, target in zip(INPUTS, TARGETS):
        a, b = prompt[prompt != 0], target[target != 0]
        a = np.zeros((0,), np.int32) if kind == "lm" else a
        if kind == "t5":
            feeds.append((a, np.ones(len(a)), np.concatenate([[0], b[:-1]]), np.ones(len(b))))
            picks.append((0, b))
            continue
        row = np.concatenate([a, b])
        feeds.append((np.concatenate([[0], row[:-1]]), np.ones(len(row)), np.arange(len(row)),
                      np.arange(len(row)) <= len(a)))
        picks.append((len(a), b))
    width = max(max(len(x) for x in feed) for feed in feeds)
    args = [jnp.asarray(np.stack([np.pad(feed[i], (0, width - len(feed[i]))) for feed in feeds]), jnp.int32)
            for i in range(4)]
    graphdef, params = M.split_params(model)
    if kind == "t5":
        logits = jax.jit(lambda p, *a: nnx.merge(graphdef, p)(*a))(params, *args)
    else:
        causal = None if kind == "lm" else args[3]
        logits = jax.jit(lambda p, x, s, q, c: nnx.merge(graphdef, p)(x, s, q, causal_attention=c))(
            params, *args[:3], causal)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return np.array([logp[r, np.arange(start, start + len(b)), b].sum() for r, (start, b) in enumerate(picks)],
                    np.float32)


@pytest.mark.parametrize("kind", ["lm", "prefix_lm", "t5"])
def test_score_is_the_log_likelihood_of_a_direct_forward_pass(kind, decoder, t5):
    model = t5 if kind == "t5" else decoder
    got = D.score(model, _batch(kind))
    assert got.shape == (3,) and got.dtype == np.float32
    assert (got < 0).all()
    np.testing.assert_allclose(got, _direct_scores(model, kind), rtol=1e-5, atol=1e-5)


def test_score_pads_the_rows_for_the_splash_kernel(decoder):
    graphdef, params = M.split_params(M.create(dataclasses.replace(DECODER, attention="splash"), seed=0))
    splash = nnx.merge(graphdef, M.split_params(decoder)[1])  # the same weights, the fused kernel
    batch = _batch("prefix_lm")
    np.testing.assert_allclose(D.score(splash, batch), D.score(decoder, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["decoder", "t5"])
def test_an_8_device_mesh_decodes_and_scores_like_one_device(name, decoder, t5):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    model = t5 if name == "t5" else decoder
    mesh = Pt.make_mesh({"data": 2, "fsdp": 2, "model": 2}, jax.devices()[:8])
    batch = {"inputs": INPUTS, "targets": TARGETS}  # 3 rows: padded to the 4 batch shards
    for cfg in (D.DecodeConfig(max_decode_length=LENGTH, eos_id=NEVER),
                D.DecodeConfig(max_decode_length=LENGTH, method="sample", top_k=20, top_p=0.9, seed=4)):
        one = D.predict(model, batch, cfg)
        np.testing.assert_array_equal(D.predict(model, batch, cfg, mesh=mesh, rules="fsdp+tp"), one)
    np.testing.assert_allclose(D.score(model, batch, mesh=mesh, rules="fsdp+tp"), D.score(model, batch),
                               rtol=1e-5)


def test_bad_configs_and_batches_raise_one_clear_error(decoder, t5):
    with pytest.raises(ValueError, match="method"):
        D.predict(decoder, {"inputs": INPUTS}, D.DecodeConfig(max_decode_length=LENGTH, method="beam"))
    with pytest.raises(ValueError, match="top_p"):
        D.predict(decoder, {"inputs": INPUTS}, D.DecodeConfig(max_decode_length=LENGTH, top_p=0.0))
    with pytest.raises(ValueError, match="packed"):
        D.predict(decoder, {"inputs": INPUTS, "inputs_segment_ids": np.array([[1, 1, 2, 2, 0, 0]] * 3)},
                  D.DecodeConfig(max_decode_length=LENGTH))
    with pytest.raises(ValueError, match="inputs"):
        D.predict(t5, {"targets": TARGETS}, D.DecodeConfig(max_decode_length=LENGTH))
