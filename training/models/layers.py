"""A stack of identical layers: unrolled or scanned, with rematerialisation.

``stack(layers, scan=cfg.scan_layers)`` holds the layers as ``ModelConfig.scan_layers`` says:

- unscanned: an ``nnx.List`` of the layers (parameters ``blocks/0/attn/wq``, ...);
- scanned: one layer module whose parameters are the layers' parameters
  stacked along a new leading axis with logical name 'layers'
  (``blocks/attn/wq`` of shape (layers, d_model, heads, head_dim)). The layers
  are built one by one first, so the initial values are those of the
  unscanned model, and ``apply`` runs one compiled layer under
  ``jax.lax.scan`` (compile time does not grow with depth, as in MaxText's and
  t5x's ``scan_layers``).

``apply`` runs a layer function over the stack, each layer wrapped in
``jax.checkpoint`` with the policy of ``ModelConfig.remat`` (Chen et al. 2016,
"Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174):

=========  ================================================================
none       every intermediate kept for the backward pass
dots       the results of matrix multiplications without batch dimensions
           (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``: the
           projections and the MLP) and attention's output (``ATTENTION_NAME``:
           the splash kernel's output and log-sum-exp) and the queries and
           keys after their rotary positions (``ROTATED_NAME``); norms and
           activations recomputed
attention  attention's output only: the projections and the MLP recomputed,
           the attention kernel not
full       nothing but the layer's input (``nothing_saveable``): the layer's
           forward pass is recomputed in the backward pass
=========  ================================================================
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

LAYERS_AXIS = "layers"
# The name (``jax.ad_checkpoint.checkpoint_name``) of attention's output: the
# splash kernel's residuals (output and log-sum-exp), or the einsum path's output.
ATTENTION_NAME = "attention"
# The name of the queries and keys after their rotary positions: "dots" keeps them
# in place of the projections they are computed from, so the backward pass does
# not recompute the rotation (same bytes kept, less element-wise work).
ROTATED_NAME = "rotated"


def name_attention(x: jax.Array) -> jax.Array:
    """``x`` tagged as attention's output, which the "dots" and "attention" policies keep."""
    return checkpoint_name(x, ATTENTION_NAME)


def name_rotated(x: jax.Array) -> jax.Array:
    """``x`` (queries or keys after their rotary positions) tagged for the "dots" policy."""
    return checkpoint_name(x, ROTATED_NAME)


def _policy(remat: str):
    saved_attention = jax.checkpoint_policies.save_only_these_names(ATTENTION_NAME)
    return {"dots": jax.checkpoint_policies.save_from_both_policies(
                jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                jax.checkpoint_policies.save_only_these_names(ATTENTION_NAME, ROTATED_NAME)),
            "attention": saved_attention,
            "full": jax.checkpoint_policies.nothing_saveable}[remat]


def stack(layers: Sequence[nnx.Module], *, scan: bool) -> nnx.Module:
    """The layers as a model attribute: ``nnx.List(layers)``, or with ``scan``
    the first layer holding every layer's parameters stacked (leading axis
    'layers', prepended to each parameter's logical axis names)."""
    if not scan:
        return nnx.List(list(layers))
    states = [nnx.to_pure_dict(nnx.state(layer)) for layer in layers]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    graphdef, state = nnx.split(layers[0])
    nnx.replace_by_pure_dict(state, stacked)
    for _, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding")
        if names:
            var.set_metadata(out_sharding=(LAYERS_AXIS,) + tuple(names))
    return nnx.merge(graphdef, state)


def apply(layers: nnx.Module, x: jax.Array, call: Callable[[nnx.Module, jax.Array, Any], jax.Array], *,
          dropout_key: jax.Array | None, key_offset: int = 0, remat: str = "none") -> jax.Array:
    """``x`` through every layer in order: ``x = call(layer_i, x, key_i)``.

    Args:
      layers: from ``stack``.
      x: the carried activation, e.g. (batch, length, d_model).
      call: applies one layer; everything else it reads (masks, positions, the
        encoder's output) it closes over.
      dropout_key: layer i gets ``fold_in(dropout_key, key_offset + i)``; None:
        every layer gets None.
      remat: "none", "dots", "attention" or "full" (module docstring).
    """
    if isinstance(layers, nnx.List):
        if remat == "none":
            for i, layer in enumerate(layers):
                key = None if dropout_key is None else jax.random.fold_in(dropout_key, key_offset + i)
                x = call(layer, x, key)
            return x
        graphdef, _ = nnx.split(layers[0])

        def one(state, y, key):
            return call(nnx.merge(graphdef, state), y, key)

        one = jax.checkpoint(one, policy=_policy(remat))
        for i, layer in enumerate(layers):
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, key_offset + i)
            x = one(nnx.state(layer), x, key)
        return x

    graphdef, state = nnx.split(layers)
    count = jax.tree.leaves(state)[0].shape[0]
    keys = None
    if dropout_key is not None:
        keys = jax.vmap(lambda i: jax.random.fold_in(dropout_key, i))(key_offset + jnp.arange(count))

    def body(y, xs):
        layer_state, key = xs
        return call(nnx.merge(graphdef, layer_state), y, key), None

    if remat != "none":
        body = jax.checkpoint(body, policy=_policy(remat))
    x, _ = jax.lax.scan(body, x, (state, keys))
    return x


def apply_cached(layers: nnx.Module, x: jax.Array, cache: Any,
                 call: Callable[[nnx.Module, jax.Array, Any], tuple[jax.Array, Any]]) -> tuple[jax.Array, Any]:
    """``x`` through every layer in order, each reading and updating its own
    part of a decoding cache: ``x, cache_i = call(layer_i, x, cache_i)``. No
    dropout, no rematerialisation (inference).

    ``cache`` is what ``init_cache`` built for ``layers``: a list of per-layer
    pytrees (unscanned), or one pytree whose arrays have a leading layer axis
    (scanned, run under ``jax.lax.scan``). Returns ``(x, cache)`` alike.
    """
    if isinstance(layers, nnx.List):
        out = []
        for layer, layer_cache in zip(layers, cache):
            x, layer_cache = call(layer, x, layer_cache)
            out.append(layer_cache)
        return x, out
    graphdef, state = nnx.split(layers)

    def body(y, xs):
        layer_state, layer_cache = xs
        return call(nnx.merge(graphdef, layer_state), y, layer_cache)

    return jax.lax.scan(body, x, (state, cache))


def init_cache(layers: nnx.Module, make: Callable[[], Any]) -> Any:
    """A decoding cache for ``layers`` (``apply_cached``) from ``make()``, one
    layer's pytree of zeros: a list of them, or stacked along a leading layer
    axis for scanned layers."""
    if isinstance(layers, nnx.List):
        return [make() for _ in layers]
    count = jax.tree.leaves(nnx.state(layers))[0].shape[0]
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (count,) + a.shape), make())
