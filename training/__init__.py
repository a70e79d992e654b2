"""seqcache.training: a small JAX/Flax/Optax trainer on top of the feeder.

    from seqcache.training import TrainConfig, ModelConfig, Trainer

    trainer = Trainer(TrainConfig(model=ModelConfig(vocab_size=259), steps=1000))
    result = trainer.fit(feeder)          # any seqcache.feeders.Feeder

See docs/training.md for the modules. Names below are imported on first use,
so that ``seqcache.training.config`` can be read without importing JAX.
"""

import importlib

_EXPORTS = {
    "TrainConfig": "config",
    "ModelConfig": "config",
    "OptimizerConfig": "config",
    "MeshConfig": "config",
    "CheckpointConfig": "config",
    "DataConfig": "config",
    "ConfigError": "config",
    "MODEL_PRESETS": "config",
    "Transformer": "model",
    "T5": "models.t5",
    "RULES": "partitioning",
    "PartitioningError": "partitioning",
    "Checkpointer": "checkpoints",
    "CheckpointError": "checkpoints",
    "Trainer": "trainer",
    "TrainResult": "trainer",
    "train": "trainer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f"seqcache.training.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'seqcache.training' has no attribute {name!r}")
