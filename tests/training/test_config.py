"""TrainConfig: presets, JSON round trip, dotted overrides and their errors."""

import dataclasses
import json
import re

import pytest

from seqcache.training import config as C


def test_json_round_trip_is_identity(tmp_path):
    cfg = C.apply_overrides(C.TrainConfig(), ["model.vocab_size=100", "optimizer.clip_norm=none", "rules=fsdp"])
    path = tmp_path / "c.json"
    path.write_text(C.to_json(cfg))
    assert C.load_config_file(str(path)) == cfg
    assert json.loads(path.read_text())["model"]["vocab_size"] == 100


def test_overrides_parse_and_check_types():
    cfg = C.apply_overrides(
        C.TrainConfig(),
        ["model.d_model=128", "optimizer.lr=1e-3", "model.tie_embeddings=false", "data.task=c4", "data.mixture={\"a\": 1}"],
    )
    assert cfg.model.d_model == 128 and isinstance(cfg.model.d_model, int)
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.model.tie_embeddings is False
    assert cfg.data.task == "c4"
    assert cfg.data.mixture == {"a": 1}
    # a string field keeps a value that would parse as a number
    assert C.apply_overrides(cfg, ["data.split=2019"]).data.split == "2019"


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.d_modle=3", "no field 'd_modle'"),
        ("model.d_model=abc", "model.d_model: expected `int` (got 'abc')"),
        ("model.d_model", "key=value"),
        ("model=3", "is a group"),
        ("steps.x=1", "not a group"),
        ("model.tie_embeddings=3", "model.tie_embeddings: expected `bool` (got 3)"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(C.ConfigError, match=re.escape(message)):
        C.apply_overrides(C.TrainConfig(), [override])


def test_config_file_with_unknown_field_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": {"widht": 3}}))
    with pytest.raises(C.ConfigError, match=r"bad\.json.*unknown field.*widht"):
        C.load_config_file(str(path))


def test_presets_and_validation():
    assert C.model_preset("tiny") == C.ModelConfig(d_model=64, num_layers=2, num_heads=4, mlp_dim=256)
    with pytest.raises(C.ConfigError, match="presets"):
        C.model_preset("huge")
    with pytest.raises(C.ConfigError, match="vocab_size is not set"):
        C.TrainConfig().validate()
    cfg = C.apply_overrides(C.TrainConfig(), ["model.vocab_size=10", "global_batch_size=6", "num_microbatches=4"])
    with pytest.raises(C.ConfigError, match="global_batch_size=6 is not divisible by num_microbatches=4"):
        cfg.validate()
    with pytest.raises(C.ConfigError, match="head_dim must be even"):
        C.ModelConfig(vocab_size=8, d_model=12, num_heads=4).validate()
    assert C.TrainConfig(global_batch_size=4, sequence_length=32).tokens_per_step == 128
    # Unset, the sequence length is the cache's, which seqcache train fills in; in Python it is given.
    unset = C.apply_overrides(C.TrainConfig(), ["model.vocab_size=10"])
    with pytest.raises(C.ConfigError, match="sequence_length is not set"):
        unset.validate()
    dataclasses.replace(unset, sequence_length=16).validate()


def test_the_sequence_length_flag_sets_the_one_field():
    flags = C.CommandLineFlags(sequence_length={"inputs": 512, "targets": 114})
    cfg = C.apply_flags(C.TrainConfig(data=C.DataConfig(converter="prefix_lm")), flags)
    assert cfg.sequence_length == {"inputs": 512, "targets": 114}
    assert C.apply_flags(C.TrainConfig(), C.CommandLineFlags(sequence_length=64)).sequence_length == {"targets": 64}
    # A bare N ("*", as --sequence-length gives it) is every feature the converter reads, FEATURE=N over it.
    t5 = C.TrainConfig(model=C.MODEL_PRESETS["t5-tiny"])
    assert C.apply_flags(t5, C.CommandLineFlags(sequence_length={"*": 64})).sequence_length == \
        {"inputs": 64, "targets": 64}
    assert C.apply_flags(t5, C.CommandLineFlags(sequence_length={"*": 64, "inputs": 32})).sequence_length == \
        {"inputs": 32, "targets": 64}
    with pytest.raises(C.ConfigError, match=r"not \['labels'\]"):
        C.apply_flags(C.TrainConfig(), C.CommandLineFlags(sequence_length={"labels": 8}))


def test_a_config_json_of_an_earlier_release_loads_into_the_one_field(tmp_path):
    """config.json files written before the sequence length became one mapping
    hold two ints, the targets' and ``inputs_sequence_length``: a resumed run
    reads them as {"inputs": Li, "targets": L}; so does --set."""
    t5 = C.to_dict(C.MODEL_PRESETS["t5-tiny"])
    old = {"model": t5, "data": {"converter": "encdec"}, "sequence_length": 114, "inputs_sequence_length": 512}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(old))
    cfg = C.load_config_file(str(path))
    assert cfg.sequence_length == {"inputs": 512, "targets": 114}
    assert C.config_from_dict(C.to_dict(cfg)).sequence_length == cfg.sequence_length  # config.json of today
    assert json.loads(C.to_json(cfg))["sequence_length"] == {"inputs": 512, "targets": 114}
    assert "inputs_sequence_length" not in C.to_dict(cfg)
    lm = {"sequence_length": 256, "inputs_sequence_length": None, "data": {"converter": "lm"}}
    assert C.config_from_dict(lm).sequence_length == {"targets": 256}
    # --set, the old field over the new one (and over the layers below).
    cfg = C.apply_overrides(C.TrainConfig(model=C.MODEL_PRESETS["t5-tiny"]),
                            ["sequence_length=64", "inputs_sequence_length=32"])
    assert cfg.sequence_length == {"inputs": 32, "targets": 64}
    cfg = C.apply_overrides(cfg, ['sequence_length={"targets": 16}'])
    assert cfg.sequence_length == {"inputs": 32, "targets": 16}


