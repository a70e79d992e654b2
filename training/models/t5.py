"""A T5-style encoder-decoder Transformer in Flax NNX (T5.1.1 by default), aware
of packed (inputs, targets) examples.

Architecture (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with
a Unified Text-to-Text Transformer", JMLR 21(140), arXiv 1910.10683; the T5.1.1
changes of t5x's ``t5_1_1`` configs):

    encoder:  x = dropout(embed(encoder_input_tokens))                 # (batch, Li, d_model)
              for each layer:
                  x = x + dropout(self_attention(rms_norm(x), bias_enc))   # bidirectional
                  x = x + dropout(mlp(rms_norm(x)))
              e = dropout(rms_norm(x))
    decoder:  y = dropout(embed(decoder_input_tokens))                 # (batch, L, d_model)
              for each layer:
                  y = y + dropout(self_attention(rms_norm(y), bias_dec))   # causal
                  y = y + dropout(cross_attention(rms_norm(y), e))
                  y = y + dropout(mlp(rms_norm(y)))
              logits = dropout(rms_norm(y)) @ W_out                    # (batch, L, vocab), float32

- RMSNorm pre-norm without bias or centring (T5's layer norm; Zhang & Sennrich
  2019), ``flax.nnx.RMSNorm``, epsilon ``ModelConfig.norm_eps``.
- No position embeddings: a learned scalar bias per head and *relative position
  bucket* is added to the attention logits (``relative_position_bucket``, the
  mesh-tensorflow scheme T5 uses), one table per stack shared by its layers, as
  in T5. Buckets are bidirectional in the encoder and causal in the decoder;
  cross-attention has none. Logits are not scaled by 1/sqrt(head_dim): T5 folds
  that into the query initialisation.
- MLP: gated GELU (T5.1.1, Shazeer 2020 arXiv 2002.05202) ``(gelu(x W0) * x W1) Wo``,
  or ReLU ``relu(x W0) Wo`` (T5 1.0), or gated SiLU; dropout on the hidden layer.
- Embeddings: one input table shared by encoder and decoder (``share_embeddings``);
  the output layer is a separate (d_model, vocab) matrix (T5.1.1), or, with
  ``tie_embeddings``, the decoder's table transposed with the logits scaled by
  d_model ** -0.5 (T5 1.0).
- Initialisation as in t5x: normal with fan-in scales (each layer's ``Normal``),
  embeddings normal(1.0); ``ModelConfig.init_std`` is not used.
- Attention is ``jax.nn.dot_product_attention`` with a boolean mask and the
  relative bias. Cross-attention, which has no bias, runs the fused splash
  kernel where ``ModelConfig.attention`` resolves to it
  (``seqcache.training.models.attention``). Self-attention, whose logits take
  the bias, runs Pallas flash attention with the bias as a kernel input
  (``attention.biased_attention``) where ``attention`` is "splash"; with
  "auto" it stays on the einsum path until the fused one is measured on the
  chip. Dropout is on the embeddings, the residual branches, the MLP
  hidden layer and the stacks' outputs, not on the attention probabilities
  (unlike t5x; T5.1.1 pre-trains with dropout 0 anyway).

Packed examples: segment k of an encoder row is the input of segment k of the
decoder row (first-fit packing numbers them alike); 0 marks padding. Masks, all
also requiring a non-zero query segment:

    encoder self-attention   encoder_segment_ids[q] == encoder_segment_ids[k]
    decoder self-attention   decoder_segment_ids[q] == decoder_segment_ids[k] and k <= q
    cross-attention          decoder_segment_ids[q] == encoder_segment_ids[k]

Relative buckets come from the token's index in the row, not its given position:
within a segment (the only pairs a mask lets through) index differences equal
position differences, so the bias is the same as if each example had its own
row, and one (heads, q, k) bias serves the whole batch.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from seqcache.training import partitioning
from seqcache.training.config import ModelConfig
from seqcache.training.models import attention as attention_lib
from seqcache.training.models import layers as layers_lib
from seqcache.training.models.common import (DTYPES, Normal, Ones, dropout, make_value, param, segment_mask,
                                             split_keys)


def relative_position_bucket(
    relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> np.ndarray:
    """T5's relative position buckets (mesh-tensorflow
    ``transformer/attention.py`` ``_relative_position_bucket``; Raffel et al.
    2020, section 2.1; Shaw et al. 2018 for relative positions).

    ``relative_position`` (int array, any shape) is key position minus query
    position. Bidirectional (encoder): half the buckets for keys before the
    query, half for keys after it; causal (decoder): keys after the query fall
    in bucket 0. In each half of n buckets, distances below n/2 have a bucket
    each and larger ones share the rest logarithmically up to ``max_distance``,
    from which on they share the last bucket.

    Returns:
      int32 bucket indices in [0, num_buckets), same shape.
    """
    n = -np.asarray(relative_position, dtype=np.int64)  # > 0: the key is before the query
    ret = np.zeros_like(n)
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).astype(np.int64) * num_buckets
        n = np.abs(n)
    else:
        n = np.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # float32 as mesh-tensorflow computes it (np.finfo eps keeps log(0) finite;
    # that branch is not taken for n < max_exact anyway).
    scaled = np.log(n.astype(np.float32) / max_exact + np.finfo(np.float32).eps) / math.log(max_distance / max_exact)
    val_if_large = max_exact + (scaled * (num_buckets - max_exact)).astype(np.int64)
    val_if_large = np.minimum(val_if_large, num_buckets - 1)
    return (ret + np.where(is_small, n, val_if_large)).astype(np.int32)


class RelativePositionBias(nnx.Module):
    """A learned scalar per (bucket, head), added to the attention logits."""

    def __init__(self, cfg: ModelConfig, *, bidirectional: bool, rngs: nnx.Rngs):
        buckets, heads = cfg.relative_attention_num_buckets, cfg.num_heads
        self.bidirectional = bidirectional
        self.num_buckets = buckets
        self.max_distance = cfg.relative_attention_max_distance
        std = ((buckets + heads) / 2) ** -0.5
        self.embedding = param(rngs, Normal(std), (buckets, heads), ("relpos_buckets", "heads"))

    def __call__(self, q_length: int, k_length: int, dtype) -> jax.Array:
        """(1, heads, q_length, k_length) bias of the given dtype."""
        relative = np.arange(k_length)[None, :] - np.arange(q_length)[:, None]  # (q, k): key - query
        buckets = relative_position_bucket(relative, bidirectional=self.bidirectional,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        values = jnp.take(self.embedding[...], jnp.asarray(buckets), axis=0)  # (q, k, heads)
        return jnp.transpose(values, (2, 0, 1))[None].astype(dtype)


def rms_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    """``nnx.RMSNorm`` over d_model with a float32 scale named ('norm',), computed
    in the model's dtype (statistics in float32)."""
    return nnx.RMSNorm(
        cfg.d_model, epsilon=cfg.norm_eps, dtype=DTYPES[cfg.dtype], param_dtype=jnp.float32,
        scale_init=lambda key, shape, dtype: make_value(key, Ones(), tuple(shape), ("norm",)),
        scale_metadata={"out_sharding": ("norm",), "eager_sharding": False}, rngs=rngs,
    )


