"""The pure functions that run inside ``jax.jit``: loss, gradients with
accumulation over microbatches, the train step and the eval step.

A batch is a dict of (batch, length) arrays whose fields depend on the feature
converter (``batch_fields``). For ``lm`` they are the feeder's own feature names:

    targets               int32    token ids to predict
    targets_segment_ids   int32    packed-segment number per token, 0 = padding
    targets_positions     int32    position of the token in its segment
    targets_loss_weights  float32  weight of the token in the loss (0 on padding)

For ``encdec`` and ``prefix_lm`` they are t5x's ``encoder_*`` and ``decoder_*``
names (``seqcache.feeders.converters``); the loss is over
``decoder_target_tokens`` weighted by ``decoder_loss_weights``.

Loss: the mean token cross-entropy weighted by loss weights over the *global*
batch, sum(w * ce) / sum(w). With microbatches, per-microbatch sums of the
weighted loss and of its gradient are accumulated and divided by the global
weight sum at the end, which gives the full-batch gradient (up to float
rounding), whatever the number of microbatches or how padding falls among them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from seqcache.training import partitioning
from seqcache.training.models import common as model_lib

BATCH_KEYS = ("targets", "targets_segment_ids", "targets_positions", "targets_loss_weights")

_DECODER_FIELDS = ("decoder_target_tokens", "decoder_input_tokens", "decoder_loss_weights", "decoder_segment_ids",
                   "decoder_positions")
_ENCODER_FIELDS = ("encoder_input_tokens", "encoder_segment_ids", "encoder_positions")


def batch_fields(converter: str, lengths: dict[str, int]) -> dict[str, tuple[int, Any]]:
    """Field name -> (length, dtype) of the batches a converter feeds.

    Args:
      converter: "lm", "prefix_lm" or "encdec".
      lengths: {"targets": L} (lm) or {"inputs": Li, "targets": L}.

    Returns:
      ``lm``: ``BATCH_KEYS``, length L; ``encdec``: ``encoder_input_tokens``,
      ``encoder_segment_ids``, ``encoder_positions`` of length Li and
      ``decoder_target_tokens``, ``decoder_input_tokens``,
      ``decoder_loss_weights``, ``decoder_segment_ids``, ``decoder_positions``
      of length L; ``prefix_lm``: the decoder fields and
      ``decoder_causal_attention`` of length Li + L. int32, loss weights float32.

    Raises:
      ValueError: an unknown converter.
    """
    if converter == "lm":
        fields = {k: lengths["targets"] for k in BATCH_KEYS}
    elif converter == "encdec":
        fields = {**dict.fromkeys(_ENCODER_FIELDS, lengths["inputs"]),
                  **dict.fromkeys(_DECODER_FIELDS, lengths["targets"])}
    elif converter == "prefix_lm":
        fields = dict.fromkeys(_DECODER_FIELDS + ("decoder_causal_attention",), lengths["inputs"] + lengths["targets"])
    else:
        raise ValueError(f"unknown feature converter {converter!r} (choose one of 'lm', 'prefix_lm', 'encdec')")
    return {k: (n, jnp.float32 if k.endswith("loss_weights") else jnp.int32) for k, n in fields.items()}


def _sums(logits, targets, weights) -> dict[str, jax.Array]:
    weights = weights.astype(jnp.float32)  # logits: (..., vocab) float32
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    cross_entropy = log_z - target_logit
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    return {
        "loss_sum": jnp.sum(cross_entropy * weights),
        "weight_sum": jnp.sum(weights),
        "correct_sum": jnp.sum(correct * weights),
    }


def loss_sums(graphdef, params, batch: dict, dropout_key: jax.Array | None, *, loss_chunks: int = 1,
              mesh=None) -> dict[str, jax.Array]:
    """Weighted sums over one (micro)batch.

    With ``loss_chunks`` > 1 the output layer and the loss run over chunks of
    rows (row r in chunk r mod ``loss_chunks``, so that every chunk spans all
    batch shards) under ``lax.scan``, each chunk rematerialised: only one
    chunk's (rows, length, vocab) float32 logits are in memory at a time.

    Returns:
      dict of float32 scalars: ``loss_sum`` = sum(w * cross-entropy) in nats,
      ``weight_sum`` = sum(w), ``correct_sum`` = sum(w * [argmax == target]).
    """
    if loss_chunks == 1:
        logits, targets, weights = model_lib.batch_logits(graphdef, params, batch, dropout_key=dropout_key)
        return _sums(logits, targets, weights)
    model = nnx.merge(graphdef, params)
    hidden, targets, weights = model.batch_hidden(batch, dropout_key=dropout_key)
    out_graphdef, out_state = nnx.split(model)
    chunks = split_microbatches({"hidden": hidden, "targets": targets, "weights": weights}, loss_chunks, mesh)

    @jax.checkpoint
    def chunk_sums(state, chunk):
        logits = nnx.merge(out_graphdef, state).logits(chunk["hidden"])
        return _sums(logits, chunk["targets"], chunk["weights"])

    def body(carry, chunk):
        return jax.tree.map(jnp.add, carry, chunk_sums(out_state, chunk)), None

    zeros = {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "weight_sum", "correct_sum")}
    sums, _ = jax.lax.scan(body, zeros, chunks)
    return sums


def split_microbatches(batch: dict, num_microbatches: int, mesh=None) -> dict:
    """(B, L) arrays -> (M, B/M, L): microbatch m holds rows m, m+M, m+2M, ...,
    so every microbatch is spread over all batch shards."""

    def split(x):
        b = x.shape[0]
        y = x.reshape((b // num_microbatches, num_microbatches) + x.shape[1:]).swapaxes(0, 1)
        if mesh is not None:
            spec = P(None, partitioning.BATCH_AXES, *([None] * (x.ndim - 1)))
            y = jax.lax.with_sharding_constraint(y, NamedSharding(mesh, spec))
        return y

    return jax.tree.map(split, batch)


def grad_sums(graphdef, params, batch: dict, key: jax.Array, num_microbatches: int, mesh=None, loss_chunks: int = 1):
    """(grads, sums): the float32 gradient of ``loss_sum`` and the sums of
    ``loss_sums``, accumulated over the microbatches with ``lax.scan``;
    microbatch m's dropout key is ``fold_in(key, m)``."""

    def one(mb, k):
        def f(p):
            sums = loss_sums(graphdef, p, mb, k, loss_chunks=loss_chunks, mesh=mesh)
            return sums["loss_sum"], sums

        (_, sums), grads = jax.value_and_grad(f, has_aux=True)(params)
        return grads, sums

    if num_microbatches == 1:
        return one(batch, jax.random.fold_in(key, 0))

    micro = split_microbatches(batch, num_microbatches, mesh)
    zeros = (jax.tree.map(jnp.zeros_like, params),
             {k: jnp.zeros((), jnp.float32) for k in ("loss_sum", "weight_sum", "correct_sum")})

    def body(carry, xs):
        index, mb = xs
        grads, sums = one(mb, jax.random.fold_in(key, index))
        return jax.tree.map(jnp.add, carry, (grads, sums)), None

    (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(num_microbatches), micro))
    return grads, sums


