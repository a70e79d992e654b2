"""The decoding loop of ``seqcache.training.decoding``: picking the next token
(greedy, temperature, top-k, top-p) and the ``jax.lax.while_loop`` over the
steps.

The choices of a ``DecodeConfig`` other than its length are arrays
(``knobs``), not constants of the program: one compiled program serves every
method, temperature, top-k, top-p, seed and EOS id.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def knobs(config) -> dict[str, np.ndarray]:
    """The runtime choices of a ``decoding.DecodeConfig``: ``greedy`` (bool;
    method "greedy" or temperature 0), ``temperature``, ``top_p`` (float32),
    ``top_k``, ``eos_id`` (int32) and ``seed`` (uint32: the seed modulo 2**32),
    each a numpy scalar."""
    return {"greedy": np.bool_(config.method == "greedy" or config.temperature == 0),
            "temperature": np.float32(config.temperature if config.temperature > 0 else 1.0),
            "top_k": np.int32(config.top_k), "top_p": np.float32(config.top_p),
            "eos_id": np.int32(config.eos_id), "seed": np.uint32(int(config.seed) % 2 ** 32)}


def _sample(logits: jax.Array, knob: dict, row_ids: jax.Array, step: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    logits = logits / knob["temperature"]
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    # top-k: in the sorted order, the first k entries.
    k = jnp.where(knob["top_k"] > 0, jnp.minimum(knob["top_k"], vocab), vocab)
    ordered = jnp.where(jnp.arange(vocab)[None, :] < k, ordered, -jnp.inf)
    # top-p: the first entries whose more likely predecessors hold less than top_p.
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs
    kept = jnp.sum((before < knob["top_p"]) & (ordered > -jnp.inf), axis=-1, keepdims=True)
    kept = jnp.where(knob["top_p"] >= 1.0, k, jnp.maximum(kept, 1))
    cutoff = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    base = jax.random.key(knob["seed"])
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(row_ids)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def select_tokens(logits: jax.Array, knob: dict, row_ids: jax.Array, step: jax.Array) -> jax.Array:
    """The next token of every row: logits (B, vocab) float32, ``knob`` from
    ``knobs`` (as arrays), row ids (B,) int32 and the step (int32 scalar) ->
    (B,) int32.

    Greedy: the argmax. Sampling: logits divided by the temperature, cut to
    the ``top_k`` largest (0 = all), then to the most likely tokens whose
    predecessors in order of probability hold less than ``top_p`` (nucleus
    sampling, Holtzman et al. 2020, arXiv 1904.09751; 1.0 = all), then one
    draw from the categorical distribution with the key
    ``fold_in(fold_in(key(seed), row_id), step)``.
    """
    return jax.lax.cond(knob["greedy"], lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32),
                        lambda: _sample(logits, knob, row_ids, step))


def generate(first_logits: jax.Array, state: Any, step_fn, length: int, knob: dict, row_ids: jax.Array) -> jax.Array:
    """The decoding loop (``jax.lax.while_loop``): picks token t from the
    current logits (B, vocab), then ``step_fn(state, t, tokens) -> (logits,
    state)`` feeds it; stops when every row has produced ``knob["eos_id"]`` or
    ``length`` tokens. Returns (B, length) int32, 0 after each row's EOS."""
    rows = first_logits.shape[0]

    def cond(carry):
        t, _, done, _, _ = carry
        return (t < length) & ~jnp.all(done)

    def body(carry):
        t, logits, done, tokens, state = carry
        token = jnp.where(done, 0, select_tokens(logits, knob, row_ids, t))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], t, axis=1)
        done = done | (token == knob["eos_id"])
        logits, state = step_fn(state, t, token)
        return t + 1, logits, done, tokens, state

    init = (jnp.int32(0), first_logits, jnp.zeros((rows,), jnp.bool_), jnp.zeros((rows, length), jnp.int32), state)
    return jax.lax.while_loop(cond, body, init)[3]
