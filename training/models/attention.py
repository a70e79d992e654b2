"""The fused attention kernel of the trainer's models: Pallas splash attention.

``ModelConfig.attention`` picks the kernel (``resolve``):

- ``xla``: each model's einsum path, which writes float32 scores and
  probabilities of shape (batch, heads, Lq, Lk) to memory and keeps them for
  the backward pass;
- ``splash``: splash attention from ``jax.experimental.pallas.ops.tpu``
  (a block-sparse flash attention, Dao et al. 2022, arXiv 2205.14135, for TPUs):
  one kernel per (query block, key block) that keeps the running softmax in
  on-chip memory and never writes the (Lq, Lk) matrix; the backward pass
  recomputes it from the saved log-sum-exp. Packed rows are masked by segment
  ids inside the kernel (``SegmentIds``), causality by its static mask. On a
  backend other than a TPU the same kernel runs in Pallas interpret mode: exact
  and slow, for tests;
- ``auto``: splash on a TPU when it applies (every length a multiple of 128,
  no dropout on attention probabilities), else xla.

Prefix LM (``decoder_causal_attention``): the mask ``same segment & (causal |
(prefix[q] & prefix[k]))`` is no static mask. seqio's ``PrefixLMFeatureConverter``
marks each example's inputs and its first target position, a run at the start
of its segment, so a prefix query sees exactly the prefix keys of its segment
and every other query the causal keys of its segment. ``splash_attention`` runs
the kernel twice, causal with the segment ids and bidirectional with keys
outside the prefix given segment id -1, and takes each query's row from the one
that applies (twice the attention FLOPs of a language model).

Attention with an additive bias (T5's relative position bias, (heads, Lq, Lk)
for every row) cannot run in the splash kernel, whose logits are q.k.
``biased_attention`` runs it in Pallas flash attention of
``jax.experimental.pallas.ops.tpu.flash_attention`` (the same algorithm, dense
blocks), which reads the bias as a kernel input (``ab``, one (heads, Lq, Lk)
block per row, broadcast on the device) and gives its gradient; packed rows by
segment ids, causality by the kernel's flag. T5 takes it for self-attention
when ``ModelConfig.attention`` is "splash" (not "auto": its pace on the chip
against the einsum path is not measured yet).

The kernels run per device under ``jax.shard_map`` over the mesh of the
enclosing ``partitioning.activation_rules``: rows split over the batch axes,
heads over the axis of the 'act_heads' rule (tensor parallelism).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as fa
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec as P

from seqcache.training import partitioning
from seqcache.training.config import SPLASH_BLOCK, ConfigError
from seqcache.training.models.layers import ATTENTION_NAME

# Block sizes tried in order: the largest dividing the length is used.
_BLOCKS = (512, 256, 128)


def resolve(kernel: str, *, lengths: Sequence[int], dropout_rate: float = 0.0) -> str:
    """The kernel to run: "xla" or "splash", for ``ModelConfig.attention``
    ``kernel`` ("auto", "xla" or "splash") on sequences of ``lengths`` tokens.

    Raises:
      ConfigError: "splash" asked for with a length that is not a multiple of
        128 (the message names the lengths and the fallback); a ``TrainConfig``
        refuses this earlier, when it is validated, for the lengths it knows.
    """
    fits = all(int(n) % SPLASH_BLOCK == 0 for n in lengths)
    if kernel == "xla":
        return "xla"
    if kernel == "splash":
        if not fits:
            raise ConfigError(
                f"model.attention='splash' needs sequence lengths that are multiples of {SPLASH_BLOCK} (got "
                f"{list(map(int, lengths))}); pad the cache's sequence length or set model.attention=xla")
        return "splash"
    return "splash" if fits and dropout_rate == 0.0 and jax.default_backend() == "tpu" else "xla"


def _block(length: int) -> int:
    return next(b for b in _BLOCKS if length % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, q_length: int, kv_length: int, causal: bool, interpret: bool):
    """The splash kernel for (heads, q, head_dim) queries of one row (built once per shape)."""
    shape = (q_length, kv_length)
    mask = sa.CausalMask(shape) if causal else sa.FullMask(shape)
    bq, bkv = _block(q_length), _block(kv_length)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                          block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    # Built outside any trace (the mask's block tables are constants), once per shape.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(sa.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                  q_seq_shards=1, interpret=interpret, residual_checkpoint_name=ATTENTION_NAME)


def _local(q, k, v, q_segment_ids, kv_segment_ids, *, causal: bool):
    """Splash attention over the rows and heads one device holds.

    q (batch, heads, Lq, head_dim), k and v (batch, heads, Lk, head_dim),
    segment ids (batch, Lq) and (batch, Lk) int32 -> (batch, heads, Lq, head_dim).
    """
    kernel = _kernel(q.shape[1], q.shape[2], k.shape[2], causal, jax.default_backend() != "tpu")

    def row(q1, k1, v1, qs, ks):
        return kernel(q1, k1, v1, sa.SegmentIds(q=qs, kv=ks))

    return jax.vmap(row)(q, k, v, q_segment_ids, kv_segment_ids)


def _sharded(q, k, v, q_segment_ids, kv_segment_ids, *, causal: bool):
    active = partitioning.active()
    if active is None:
        return _local(q, k, v, q_segment_ids, kv_segment_ids, causal=causal)
    mesh, rules = active
    batch = rules.get("batch")
    heads = rules.get("act_heads")
    qkv = P(batch, heads, None, None)
    seg = P(batch, None)
    fn = functools.partial(_local, causal=causal)
    return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg), out_specs=qkv,
                         check_vma=False)(q, k, v, q_segment_ids, kv_segment_ids)


def splash_attention_bhlk(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                          kv_segment_ids: jax.Array, *, causal: bool, scale: float,
                          prefix: jax.Array | None = None) -> jax.Array:
    """``splash_attention`` in the kernel's own layout: q (batch, heads, Lq,
    head_dim), k and v (batch, heads, Lk, head_dim) -> (batch, heads, Lq,
    head_dim) in q's dtype; the other arguments as there."""
    qs = q * jnp.asarray(scale, q.dtype)
    q_segment_ids = q_segment_ids.astype(jnp.int32)
    kv_segment_ids = kv_segment_ids.astype(jnp.int32)
    out = _sharded(qs, k, v, q_segment_ids, kv_segment_ids, causal=causal)
    if prefix is not None:
        prefix = prefix.astype(jnp.bool_)
        prefix_keys = jnp.where(prefix, kv_segment_ids, -1)
        bidirectional = _sharded(qs, k, v, q_segment_ids, prefix_keys, causal=False)
        out = jnp.where(prefix[:, None, :, None], bidirectional, out)
    return out.astype(q.dtype)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                     *, causal: bool, scale: float, prefix: jax.Array | None = None) -> jax.Array:
    """Attention with the splash kernel, in the models' layout.

    Args:
      q: (batch, Lq, heads, head_dim) queries; k, v: (batch, Lk, heads, head_dim);
        Lq and Lk multiples of 128; any float dtype (the kernel accumulates in
        float32).
      q_segment_ids, kv_segment_ids: (batch, Lq), (batch, Lk) int32: a query
        sees only keys of its segment id.
      causal: also key index <= query index (self-attention).
      scale: multiplies the logits (the queries are scaled before the kernel).
      prefix: (batch, Lq) int, 1 on the prefix of a prefix LM (a run at the start
        of each segment, as seqio's converter marks it), causal self-attention only.

    Returns:
      (batch, Lq, heads, head_dim) in q's dtype. Rows of queries whose mask is
      empty (padding) hold finite values that no real token reads. The kernel's
      output and log-sum-exp are named ``layers.ATTENTION_NAME`` for the
      rematerialisation policies.
    """
    out = splash_attention_bhlk(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), q_segment_ids,
                                kv_segment_ids, causal=causal, scale=scale, prefix=prefix)
    return jnp.swapaxes(out, 1, 2)