def mean_grads(graphdef, params, batch, key, num_microbatches: int, mesh=None, loss_chunks: int = 1):
    """(loss, grads, sums): the weighted-mean loss over the global batch and its
    gradient. A batch with zero total weight gives loss 0 and zero gradients."""
    grads, sums = grad_sums(graphdef, params, batch, key, num_microbatches, mesh, loss_chunks)
    denom = jnp.where(sums["weight_sum"] > 0, sums["weight_sum"], 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    return sums["loss_sum"] / denom, grads, sums


def make_train_step(graphdef, optimizer: optax.GradientTransformation, schedule: optax.Schedule, *, seed: int,
                    num_microbatches: int, mesh=None, loss_chunks: int = 1) -> Callable:
    """``train_step(params, opt_state, step, batch) -> (params, opt_state, metrics)``.

    ``step`` is an int32 scalar: the number of updates applied so far; the step's
    RNG key is ``fold_in(key(seed), step)``. ``metrics`` holds float32 scalars:
    loss (weighted mean cross-entropy, nats/token), grad_norm (global L2 norm
    before clipping), learning_rate (the rate this update used), accuracy
    (weighted token accuracy) and loss_weight_sum.
    """

    def train_step(params, opt_state, step, batch):
        key = jax.random.fold_in(jax.random.key(seed), step)
        loss, grads, sums = mean_grads(graphdef, params, batch, key, num_microbatches, mesh, loss_chunks)
        grad_norm = optax.global_norm(grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        denom = jnp.where(sums["weight_sum"] > 0, sums["weight_sum"], 1.0)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "learning_rate": jnp.asarray(schedule(step), jnp.float32),
            "accuracy": sums["correct_sum"] / denom,
            "loss_weight_sum": sums["weight_sum"],
        }
        return params, opt_state, metrics

    return train_step


def make_eval_step(graphdef, *, loss_chunks: int = 1, mesh=None) -> Callable:
    """``eval_step(params, batch) -> sums`` (see ``loss_sums``), no dropout."""

    def eval_step(params, batch):
        return loss_sums(graphdef, params, batch, None, loss_chunks=loss_chunks, mesh=mesh)

    return eval_step


def abstract_batch(batch_size: int, fields: dict[str, tuple[int, Any]], sharding) -> dict[str, Any]:
    """ShapeDtypeStructs of a global batch (``fields`` from ``batch_fields``), for
    ahead-of-time lowering."""
    return {
        k: jax.ShapeDtypeStruct((batch_size, length), dt, sharding=sharding) for k, (length, dt) in fields.items()
    }
