"""Batched decoding and scoring with the trainer's models, compiled over the run's mesh.

``predict(model, batch, config)`` generates ``config.max_decode_length``
tokens per row; ``score(model, batch)`` gives each row's log-likelihood of its
targets. ``batch`` holds raw (unconverted, unpacked) feeder examples padded
with 0, each row's tokens at its start:

==============  =================================================================
model           what ``predict`` reads
==============  =================================================================
decoder, lm     nothing (every row starts from the start token 0), or a prompt
                ``inputs`` (B, Li) that the row continues, causal throughout
decoder,        ``inputs`` (B, Li): the prompt, attended to bidirectionally as
prefix_lm       seqio's ``PrefixLMFeatureConverter`` marks it for training
t5 (encdec)     ``inputs`` (B, Li): the encoder's input
==============  =================================================================

The converter of a decoder is the one training would pick for the batch's
features (``models.converter_for``: ``prefix_lm`` when there are ``inputs``),
unless ``converter=`` says otherwise. A row's prompt length is the number of
its non-zero ``inputs_segment_ids`` when the batch has them, else the index of
its last non-zero token plus one.

Decoder layout (both converters): a row's decoder inputs are the start token 0,
the prompt, then the generated tokens, at positions 0, 1, 2, ... (as
``shift_right_by_segment`` and the prefix LM converter lay them out). With the
key/value cache (``use_cache=True``) the prompts, right-padded to P = Li + 1
tokens with the start token, run in one pass that fills the cache (prefix LM: bidirectional over
the start token and the prompt, the converter's ``decoder_causal_attention``);
generated token t is then written at cache index ``P + t`` for every row, with
its row's own rotary position ``n_r + 1 + t``, and a mask over the cache hides
each row's padding. T5: the encoder and every decoder layer's cross-attention
keys and values run once; the decoder's self-attention keys and values are
cached. ``use_cache=False`` is the reference: the model's full forward pass
(``__call__``, the training path) over the whole sequence at every step.

Generation runs under ``jax.lax.while_loop`` until every row has produced
``eos_id`` or ``max_decode_length`` tokens; a row's positions after its EOS
are 0. Sampling (``method="sample"``): logits divided by ``temperature``, then
top-k (the k largest logits), then top-p (nucleus sampling, Holtzman et al.
2020, arXiv 1904.09751: the smallest set of most likely tokens whose
probability reaches ``top_p``), then one categorical draw. The key of row r at
step t is ``fold_in(fold_in(key(seed), row_offset + r), t)``: a row's tokens
depend on its index in the batch plus ``row_offset`` (the index of the batch's
first row in the whole eval set), so an evaluator that passes ``row_offset``
gets the same tokens however the set is cut into batches, and on any mesh.

Mesh: with ``mesh`` the program is compiled with the parameters sharded as in
training (``rules``, default "dp") and the rows split over ('data', 'fsdp');
rows are padded with empty rows to a multiple of the batch shards. Outputs are
numpy arrays on the host, replicated: on several hosts every process passes the
same global batch and gets every row back.

An empty prompt (a row of zeros) decodes as a language model does: the prefix
is then the start token alone, which attends to itself only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from seqcache.training import decoding_programs as programs
from seqcache.training import sampling
from seqcache.training.config import SPLASH_BLOCK


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How ``predict`` decodes.

    Attributes:
      max_decode_length: tokens to generate per example (>= 1).
      method: "greedy" (argmax) or "sample".
      temperature: divides the logits before sampling (> 0; 0 = greedy).
      top_k: sample among the k most likely tokens; 0 = off.
      top_p: nucleus sampling threshold in (0, 1]; 1.0 = off.
      seed: the sampling seed, taken modulo 2**32 (the module docstring gives
        each row's key).
      eos_id: a row stops at this token (kept); its later positions are 0. A
        negative id never stops a row.

    Raises:
      ValueError: at construction, a field out of range (the message names it).
    """

    max_decode_length: int
    method: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_id: int = 1

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field when a value cannot work."""
        if int(self.max_decode_length) < 1:
            raise ValueError(f"DecodeConfig.max_decode_length must be >= 1 (got {self.max_decode_length})")
        if self.method not in ("greedy", "sample"):
            raise ValueError(f"DecodeConfig.method must be 'greedy' or 'sample' (got {self.method!r})")
        if self.temperature < 0:
            raise ValueError(f"DecodeConfig.temperature must be >= 0 (got {self.temperature})")
        if self.top_k < 0:
            raise ValueError(f"DecodeConfig.top_k must be >= 0, 0 = off (got {self.top_k})")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"DecodeConfig.top_p must be in (0, 1], 1.0 = off (got {self.top_p})")


def predict(model, batch: Mapping[str, Any], config: DecodeConfig, *, mesh=None, use_cache: bool = True,
            rules: str | Mapping[str, Any] = "dp", converter: str | None = None, row_offset: int = 0) -> np.ndarray:
    """Decoded tokens of every row of ``batch``.

    Args:
      model: a trainer model (``nnx.Module`` of ``seqcache.training.models``).
      batch: raw feeder examples padded with 0 (module docstring): ``inputs``
        (B, Li) int for prefix_lm and t5, optional for lm; for lm without
        ``inputs`` any (B, ...) array gives the number of rows.
      config: how to decode.
      mesh: a ('data', 'fsdp', 'model') mesh (``partitioning.make_mesh``);
        None = the default device.
      use_cache: False runs the slow reference decode (the model's full
        forward pass at every step; with ``attention="splash"`` only where
        Li + 1 + max_decode_length, or T5's lengths, fit the kernel).
      rules: a rules preset name or table for the parameters' shardings.
      converter: a decoder's converter ("lm" or "prefix_lm"); None = from the
        batch's features.
      row_offset: index of the batch's first row in the whole set (sampling keys).

    Returns:
      numpy int32 (B, max_decode_length): generated token ids, 0 after a row's EOS.

    Raises:
      ValueError: a batch without the features the model reads, a converter
        that does not feed the model, or a packed batch.
    """
    conv = programs.resolve_converter(model, batch, converter)
    arrays, rows = programs.prompt_arrays(model, batch, conv)
    arrays["row_ids"] = np.arange(rows, dtype=np.int32) + np.int32(row_offset)
    length = int(config.max_decode_length)
    fn = programs.predict_fn(conv, length, use_cache)
    out = programs.run(fn, model, arrays, sampling.knobs(config), mesh=mesh, rules=rules,
                       key=("predict", conv, length, use_cache))
    return np.asarray(out, np.int32)[:rows]


def score(model, batch: Mapping[str, Any], *, mesh=None, rules: str | Mapping[str, Any] = "dp",
          converter: str | None = None) -> np.ndarray:
    """Log-likelihood (natural log) of each row's ``targets`` given its ``inputs``.

    The model reads the batch as training does (the converter's fields, the
    ``batch_logits`` path, no dropout); the sum runs over the target tokens
    (non-zero ``targets_segment_ids`` when given, else the tokens up to the
    last non-zero one).

    Args:
      model, mesh, rules, converter: as in ``predict``.
      batch: raw feeder examples padded with 0: ``targets`` (B, Lt) and, for
        prefix_lm and t5, ``inputs`` (B, Li).

    Returns:
      numpy float32 (B,): sum over each row's target tokens of log p(token).

    Raises:
      ValueError: a batch without the features the model reads, or a packed batch.
    """
    conv = programs.resolve_converter(model, batch, converter)
    multiple = SPLASH_BLOCK if model.cfg.attention == "splash" else 1
    fields, rows = programs.score_fields(batch, conv, multiple=multiple)
    out = programs.run(programs.score_fn(), model, fields, {}, mesh=mesh, rules=rules, key=("score",))
    return np.asarray(out, np.float32)[:rows]
