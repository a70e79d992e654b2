"""Loss and gradients: the weighted loss against a float64 reference, and
gradient accumulation over microbatches against the full batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import model as M
from seqcache.training import step as S
from seqcache_training_test_fakes import FakeFeeder

CFG = C.ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=4, mlp_dim=64)


@pytest.fixture(scope="module")
def setup():
    graphdef, params = M.split_params(M.create(CFG, seed=3))
    feeder = FakeFeeder(global_batch_size=8, sequence_length=16, seed=1)
    batch = {k: jnp.asarray(v) for k, v in feeder.get_batch(0).items()}
    # Make two rows all padding and one row's second half zero-weighted, so the
    # microbatches carry different total weights.
    for key in ("targets_loss_weights", "targets_segment_ids"):
        batch[key] = batch[key].at[1].set(0).at[6].set(0)
    batch["targets_loss_weights"] = batch["targets_loss_weights"].at[3, 8:].set(0.0)
    return graphdef, params, batch


def test_loss_matches_float64_reference(setup):
    graphdef, params, batch = setup

    def run(p, b):
        inputs = M.shift_right_by_segment(b["targets"], b["targets_segment_ids"])
        logits = M.apply(graphdef, p, inputs, b["targets_segment_ids"], b["targets_positions"])
        return S.loss_sums(graphdef, p, b, None), logits

    sums, logits = jax.jit(run)(params, batch)
    logits = np.asarray(logits, np.float64)
    targets = np.asarray(batch["targets"])
    weights = np.asarray(batch["targets_loss_weights"], np.float64)
    log_z = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    ce = log_z - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    assert float(sums["weight_sum"]) == weights.sum()
    np.testing.assert_allclose(float(sums["loss_sum"]), (ce * weights).sum(), rtol=1e-5)
    correct = (logits.argmax(-1) == targets) * weights
    assert float(sums["correct_sum"]) == correct.sum()


def test_microbatched_gradients_equal_full_batch(setup):
    graphdef, params, batch = setup
    key = jax.random.key(0)

    def both(p, b):
        micro = S.split_microbatches(b, 4)
        per_micro = jax.lax.map(lambda mb: S.loss_sums(graphdef, p, mb, None), micro)
        return S.mean_grads(graphdef, p, b, key, 1), S.mean_grads(graphdef, p, b, key, 4), per_micro

    (loss_full, g_full, sums_full), (loss_micro, g_micro, sums_micro), per_micro = jax.jit(both)(params, batch)
    assert float(sums_micro["weight_sum"]) == float(sums_full["weight_sum"])
    # Same sums in another order: float32 rounding of sums over a few hundred
    # tokens, relative ~1e-6; the tolerances leave headroom, while a wrong
    # normalisation is off by far more (negative control below).
    np.testing.assert_allclose(float(loss_micro), float(loss_full), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_micro), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    # Negative control: the microbatches carry unequal weights (padding rows), so
    # the naive mean of per-microbatch mean losses differs from the true loss.
    naive = np.mean(np.asarray(per_micro["loss_sum"]) / np.asarray(per_micro["weight_sum"]))
    assert abs(naive - float(loss_full)) > 1e-3


def test_split_microbatches_interleaves_rows():
    batch = {"targets": jnp.arange(8)[:, None] * jnp.ones((1, 3), jnp.int32)}
    micro = S.split_microbatches(batch, 4)["targets"]
    assert micro.shape == (4, 2, 3)
    np.testing.assert_array_equal(np.asarray(micro[:, :, 0]), [[0, 4], [1, 5], [2, 6], [3, 7]])
