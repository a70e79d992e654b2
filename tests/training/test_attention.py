"""The fused attention kernel, scanned layers and rematerialisation against the
einsum path, on random packed batches.

On CPU the splash kernel runs in Pallas interpret mode: the same kernel code,
interpreted. The tests marked ``tpu`` compile it for the chip and run only
there (``pytest -m tpu``).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqcache.training import config as config_lib
from seqcache.training import step as step_lib
from seqcache.training.checkpoints import CheckpointError
from seqcache.training.models import attention as attention_lib
from seqcache.training.models import common
from seqcache.training.models.decoder import attention_mask, shift_right_by_segment
from seqcache.training.resume import check_structure

ON_TPU = jax.default_backend() == "tpu"


def packed_segments(rng, rows, length, *, pad=8, most=70):
    """(rows, length) int32 segment ids 1, 2, ... of random lengths, then padding,
    and positions restarting at 0 in each segment."""
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    for r in range(rows):
        i, s = 0, 1
        while i < length - pad:
            n = min(int(rng.integers(3, most)), length - pad - i)
            seg[r, i:i + n], pos[r, i:i + n] = s, np.arange(n)
            i, s = i + n, s + 1
    return seg, pos


def lm_batch(seed, rows=2, length=128, vocab=50, prefix=False):
    """A language-model batch (``lm``), or a prefix-LM one (``prefix_lm``) whose
    prefix is a run at the start of each segment, as seqio's converter marks it."""
    rng = np.random.default_rng(seed)
    seg, pos = packed_segments(rng, rows, length)
    targets = rng.integers(1, vocab, (rows, length)).astype(np.int32) * (seg > 0)
    weights = (seg > 0).astype(np.float32)
    if not prefix:
        return {"targets": targets, "targets_segment_ids": seg, "targets_positions": pos,
                "targets_loss_weights": weights}
    causal = np.zeros_like(seg)
    for r in range(rows):
        for s in set(seg[r]) - {0}:
            where = np.flatnonzero(seg[r] == s)
            causal[r, where[:int(rng.integers(1, len(where) + 1))]] = 1
    inputs = np.asarray(shift_right_by_segment(jnp.asarray(targets), jnp.asarray(seg)))
    return {"decoder_target_tokens": targets, "decoder_input_tokens": inputs,
            "decoder_loss_weights": weights * (1 - causal), "decoder_segment_ids": seg, "decoder_positions": pos,
            "decoder_causal_attention": causal}


def encdec_batch(seed, rows=2, inputs_length=256, length=128, vocab=60):
    rng = np.random.default_rng(seed)
    enc, enc_pos = packed_segments(rng, rows, inputs_length, most=120)
    dec, dec_pos = packed_segments(rng, rows, length)
    dec = np.where(dec > enc.max(axis=1, keepdims=True), 0, dec)  # every decoder segment has its inputs
    return {"encoder_input_tokens": rng.integers(1, vocab, enc.shape).astype(np.int32) * (enc > 0),
            "encoder_segment_ids": enc, "encoder_positions": enc_pos,
            "decoder_target_tokens": rng.integers(1, vocab, dec.shape).astype(np.int32) * (dec > 0),
            "decoder_input_tokens": rng.integers(1, vocab, dec.shape).astype(np.int32) * (dec > 0),
            "decoder_loss_weights": (dec > 0).astype(np.float32), "decoder_segment_ids": dec,
            "decoder_positions": dec_pos}


def loss_and_grads(cfg, batch, loss_chunks=1):
    """(weighted loss sum, gradients) of ``cfg``'s model initialised from seed 0."""
    graphdef, params = common.split_params(common.create(cfg, 0))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}

    def f(p):
        return step_lib.loss_sums(graphdef, p, batch, None, loss_chunks=loss_chunks)["loss_sum"]

    loss, grads = jax.jit(jax.value_and_grad(f))(params)
    return float(loss), grads


def unstacked(tree):
    """Scanned layers' stacked gradients as the unscanned model lays them out."""
    tree = dict(tree)
    for name in ("blocks", "encoder_layers", "decoder_layers"):
        if name in tree and 0 not in tree[name]:
            count = jax.tree.leaves(tree[name])[0].shape[0]
            tree[name] = {i: jax.tree.map(lambda x, i=i: x[i], tree[name]) for i in range(count)}
    return tree