def _biased_local(q, k, v, bias, q_segment_ids, kv_segment_ids, *, causal: bool):
    """Flash attention with ``bias`` over the rows and heads one device holds:
    q (batch, heads, Lq, head_dim), k and v (batch, heads, Lk, head_dim), bias
    (1, heads, Lq, Lk), segment ids (batch, Lq) and (batch, Lk) int32 ->
    (batch, heads, Lq, head_dim)."""
    if jax.default_backend() != "tpu":
        # The kernel's forward and backward pallas_calls are traced at different
        # times (the backward with the gradient), so interpret mode is set for the
        # process: True, Pallas' HLO interpreter (the splash kernel's interpret
        # flag), the only way a TPU kernel runs on another backend.
        from jax.experimental.pallas import tpu as pltpu

        pltpu.set_tpu_interpret_mode(True)
    (b, h, lq, _), lk = q.shape, k.shape[2]
    bq, bk = _block(lq), _block(lk)
    sizes = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1, block_q_major_dkv=bq,
                          block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bk,
                          block_k_dq=bk, block_q_dq=bq)
    return fa.flash_attention(q, k, v, ab=jnp.broadcast_to(bias.astype(q.dtype), (b, h, lq, lk)),
                              segment_ids=fa.SegmentIds(q=q_segment_ids, kv=kv_segment_ids), causal=causal,
                              sm_scale=1.0, block_sizes=sizes)


def biased_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, q_segment_ids: jax.Array,
                     kv_segment_ids: jax.Array, *, causal: bool) -> jax.Array:
    """Attention with an additive bias in one fused kernel (Pallas flash
    attention, Dao et al. 2022, with the bias as its input), no logit scaling.

    Args:
      q: (batch, Lq, heads, head_dim) queries; k, v: (batch, Lk, heads,
        head_dim); Lq and Lk multiples of 128; any float dtype.
      bias: (1, heads, Lq, Lk), added to every row's logits (its gradient is
        the sum over the rows).
      q_segment_ids, kv_segment_ids: (batch, Lq), (batch, Lk) int: a query sees
        only keys of its segment id.
      causal: also key index <= query index.

    Returns:
      (batch, Lq, heads, head_dim) in q's dtype. Rows of padding queries
      (segment 0) hold finite values that no real token reads.
    """
    qb, kb, vb = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    segments = (q_segment_ids.astype(jnp.int32), kv_segment_ids.astype(jnp.int32))
    fn = functools.partial(_biased_local, causal=causal)
    active = partitioning.active()
    if active is None:
        out = fn(qb, kb, vb, bias, *segments)
    else:
        mesh, rules = active
        qkv, seg = P(rules.get("batch"), rules.get("act_heads"), None, None), P(rules.get("batch"), None)
        out = jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, P(None, rules.get("act_heads"), None, None),
                                                     seg, seg),
                            out_specs=qkv, check_vma=False)(qb, kb, vb, bias, *segments)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)
