"""Every rules preset on 8 CPU devices trains like one device.

Tolerance: the sharded programs compute the same sums in another order (partial
sums per shard, then all-reduce), so float32 results differ by rounding only:
relative ~1e-7 per reduction, growing to ~1e-6 through a few Adam steps. We allow
rtol 1e-5 on losses and 1e-4 (atol 1e-6) on parameters after the last step; a
sharding bug (a dropped shard, a wrong all-reduce) changes the loss in the
second or third digit.

Dropout is on and gradients are accumulated over 2 microbatches (the tests'
common config), so the dropout masks and the accumulation must not depend on
the sharding either.

The fsdp+tp case runs the whole ``fit`` (sharded initialisation included). The
other presets start from the reference initialisation, resharded, and run the
compiled train step directly: one sharded initialisation is enough to show it
does not depend on the mesh, and each one costs seconds of compilation.

The T5 encoder-decoder runs every preset too, each from its own sharded
initialisation (compared bit for bit with the 1-device one), with the same
tolerances. The default suite runs its fsdp+tp preset without dropout and
accumulation (T5's parameter and activation layouts; a program that compiles in
half the time); the dropout masks and the accumulation use the same code for
both models, and the decoder's fsdp+tp fit shows in the default suite that they
do not depend on the sharding. The slow tests run every T5 preset with both on.
"""

import jax
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import trainer as T
from seqcache_training_test_fakes import FEEDER_KWARGS, FakeEncDecFeeder, FakeFeeder, t5_config_dict, tiny_config_dict

STEPS = 3  # of a 6-step schedule (the tests' common config)
FEEDER = FEEDER_KWARGS


def _trainer(rules, mesh, devices, config_dict=tiny_config_dict, **extra):
    cfg = C.config_from_dict(config_dict(rules=rules, mesh=mesh, **extra))
    return T.Trainer(cfg, devices=jax.devices()[:devices])


def _one_device_run(config_dict, feeder_cls):
    """(initial state, result of STEPS steps) on one device: what every preset matches."""
    trainer = _trainer("dp", {"data": 1, "fsdp": 1, "model": 1}, 1, config_dict)
    init = jax.device_get(trainer.init_state())
    return init, trainer.fit(feeder_cls(**FEEDER), stop_at=STEPS)


@pytest.fixture(scope="module")
def reference():
    return _one_device_run(tiny_config_dict, FakeFeeder)


def _steps(trainer, params, opt_state, feeder):
    """(params, opt_state, losses) after STEPS compiled train steps on ``feeder``."""
    compiled = trainer.compile()
    losses = []
    for step in range(STEPS):
        batch = trainer.global_batch(next(feeder))
        step_arr = jax.device_put(np.int32(step), trainer.replicated)
        params, opt_state, metrics = compiled(params, opt_state, step_arr, batch)
        losses.append(float(metrics["loss"]))
    return params, opt_state, losses


def _shard_shape(rules, mesh, shape) -> list:
    """One device's shard of an attention projection of ``shape``: its rows over
    'fsdp' under fsdp, its columns over 'model' under tp."""
    expect = list(shape)
    if "fsdp" in rules:
        expect[0] //= mesh["fsdp"]
    if "tp" in rules:
        expect[1] //= mesh["model"]
    return expect


def _check_layout(rules, mesh, params, opt_state):
    wq = params["blocks"][0]["attn"]["wq"]
    assert list(wq.addressable_shards[0].data.shape) == _shard_shape(rules, mesh, wq.shape)
    # Optimizer moments are sharded like their parameters (ZeRO-3 under fsdp).
    assert opt_state[1][0].mu["blocks"][0]["attn"]["wq"].sharding == wq.sharding


