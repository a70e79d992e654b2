"""A torchtitan config module that trains llama3's debug model on a seqcache cache.

    python -m torchtitan.train --module seqcache_torchtitan --config llama3_seqcache \
        --dataloader.cache CACHE_DIR/shakespeare_lm/train --dump_folder OUT

(this folder on PYTHONPATH; RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, as torchrun sets them). The data loader is
``seqcache.feeders.trainers.torch.TorchtitanDataLoader``: torchtitan builds it with its
data-parallel rank and degree, and its checkpoint (DCP) saves the loader's
state, the Feeder's global position, under "dataloader".

On a machine without CUDA the module applies three shims at import, before
torchtitan builds anything: the cpu device (torchtitan picks "cuda" when no
accelerator is found), attention by ``F.scaled_dot_product_attention`` instead
of FlexAttention (which needs torch.compile on CPU), and a no-op
``torch.distributed.set_timeout`` (gloo's process groups cannot change their
timeout). With CUDA none is applied.
"""

from __future__ import annotations

import os
import types

import torch

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import DebugConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

from seqcache.feeders.trainers.torch import TorchtitanDataLoader

GLOBAL_BATCH = 8  # B rows per step, over all data-parallel ranks
LOCAL_BATCH = 4  # rows per microbatch: B / (R * 4) microbatches per step on R ranks
SEQUENCE_LENGTH = 64  # the packed cache's sequence length


class CacheTokenIds(BaseTokenizer):
    """The tokenizer slot of a run whose data are token ids already (the cache's
    vocabulary made them): torchtitan builds a tokenizer for its own loaders;
    this one only states the vocabulary size."""

    from dataclasses import dataclass as _dataclass

    @_dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 1000

    def __init__(self, config: Config, **unused):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("this run reads token ids from a seqcache cache; it encodes no text")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("decode the cache's token ids with its vocabulary (seqcache show)")

    def get_vocab_size(self) -> int:
        return self.vocab_size


def _cpu_device_module() -> types.SimpleNamespace:
    """What torchtitan calls on its ``device_module`` (torch.cuda's API), for the cpu."""

    class _Props:
        total_memory = 1 << 40
        name = "cpu"

    return types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        synchronize=lambda *a: None, is_available=lambda: True, get_device_name=lambda *a: "cpu",
        get_device_properties=lambda *a: _Props(), memory_stats=lambda *a: {},
        reset_peak_memory_stats=lambda *a: None, empty_cache=lambda: None,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
    )


def apply_cpu_shims() -> None:
    """Points torchtitan at the cpu device and makes set_timeout a no-op, in
    every torchtitan module that copied ``device_type``/``device_module`` at import."""
    import importlib

    cpu = _cpu_device_module()
    for name in ("torchtitan.tools.utils", "torchtitan.components.metrics", "torchtitan.distributed.utils",
                 "torchtitan.distributed.parallel_dims", "torchtitan.tools.profiler",
                 "torchtitan.models.common.token_dispatcher"):
        module = importlib.import_module(name)
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = cpu
    torch.distributed.set_timeout = lambda timeout, group=None: None


ON_CPU = not torch.cuda.is_available()
if ON_CPU:
    apply_cpu_shims()


def _debug_model_spec():
    """llama3's "debugmodel" (dim 256, vocab 2048 >= the cache's 1000), 2 layers;
    scaled-dot-product attention on CPU."""
    spec = model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:2]
    if ON_CPU:
        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    return spec


def llama3_seqcache() -> Trainer.Config:
    """llama3 debug model, 6 steps of B=8 rows of 64 tokens from a seqcache cache,
    2 microbatches of 4 rows per step on 1 rank, a DCP checkpoint every 3 steps."""
    spec = _debug_model_spec()
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path="",
        dump_folder=os.environ.get("SEQCACHE_TORCHTITAN_DUMP", "./outputs"),
        tokenizer=CacheTokenIds.Config(vocab_size=1000),
        loss=CrossEntropyLoss.Config(global_vocab_size=2048),
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                                  min_lr_factor=0.0),
        training=TrainingConfig(local_batch_size=LOCAL_BATCH, global_batch_size=GLOBAL_BATCH,
                                seq_len=SEQUENCE_LENGTH, steps=6, disable_cuda_graphs=True),
        dataloader=TorchtitanDataLoader.Config(cache="", global_batch_size=GLOBAL_BATCH, seed=0),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(),
        checkpoint=CheckpointManager.Config(enable=True, interval=3, last_save_model_only=False),
        activation_checkpoint=SelectiveAC.Config(),
        debug=DebugConfig(seed=0, deterministic=True),
    )