class Attention(nnx.Module):
    """Multi-head attention (self or cross) with T5's initialisation and no
    logit scaling."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim
        self.kernel = cfg.attention
        self.wq = param(rngs, Normal((d * k) ** -0.5), (d, h, k), ("embed", "heads", "kv"))
        self.wk = param(rngs, Normal(d ** -0.5), (d, h, k), ("embed", "heads", "kv"))
        self.wv = param(rngs, Normal(d ** -0.5), (d, h, k), ("embed", "heads", "kv"))
        self.wo = param(rngs, Normal((h * k) ** -0.5), (h, k, d), ("heads", "kv", "embed"))

    def __call__(self, x_q: jax.Array, x_kv: jax.Array, mask: jax.Array, bias: jax.Array | None,
                 segments: tuple[jax.Array, jax.Array] | None = None, causal: bool = False) -> jax.Array:
        """x_q: (batch, q, d_model), x_kv: (batch, k, d_model), mask: (batch, 1, q, k)
        bool, bias: (1, heads, q, k) or None -> (batch, q, d_model). With
        ``segments`` ((batch, q), (batch, k) int32 segment ids that give the
        same mask, with ``causal`` where it is causal) a fused kernel may run
        instead (``ModelConfig.attention``): splash without a bias, flash
        attention with the bias as its input where the kernel is "splash"."""
        dtype = x_q.dtype
        q = jnp.einsum("bld,dhk->blhk", x_q, self.wq[...].astype(dtype))
        k = jnp.einsum("bld,dhk->blhk", x_kv, self.wk[...].astype(dtype))
        v = jnp.einsum("bld,dhk->blhk", x_kv, self.wv[...].astype(dtype))
        q = partitioning.constrain(q, ("batch", "length", "act_heads", None))
        fused = (segments is not None
                 and attention_lib.resolve(self.kernel, lengths=(q.shape[1], k.shape[1])) == "splash")
        if fused and bias is None:
            out = attention_lib.splash_attention(q, k, v, *segments, causal=causal, scale=1.0)
        elif fused and self.kernel == "splash":
            out = attention_lib.biased_attention(q, k, v, bias, *segments, causal=causal)
        else:
            out = jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=1.0, implementation="xla")
        return jnp.einsum("bqhk,hkd->bqd", out, self.wo[...].astype(dtype))

    def project_kv(self, x_kv: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x_kv: (batch, k, d_model) -> keys and values, each (batch, k, heads, head_dim)."""
        dtype = x_kv.dtype
        return (jnp.einsum("bld,dhk->blhk", x_kv, self.wk[...].astype(dtype)),
                jnp.einsum("bld,dhk->blhk", x_kv, self.wv[...].astype(dtype)))

    def attend(self, x_q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
               bias: jax.Array | None) -> jax.Array:
        """``__call__`` on keys and values already projected (``project_kv``;
        decoding): x_q (batch, q, d_model), k and v (batch, k, heads, head_dim),
        mask (batch, 1, q, k) bool, bias (1, heads, q, k) or None -> (batch, q, d_model)."""
        dtype = x_q.dtype
        q = jnp.einsum("bld,dhk->blhk", x_q, self.wq[...].astype(dtype))
        out = jax.nn.dot_product_attention(q, k.astype(dtype), v.astype(dtype), bias=bias, mask=mask, scale=1.0,
                                           implementation="xla")
        return jnp.einsum("bqhk,hkd->bqd", out, self.wo[...].astype(dtype))