def _compare(losses, params, reference):
    _, ref = reference
    np.testing.assert_allclose(losses, ref.losses, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "rules, mesh, extra",
    [
        # The slow tests: the default suite keeps the fsdp+tp fit below (fsdp and model axes
        # together, layouts and losses against one device) and the T5 fsdp+tp preset.
        pytest.param("dp", {"data": 8, "fsdp": 1, "model": 1}, {}, marks=pytest.mark.slow),
        pytest.param("fsdp", {"data": 2, "fsdp": 4, "model": 1}, {}, marks=pytest.mark.slow),
        pytest.param("tp", {"data": 2, "fsdp": 1, "model": 4}, {}, marks=pytest.mark.slow),
    ],
    ids=["dp", "fsdp", "tp"],
)
def test_preset_step_on_8_devices_matches_one_device(reference, rules, mesh, extra):
    trainer = _trainer(rules, mesh, 8, **extra)
    assert trainer.mesh.size == 8
    init_params, init_opt = reference[0]
    params = jax.device_put(init_params, trainer.param_shardings)
    opt_state = jax.device_put(init_opt, trainer.opt_shardings)
    params, opt_state, losses = _steps(trainer, params, opt_state, FakeFeeder(**FEEDER))
    _check_layout(rules, mesh, params, opt_state)
    _compare(losses, params, reference)


def test_fsdp_tp_fit_on_8_devices_matches_one_device(reference):
    mesh = {"data": 1, "fsdp": 2, "model": 4}
    trainer = _trainer("fsdp+tp", mesh, 8)
    init_params, _ = trainer.init_state()
    # Sharded initialisation gives the same values as the 1-device one.
    for a, b in zip(jax.tree.leaves(init_params), jax.tree.leaves(reference[0][0])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    result = trainer.fit(FakeFeeder(**FEEDER), stop_at=STEPS)
    _check_layout("fsdp+tp", mesh, result.params, result.opt_state)
    _compare(result.losses, result.params, reference)


PRESETS = {
    "dp": {"data": 8, "fsdp": 1, "model": 1},
    "fsdp": {"data": 2, "fsdp": 4, "model": 1},
    "tp": {"data": 2, "fsdp": 1, "model": 4},
    "fsdp+tp": {"data": 1, "fsdp": 2, "model": 4},
}


def t5_lean_config_dict(**overrides) -> dict:
    """``t5_config_dict`` without dropout and with one microbatch."""
    return t5_config_dict(num_microbatches=1, model={"dropout_rate": 0.0}, **overrides)


T5_CONFIGS = {"common": t5_config_dict, "lean": t5_lean_config_dict}


@pytest.fixture(scope="module")
def t5_references():
    """config name -> the 1-device reference of that T5 config, computed when first asked for."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _one_device_run(T5_CONFIGS[name], FakeEncDecFeeder)
        return cache[name]

    return get


# fsdp+tp (both sharded axes) without dropout and accumulation in the default suite
# (the decoder's fsdp+tp fit covers those), every preset with both on in the slow tests.
@pytest.mark.parametrize("rules, config", [("fsdp+tp", "lean")] + [
    pytest.param(r, "common", marks=pytest.mark.slow) for r in sorted(PRESETS)])
def test_t5_preset_on_8_devices_matches_one_device(t5_references, rules, config):
    t5_reference = t5_references(config)
    mesh = PRESETS[rules]
    trainer = _trainer(rules, mesh, 8, T5_CONFIGS[config])
    params, opt_state = trainer.init_state()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(t5_reference[0][0])):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    params, opt_state, losses = _steps(trainer, params, opt_state, FakeEncDecFeeder(**FEEDER))
    wq = params["decoder_layers"][0]["cross_attn"]["wq"]
    assert list(wq.addressable_shards[0].data.shape) == _shard_shape(rules, mesh, wq.shape)
    bias = params["encoder_bias"]["embedding"]  # (buckets, heads): heads over 'model' under tp
    assert bias.addressable_shards[0].data.shape == (32, 4 // mesh["model"] if "tp" in rules else 4)
    assert opt_state[1][0].mu["decoder_layers"][0]["cross_attn"]["wq"].sharding == wq.sharding
    _compare(losses, params, t5_reference)