def assert_close(got, want, *, rtol):
    """Losses within ``rtol``; each gradient within ``rtol`` of its norm (a wrong
    mask moves a gradient by a share of its whole norm, far above rounding)."""
    got_loss, got_grads = got
    want_loss, want_grads = want
    got_grads = unstacked(got_grads)
    assert jax.tree.structure(got_grads) == jax.tree.structure(want_grads)
    np.testing.assert_allclose(got_loss, want_loss, rtol=rtol)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert float(jnp.linalg.norm(g - w)) <= rtol * max(float(jnp.linalg.norm(w)), 1e-12)


def decoder_config(**changes):
    return dataclasses.replace(config_lib.MODEL_PRESETS["tiny"], **{"vocab_size": 50, **changes})


def t5_config(**changes):
    return dataclasses.replace(config_lib.MODEL_PRESETS["t5-tiny"], **{"vocab_size": 60, **changes})


# -- the kernel alone ----------------------------------------------------------------


@pytest.mark.parametrize("prefix", [False, True], ids=["causal", "prefix_lm"])
def test_splash_matches_the_masked_reference_on_packed_rows(prefix):
    """Splash (interpret mode on CPU, compiled on a TPU) against softmax over the
    decoder's own mask, at every non-padding query, in float32 and bfloat16."""
    batch = lm_batch(1, rows=3, length=256, prefix=prefix)
    seg = jnp.asarray(batch["decoder_segment_ids" if prefix else "targets_segment_ids"])
    causal = jnp.asarray(batch["decoder_causal_attention"]) if prefix else None
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (3, 256, 4, 32), jnp.float32) for key in keys)
    mask = attention_mask(seg, causal)[:, None]  # (batch, 1, q, k)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(32)
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    want = np.asarray(jnp.einsum("bhqk,bkhd->bqhd", probs, v))
    real = np.asarray(seg) > 0
    for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)):
        got = attention_lib.splash_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), seg, seg,
                                             causal=True, scale=1 / np.sqrt(32), prefix=causal)
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float32)[real], want[real], atol=tol, rtol=tol)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_biased_flash_matches_the_masked_reference_and_gives_the_bias_its_gradient(causal):
    """T5's self-attention in one kernel: flash attention with the (heads, q, k)
    bias as its input (interpret mode on CPU), against softmax(q.k + bias) over
    the packed rows' mask: outputs at every non-padding query, and the
    gradients of q and of the bias (summed over the rows). One row in the
    default suite (the kernel interpreted costs seconds a grid cell), two in
    the heavy one."""
    rows = 1 if causal else 2
    batch = lm_batch(8, rows=rows, length=128)
    seg = jnp.asarray(batch["targets_segment_ids"])
    keys = jax.random.split(jax.random.key(1), 5)
    q, k, v = (jax.random.normal(key, (rows, 128, 2, 32), jnp.float32) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, 2, 128, 128), jnp.float32)
    real = (seg > 0)[:, :, None, None].astype(jnp.float32)
    mask = attention_mask(seg, None)[:, None] if causal else ((seg[:, :, None] == seg[:, None, :])
                                                              & (seg[:, :, None] > 0))[:, None]

    def reference(q, bias):
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.nan_to_num(probs), v)

    def fused(q, bias):
        return attention_lib.biased_attention(q, k, v, bias, seg, seg, causal=causal)

    def loss(fn):
        return lambda q, bias: jnp.sum((fn(q, bias) * real) ** 2)

    np.testing.assert_allclose(np.asarray(fused(q, bias) * real), np.asarray(reference(q, bias) * real),
                               atol=2e-5, rtol=2e-5)
    got, want = jax.grad(loss(fused), (0, 1))(q, bias), jax.grad(loss(reference), (0, 1))(q, bias)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-4, rtol=2e-4)


def test_resolve_picks_splash_only_where_it_applies():
    assert attention_lib.resolve("xla", lengths=(1024,)) == "xla"
    assert attention_lib.resolve("splash", lengths=(1024, 512)) == "splash"
    expected = "splash" if ON_TPU else "xla"
    assert attention_lib.resolve("auto", lengths=(1024,)) == expected
    assert attention_lib.resolve("auto", lengths=(1000,)) == "xla"
    assert attention_lib.resolve("auto", lengths=(1024,), dropout_rate=0.1) == "xla"
    with pytest.raises(config_lib.ConfigError, match=r"multiples of 128 \(got \[1000\]\).*model.attention=xla"):
        attention_lib.resolve("splash", lengths=(1000,))


