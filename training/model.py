"""A decoder-only Transformer in Flax NNX, aware of packed sequences.

Architecture (pre-norm, as in GPT-2/LLaMA-style decoders):

    x = embed(inputs)                                   # (batch, length, d_model)
    for each block:
        x = x + dropout(attention(rms_norm(x)))         # causal, same segment only
        x = x + dropout(swiglu_mlp(rms_norm(x)))
    logits = rms_norm(x) @ embedding.T                  # (batch, length, vocab), float32

- RMSNorm: Zhang & Sennrich 2019, arXiv 1910.07467.
- Rotary positions (RoPE): Su et al. 2021, arXiv 2104.09864, "rotate half" layout;
  the rotation angle of a token is its *given* position, so positions that restart
  at 0 in every packed segment make each segment look like a sequence of its own.
- Gated MLP (SwiGLU): Shazeer 2020, arXiv 2002.05202.
- Tied input/output embeddings by default (``ModelConfig.tie_embeddings``).

Packed sequences: several examples share one row. ``segment_ids`` (batch, length)
int32 numbers them 1, 2, ... in each row; 0 marks padding. A query attends to a key
only if the key is not later (causal) *and* both have the same non-zero segment id.
Padding queries attend to nothing real; their outputs are garbage that carries zero
loss weight and that no real token ever reads.

Parameters are float32 and carry logical axis names (see
``seqcache.training.partitioning``); computation runs in ``ModelConfig.dtype``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from seqcache.training import partitioning
from seqcache.training.config import ModelConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Normal:
    """Initializer: normal with mean 0 and standard deviation ``std``."""

    std: float

    def __call__(self, key, shape, dtype=jnp.float32):
        return _normal(key, jnp.float32(self.std), shape, dtype)


@dataclasses.dataclass(frozen=True)
class Ones:
    """Initializer: all ones."""

    def __call__(self, key, shape, dtype=jnp.float32):
        return jnp.ones(shape, dtype)


def _normal(key, std, shape, dtype):
    return std * jax.random.normal(key, shape, dtype)


# Set by ``init_params``: creates each parameter value from (initializer, key,
# shape, logical axis names). Unset, initializers run where the model is built
# (eagerly, or traced by nnx.eval_shape).
_PARAM_FACTORY = threading.local()


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """A float32 parameter annotated with logical axis names (``out_sharding``
    metadata, as ``nnx.with_partitioning`` sets it)."""
    key = rngs.params()
    factory = getattr(_PARAM_FACTORY, "fn", None)
    value = init(key, shape, jnp.float32) if factory is None else factory(init, key, shape, names)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; identity when ``key`` is None or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout.

    Args:
      x: (batch, length, heads, head_dim), head_dim even.
      positions: (batch, length) int32, the position of each token in its segment.
      theta: frequency base.

    Returns:
      x rotated, same shape and dtype (the rotation is computed in float32).
    """
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (half,)
    angle = positions.astype(jnp.float32)[..., None] * freq  # (batch, length, half)
    sin = jnp.sin(angle)[:, :, None, :]
    cos = jnp.cos(angle)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """(batch, length) int32 segment ids -> (batch, length_q, length_k) bool mask:
    causal and same non-zero segment."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids != 0)[:, :, None]
    return same & real & causal[None]


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no centring)."""

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, Ones(), (dim,), ("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...]).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head self-attention with rotary positions and a segment-aware causal mask."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim
        init = Normal(cfg.init_std)
        # Output projection scaled down with depth (GPT-2 style) to keep the
        # residual stream's variance stable at initialisation.
        out_init = Normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.cfg = cfg
        self.wq = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"))
        self.wk = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"))
        self.wv = _param(rngs, init, (d, h, k), ("embed", "heads", "kv"))
        self.wo = _param(rngs, out_init, (h, k, d), ("heads", "kv", "embed"))

    def __call__(self, x, segment_ids, positions, dropout_key=None):
        """x: (batch, length, d_model) -> (batch, length, d_model)."""
        cfg = self.cfg
        dtype = x.dtype
        q = jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dtype))
        k = jnp.einsum("bld,dhk->blhk", x, self.wk[...].astype(dtype))
        v = jnp.einsum("bld,dhk->blhk", x, self.wv[...].astype(dtype))
        q = partitioning.constrain(q, ("batch", "length", "act_heads", None))
        q = rotary(q, positions, cfg.rope_theta)
        k = rotary(k, positions, cfg.rope_theta)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)  # (batch, heads, q, k)
        scores = scores / math.sqrt(q.shape[-1])
        mask = attention_mask(segment_ids)[:, None]  # (batch, 1, q, k)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = _dropout(probs, cfg.dropout_rate, dropout_key).astype(dtype)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        return jnp.einsum("bqhk,hkd->bqd", out, self.wo[...].astype(dtype))


