"""config_from_layers: defaults < model preset < config file < flags < dotted
overrides, then both seeds explicit."""

import json

import pytest

from seqcache.training import config as C
from seqcache.training import partitioning


def _config_file(tmp_path, raw) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_no_layers_is_the_defaults_with_explicit_seeds():
    cfg = C.config_from_layers()
    assert cfg == C.resolve_seeds(C.TrainConfig())
    assert (cfg.seed, cfg.data.seed) == (0, C.DEFAULT_DATA_SEED)


def test_each_layer_overrides_the_one_before(tmp_path):
    path = _config_file(tmp_path, {"model": {"num_layers": 3, "mlp_dim": 100}, "steps": 7, "global_batch_size": 4,
                                   "data": {"split": "file_split", "task": "file_task"}})
    flags = C.CommandLineFlags(global_batch_size=16, sequence_length=32, task="flag_task")
    cfg = C.config_from_layers(preset="small", config_file=path, flags=flags,
                               overrides=["sequence_length=48", "data.task=set_task"])
    small = C.MODEL_PRESETS["small"]
    assert cfg.model.d_model == small.d_model == 256  # the preset, over the default 64
    assert (cfg.model.num_layers, cfg.model.mlp_dim) == (3, 100)  # the file, over the preset
    assert cfg.steps == 7  # the file, no flag
    assert cfg.global_batch_size == 16  # the flag, over the file
    assert cfg.data.split == "file_split"  # a flag left None keeps the file's
    assert cfg.sequence_length == {"targets": 48} and cfg.data.task == "set_task"  # --set, over the flags
    assert cfg.rules == "dp" and cfg.mesh == C.MeshConfig()  # untouched defaults


def test_flags_set_their_fields():
    flags = C.CommandLineFlags(cache_dir="caches", task="t", split="s", eval_split="e", steps=3,
                               global_batch_size=2, sequence_length=5, rules="fsdp", seed=9, tensorboard=False,
                               mesh="data=2,fsdp=4", checkpoint_dir="ckpt")
    cfg = C.config_from_layers(flags=flags)
    assert (cfg.data.cache_dir, cfg.data.task, cfg.data.split, cfg.data.eval_split) == ("caches", "t", "s", "e")
    assert (cfg.steps, cfg.global_batch_size, cfg.sequence_length) == (3, 2, {"targets": 5})
    assert (cfg.rules, cfg.seed, cfg.tensorboard) == ("fsdp", 9, False)
    assert cfg.mesh == C.MeshConfig(data=2, fsdp=4, model=1)
    # --checkpoint-dir sets the folder only; the other checkpoint fields stay.
    assert cfg.checkpoint == C.CheckpointConfig(directory="ckpt")
    # The init seed never sets the feeder's.
    assert cfg.data.seed == C.DEFAULT_DATA_SEED


def test_checkpoint_dir_flag_keeps_the_files_other_checkpoint_fields(tmp_path):
    path = _config_file(tmp_path, {"checkpoint": {"every_steps": 5, "directory": "from_file"}})
    cfg = C.config_from_layers(config_file=path, flags=C.CommandLineFlags(checkpoint_dir="from_flag"))
    assert (cfg.checkpoint.directory, cfg.checkpoint.every_steps) == ("from_flag", 5)
    kept = C.config_from_layers(config_file=path, flags=C.CommandLineFlags())
    assert kept.checkpoint.directory == "from_file"


def test_empty_mesh_flag_leaves_the_mesh(tmp_path):
    path = _config_file(tmp_path, {"mesh": {"data": 1, "fsdp": 8}})
    cfg = C.config_from_layers(config_file=path, flags=C.CommandLineFlags(mesh=""))
    assert cfg.mesh == C.MeshConfig(data=1, fsdp=8, model=1)


def test_errors_of_each_layer(tmp_path):
    with pytest.raises(C.ConfigError, match="unknown model preset 'huge'"):
        C.config_from_layers(preset="huge")
    with pytest.raises(C.ConfigError, match=r"run\.json.*unknown field.*widht"):
        C.config_from_layers(config_file=_config_file(tmp_path, {"model": {"widht": 3}}))
    with pytest.raises(partitioning.PartitioningError, match="unknown axis 'dta'"):
        C.config_from_layers(flags=C.CommandLineFlags(mesh="dta=2"))
    with pytest.raises(C.ConfigError, match="no field 'd_modle'"):
        C.config_from_layers(overrides=["model.d_modle=3"])
    with pytest.raises(C.ConfigError, match=r"data\.seed must be in \[0, 2\*\*32\) \(got -1\)"):
        C.config_from_layers(overrides=["data.seed=-1"])
