"""The optimizers (AdamW, Adafactor) and the refusal to resume a checkpoint of
another optimizer."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from seqcache.training import config as C
from seqcache.training import optimizer as O
from seqcache.training import trainer as T
from seqcache.training.checkpoints import CheckpointError
from seqcache.training.resume import check_structure
from seqcache_training_test_fakes import FEEDER_KWARGS, FakeFeeder, tiny_config_dict


# -- the optimizer of a checkpoint ---------------------------------------------------


def _write(path, config):
    path.write_text(json.dumps(C.to_dict(config)))
    return str(path)


def test_a_checkpoint_resumes_only_with_its_own_optimizer(tmp_path):
    adamw = C.TrainConfig(model=C.ModelConfig(vocab_size=100))
    path = _write(tmp_path / "config.json", adamw)
    adafactor = C.apply_overrides(adamw, ["optimizer.name=adafactor"])
    with pytest.raises(CheckpointError) as e:
        check_structure(path, adafactor, "runs/o")
    assert str(e.value) == (
        'runs/o: the checkpoint was saved with optimizer.name="adamw" and this run has optimizer.name="adafactor", '
        "whose state differs; resume with --set optimizer.name=adamw or start a new run in another checkpoint "
        "directory")
    # A config.json from before the field means AdamW.
    raw = C.to_dict(adamw)
    del raw["optimizer"]["name"]
    (tmp_path / "old.json").write_text(json.dumps(raw))
    check_structure(str(tmp_path / "old.json"), adamw, "runs/o")
    with pytest.raises(CheckpointError, match='saved with optimizer.name="adamw"'):
        check_structure(str(tmp_path / "old.json"), adafactor, "runs/o")
    path = _write(tmp_path / "af.json", adafactor)
    with pytest.raises(CheckpointError, match="optimizer.factored=true and this run has optimizer.factored=false"):
        check_structure(path, C.apply_overrides(adafactor, ["optimizer.factored=false"]), "runs/o")
    check_structure(path, C.apply_overrides(adafactor, ["optimizer.lr=0.01"]), "runs/o")


def test_an_unknown_optimizer_is_refused():
    cfg = C.apply_overrides(C.TrainConfig(model=C.ModelConfig(vocab_size=100), sequence_length=16),
                            ["optimizer.name=lion"])
    with pytest.raises(C.ConfigError, match=r"optimizer.name must be one of \('adamw', 'adafactor'\) \(got 'lion'\)"):
        cfg.validate()


# -- Adafactor ----------------------------------------------------------------------


def test_adafactor_first_step_by_hand():
    """t5x's defaults, step 0: the decay 1 - 1^-0.8 = 0 keeps g^2 alone; for a
    rank-one gradient g = a b^T the factored estimate (row means x column
    means / mean) is g^2 exactly, so the update is sign(g), of RMS 1 (the
    clipping at 1.0 leaves it), times lr times the parameter's RMS."""
    cfg = C.OptimizerConfig(name="adafactor", lr=0.1, warmup_steps=0, clip_norm=None, end_lr_ratio=1.0)
    tx, schedule = O.make_optimizer(cfg, total_steps=10)
    assert float(schedule(0)) == pytest.approx(0.1)
    rng = np.random.default_rng(0)
    a, b = rng.uniform(0.5, 2.0, 128), rng.uniform(0.5, 2.0, 256) * rng.choice([-1, 1], 256)
    grad = np.outer(a, b).astype(np.float32)
    param = rng.normal(0, 0.5, (128, 256)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, 128).astype(np.float32)  # 1-D: not factored
    params = {"w": jnp.asarray(param), "scale": jnp.asarray(scale)}
    grads = {"w": jnp.asarray(grad), "scale": jnp.asarray(np.full(128, 3.0, np.float32))}
    state = tx.init(params)
    shapes = sorted(x.shape for x in jax.tree.leaves(state) if x.ndim)
    assert (128,) in shapes and (256,) in shapes and (128, 256) not in shapes  # factored: a row and a column
    updates, _ = tx.update(grads, state, params)
    rms = float(np.sqrt(np.mean(param.astype(np.float64) ** 2)))
    np.testing.assert_allclose(np.asarray(updates["w"]), -0.1 * rms * np.sign(grad), rtol=2e-5)
    scale_rms = float(np.sqrt(np.mean(scale.astype(np.float64) ** 2)))
    np.testing.assert_allclose(np.asarray(updates["scale"]), -0.1 * scale_rms * np.ones(128), rtol=2e-5)