@pytest.mark.parametrize("override, message", [
    ("model.d_model=0", "model.d_model: expected `int` >= 1 (got 0)"),
    ("model.dropout_rate=1.0", "model.dropout_rate: expected `float` < 1.0 (got 1.0)"),
    ("checkpoint.every_steps=0", "checkpoint.every_steps: expected `int` >= 1 (got 0)"),
    ("optimizer.warmup_steps=-1", "optimizer.warmup_steps: expected `int` >= 0 (got -1)"),
    ("seed=4294967296", "seed: expected `int` <= 4294967295 (got 4294967296)"),
    # A sign or a range that would train another way without a word (clip_norm < 0: gradient ascent).
    ("optimizer.clip_norm=-1", "optimizer.clip_norm: expected `float` > 0.0 (got -1.0)"),
    ("optimizer.lr=-0.001", "optimizer.lr: expected `float` >= 0.0 (got -0.001)"),
    ("optimizer.b2=1", "optimizer.b2: expected `float` < 1.0 (got 1.0)"),
    ("optimizer.end_lr_ratio=5", "optimizer.end_lr_ratio: expected `float` <= 1.0 (got 5.0)"),
    ("optimizer.decay_steps=0", "optimizer.decay_steps: expected `int` >= 1 (got 0)"),
    ("model.norm_eps=0", "model.norm_eps: expected `float` > 0.0 (got 0.0)"),
    ("eval_every=-1", "eval_every: expected `int` >= 0 (got -1)"),
])
def test_validate_names_a_field_out_of_its_bounds(override, message):
    # Read as given (a later layer may still replace it), refused by validate.
    cfg = C.apply_overrides(C.TrainConfig(), ["model.vocab_size=10", "sequence_length=16", override])
    with pytest.raises(C.ConfigError, match="^" + re.escape(message) + "$"):
        cfg.validate()


def test_a_config_file_value_out_of_bounds_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"steps": 0, "optimizer": {"lr": 0.01}}')
    with pytest.raises(C.ConfigError, match="^" + re.escape(f"{path}: steps: expected `int` >= 1 (got 0)") + "$"):
        C.load_config_file(str(path))
    path.write_text('{"model": {"dropout_rate": 1.0}}')
    with pytest.raises(C.ConfigError, match=re.escape(f"{path}: model.dropout_rate: expected `float` < 1.0")):
        C.config_from_layers(config_file=str(path), overrides=["model.dropout_rate=0.1"])
