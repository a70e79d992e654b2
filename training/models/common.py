"""What every model shares: parameters with logical axis names, initializers,
dropout, sharded initialisation, abstract shapes and the functional call.

Parameters are float32 with logical axis names (``seqcache.training.partitioning``)
as ``out_sharding`` metadata; computation runs in ``ModelConfig.dtype``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from seqcache.training import models, partitioning
from seqcache.training.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


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


def make_value(key: jax.Array, init, shape: tuple[int, ...], names: tuple[str, ...]) -> jax.Array:
    """``init(key, shape)``; inside ``init_params`` computed compiled, with the parameter's sharding."""
    factory = getattr(_PARAM_FACTORY, "fn", None)
    return init(key, shape, jnp.float32) if factory is None else factory(init, key, shape, names)


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str, ...]) -> nnx.Param:
    """A float32 parameter annotated with logical axis names (``out_sharding``
    metadata, as ``nnx.with_partitioning`` sets it). Takes one key from the
    ``params`` stream."""
    value = make_value(rngs.params(), init, shape, names)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; identity when ``key`` is None or ``rate`` is 0."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def segment_mask(query_segment_ids: jax.Array, key_segment_ids: jax.Array) -> jax.Array:
    """(batch, q), (batch, k) int32 -> (batch, q, k) bool: same segment, query segment not 0 (padding)."""
    return (query_segment_ids[:, :, None] == key_segment_ids[:, None, :]) & (query_segment_ids != 0)[:, :, None]


def split_keys(key: jax.Array | None, n: int) -> list:
    """``n`` dropout keys from ``key`` (``jax.random.split``), or ``n`` Nones."""
    return [None] * n if key is None else list(jax.random.split(key, n))


_COMPILED_INITS: dict = {}


def _compiled_init(init, key, shape, sharding):
    """``init`` compiled and placed with ``sharding``, one program per kind, shape
    and sharding (the standard deviation is an argument, not a constant)."""
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


def init_params(cfg: ModelConfig, seed: int,
                sharding_of: Callable[[tuple[str, ...], tuple[int, ...]], Any] | None = None) -> dict:
    """Parameters of the ``cfg.architecture`` model initialised from ``seed``, as
    a nested dict of float32 arrays.

    Each parameter is computed by a compiled initializer placed with its
    sharding (``sharding_of(logical axis names, shape)``; None: the default
    device), shared by parameters of the same shape and sharding, so compile
    time does not grow with depth. Keys come from ``nnx.Rngs(params=seed)`` in
    construction order; with JAX's partitionable threefry the values do not
    depend on the sharding.
    """

    def factory(init, key, shape, names):
        sharding = None if sharding_of is None else sharding_of(names, shape)
        return _compiled_init(init, key, shape, sharding)

    previous = getattr(_PARAM_FACTORY, "fn", None)
    _PARAM_FACTORY.fn = factory
    try:
        with nnx.use_eager_sharding(False):
            model = models.model_class(cfg.architecture)(cfg, rngs=nnx.Rngs(params=seed))
    finally:
        _PARAM_FACTORY.fn = previous
    params = split_params(model)[1]
    if sharding_of is None:
        return params
    # Scanned layers' parameters were stacked after their initializers ran:
    # place them with the sharding of their stacked shape (a no-op for the rest).
    return jax.tree.map(lambda value, names: jax.device_put(value, sharding_of(names, value.shape)),
                        params, logical_axes(model), is_leaf=lambda x: isinstance(x, tuple))


def create(cfg: ModelConfig, seed: int) -> nnx.Module:
    """The model initialised from ``seed`` on the default device (the values of
    the trainer's sharded initialisation)."""
    graphdef, _ = split_params(abstract_model(cfg))
    return nnx.merge(graphdef, init_params(cfg, seed))


def abstract_model(cfg: ModelConfig) -> nnx.Module:
    """The model with ShapeDtypeStructs instead of arrays (no memory, no compute)."""
    cls = models.model_class(cfg.architecture)
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(params=0)))


def split_params(model: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """(graphdef, params as a nested dict of arrays)."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def logical_axes(model: nnx.Module) -> dict:
    """Nested dict shaped like the parameters with a tuple of logical axis names at each leaf.

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
                "names; create it with nnx.with_partitioning")
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tuple(names)
    return out


def batch_logits(graphdef: nnx.GraphDef, params: Any, batch: dict, *, dropout_key: jax.Array | None = None):
    """Functional call on a batch: ``(logits, targets, loss_weights)`` of the model
    ``graphdef`` with ``params``; see the model's ``batch_logits``.

    Returns:
      logits (batch, length, vocab) float32, targets (batch, length) int32 and
      loss weights (batch, length) float32, over the model's output positions.
    """
    model = nnx.merge(graphdef, params)
    return model.batch_logits(batch, dropout_key=dropout_key)


def count_params(params: Any) -> int:
    """Total number of parameter elements."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))