class MLP(nnx.Module):
    """T5's feed-forward block: gated GELU / gated SiLU (``(act(x W0) * x W1) Wo``)
    or ReLU (``relu(x W0) Wo``), dropout on the hidden layer."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        self.activation = cfg.mlp_activation
        self.rate = cfg.dropout_rate
        self.wi_0 = param(rngs, Normal(d ** -0.5), (d, f), ("embed", "mlp"))
        if self.activation != "relu":
            self.wi_1 = param(rngs, Normal(d ** -0.5), (d, f), ("embed", "mlp"))
        self.wo = param(rngs, Normal(f ** -0.5), (f, d), ("mlp", "embed"))

    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        """x: (batch, length, d_model) -> (batch, length, d_model)."""
        dtype = x.dtype
        h0 = jnp.einsum("bld,df->blf", x, self.wi_0[...].astype(dtype))
        if self.activation == "relu":
            hidden = jax.nn.relu(h0)
        else:
            act = jax.nn.gelu if self.activation == "geglu" else jax.nn.silu
            # T5.1.1's gated GELU uses the tanh approximation (jax.nn.gelu's default).
            hidden = act(h0) * jnp.einsum("bld,df->blf", x, self.wi_1[...].astype(dtype))
        hidden = partitioning.constrain(hidden, ("batch", "length", "act_mlp"))
        hidden = dropout(hidden, self.rate, dropout_key)
        return jnp.einsum("blf,fd->bld", hidden, self.wo[...].astype(dtype))


def _residual(x, branch, rate, key):
    x = x + dropout(branch, rate, key)
    return partitioning.constrain(x, ("batch", "length", "act_embed"))


class EncoderLayer(nnx.Module):
    """Pre-norm self-attention then MLP, each on a residual branch."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.rate = cfg.dropout_rate
        self.attn_norm = rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, mask, bias, dropout_key=None, segments=None):
        keys = split_keys(dropout_key, 3)
        h = self.attn_norm(x)
        x = _residual(x, self.attn(h, h, mask, bias, segments=segments), self.rate, keys[0])
        return _residual(x, self.mlp(self.mlp_norm(x), keys[1]), self.rate, keys[2])


