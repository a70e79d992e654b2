"""The presets measured on the chip (``base``'s heads of 128, the run settings
``large`` brings) and the refusal of a checkpoint of another shape."""

import dataclasses
import json

import jax
import pytest

from seqcache.training import config as C
from seqcache.training.models import common
from seqcache.training.checkpoints import CheckpointError
from seqcache.training.resume import check_structure


# -- presets ------------------------------------------------------------------------


def test_base_has_six_heads_of_128():
    base = C.model_preset("base")
    assert (base.d_model, base.num_layers, base.num_heads, base.resolved_head_dim, base.mlp_dim) == (768, 12, 6, 128,
                                                                                                     2048)
    assert (base.remat, base.scan_layers) == ("none", False)


def test_large_brings_remat_dots_and_four_microbatches_unrolled():
    large = C.config_from_layers(preset="large")
    assert (large.model.remat, large.model.scan_layers, large.num_microbatches) == ("dots", False, 4)
    # A flag or override still replaces what the preset brings.
    assert C.config_from_layers(preset="large", overrides=["num_microbatches=2"]).num_microbatches == 2
    # Other presets keep one microbatch.
    assert C.config_from_layers(preset="base").num_microbatches == 1
    assert C.config_from_layers(preset="tiny").num_microbatches == 1


def test_a_batch_the_microbatches_do_not_divide_names_a_divisor():
    cfg = C.apply_overrides(C.config_from_layers(preset="large"),
                            ["model.vocab_size=100", "sequence_length=128", "global_batch_size=6"])
    with pytest.raises(C.ConfigError, match="global_batch_size=6 is not divisible by num_microbatches=4; .*"
                                            "--set num_microbatches=2"):
        cfg.validate()


# -- the structure of a checkpoint ------------------------------------------------


def _write(path, config):
    path.write_text(json.dumps(C.to_dict(config)))
    return str(path)


def _refusal(path, saved, now, run: str) -> str:
    """The one line ``check_structure`` refuses ``now`` with, a checkpoint of ``saved``'s config at ``path``."""
    _write(path, saved)
    with pytest.raises(CheckpointError) as e:
        check_structure(str(path), now, run)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_checkpoint_of_the_earlier_base_is_refused_in_one_line(tmp_path):
    earlier = C.TrainConfig(model=dataclasses.replace(C.model_preset("base"), num_heads=12, vocab_size=16000))
    now = C.TrainConfig(model=dataclasses.replace(C.model_preset("base"), vocab_size=16000))
    path = tmp_path / "config.json"
    message = _refusal(path, earlier, now, "runs/b")
    assert message.startswith("runs/b: the checkpoint's parameters have other shapes than this run's model (saved "
                              "-> now: model.num_heads 12 -> 6, model.head_dim 64 -> 128) (the preset 'base' has 6 "
                              "heads of 128, no longer 12 of 64); ")
    assert "--set 'model.num_heads=12 model.head_dim=64'" in message
    # The fix works: the earlier shape resumes.
    check_structure(str(path), C.apply_overrides(now, ["model.num_heads=12", "model.head_dim=64"]), "runs/b")


@pytest.mark.parametrize("preset", ["large", "1b"])
def test_a_checkpoint_of_the_earlier_scanned_preset_is_refused_in_one_line_naming_the_change(tmp_path, preset):
    now = C.apply_overrides(C.config_from_layers(preset=preset), ["model.vocab_size=16000"])
    earlier = C.apply_overrides(now, ["model.scan_layers=true"])
    message = _refusal(tmp_path / "config.json", earlier, now, "runs/l")
    assert message.startswith("runs/l: the checkpoint was saved with model.scan_layers=true and this run has "
                              "model.scan_layers=false")
    assert f"(the preset '{preset}' no longer scans its layers: unrolled, it runs faster)" in message
    assert message.endswith("resume with --set model.scan_layers=true")
    check_structure(str(tmp_path / "config.json"), earlier, "runs/l")  # the fix works
    # A model of another shape, scanned then unrolled: no word of the presets.
    other = C.apply_overrides(now, ["model.mlp_dim=1024"])
    assert "preset" not in _refusal(tmp_path / "other.json", C.apply_overrides(other, ["model.scan_layers=true"]),
                                    other, "runs/l")


def test_other_shapes_are_refused_and_remat_is_not(tmp_path):
    saved = C.TrainConfig(model=C.ModelConfig(vocab_size=100))
    path = _write(tmp_path / "config.json", saved)
    with pytest.raises(CheckpointError, match=r"model.mlp_dim 256 -> 512\)"):
        check_structure(path, C.apply_overrides(saved, ["model.mlp_dim=512"]), "runs/x")
    with pytest.raises(CheckpointError, match=r"model.vocab_size 100 -> 101\)"):
        check_structure(path, C.apply_overrides(saved, ["model.vocab_size=101"]), "runs/x")
    # head_dim given explicitly as the value it resolved to: the same shapes.
    check_structure(path, C.apply_overrides(saved, ["model.head_dim=16"]), "runs/x")
    check_structure(path, C.apply_overrides(saved, ["model.remat=full", "num_microbatches=2"]), "runs/x")


def test_1b_has_about_a_billion_parameters_and_brings_adafactor():
    cfg = C.config_from_layers(preset="1b")
    model = dataclasses.replace(cfg.model, vocab_size=16000)
    assert (model.d_model, model.num_layers, model.num_heads, model.resolved_head_dim, model.mlp_dim) == (
        2048, 18, 16, 128, 5632)
    assert (model.remat, model.scan_layers, cfg.num_microbatches) == ("dots", False, 8)
    assert (cfg.optimizer.name, cfg.optimizer.lr) == ("adafactor", 1e-2)
    _, params = common.split_params(common.abstract_model(model))
    assert sum(x.size for x in jax.tree.leaves(params)) == 957_687_808
    # --set replaces what the preset brings.
    cfg = C.config_from_layers(preset="1b", overrides=["optimizer.name=adamw", "num_microbatches=4"])
    assert (cfg.optimizer.name, cfg.num_microbatches, cfg.optimizer.lr) == ("adamw", 4, 1e-2)
