"""The T5 encoder-decoder: relative position buckets, packed-example masking
(encoder, decoder, cross-attention), parameter layout, and the model/cache fit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from seqcache.training import config as C
from seqcache.training import models
from seqcache.training import partitioning as Pt
from seqcache.training.models import common as M
from seqcache.training.models import t5 as T5

CFG = C.ModelConfig(architecture="t5", vocab_size=64, d_model=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                    head_dim=8, mlp_dim=64, mlp_activation="geglu", tie_embeddings=False)


def test_relative_position_buckets_follow_t5():
    # Hand-derived from the mesh-tensorflow formula (key position - query
    # position). Bidirectional, 32 buckets: 16 per direction, distances 0..7
    # exact, 8..127 logarithmic in 8 buckets (8 + floor(log(n/8)/log(16) * 8)),
    # keys after the query offset by 16. Changing these changes every T5 model.
    rel = np.array([0, -1, 1, -7, -8, -16, -128, -1000, 7, 8, 128])
    got = T5.relative_position_bucket(rel, bidirectional=True, num_buckets=32, max_distance=128)
    assert got.tolist() == [0, 1, 17, 7, 8, 10, 15, 15, 23, 24, 31]
    # Causal: later keys share bucket 0; distances 0..15 exact, then
    # 16 + floor(log(n/16)/log(8) * 16) up to 31.
    rel = np.array([0, -1, 5, -15, -16, -32, -64, -127, -128, -1000])
    got = T5.relative_position_bucket(rel, bidirectional=False, num_buckets=32, max_distance=128)
    assert got.tolist() == [0, 1, 0, 15, 16, 21, 26, 31, 31, 31]
    assert got.dtype == np.int32


@pytest.fixture(scope="module")
def tiny():
    return M.split_params(M.create(CFG, seed=0))


_FORWARD = {}


def _logits(tiny, enc, enc_seg, dec, dec_seg):
    graphdef, params = tiny
    if id(graphdef) not in _FORWARD:
        _FORWARD[id(graphdef)] = jax.jit(lambda p, *rows: nnx.merge(graphdef, p)(*rows))
    rows = [jnp.asarray(x, jnp.int32)[None] for x in (enc, enc_seg, dec, dec_seg)]
    return np.asarray(_FORWARD[id(graphdef)](params, *rows))[0]


# One packed row: example 1 (encoder 5 tokens, decoder 3), example 2 (encoder 4,
# decoder 4), then padding.
ENC = [5, 9, 13, 2, 7, 40, 41, 42, 43, 0, 0, 0]
ENC_SEG = [1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0]
DEC = [0, 11, 12, 0, 21, 22, 23, 0]
DEC_SEG = [1, 1, 1, 2, 2, 2, 2, 0]
D1, D2 = slice(0, 3), slice(3, 7)


def test_cross_attention_reads_only_the_matching_encoder_segment(tiny):
    base = _logits(tiny, ENC, ENC_SEG, DEC, DEC_SEG)
    changed = list(ENC)
    changed[5:9] = [60, 61, 62, 63]  # example 2's inputs
    changed[9:12] = [30, 31, 32]  # and the padding
    out = _logits(tiny, changed, ENC_SEG, DEC, DEC_SEG)
    np.testing.assert_array_equal(out[D1], base[D1])
    assert np.abs(out[D2] - base[D2]).max() > 1e-3  # the perturbation is real
    changed = list(ENC)
    changed[0:5] = [1, 2, 3, 4, 6]  # example 1's inputs
    out = _logits(tiny, changed, ENC_SEG, DEC, DEC_SEG)
    np.testing.assert_array_equal(out[D2], base[D2])
    assert np.abs(out[D1] - base[D1]).max() > 1e-3


def test_decoder_is_causal_and_segment_masked(tiny):
    base = _logits(tiny, ENC, ENC_SEG, DEC, DEC_SEG)
    later = list(DEC)
    later[5] = 50  # a later token of example 2
    out = _logits(tiny, ENC, ENC_SEG, later, DEC_SEG)
    np.testing.assert_array_equal(out[:5], base[:5])  # example 1 and example 2's earlier tokens
    assert np.abs(out[5:7] - base[5:7]).max() > 1e-3
    earlier = list(DEC)
    earlier[1:3] = [33, 34]  # example 1's decoder tokens: example 2 does not see them
    out = _logits(tiny, ENC, ENC_SEG, earlier, DEC_SEG)
    np.testing.assert_array_equal(out[D2], base[D2])


def test_a_packed_example_equals_the_example_alone(tiny):
    packed = _logits(tiny, ENC, ENC_SEG, DEC, DEC_SEG)
    alone = _logits(tiny, ENC[5:9] + [0] * 8, [1] * 4 + [0] * 8, DEC[3:7] + [0] * 4, [1] * 4 + [0] * 4)
    # Relative buckets depend on index differences, equal within a segment; the
    # softmax rows differ only by masked exact zeros (float rounding only).
    np.testing.assert_allclose(packed[D2], alone[0:4], rtol=1e-5, atol=1e-5)
    # Negative control: the same tokens in another order give other logits.
    swapped = _logits(tiny, ENC[5:9][::-1] + [0] * 8, [1] * 4 + [0] * 8, DEC[3:7] + [0] * 4, [1] * 4 + [0] * 4)
    assert np.abs(swapped[0:4] - alone[0:4]).max() > 1e-3


def _abstract_params(cfg):
    return M.split_params(M.abstract_model(cfg))[1]


def test_parameters_by_hand_and_embedding_options(tiny):
    _, params = tiny  # initialised; the options below are counted on their shapes alone
    assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                              _abstract_params(CFG))
    d, h, k, f, v, b = 32, 4, 8, 64, 64, 32
    attn, mlp = 4 * d * h * k, 3 * d * f
    expected = (v * d  # shared input embedding
                + 2 * b * h  # relative bias per stack
                + 2 * (attn + mlp + 2 * d)  # encoder layers
                + 2 * (2 * attn + mlp + 3 * d)  # decoder layers
                + 2 * d  # final norms
                + d * v)  # output layer (T5.1.1: not tied)
    assert M.count_params(params) == expected
    assert params["encoder_bias"]["embedding"].shape == (b, h)
    separate = _abstract_params(dataclasses.replace(CFG, share_embeddings=False))
    assert M.count_params(separate) == expected + v * d
    tied = _abstract_params(dataclasses.replace(CFG, tie_embeddings=True))
    assert M.count_params(tied) == expected - d * v and "output" not in tied
    relu = dataclasses.replace(CFG, mlp_activation="relu")
    assert M.count_params(_abstract_params(relu)) == expected - 4 * d * f


def test_rms_norm_is_flax_rms_norm_in_float32_and_bfloat16():
    norm = T5.rms_norm(CFG, nnx.Rngs(params=0))
    bf16 = T5.rms_norm(dataclasses.replace(CFG, dtype="bfloat16"), nnx.Rngs(params=0))
    x = np.random.default_rng(1).normal(size=(2, 3, 32)).astype(np.float32) * 3.0
    want = x / np.sqrt(np.mean(np.float64(x) ** 2, axis=-1, keepdims=True) + CFG.norm_eps)
    got, got_bf16 = nnx.jit(lambda a, b, x: (a(x), b(x)))(norm, bf16, x)  # one compiled program for both
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    assert got_bf16.dtype == jnp.bfloat16 and bf16.scale[...].dtype == jnp.float32


def test_rules_presets_shard_the_t5_parameters():
    abstract = M.abstract_model(CFG)
    _, params = M.split_params(abstract)
    axes = M.logical_axes(abstract)
    tp = Pt.param_specs(params, axes, Pt.get_rules("tp"), Pt.make_mesh({"data": 2, "model": 4}))
    assert tp["encoder_layers"][0]["attn"]["wq"] == Pt.P(None, "model", None)
    assert tp["decoder_layers"][0]["cross_attn"]["wo"] == Pt.P("model", None, None)
    assert tp["decoder_bias"]["embedding"] == Pt.P(None, "model")
    assert tp["decoder_layers"][1]["mlp"]["wi_1"] == Pt.P(None, "model")
    fsdp = Pt.param_specs(params, axes, Pt.get_rules("fsdp"), Pt.make_mesh({"fsdp": 8}))
    assert fsdp["embedding"] == Pt.P(None, "fsdp") and fsdp["output"] == Pt.P("fsdp", None)
    assert fsdp["encoder_norm"]["scale"] == Pt.P(None)


def test_a_model_that_cannot_read_a_cache_is_named_with_it():
    assert models.converter_for("t5", ["inputs", "targets"], cache="c") == "encdec"
    assert models.converter_for("decoder", ["inputs", "targets"], cache="c") == "prefix_lm"
    assert models.converter_for("decoder", ["targets"], cache="c") == "lm"
    with pytest.raises(models.ModelDataMismatch) as e:
        models.converter_for("t5", ["targets"], cache="caches/shakespeare_lm/train", model="t5-tiny")
    assert str(e.value).startswith("caches/shakespeare_lm/train: the cache has features ['targets'], but model "
                                   "'t5-tiny' (architecture 't5') reads features (inputs, targets)")


def test_config_refuses_what_cannot_work():
    t5 = C.MODEL_PRESETS["t5-tiny"]
    with pytest.raises(C.ConfigError, match="sequence_length is not set"):
        C.TrainConfig(model=dataclasses.replace(t5, vocab_size=64)).validate()
    with pytest.raises(C.ConfigError, match=r"has no length for \['inputs'\]; give it, e.g. --sequence-length "
                                            "inputs=512"):
        C.TrainConfig(model=dataclasses.replace(t5, vocab_size=64), sequence_length={"targets": 32}).validate()
    with pytest.raises(C.ConfigError, match=r"data.converter='lm' does not feed model architecture 't5'"):
        C.TrainConfig(model=dataclasses.replace(t5, vocab_size=64), data=C.DataConfig(converter="lm")).validate()
    with pytest.raises(C.ConfigError, match="the decoder-only model has a SwiGLU MLP only"):
        C.ModelConfig(vocab_size=64, mlp_activation="geglu").validate()
    with pytest.raises(C.ConfigError, match="model.architecture must be one of"):
        C.ModelConfig(vocab_size=64, architecture="rnn").validate()
    ok = C.TrainConfig(model=dataclasses.replace(t5, vocab_size=64), sequence_length={"inputs": 128, "targets": 32})
    ok.validate()
    assert ok.converter == "encdec" and ok.sequence_length == {"inputs": 128, "targets": 32}
    # An int is every feature the converter reads.
    assert C.TrainConfig(model=t5, sequence_length=32).sequence_length == {"inputs": 32, "targets": 32}
    assert ok.tokens_per_step == 8 * (128 + 32)


def test_t5_small_has_t5_1_1_small_dimensions():
    cfg = dataclasses.replace(C.MODEL_PRESETS["t5-small"], vocab_size=32128)
    _, params = M.split_params(M.abstract_model(cfg))
    # T5.1.1-small: about 77 M parameters with its 32128-id vocabulary.
    assert 76e6 < M.count_params(params) < 78e6
    assert len(params["encoder_layers"]) == 8 and len(params["decoder_layers"]) == 8


def test_attention_matches_a_plain_softmax_reference():
    """jax.nn.dot_product_attention with the boolean mask and the relative bias
    equals softmax(q k^T + bias, masked) v written out, in float32."""
    attn = T5.Attention(CFG, rngs=nnx.Rngs(params=3))
    bias_module = T5.RelativePositionBias(CFG, bidirectional=True, rngs=nnx.Rngs(params=4))
    x = np.random.default_rng(2).normal(size=(2, 6, 32)).astype(np.float32)
    seg = np.asarray([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)

    @nnx.jit  # the module and the written-out reference in one compiled program
    def both(attn, bias_module, x, seg):
        mask = T5.encoder_mask(seg)
        bias = bias_module(6, 6, jnp.float32)
        got = attn(x, x, mask, bias)
        q = jnp.einsum("bld,dhk->bhlk", x, attn.wq[...])
        k = jnp.einsum("bld,dhk->bhlk", x, attn.wk[...])
        v = jnp.einsum("bld,dhk->bhlk", x, attn.wv[...])
        logits = jnp.einsum("bhqk,bhsk->bhqs", q, k) + bias  # T5: no 1/sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
        return got, jnp.einsum("bhqs,bhsk,hkd->bqd", probs, v, attn.wo[...])

    got, want = both(attn, bias_module, x, seg)
    real = seg != 0  # padding queries attend to nothing real; their output is unused
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=2e-5, atol=2e-5)


def test_a_checkpoint_fed_through_another_converter_is_refused():
    from seqcache.training import resume
    from seqcache.training.checkpoints import CheckpointError

    state = {"kind": "fake", "global_batch_size": 8, "seed": 0, "step": 2}
    encdec = {**state, "converter": {"name": "encdec", "sequence_length": {"inputs": 128, "targets": 29}}}
    resume.check_same_stream("ckpt/2", encdec, {**encdec, "step": 0})  # same stream, another position
    with pytest.raises(CheckpointError, match=r"ckpt/2: the checkpoint's feeder fed the model through converter "
                                              r"\{'name': 'encdec'.*this run's feeder through None"):
        resume.check_same_stream("ckpt/2", encdec, state)
    longer = {**encdec, "converter": {"name": "encdec", "sequence_length": {"inputs": 256, "targets": 29}}}
    with pytest.raises(CheckpointError, match="another data stream"):
        resume.check_same_stream("ckpt/2", encdec, longer)