class DecoderLayer(nnx.Module):
    """Pre-norm causal self-attention, cross-attention, then MLP."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.rate = cfg.dropout_rate
        self.self_attn_norm = rms_norm(cfg, rngs)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.cross_attn_norm = rms_norm(cfg, rngs)
        self.cross_attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, y, encoded, self_mask, cross_mask, bias, dropout_key=None, cross_segments=None):
        keys = split_keys(dropout_key, 4)
        h = self.self_attn_norm(y)
        self_segments = None if cross_segments is None else (cross_segments[0], cross_segments[0])
        y = _residual(y, self.self_attn(h, h, self_mask, bias, segments=self_segments, causal=True), self.rate,
                      keys[0])
        cross = self.cross_attn(self.cross_attn_norm(y), encoded, cross_mask, None, segments=cross_segments)
        y = _residual(y, cross, self.rate, keys[1])
        return _residual(y, self.mlp(self.mlp_norm(y), keys[2]), self.rate, keys[3])

    def cached(self, y, cache, index, self_mask, x_mask, bias):
        """The layer over new decoder tokens y (batch, Lq, d_model) with a cache
        (``T5.decode_cached``): {"k", "v"} (batch, S, heads, head_dim) of the
        self-attention, written at ``index``, and {"ck", "cv"} (batch, Li,
        heads, head_dim) of the cross-attention, read only. Returns (y, cache)."""
        h = self.self_attn_norm(y)
        k, v = self.self_attn.project_kv(h)
        keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), index, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), index, axis=1)
        y = _residual(y, self.self_attn.attend(h, keys, values, self_mask, bias), 0.0, None)
        y = _residual(y, self.cross_attn.attend(self.cross_attn_norm(y), cache["ck"], cache["cv"], x_mask, None),
                      0.0, None)
        y = _residual(y, self.mlp(self.mlp_norm(y)), 0.0, None)
        return y, {**cache, "k": keys, "v": values}


def encoder_mask(encoder_segment_ids: jax.Array) -> jax.Array:
    """(batch, Li) int32 -> (batch, 1, Li, Li) bool: same non-zero segment."""
    return segment_mask(encoder_segment_ids, encoder_segment_ids)[:, None]


def decoder_mask(decoder_segment_ids: jax.Array) -> jax.Array:
    """(batch, L) int32 -> (batch, 1, L, L) bool: causal and same non-zero segment."""
    length = decoder_segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    return (segment_mask(decoder_segment_ids, decoder_segment_ids) & causal[None])[:, None]


def cross_mask(decoder_segment_ids: jax.Array, encoder_segment_ids: jax.Array) -> jax.Array:
    """(batch, L), (batch, Li) int32 -> (batch, 1, L, Li) bool: a decoder token
    sees the encoder tokens of its own (non-zero) segment."""
    return segment_mask(decoder_segment_ids, encoder_segment_ids)[:, None]


class T5(nnx.Module):
    """T5-style encoder-decoder (see the module docstring).

    Args:
      cfg: the model config, ``architecture="t5"``; ``cfg.vocab_size`` must be set.
      rngs: ``nnx.Rngs`` with a ``params`` stream for initialisation.

    Raises:
      ConfigError: an invalid ``cfg`` (``ModelConfig.validate``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        cfg.validate()
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.d_model
        self.embedding = param(rngs, Normal(1.0), (v, d), ("vocab", "embed"))
        if not cfg.share_embeddings:
            self.decoder_embedding = param(rngs, Normal(1.0), (v, d), ("vocab", "embed"))
        self.encoder_bias = RelativePositionBias(cfg, bidirectional=True, rngs=rngs)
        self.encoder_layers = layers_lib.stack([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)],
                                               scan=cfg.scan_layers)
        self.encoder_norm = rms_norm(cfg, rngs)
        self.decoder_bias = RelativePositionBias(cfg, bidirectional=False, rngs=rngs)
        self.decoder_layers = layers_lib.stack(
            [DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.resolved_num_decoder_layers)], scan=cfg.scan_layers)
        self.decoder_norm = rms_norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.output = param(rngs, Normal(d ** -0.5), (d, v), ("embed", "vocab"))

    def _embed(self, table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
        # Gathered whole before the lookup under fsdp (as in the decoder model),
        # so that the looked-up rows come out split by batch rows.
        table = partitioning.constrain(table, ("act_vocab", "act_embed"))
        x = jnp.take(table, tokens, axis=0).astype(dtype)
        return partitioning.constrain(x, ("batch", "length", "act_embed"))

    def encode(self, encoder_input_tokens, encoder_segment_ids, *, dropout_key=None) -> jax.Array:
        """(batch, Li) int32 tokens and segment ids -> (batch, Li, d_model) encodings."""
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        keys = split_keys(dropout_key, 2)
        x = dropout(self._embed(self.embedding[...], encoder_input_tokens, dtype), cfg.dropout_rate, keys[0])
        length = encoder_input_tokens.shape[1]
        mask = encoder_mask(encoder_segment_ids)
        bias = self.encoder_bias(length, length, dtype)
        segments = (encoder_segment_ids, encoder_segment_ids)
        x = layers_lib.apply(self.encoder_layers, x, lambda layer, y, key: layer(y, mask, bias, key, segments),
                             dropout_key=dropout_key, key_offset=2, remat=cfg.remat)
        return dropout(self.encoder_norm(x), cfg.dropout_rate, keys[1])

    def decode(self, encoded, encoder_segment_ids, decoder_input_tokens, decoder_segment_ids, *,
               dropout_key=None) -> jax.Array:
        """Logits (batch, L, vocab_size) float32 of the decoder over ``encoded``
        (batch, Li, d_model)."""
        return self.logits(self.decode_hidden(encoded, encoder_segment_ids, decoder_input_tokens,
                                              decoder_segment_ids, dropout_key=dropout_key))

    def _decoder_table(self) -> jax.Array:
        return self.embedding[...] if self.cfg.share_embeddings else self.decoder_embedding[...]

    def decode_hidden(self, encoded, encoder_segment_ids, decoder_input_tokens, decoder_segment_ids, *,
                      dropout_key=None) -> jax.Array:
        """The decoder's final hidden states (batch, L, d_model) in the compute
        dtype, the input of ``logits``; arguments as in ``decode``."""
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        keys = split_keys(dropout_key, 2)
        y = dropout(self._embed(self._decoder_table(), decoder_input_tokens, dtype), cfg.dropout_rate, keys[0])
        length = decoder_input_tokens.shape[1]
        self_mask = decoder_mask(decoder_segment_ids)
        x_mask = cross_mask(decoder_segment_ids, encoder_segment_ids)
        bias = self.decoder_bias(length, length, dtype)
        segments = (decoder_segment_ids, encoder_segment_ids)
        y = layers_lib.apply(
            self.decoder_layers, y,
            lambda layer, z, key: layer(z, encoded, self_mask, x_mask, bias, key, cross_segments=segments),
            dropout_key=dropout_key, key_offset=2, remat=cfg.remat)
        return dropout(self.decoder_norm(y), cfg.dropout_rate, keys[1])

    def init_cache(self, encoded: jax.Array, length: int):
        """The decoding cache over ``encoded`` (batch, Li, d_model) for up to
        ``length`` decoder tokens: per decoder layer the cross-attention keys and
        values of the encodings ("ck", "cv", computed here once) and a zero
        self-attention cache ("k", "v", (batch, length, heads, head_dim)), in the
        compute dtype."""
        cfg = self.cfg
        dtype = DTYPES[cfg.dtype]
        b, li = encoded.shape[:2]
        heads, head_dim = cfg.num_heads, cfg.resolved_head_dim

        def make():
            own, other = (b, length, heads, head_dim), (b, li, heads, head_dim)
            return {"k": jnp.zeros(own, dtype), "v": jnp.zeros(own, dtype),
                    "ck": jnp.zeros(other, dtype), "cv": jnp.zeros(other, dtype)}

        def cross(layer, x, c):
            ck, cv = layer.cross_attn.project_kv(encoded.astype(dtype))
            return x, {**c, "ck": ck.astype(dtype), "cv": cv.astype(dtype)}

        _, cache = layers_lib.apply_cached(self.decoder_layers, jnp.zeros((), dtype),
                                           layers_lib.init_cache(self.decoder_layers, make), cross)
        return cache

    def decode_cached(self, tokens: jax.Array, cache, index: jax.Array, self_mask: jax.Array, x_mask: jax.Array,
                      bias: jax.Array):
        """The decoder's final hidden states (batch, Lq, d_model) of ``tokens``
        (batch, Lq) int32 at decoder indices ``index`` .. ``index + Lq - 1``
        (int32 scalar), with ``cache`` from ``init_cache``; ``self_mask`` (batch,
        1, Lq, S) and ``x_mask`` (batch, 1, Lq, Li) bool, ``bias`` (1, heads,
        Lq, S) the rows of ``decoder_bias`` for these indices. Returns
        (hidden, cache); no dropout."""
        y = self._embed(self._decoder_table(), tokens, DTYPES[self.cfg.dtype])
        y, cache = layers_lib.apply_cached(
            self.decoder_layers, y, cache, lambda layer, z, c: layer.cached(z, c, index, self_mask, x_mask, bias))
        return self.decoder_norm(y), cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """(..., d_model) decoder hidden states -> (..., vocab_size) float32 logits."""
        cfg = self.cfg
        dtype = hidden.dtype
        if cfg.tie_embeddings:
            table = partitioning.constrain(self._decoder_table(), ("act_vocab", "act_embed"))
            logits = jnp.einsum("...d,vd->...v", hidden, table.astype(dtype)) * (cfg.d_model ** -0.5)
        else:
            logits = jnp.einsum("...d,dv->...v", hidden, self.output[...].astype(dtype))
        return logits.astype(jnp.float32)

    def __call__(self, encoder_input_tokens, encoder_segment_ids, decoder_input_tokens, decoder_segment_ids, *,
                 dropout_key: jax.Array | None = None) -> jax.Array:
        """(batch, L, vocab_size) float32 logits of the decoder.

        Args:
          encoder_input_tokens, encoder_segment_ids: (batch, Li) int32; segment 0 = padding.
          decoder_input_tokens: (batch, L) int32 (targets shifted right per segment).
          decoder_segment_ids: (batch, L) int32; segment k reads encoder segment k.
          dropout_key: PRNG key for dropout; None = no dropout (evaluation).
        """
        return self.logits(self._hidden(encoder_input_tokens, encoder_segment_ids, decoder_input_tokens,
                                        decoder_segment_ids, dropout_key=dropout_key))

    def _hidden(self, encoder_input_tokens, encoder_segment_ids, decoder_input_tokens, decoder_segment_ids, *,
                dropout_key=None) -> jax.Array:
        enc_key, dec_key = split_keys(dropout_key, 2)
        encoded = self.encode(encoder_input_tokens, encoder_segment_ids, dropout_key=enc_key)
        return self.decode_hidden(encoded, encoder_segment_ids, decoder_input_tokens, decoder_segment_ids,
                                  dropout_key=dec_key)

    def batch_hidden(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """``(decoder hidden states, decoder_target_tokens, decoder_loss_weights)``
        for an ``encdec`` batch (t5x field names, ``seqcache.feeders.converters``);
        ``logits`` maps the hidden states to the vocabulary."""
        hidden = self._hidden(batch["encoder_input_tokens"], batch["encoder_segment_ids"],
                              batch["decoder_input_tokens"], batch["decoder_segment_ids"], dropout_key=dropout_key)
        return hidden, batch["decoder_target_tokens"], batch["decoder_loss_weights"]

    def batch_logits(self, batch: dict, *, dropout_key: jax.Array | None = None):
        """``(logits, decoder_target_tokens, decoder_loss_weights)``: ``batch_hidden``
        through ``logits``."""
        hidden, targets, weights = self.batch_hidden(batch, dropout_key=dropout_key)
        return self.logits(hidden), targets, weights


MODEL = T5