def test_adafactor_keeps_a_fraction_of_adamws_state():
    """Every matrix has two dimensions of at least 128 (one head of 128): all factored."""
    model = {"vocab_size": 256, "d_model": 128, "num_heads": 1, "mlp_dim": 256, "dropout_rate": 0.0}
    sizes = {}
    for name in ("adamw", "adafactor"):
        cfg = C.config_from_dict(tiny_config_dict(model=model, optimizer={"name": name}))
        trainer = T.Trainer(cfg, devices=jax.devices()[:1])
        sizes[name] = sum(x.size for x in jax.tree.leaves(trainer.abstract_opt_state))
    params = T.Trainer(cfg, devices=jax.devices()[:1]).num_params
    assert sizes["adamw"] == 2 * params + 2  # two moments, the update count and the schedule's
    assert sizes["adafactor"] < params / 20


def test_adafactor_trains_on_8_devices_like_on_one():
    """fsdp over 8 devices: the moments that have their parameter's shape get its
    sharding, the factored ones are replicated; the losses are those of one
    device."""
    model = {"vocab_size": 256, "d_model": 128, "num_heads": 2, "mlp_dim": 256}
    raw = tiny_config_dict(model=model, optimizer={"name": "adafactor", "lr": 1e-2}, steps=3)
    losses = {}
    for devices, mesh, rules in ((1, {"data": 1, "fsdp": 1}, "dp"), (8, {"data": 1, "fsdp": 8}, "fsdp")):
        cfg = C.config_from_dict({**raw, "mesh": {**mesh, "model": 1}, "rules": rules})
        trainer = T.Trainer(cfg, devices=jax.devices()[:devices])
        result = trainer.fit(FakeFeeder(**FEEDER_KWARGS))
        losses[devices] = result.losses
        if devices == 8:
            sharded = [s for s in jax.tree.leaves(trainer.opt_shardings) if not s.is_fully_replicated]
            assert sharded, "the unfactored moments of fsdp-sharded parameters are sharded"
    assert losses[1][-1] < losses[1][0]
    np.testing.assert_allclose(losses[8], losses[1], rtol=1e-5)


def test_adamw_stays_the_default_with_the_updates_of_before():
    """The default optimizer is AdamW, and its updates are exactly those of the
    chain built before Adafactor existed (clip, then AdamW with the schedule,
    decay on matrices only): existing runs resume bit for bit."""
    cfg = C.OptimizerConfig()
    assert cfg.name == "adamw"
    tx, schedule = O.make_optimizer(cfg, total_steps=20)
    matrices = lambda tree: jax.tree.map(lambda x: x.ndim > 1, tree)  # noqa: E731
    before = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                         optax.adamw(learning_rate=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                                     weight_decay=cfg.weight_decay, mask=matrices))
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32), "s": jnp.asarray(rng.normal(size=4), jnp.float32)}
    state, state_before = tx.init(params), before.init(params)
    for _ in range(12):  # past the warmup of 10 steps
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
        updates, state = tx.update(grads, state, params)
        expected, state_before = before.update(grads, state_before, params)
        for key in params:
            np.testing.assert_array_equal(np.asarray(updates[key]), np.asarray(expected[key]))
        params = optax.apply_updates(params, updates)
