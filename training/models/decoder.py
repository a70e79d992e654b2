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

Prefix LM (``decoder_causal_attention``, seqio's ``PrefixLMFeatureConverter``):
a query may also attend to a later key of its segment when both are marked as
prefix (the inputs, and the first target position), as in t5x's decoder-only
model: ``mask = same segment & (causal | (prefix[q] & prefix[k]))``.

Packed sequences: ``segment_ids`` (batch, length) int32 number the examples of
a row 1, 2, ...; 0 marks padding. A query attends to a key only if the key is
not later (causal) *and* both have the same non-zero segment id; padding
outputs carry zero loss weight and no real token reads them.

Attention: ``ModelConfig.attention`` picks the einsum path below or the fused
splash kernel (``seqcache.training.models.attention``), which takes the segment
ids and the prefix itself and never writes the (length, length) matrix. The
einsum path is not ``jax.nn.dot_product_attention`` and ``nnx.RMSNorm`` (as in
the T5 model): it has dropout on the attention probabilities, and resumed
checkpoints of existing runs keep training bit for bit.

Layers: ``ModelConfig.scan_layers`` and ``ModelConfig.remat``
(``seqcache.training.models.layers``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from seqcache.training import partitioning
from seqcache.training.config import ModelConfig
from seqcache.training.models import attention as attention_lib
from seqcache.training.models import layers as layers_lib
from seqcache.training.models.common import DTYPES, Normal, Ones, segment_mask, split_keys
from seqcache.training.models.common import dropout as _dropout
from seqcache.training.models.common import param as _param


def rotary_tables(positions: jax.Array, theta: float, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) of the rotary angles, each (batch, length, head_dim // 2)
    float32, for ``positions`` (batch, length) int32 with frequency base
    ``theta``. Computed once per forward pass and shared by the layers (on a TPU
    the transcendentals per layer cost more than the attention projections)."""
    half = head_dim // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # (half,)
    angle = positions.astype(jnp.float32)[..., None] * freq  # (batch, length, half)
    return jnp.sin(angle), jnp.cos(angle)


def apply_rotary(x: jax.Array, tables: tuple[jax.Array, jax.Array], *, heads_axis: int = 2) -> jax.Array:
    """``x`` (batch, length, heads, head_dim), or with ``heads_axis=1`` (batch,
    heads, length, head_dim), rotated by ``rotary_tables``; same shape and
    dtype, computed in float32."""
    sin, cos = (jnp.expand_dims(t, heads_axis) for t in tables)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rotary(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (RoPE, Su et al. 2021), "rotate half" layout:
    x (batch, length, heads, head_dim even) rotated by ``positions`` (batch,
    length) int32 with frequency base ``theta``; same shape and dtype, computed
    in float32 (``rotary_tables`` then ``apply_rotary``)."""
    return apply_rotary(x, rotary_tables(positions, theta, x.shape[-1]))


def attention_mask(segment_ids: jax.Array, causal_attention: jax.Array | None = None) -> jax.Array:
    """(batch, length) int32 segment ids -> (batch, length_q, length_k) bool mask:
    causal and same non-zero segment.

    With ``causal_attention`` (batch, length) int (1 = prefix, seqio's
    ``decoder_causal_attention``), a prefix query also sees the later prefix keys
    of its segment (bidirectional attention over the prefix)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    if causal_attention is None:
        return segment_mask(segment_ids, segment_ids) & causal[None]
    prefix = causal_attention.astype(jnp.bool_)
    return segment_mask(segment_ids, segment_ids) & (causal[None] | (prefix[:, :, None] & prefix[:, None, :]))


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

    def __call__(self, x, segment_ids, rope, dropout_key=None, causal_attention=None):
        """x: (batch, length, d_model) -> (batch, length, d_model); ``rope``:
        ``rotary_tables`` of the row's positions."""
        cfg = self.cfg
        dtype = x.dtype
        kernel = attention_lib.resolve(cfg.attention, lengths=(x.shape[1],), dropout_rate=cfg.dropout_rate)
        if kernel == "splash":
            # Projected straight into the kernel's (batch, heads, length, head_dim)
            # layout: no transposes around the kernel.
            q = jnp.einsum("bld,dhk->bhlk", x, self.wq[...].astype(dtype))
            k = jnp.einsum("bld,dhk->bhlk", x, self.wk[...].astype(dtype))
            v = jnp.einsum("bld,dhk->bhlk", x, self.wv[...].astype(dtype))
            q = partitioning.constrain(q, ("batch", "act_heads", "length", None))
            q = layers_lib.name_rotated(apply_rotary(q, rope, heads_axis=1))
            k = layers_lib.name_rotated(apply_rotary(k, rope, heads_axis=1))
            out = attention_lib.splash_attention_bhlk(q, k, v, segment_ids, segment_ids, causal=True,
                                                      scale=1.0 / math.sqrt(q.shape[-1]), prefix=causal_attention)
            return jnp.einsum("bhqk,hkd->bqd", out, self.wo[...].astype(dtype))
        q = jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dtype))
        k = jnp.einsum("bld,dhk->blhk", x, self.wk[...].astype(dtype))
        v = jnp.einsum("bld,dhk->blhk", x, self.wv[...].astype(dtype))
        q = partitioning.constrain(q, ("batch", "length", "act_heads", None))
        q = layers_lib.name_rotated(apply_rotary(q, rope))
        k = layers_lib.name_rotated(apply_rotary(k, rope))
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k).astype(jnp.float32)  # (batch, heads, q, k)
        scores = scores / math.sqrt(q.shape[-1])
        mask = attention_mask(segment_ids, causal_attention)[:, None]  # (batch, 1, q, k)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = _dropout(probs, cfg.dropout_rate, dropout_key).astype(dtype)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
        out = layers_lib.name_attention(out)
        return jnp.einsum("bqhk,hkd->bqd", out, self.wo[...].astype(dtype))

    def cached(self, x, rope, cache, index, mask):
        """Attention of new tokens over a key/value cache (decoding; einsum path,
        no dropout). x: (batch, Lq, d_model) at the positions of ``rope``;
        ``cache``: {"k", "v"} (batch, S, heads, head_dim), keys rotated; the
        new keys and values are written at cache indices ``index`` ..
        ``index + Lq - 1`` (int32 scalar); ``mask``: (batch, Lq, S) bool, the
        cache entries each query sees. Returns ((batch, Lq, d_model), cache)."""
        dtype = x.dtype
        q = apply_rotary(jnp.einsum("bld,dhk->blhk", x, self.wq[...].astype(dtype)), rope)
        k = apply_rotary(jnp.einsum("bld,dhk->blhk", x, self.wk[...].astype(dtype)), rope)
        v = jnp.einsum("bld,dhk->blhk", x, self.wv[...].astype(dtype))
        keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), index, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), index, axis=1)
        scores = jnp.einsum("bqhk,bshk->bhqs", q, keys.astype(dtype)).astype(jnp.float32) / math.sqrt(q.shape[-1])
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bhqs,bshk->bqhk", probs, values.astype(dtype))
        return jnp.einsum("bqhk,hkd->bqd", out, self.wo[...].astype(dtype)), {"k": keys, "v": values}


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

    def __call__(self, x, segment_ids, rope, dropout_key=None, causal_attention=None):
        keys = split_keys(dropout_key, 3)
        rate = self.cfg.dropout_rate
        attn = self.attn(self.attn_norm(x), segment_ids, rope, keys[0], causal_attention)
        x = x + _dropout(attn, rate, keys[1])
        x = partitioning.constrain(x, ("batch", "length", "act_embed"))
        x = x + _dropout(self.mlp(self.mlp_norm(x)), rate, keys[2])
        return partitioning.constrain(x, ("batch", "length", "act_embed"))

    def cached(self, x, rope, cache, index, mask):
        """The block over new tokens with a key/value cache (``Attention.cached``);
        returns (x, cache)."""
        attn, cache = self.attn.cached(self.attn_norm(x), rope, cache, index, mask)
        x = partitioning.constrain(x + attn, ("batch", "length", "act_embed"))
        x = x + self.mlp(self.mlp_norm(x))
        return partitioning.constrain(x, ("batch", "length", "act_embed")), cache


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
        self.blocks = layers_lib.stack([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)],
                                       scan=cfg.scan_layers)
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            self.unembedding = _param(
                rngs, Normal(cfg.init_std), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
            )

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
                 dropout_key: jax.Array | None = None, causal_attention: jax.Array | None = None) -> jax.Array:
        """(batch, length, vocab_size) float32 next-token logits.

        Args:
          inputs: (batch, length) int32 token ids (``shift_right_by_segment``).
          segment_ids: (batch, length) int32, 0 = padding.
          positions: (batch, length) int32, restarting at 0 in each segment.
          dropout_key: PRNG key for dropout; None = no dropout (evaluation).
          causal_attention: (batch, length) int32, 1 on the prefix of a prefix
            LM (``attention_mask``); None = causal everywhere.
        """
        hidden = self.hidden(inputs, segment_ids, positions, dropout_key=dropout_key,
                             causal_attention=causal_attention)
        return self.logits(hidden)

    def _table(self) -> jax.Array:
        # Under fsdp the table is sharded along d_model; gather it whole before the
        # lookup (ZeRO-3 gathers parameters per use) so that the looked-up rows come
        # out split by batch rows, not by d_model.
        return partitioning.constrain(self.embedding[...], ("act_vocab", "act_embed"))

    def hidden(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
               dropout_key: jax.Array | None = None, causal_attention: jax.Array | None = None) -> jax.Array:
        """(batch, length, d_model) final-normed hidden states in the compute
        dtype, the input of ``logits``; arguments as in ``__call__``."""
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        x = jnp.take(self._table(), inputs, axis=0).astype(dtype)  # (batch, length, d_model)
        x = partitioning.constrain(x, ("batch", "length", "act_embed"))
        rope = rotary_tables(positions, cfg.rope_theta, cfg.resolved_head_dim)
        x = layers_lib.apply(
            self.blocks, x, lambda block, y, key: block(y, segment_ids, rope, key, causal_attention),
            dropout_key=dropout_key, remat=cfg.remat)
        return self.final_norm(x)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """(..., d_model) hidden states -> (..., vocab_size) float32 logits."""
        dtype = hidden.dtype
        if self.cfg.tie_embeddings:
            logits = jnp.einsum("...d,vd->...v", hidden, self._table().astype(dtype))
        else:
            logits = jnp.einsum("...d,dv->...v", hidden, self.unembedding[...].astype(dtype))
        return logits.astype(jnp.float32)

    def init_cache(self, batch: int, length: int):
        """A zero key/value cache for ``decode_cached``: per layer {"k", "v"}
        of shape (batch, length, heads, head_dim) in the compute dtype
        (``layers.init_cache`` layout)."""
        cfg = self.cfg
        shape = (batch, length, cfg.num_heads, cfg.resolved_head_dim)
        dtype = DTYPES[cfg.dtype]
        return layers_lib.init_cache(self.blocks, lambda: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)})

    def decode_cached(self, tokens: jax.Array, positions: jax.Array, cache, index: jax.Array, mask: jax.Array):
        """Final-normed hidden states (batch, Lq, d_model) of ``tokens`` (batch,
        Lq) int32 at ``positions`` (batch, Lq) int32, attending to the cache
        entries of ``mask`` (batch, Lq, S) bool after their own keys and values
        are written at cache indices ``index`` .. ``index + Lq - 1``; returns
        (hidden, cache). The same function as ``hidden`` (no dropout) when the
        mask lets each query see the tokens ``attention_mask`` would."""
        cfg = self.cfg
        x = jnp.take(self._table(), tokens, axis=0).astype(DTYPES[cfg.dtype])
        x = partitioning.constrain(x, ("batch", "length", "act_embed"))
        rope = rotary_tables(positions, cfg.rope_theta, cfg.resolved_head_dim)
        x, cache = layers_lib.apply_cached(self.blocks, x, cache,
                                           lambda block, y, c: block.cached(y, rope, c, index, mask))
        return self.final_norm(x), cache

    def batch_hidden(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """``(hidden, targets, loss_weights)`` for a batch of either converter:

        - ``lm``: the feeder's own fields ``targets``, ``targets_segment_ids``,
          ``targets_positions``, ``targets_loss_weights`` (inputs are the targets
          shifted right within each segment, ``shift_right_by_segment``);
        - ``prefix_lm``: t5x's ``decoder_*`` fields with ``decoder_causal_attention``.

        All (batch, length); hidden (batch, length, d_model) in the compute dtype
        (``logits`` maps it to the vocabulary).
        """
        if "targets" in batch:
            targets, segment_ids = batch["targets"], batch["targets_segment_ids"]
            inputs = shift_right_by_segment(targets, segment_ids)
            hidden = self.hidden(inputs, segment_ids, batch["targets_positions"], dropout_key=dropout_key)
            return hidden, targets, batch["targets_loss_weights"]
        hidden = self.hidden(
            batch["decoder_input_tokens"], batch["decoder_segment_ids"], batch["decoder_positions"],
            dropout_key=dropout_key, causal_attention=batch["decoder_causal_attention"],
        )
        return hidden, batch["decoder_target_tokens"], batch["decoder_loss_weights"]

    def batch_logits(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """``(logits, targets, loss_weights)``: ``batch_hidden`` through ``logits``;
        logits (batch, length, vocab_size) float32."""
        hidden, targets, weights = self.batch_hidden(batch, dropout_key=dropout_key)
        return self.logits(hidden), targets, weights


MODEL = Transformer


def shift_right_by_segment(targets: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Decoder inputs from (batch, length) int32 targets and segment ids, as
    seqio's DecoderFeatureConverter builds them for packed data: shifted right
    by one within each segment, 0 at each segment's (and row's) start."""
    shifted = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))
    prev_seg = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    return jnp.where(segment_ids == prev_seg, shifted, 0).astype(jnp.int32)



def apply(graphdef: nnx.GraphDef, params: Any, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array, *,
          dropout_key: jax.Array | None = None) -> jax.Array:
    """Functional call: logits of the model ``graphdef`` with ``params`` (a nested
    dict from ``split_params``). Shapes as in ``Transformer.__call__``."""
    model = nnx.merge(graphdef, params)
    return model(inputs, segment_ids, positions, dropout_key=dropout_key)
