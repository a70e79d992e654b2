"""Optax AdamW with linear warmup, cosine decay and global-norm clipping."""

from __future__ import annotations

import jax
import optax

from seqcache.training.config import OptimizerConfig


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Learning rate as a function of the step (the number of updates already applied).

    Linear from 0 to ``cfg.lr`` over ``cfg.warmup_steps``, then a cosine decay
    (Loshchilov & Hutter 2017, SGDR) to ``cfg.lr * cfg.end_lr_ratio`` at
    ``cfg.decay_steps`` (default ``total_steps``), constant after that.
    """
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    decay_steps = max(decay_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps,
                                              decay_steps=decay_steps, end_value=cfg.lr * cfg.end_lr_ratio)


def _decay_mask(params):
    # Decoupled weight decay on matrices only; RMSNorm scales (1-D) are not decayed.
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule): clip_by_global_norm (if ``cfg.clip_norm``) then AdamW."""
    schedule = make_schedule(cfg, total_steps)
    clip = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(cfg.clip_norm)]
    adamw = optax.adamw(learning_rate=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                        mask=_decay_mask)
    return optax.chain(*clip, adamw), schedule