def test_remat_dots_keeps_the_rotated_queries_and_keys_not_their_projections(capsys):
    """Under "dots" each layer keeps its queries and keys after the rotary
    positions (so the backward pass does not rotate again) in place of the
    projections they come from: four head-shaped residuals per layer (q, k, v
    and attention's output), two of them the rotated ones."""
    cfg = decoder_config(attention="xla", remat="dots")
    graphdef, params = common.split_params(common.create(cfg, 0))
    batch = {k: jnp.asarray(v) for k, v in lm_batch(2).items()}
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: step_lib.loss_sums(graphdef, p, batch, None)["loss_sum"], params)
    lines = capsys.readouterr().out.splitlines()
    head_shaped = [x for x in lines if x.startswith(f"f32[2,128,{cfg.num_heads},{cfg.resolved_head_dim}]")]
    assert len(head_shaped) == 4 * cfg.num_layers, head_shaped
    assert sum("named 'rotated'" in x for x in head_shaped) == 2 * cfg.num_layers
    assert sum("named 'attention'" in x for x in head_shaped) == cfg.num_layers


def test_config_refuses_splash_lengths_before_compiling_and_reads_remat_none_as_a_string():
    with pytest.raises(config_lib.ConfigError, match=r"lm converter's are \[200\]"):
        config_lib.TrainConfig(model=decoder_config(attention="splash"), sequence_length=200).validate()
    t5 = config_lib.TrainConfig(model=t5_config(attention="splash"), sequence_length={"inputs": 100, "targets": 128})
    with pytest.raises(config_lib.ConfigError, match=r"encdec converter's are \[128, 100\]"):
        t5.validate()
    config_lib.TrainConfig(model=decoder_config(attention="auto"), sequence_length=200).validate()
    cfg = config_lib.apply_overrides(config_lib.TrainConfig(model=decoder_config(remat="full")), ["model.remat=none"])
    assert cfg.model.remat == "none"
    cfg = config_lib.apply_overrides(cfg, ["checkpoint.directory=none"])
    assert cfg.checkpoint.directory is None


def test_config_refuses_splash_with_attention_dropout_and_unknown_settings():
    with pytest.raises(config_lib.ConfigError, match="no dropout on attention probabilities"):
        decoder_config(attention="splash", dropout_rate=0.1).validate()
    with pytest.raises(config_lib.ConfigError, match="model.remat must be one of"):
        decoder_config(remat="some").validate()
    with pytest.raises(config_lib.ConfigError, match="model.attention must be one of"):
        decoder_config(attention="flash").validate()


# -- whole models ----------------------------------------------------------------------


@pytest.mark.slow  # five models' gradients through the interpreted kernel (about 70 s on 2 cores); the
# prefix LM's test below keeps splash with scanned layers and remat in the default suite
def test_decoder_splash_scan_and_remat_agree_with_the_einsum_path():
    """Loss and every gradient: splash, scanned layers and both remat policies
    equal the einsum path to float32 rounding; in bfloat16 splash stays within
    bfloat16 tolerance of the einsum path in bfloat16."""
    batch = lm_batch(2)
    want = loss_and_grads(decoder_config(attention="xla"), batch)
    for changes in ({"attention": "splash"}, {"scan_layers": True, "remat": "dots", "attention": "splash"},
                    {"remat": "attention", "scan_layers": True},
                    {"remat": "full", "attention": "splash", "scan_layers": True}):
        assert_close(loss_and_grads(decoder_config(**changes), batch), want, rtol=1e-4)
    want16 = loss_and_grads(decoder_config(attention="xla", dtype="bfloat16"), batch)
    got16 = loss_and_grads(decoder_config(attention="splash", dtype="bfloat16"), batch)
    assert_close(got16, want16, rtol=5e-2)


def test_prefix_lm_splash_agrees_with_the_einsum_path():
    """The prefix LM's two kernel passes give the mask's loss and gradients."""
    batch = lm_batch(5, prefix=True)
    want = loss_and_grads(decoder_config(attention="xla"), batch)
    got = loss_and_grads(decoder_config(attention="splash", scan_layers=True, remat="full"), batch)
    assert_close(got, want, rtol=1e-4)


# Slow (about 14 s on 2 cores, the kernel interpreted on CPU): the prefix LM's splash test stays in the default suite.
@pytest.mark.slow
def test_t5_splash_cross_attention_scan_and_remat_agree_with_the_einsum_path():
    batch = encdec_batch(3)
    want = loss_and_grads(t5_config(attention="xla"), batch)
    got = loss_and_grads(t5_config(attention="splash", scan_layers=True, remat="full"), batch)
    assert_close(got, want, rtol=1e-4)


