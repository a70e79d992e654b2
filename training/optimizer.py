"""The optimizers, Optax AdamW (the default) or Adafactor, with linear warmup,
cosine decay and global-norm clipping."""

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


def _adafactor(cfg: OptimizerConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """``optax.adafactor`` with t5x's defaults (``t5x.adafactor.Adafactor``):
    factored second moments for parameters with two dimensions of at least 128
    (the two largest are factored), decay rate 0.8, update clipping at RMS
    1.0, steps relative to the parameter's RMS, epsilons 1e-30 and 1e-3, no
    momentum and no weight decay. Unlike t5x, whose factor rules treat a
    scanned 'layers' axis as a batch axis, Optax takes a stacked parameter as
    one array: with ``model.scan_layers`` the RMS of clipping and of the
    parameter scale is over all layers of it, so scanned and unscanned runs
    differ under Adafactor (not under AdamW)."""
    return optax.adafactor(learning_rate=schedule, min_dim_size_to_factor=128, decay_rate=cfg.decay_rate,
                           multiply_by_parameter_scale=cfg.multiply_by_parameter_scale,
                           clipping_threshold=cfg.clipping_threshold, momentum=None, weight_decay_rate=None,
                           eps=1e-30, factored=cfg.factored)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule): clip_by_global_norm (if ``cfg.clip_norm``) then
    AdamW or Adafactor (``cfg.name``).

    Raises:
      ValueError: an unknown ``cfg.name``.
    """
    schedule = make_schedule(cfg, total_steps)
    clip = [] if cfg.clip_norm is None else [optax.clip_by_global_norm(cfg.clip_norm)]
    if cfg.name == "adamw":
        update = optax.adamw(learning_rate=schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=_decay_mask)
    elif cfg.name == "adafactor":
        update = _adafactor(cfg, schedule)
    else:
        raise ValueError(f"optimizer.name must be 'adamw' or 'adafactor' (got {cfg.name!r})")
    return optax.chain(*clip, update), schedule
