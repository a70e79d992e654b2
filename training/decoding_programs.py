"""The compiled programs behind ``seqcache.training.decoding``: the batch's
arrays, one decode program per architecture (with and without the key/value
cache), the scoring program, and their compilation over a mesh. The layouts
are described in ``seqcache.training.decoding``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from seqcache.feeders import converters as converters_lib
from seqcache.training import models, partitioning, sampling
from seqcache.training.models import common as model_lib


def resolve_converter(model, batch: Mapping[str, Any], converter: str | None) -> str:
    """The converter the model reads ``batch`` with: ``converter`` if given,
    else the one training would pick from the batch's features.

    Raises:
      ValueError: a converter that does not feed the model's architecture, or a
        batch without the features the model reads.
    """
    arch = model.cfg.architecture
    allowed = [c for c, _ in models.architecture(arch).converters]
    if converter is not None:
        if converter not in allowed:
            raise ValueError(f"decoding: converter {converter!r} does not feed architecture {arch!r} "
                             f"(converters: {allowed})")
        return converter
    if arch == "decoder":  # as models.converter_for picks: a prompt makes a prefix LM
        return "prefix_lm" if "inputs" in batch else "lm"
    if "inputs" in batch:  # the targets are what is decoded
        return models.default_converter(arch)
    return models.converter_for(arch, [f for f in ("inputs", "targets") if f in batch], cache="decoding batch")


def _rows(batch: Mapping[str, Any]) -> int:
    for name in ("inputs", "targets"):
        if name in batch:
            return int(np.shape(batch[name])[0])
    for value in batch.values():
        if isinstance(value, (np.ndarray, jax.Array)) and value.ndim:
            return int(value.shape[0])
    raise ValueError(f"decoding: the batch has no array to count its rows (features {sorted(batch)})")


def _feature(batch: Mapping[str, Any], name: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens (B, L) int32 with 0 after each row's length, lengths (B,) int32)
    of feature ``name``: the non-zero ``{name}_segment_ids`` when the batch has
    them, else up to the last non-zero token.

    Raises:
      ValueError: a missing feature, a rank other than 2, or a packed row.
    """
    if name not in batch:
        raise ValueError(f"decoding: the batch has no feature {name!r} (features {sorted(batch)})")
    tokens = np.asarray(batch[name])
    if tokens.ndim != 2:
        raise ValueError(f"decoding: feature {name!r} has shape {tokens.shape}; expected (batch, length)")
    index = np.arange(tokens.shape[1])
    segments = batch.get(f"{name}_segment_ids")
    if segments is not None:
        segments = np.asarray(segments)
        if segments.size and segments.max() > 1:
            raise ValueError(f"decoding: feature {name!r} is packed ({name}_segment_ids up to {segments.max()}); "
                             "decode an unpacked cache, one example a row")
        lengths = (segments != 0).sum(axis=1)
    else:
        lengths = np.where(tokens != 0, index + 1, 0).max(axis=1, initial=0)
    tokens = np.where(index[None, :] < lengths[:, None], tokens, 0)
    return tokens.astype(np.int32), lengths.astype(np.int32)


def prompt_arrays(model, batch: Mapping[str, Any], converter: str) -> tuple[dict[str, np.ndarray], int]:
    """(arrays, rows): a decoder's ``prompt`` (B, Li + 1) int32 (the start
    token 0, then the prompt) and ``lengths`` (B,) int32, or T5's
    ``encoder_tokens`` and ``encoder_segment_ids`` (B, Li) int32."""
    rows = _rows(batch)
    if converter == "encdec":
        tokens, lengths = _feature(batch, "inputs")
        segments = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int32)
        return {"encoder_tokens": tokens, "encoder_segment_ids": segments}, rows
    if converter == "lm" and "inputs" not in batch:
        tokens, lengths = np.zeros((rows, 0), np.int32), np.zeros((rows,), np.int32)
    else:
        tokens, lengths = _feature(batch, "inputs")
    prompt = np.concatenate([np.zeros((rows, 1), np.int32), tokens], axis=1)
    return {"prompt": prompt, "lengths": lengths}, rows


def _feeder_like(batch: Mapping[str, Any], name: str) -> dict[str, np.ndarray]:
    tokens, lengths = _feature(batch, name)
    segments = (np.arange(tokens.shape[1])[None, :] < lengths[:, None]).astype(np.int32)
    return {name: tokens, f"{name}_segment_ids": segments,
            f"{name}_positions": (np.cumsum(segments, axis=1) - 1) * segments,
            f"{name}_loss_weights": segments.astype(np.float32)}