class MLP(nnx.Module):
    """Gated MLP with SiLU gate (SwiGLU): (silu(x W_gate) * (x W_up)) W_down."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        init = Normal(cfg.init_std)
        out_init = Normal(cfg.init_std / math.sqrt(2 * cfg.num_layers))
        self.w_gate = _param(rngs, init, (d, f), ("embed", "mlp"))
        self.w_up = _param(rngs, init, (d, f), ("embed", "mlp"))
        self.w_down = _param(rngs, out_init, (f, d), ("mlp", "embed"))

    def __call__(self, x):
        """x: (batch, length, d_model) -> (batch, length, d_model)."""
        dtype = x.dtype
        gate = jnp.einsum("bld,df->blf", x, self.w_gate[...].astype(dtype))
        up = jnp.einsum("bld,df->blf", x, self.w_up[...].astype(dtype))
        hidden = partitioning.constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return jnp.einsum("blf,fd->bld", hidden, self.w_down[...].astype(dtype))


class Block(nnx.Module):
    """Pre-norm Transformer block: attention then MLP, each on a residual branch."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, segment_ids, positions, dropout_key=None):
        keys = [None, None, None] if dropout_key is None else list(jax.random.split(dropout_key, 3))
        rate = self.cfg.dropout_rate
        x = x + _dropout(self.attn(self.attn_norm(x), segment_ids, positions, keys[0]), rate, keys[1])
        x = partitioning.constrain(x, ("batch", "length", "act_embed"))
        x = x + _dropout(self.mlp(self.mlp_norm(x)), rate, keys[2])
        return partitioning.constrain(x, ("batch", "length", "act_embed"))


class Transformer(nnx.Module):
    """Decoder-only Transformer language model.

    Args:
      cfg: the model config; ``cfg.vocab_size`` must be set.
      rngs: ``nnx.Rngs`` with a ``params`` stream for initialisation.

    Raises:
      ConfigError: an invalid ``cfg`` (``ModelConfig.validate``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        self.embedding = _param(
            rngs, Normal(cfg.init_std), (cfg.vocab_size, cfg.d_model), ("vocab", "embed")
        )
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.unembedding = _param(
                rngs, Normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
            )

    def __call__(
        self,
        inputs: jax.Array,
        segment_ids: jax.Array,
        positions: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits.

        Args:
          inputs: (batch, length) int32 token ids (targets shifted right within
            each segment; see ``shift_right_by_segment``).
          segment_ids: (batch, length) int32, 0 = padding.
          positions: (batch, length) int32, restarting at 0 in each segment.
          dropout_key: PRNG key for dropout; None = no dropout (evaluation).

        Returns:
          (batch, length, vocab_size) float32 logits.
        """
        cfg = self.cfg
        dtype = _DTYPES[cfg.dtype]
        # Under fsdp the table is sharded along d_model; gather it whole before the
        # lookup (ZeRO-3 gathers parameters per use) so that the looked-up rows come
        # out split by batch rows, not by d_model.
        table = partitioning.constrain(self.embedding[...], ("act_vocab", "act_embed"))
        x = jnp.take(table, inputs, axis=0).astype(dtype)  # (batch, length, d_model)
        x = partitioning.constrain(x, ("batch", "length", "act_embed"))
        for i, block in enumerate(self.blocks):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, i)
            x = block(x, segment_ids, positions, key)
        x = self.final_norm(x)
        if cfg.tie_embeddings:
            logits = jnp.einsum("bld,vd->blv", x, table.astype(dtype))
        else:
            logits = jnp.einsum("bld,dv->blv", x, self.unembedding[...].astype(dtype))
        return logits.astype(jnp.float32)


