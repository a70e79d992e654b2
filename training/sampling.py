"""The decoding loop of ``seqcache.training.decoding``: picking the next token
(greedy, temperature, top-k, top-p) and the ``jax.lax.while_loop`` over the
steps. ``config`` is a ``decoding.DecodeConfig`` (read by attribute only).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def select_tokens(logits: jax.Array, config, row_ids: jax.Array, step: jax.Array) -> jax.Array:
    """The next token of every row: logits (B, vocab) float32, row ids (B,)
    int32 and the step (int32 scalar) -> (B,) int32, greedy or sampled as
    ``config`` says (module docstring)."""
    if config.method == "greedy" or config.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / jnp.float32(config.temperature)
    if config.top_k:
        k = min(int(config.top_k), logits.shape[-1])
        kth = jax.lax.top_k(logits, k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if config.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        kept = jnp.sum(before < jnp.float32(config.top_p), axis=-1, keepdims=True)  # >= 1
        cutoff = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    base = jax.random.key(config.seed)
    keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.fold_in(base, r), step))(row_ids)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def generate(first_logits: jax.Array, state: Any, step_fn, config, row_ids: jax.Array) -> jax.Array:
    """The decoding loop (``jax.lax.while_loop``): picks token t from the
    current logits (B, vocab), then ``step_fn(state, t, tokens) -> (logits,
    state)`` feeds it; stops when every row has produced ``config.eos_id`` or
    ``max_decode_length`` tokens. Returns (B, max_decode_length) int32, 0
    after each row's EOS."""
    rows, length = first_logits.shape[0], int(config.max_decode_length)

    def cond(carry):
        t, _, done, _, _ = carry
        return (t < length) & ~jnp.all(done)

    def body(carry):
        t, logits, done, tokens, state = carry
        token = jnp.where(done, 0, select_tokens(logits, config, row_ids, t))
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], t, axis=1)
        done = done | (token == config.eos_id)
        logits, state = step_fn(state, t, token)
        return t + 1, logits, done, tokens, state

    init = (jnp.int32(0), first_logits, jnp.zeros((rows,), jnp.bool_), jnp.zeros((rows, length), jnp.int32), state)
    return jax.lax.while_loop(cond, body, init)[3]