def _pad_length(fields: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Each (B, L) field padded with 0 to a length that is a multiple of ``multiple``."""
    return {k: np.pad(v, [(0, 0), (0, -v.shape[1] % multiple)]) for k, v in fields.items()}


def score_fields(batch: Mapping[str, Any], converter: str, *, multiple: int = 1) -> tuple[dict[str, np.ndarray], int]:
    """(fields, rows): the converter's training fields of ``batch``
    (``seqcache.feeders.converters``), every target token weighted 1, each
    feature padded to a multiple of ``multiple`` tokens (the splash kernel's
    block, for a model whose ``attention`` is "splash")."""
    rows = _rows(batch)
    targets = _pad_length(_feeder_like(batch, "targets"), multiple)
    if converter == "lm":
        return targets, rows
    inputs = _pad_length(_feeder_like(batch, "inputs"), multiple)
    if converter == "encdec":
        fields = converters_lib.convert_encdec({"inputs": inputs, "targets": targets})
    else:
        length = inputs["inputs"].shape[1] + targets["targets"].shape[1]
        fields = converters_lib.convert_prefix_lm({"inputs": inputs, "targets": targets}, length=length)
    return {k: v for k, v in fields.items() if k.startswith(("encoder_", "decoder_"))}, rows


def score_fn() -> Callable:
    """``fn(model, fields, knob) -> (B,) float32``: the sum of log-softmax of
    each row's target tokens where the loss weight is positive (``knob`` unused)."""

    def fn(module, fields, knob):
        del knob
        logits, targets, weights = module.batch_logits(fields)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(weights > 0, logp, 0.0), axis=-1)

    return fn


def predict_fn(converter: str, length: int, use_cache: bool) -> Callable:
    """``fn(model, arrays, knob) -> (B, length) int32``: the decode program of
    the converter's architecture (``prompt_arrays``' arrays plus ``row_ids``
    (B,) int32; ``knob``: ``sampling.knobs``)."""
    if converter == "encdec":
        return functools.partial(_t5_cached if use_cache else _t5_slow, length=length)
    program = _decoder_cached if use_cache else _decoder_slow
    return functools.partial(program, length=length, prefix=converter == "prefix_lm")


def _decoder_cached(model, arrays, knob, *, length: int, prefix: bool):
    prompt, n = arrays["prompt"], arrays["lengths"]
    rows, p = prompt.shape
    total = p + length
    idx = jnp.arange(total)
    seen = idx[None, :] <= n[:, None]  # (B, S): the start token and the prompt
    q = jnp.arange(p)
    mask = seen[:, None, :] if prefix else seen[:, None, :] & (idx[None, None, :] <= q[None, :, None])
    mask = jnp.broadcast_to(mask, (rows, p, total))
    positions = jnp.broadcast_to(q[None, :], (rows, p))
    hidden, cache = model.decode_cached(prompt, positions, model.init_cache(rows, total), jnp.int32(0), mask)
    first = model.logits(jnp.take_along_axis(hidden, n[:, None, None], axis=1))[:, 0]

    def step(cache, t, token):
        at = p + t
        visible = (seen | ((idx >= p) & (idx <= at))[None, :])[:, None, :]
        hidden, cache = model.decode_cached(token[:, None], (n + 1 + t)[:, None], cache, at, visible)
        return model.logits(hidden)[:, 0], cache

    return sampling.generate(first, cache, step, length, knob, arrays["row_ids"])


def _decoder_slow(model, arrays, knob, *, length: int, prefix: bool):
    prompt, n = arrays["prompt"], arrays["lengths"]
    rows, p = prompt.shape
    total = p + length
    idx = jnp.arange(total)
    seq = jnp.pad(prompt, ((0, 0), (0, total - p)))
    positions = jnp.broadcast_to(idx[None, :], (rows, total))
    causal = (idx[None, :] <= n[:, None]).astype(jnp.int32) if prefix else None

    def logits_at(seq, at):
        segments = (idx[None, :] <= at[:, None]).astype(jnp.int32)
        logits = model(seq, segments, positions, causal_attention=causal)
        return jnp.take_along_axis(logits, at[:, None, None], axis=1)[:, 0]

    def step(seq, t, token):
        at = n + 1 + t
        seq = jnp.where(idx[None, :] == at[:, None], token[:, None], seq)
        return logits_at(seq, at), seq

    return sampling.generate(logits_at(seq, n), seq, step, length, knob, arrays["row_ids"])