def test_chunked_loss_equals_the_whole_batch_loss():
    """``loss_chunks``: the same loss and gradients for the decoder (untied output
    layer); a batch the chunks cannot split evenly over the shards is refused."""
    batch = lm_batch(6, rows=4)
    cfg = decoder_config(tie_embeddings=False)
    assert_close(loss_and_grads(cfg, batch, loss_chunks=2), loss_and_grads(cfg, batch), rtol=1e-5)
    from seqcache.training.trainer import Trainer

    bad = config_lib.TrainConfig(model=decoder_config(), global_batch_size=6, sequence_length=128, loss_chunks=4)
    with pytest.raises(config_lib.ConfigError, match="not divisible by loss_chunks=4"):
        Trainer(bad, devices=jax.devices()[:1])


@pytest.mark.slow
def test_chunked_loss_equals_the_whole_batch_loss_for_t5():
    batch = encdec_batch(7)
    assert_close(loss_and_grads(t5_config(), batch, loss_chunks=2), loss_and_grads(t5_config(), batch), rtol=1e-5)


def test_scanned_parameters_are_the_stacked_unscanned_ones():
    """Same initial values, stacked on a leading 'layers' axis that every rules
    preset replicates."""
    flat = common.split_params(common.create(decoder_config(), 0))[1]
    scanned_model = common.create(decoder_config(scan_layers=True), 0)
    scanned = common.split_params(scanned_model)[1]
    assert sorted(scanned["blocks"]) == sorted(flat["blocks"][0])
    wq = scanned["blocks"]["attn"]["wq"]
    assert wq.shape == (2,) + flat["blocks"][0]["attn"]["wq"].shape
    for i in range(2):
        np.testing.assert_array_equal(wq[i], flat["blocks"][i]["attn"]["wq"])
    axes = common.logical_axes(scanned_model)
    assert axes["blocks"]["attn"]["wq"] == ("layers", "embed", "heads", "kv")
    assert axes["embedding"] == ("vocab", "embed")


def test_a_checkpoint_resumes_only_with_the_scan_setting_it_was_saved_with(tmp_path):
    """One line naming the setting, both values and the fix; a config.json from
    before the setting counts as unscanned."""
    path = tmp_path / "config.json"
    saved = config_lib.to_dict(config_lib.TrainConfig(model=decoder_config()))
    path.write_text(json.dumps(saved))
    scanned = config_lib.TrainConfig(model=decoder_config(scan_layers=True))
    with pytest.raises(CheckpointError) as e:
        check_structure(str(path), scanned, "runs/x")
    assert str(e.value).count("\n") == 0
    assert "model.scan_layers=false" in str(e.value) and "--set model.scan_layers=false" in str(e.value)
    check_structure(str(path), config_lib.TrainConfig(model=decoder_config(remat="full")), "runs/x")
    del saved["model"]["scan_layers"]
    path.write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="saved with model.scan_layers=false"):
        check_structure(str(path), scanned, "runs/x")


@pytest.mark.tpu
@pytest.mark.skipif(not ON_TPU, reason="needs a TPU")
def test_compiled_splash_on_the_chip_matches_the_einsum_path_in_bfloat16():
    """On the chip, L = 1024: the compiled kernel, bfloat16, against the einsum path."""
    for prefix in (False, True):
        batch = lm_batch(4, rows=4, length=1024, vocab=500, prefix=prefix)
        cfg = dict(vocab_size=500, d_model=256, num_heads=2, num_layers=2, mlp_dim=512, dtype="bfloat16")
        want = loss_and_grads(decoder_config(attention="xla", **cfg), batch)
        got = loss_and_grads(decoder_config(attention="splash", **cfg), batch)
        assert_close(got, want, rtol=5e-2)


@pytest.mark.tpu
@pytest.mark.skipif(not ON_TPU, reason="needs a TPU")
def test_compiled_t5_kernels_on_the_chip_match_the_einsum_path_in_bfloat16():
    """On the chip: T5 with attention=splash (self-attention in flash attention
    with its bias, cross-attention in splash), bfloat16, against the einsum path."""
    batch = encdec_batch(9, rows=4, inputs_length=512, length=128, vocab=500)
    cfg = dict(vocab_size=500, dtype="bfloat16")
    want = loss_and_grads(t5_config(attention="xla", **cfg), batch)
    got = loss_and_grads(t5_config(attention="splash", **cfg), batch)
    assert_close(got, want, rtol=5e-2)