def shift_right_by_segment(targets: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Decoder inputs from targets, as seqio's DecoderFeatureConverter builds them
    for packed data: shift right by one within each segment; the first token of each
    segment (and of each row) gets input 0.

    Args:
      targets: (batch, length) int32.
      segment_ids: (batch, length) int32.

    Returns:
      (batch, length) int32.
    """
    shifted = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
    prev_seg = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(segment_ids == prev_seg, shifted, 0).astype(jnp.int32)


_COMPILED_INITS: dict = {}


def _compiled_init(init, key, shape, sharding):
    """Runs ``init`` as a compiled computation placed with ``sharding``; compiled
    programs are shared by all parameters of the same kind, shape and sharding
    (the standard deviation is an argument, not a constant)."""
    shape = tuple(shape)
    if isinstance(init, Normal):
        cache_key = ("normal", shape, sharding)
        if cache_key not in _COMPILED_INITS:
            _COMPILED_INITS[cache_key] = jax.jit(
                lambda k, std: _normal(k, std, shape, jnp.float32), out_shardings=sharding
            )
        return _COMPILED_INITS[cache_key](key, jnp.float32(init.std))
    cache_key = (init, shape, sharding)
    if cache_key not in _COMPILED_INITS:
        _COMPILED_INITS[cache_key] = jax.jit(lambda k: init(k, shape, jnp.float32), out_shardings=sharding)
    return _COMPILED_INITS[cache_key](key)


def init_params(
    cfg: ModelConfig,
    seed: int,
    sharding_of: Callable[[tuple[str, ...], tuple[int, ...]], Any] | None = None,
) -> dict:
    """Parameters initialised from ``seed``, as a nested dict of float32 arrays.

    Each parameter is created by its own compiled initializer, placed directly
    with its sharding (each device computes only its shard), and compiled
    initializers are shared between parameters of the same shape and sharding,
    so compile time does not grow with depth. Keys come from
    ``nnx.Rngs(params=seed)`` in construction order; with JAX's partitionable
    threefry the values do not depend on the sharding.

    Args:
      cfg: the model config.
      seed: parameter seed.
      sharding_of: (logical axis names, shape) -> a jax Sharding, or None for
        the default device.
    """

    def factory(init, key, shape, names):
        sharding = None if sharding_of is None else sharding_of(names, shape)
        return _compiled_init(init, key, shape, sharding)

    previous = getattr(_PARAM_FACTORY, "fn", None)
    _PARAM_FACTORY.fn = factory
    try:
        with nnx.use_eager_sharding(False):
            model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    finally:
        _PARAM_FACTORY.fn = previous
    return split_params(model)[1]


def create(cfg: ModelConfig, seed: int) -> Transformer:
    """A Transformer with parameters initialised from ``seed`` on the default
    device (for inspection and tests; the same values as the trainer's sharded
    initialisation)."""
    graphdef, _ = split_params(abstract_model(cfg))
    return nnx.merge(graphdef, init_params(cfg, seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """The model with ShapeDtypeStructs instead of arrays (no memory, no compute)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))


def split_params(model: Transformer) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as a nested dict of arrays)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def logical_axes(model: Transformer) -> dict:
    """Nested dict shaped like the parameters with a tuple of logical axis names at
    each leaf.

    Raises:
      partitioning.PartitioningError: a parameter without logical axis names
        (the message names its path and shape).
    """
    _, state = nnx.split(model)
    out: dict = {}
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding")
        if not names:
            raise partitioning.PartitioningError(
                f"parameter {'/'.join(map(str, path))} with shape {tuple(var.shape)} has no logical axis "
                "names; create it with nnx.with_partitioning"
            )
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(names)
    return out


def apply(
    graphdef: nnx.GraphDef,
    params: Any,
    inputs: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """Functional call: logits of the model ``graphdef`` with ``params`` (a nested
    dict from ``split_params``). Shapes as in ``Transformer.__call__``."""
    model = nnx.merge(graphdef, params)
    return model(inputs, segment_ids, positions, dropout_key=dropout_key)


def count_params(params: Any) -> int:
    """Total number of parameter elements."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