def _t5_cached(model, arrays, knob, *, length: int):
    tokens, segments = arrays["encoder_tokens"], arrays["encoder_segment_ids"]
    rows, total = tokens.shape[0], length + 1
    encoded = model.encode(tokens, segments)
    x_mask = (segments != 0)[:, None, None, :]
    bias = model.decoder_bias(total, total, encoded.dtype)  # (1, heads, S, S)
    idx = jnp.arange(total)

    def run(token, at, cache):
        self_mask = jnp.broadcast_to((idx <= at)[None, None, None, :], (rows, 1, 1, total))
        row_bias = jax.lax.dynamic_slice_in_dim(bias, at, 1, axis=2)
        hidden, cache = model.decode_cached(token[:, None], cache, at, self_mask, x_mask, row_bias)
        return model.logits(hidden)[:, 0], cache

    first, cache = run(jnp.zeros((rows,), jnp.int32), jnp.int32(0), model.init_cache(encoded, total))
    return sampling.generate(first, cache, lambda c, t, token: run(token, t + 1, c), length, knob, arrays["row_ids"])


def _t5_slow(model, arrays, knob, *, length: int):
    tokens, segments = arrays["encoder_tokens"], arrays["encoder_segment_ids"]
    rows, total = tokens.shape[0], length + 1
    idx = jnp.arange(total)

    def logits_at(dec, at):
        dec_segments = jnp.broadcast_to((idx <= at).astype(jnp.int32)[None, :], (rows, total))
        logits = model(tokens, segments, dec, dec_segments)
        return jax.lax.dynamic_index_in_dim(logits, at, axis=1, keepdims=False)

    def step(dec, t, token):
        dec = jax.lax.dynamic_update_slice_in_dim(dec, token[:, None], t + 1, axis=1)
        return logits_at(dec, t + 1), dec

    dec = jnp.zeros((rows, total), jnp.int32)
    return sampling.generate(logits_at(dec, jnp.int32(0)), dec, step, length, knob, arrays["row_ids"])


# Compiled programs by (graphdef, program key, mesh, rules, array layout); the
# oldest is dropped past _MAX_PROGRAMS.
_PROGRAMS: dict = {}
_MAX_PROGRAMS = 32


def _pad_rows(arrays: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    rows = next(iter(arrays.values())).shape[0]
    extra = -rows % multiple
    if not extra:
        return arrays
    return {k: np.pad(v, [(0, extra)] + [(0, 0)] * (v.ndim - 1)) for k, v in arrays.items()}


def run(fn: Callable, model, arrays: dict[str, np.ndarray], knob: dict[str, np.ndarray], *, mesh=None,
        rules="dp", key: tuple) -> np.ndarray:
    """``fn(model, arrays, knob)`` compiled once per (model structure, ``key``,
    mesh, rules, array names and ranks) and run: on the default device, or
    over ``mesh`` with the parameters sharded by ``rules``, the rows of
    ``arrays`` split over the batch axes (padded with zero rows to a multiple
    of the batch shards) and the scalars of ``knob`` replicated. Returns the
    host copy of the result, padded rows included."""
    graphdef, params = model_lib.split_params(model)
    layout = tuple(sorted((k, v.ndim) for k, v in arrays.items()))
    if mesh is None:
        table, context = None, contextlib.nullcontext()
    else:
        table = partitioning.get_rules(rules) if isinstance(rules, str) else dict(rules)
        context = partitioning.activation_rules(mesh, table)
        arrays = _pad_rows(arrays, partitioning.data_parallel_size(mesh))
    rules_key = None if table is None else tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                                                        for k, v in table.items()))  # lists made hashable
    cache_key = (graphdef, key, mesh, rules_key, layout)
    entry = _PROGRAMS.get(cache_key)
    if entry is None:
        entry = _compile(fn, graphdef, model, params, arrays, mesh, table)
        if len(_PROGRAMS) >= _MAX_PROGRAMS:
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[cache_key] = entry
    jitted, param_shardings, array_shardings = entry
    if mesh is not None:
        params = jax.device_put(params, param_shardings)
        arrays = {k: _global(v, array_shardings[k]) for k, v in arrays.items()}
        knob = {k: _global(v, partitioning.replicated(mesh)) for k, v in knob.items()}
    with context:
        out = jitted(params, arrays, knob)
    return np.asarray(jax.device_get(out))


def _global(value: np.ndarray, sharding) -> jax.Array:
    """A global array from the whole ``value`` that every process holds (each
    device takes its slice: no transfer between hosts)."""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def _compile(fn, graphdef, model, params, arrays, mesh, table):
    def call(p, a, k):
        return fn(nnx.merge(graphdef, p), a, k)

    if mesh is None:
        return jax.jit(call), None, None
    specs = partitioning.param_specs(params, model_lib.logical_axes(model), table, mesh)
    param_shardings = partitioning.named_shardings(specs, mesh)
    array_shardings = {k: NamedSharding(mesh, P(partitioning.BATCH_AXES, *[None] * (v.ndim - 1)))
                       for k, v in arrays.items()}
    jitted = jax.jit(call, in_shardings=(param_shardings, array_shardings, partitioning.replicated(mesh)),
                     out_shardings=partitioning.replicated(mesh))
    return jitted, param_shardings, array_shardings
