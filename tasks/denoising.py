"""T5's unsupervised objectives: noise masks, span corruption, prefix LM, denoise.

A numpy rebuild of ``t5.data.preprocessors`` (``random_spans_helper``,
``random_spans_noise_mask``, ``random_prefix_noise_mask``, ``iid_noise_mask``,
``noise_span_to_unique_sentinel``, ``nonnoise_span_to_unique_sentinel``,
``drop_noise_tokens``, ``drop_nonnoise_tokens``, ``select_random_chunk``,
``denoise``, ``span_corruption``, ``prefix_lm``), following Raffel et al. 2020,
"Exploring the Limits of Transfer Learning with a Unified Text-to-Text
Transformer" (arXiv 1910.10683, section 3.1.4 and 3.3).

*Tokens* are the example's ``targets`` ids before corruption; the *noise mask*
is a bool array over them (True = noise); a *span* is a maximal run of noise (or
non-noise) tokens. Sentinel ``i`` is ``vocabulary.sentinel_id(i)``
(``<extra_id_i>``: the last id for i = 0, then descending, as in T5).

Every draw comes from ``PreprocessContext.rng(i, salt)`` (task seed and shuffle
key): a record's corruption is the same in any runner, worker, batch or file
split. The draws are numpy's, so the masks follow T5's distribution, not its bits.

Unlike T5's task, one record gives one example: ``select_random_chunk`` keeps
one chunk of the raw length the sequence length allows, at a uniformly random
start, instead of ``reduce_concat_tokens`` + ``split_tokens``; first-fit
packing then packs short documents together.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from seqcache.tasks.preprocessors import PreprocessContext, Preprocessor


def _spans_lengths(tokens_length: int, noise_density: float, mean_noise_span_length: float,
                   extra_inputs: int = 1, extra_targets: int = 1) -> tuple[int, int]:
    """(inputs length, targets length) after span corruption of ``tokens_length``
    tokens, EOS included (T5's ``_tokens_length_to_inputs_length_targets_length``)."""
    num_noise_tokens = int(round(tokens_length * noise_density))
    num_nonnoise_tokens = tokens_length - num_noise_tokens
    num_noise_spans = int(round(num_noise_tokens / mean_noise_span_length))
    return (num_nonnoise_tokens + num_noise_spans * extra_inputs + 1,
            num_noise_tokens + num_noise_spans * extra_targets + 1)


def random_spans_helper(inputs_length: int, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                        extra_tokens_per_span_inputs: int = 1,
                        extra_tokens_per_span_targets: int = 1) -> tuple[int, int]:
    """T5's ``random_spans_helper``: ``(tokens_length, targets_length)``, the most
    raw tokens whose corrupted inputs (non-noise tokens, one sentinel per span,
    EOS) fit in ``inputs_length``, and the length of their targets (noise tokens,
    one sentinel per span, EOS). T5's default: 512 -> (568, 114).

    Raises:
      ValueError: inputs_length < 2, or a density outside (0, 1).
    """
    if inputs_length < 2:
        raise ValueError(f"inputs_length must be >= 2 (got {inputs_length=})")
    if not 0.0 < noise_density < 1.0:
        raise ValueError(f"noise_density must be in (0, 1) (got {noise_density=})")
    tokens_length = inputs_length - 1
    while _spans_lengths(tokens_length + 1, noise_density, mean_noise_span_length, extra_tokens_per_span_inputs,
                         extra_tokens_per_span_targets)[0] <= inputs_length:
        tokens_length += 1
    _, targets_length = _spans_lengths(tokens_length, noise_density, mean_noise_span_length,
                                       extra_tokens_per_span_inputs, extra_tokens_per_span_targets)
    # T5's hack: at density 0.5 keep targets no longer than inputs.
    if noise_density == 0.5 and targets_length > inputs_length:
        tokens_length -= 1
        targets_length -= 1
    return tokens_length, targets_length


def inputs_length_for_targets(targets_length: int, noise_density: float = 0.15,
                              mean_noise_span_length: float = 3.0) -> tuple[int, int]:
    """The inverse of ``random_spans_helper``: the smallest ``inputs_length``
    whose derived targets length is ``targets_length`` or more, as
    ``(inputs_length, tokens_length)``. At the defaults, 114 -> (508, 564): every
    inputs length from 508 to 513 derives 114 targets, and this returns the
    smallest; give ``inputs=512`` to get T5's exact (512, 114) pair.

    Raises:
      ValueError: no inputs length up to 1,000,000 reaches ``targets_length``.
    """
    lo, hi = 2, 2
    while random_spans_helper(hi, noise_density, mean_noise_span_length)[1] < targets_length:
        lo, hi = hi, hi * 2
        if hi > 1_000_000:
            raise ValueError(f"no inputs length gives targets_length={targets_length}")
    while lo < hi:  # the derived targets length grows with the inputs length
        mid = (lo + hi) // 2
        if random_spans_helper(mid, noise_density, mean_noise_span_length)[1] >= targets_length:
            hi = mid
        else:
            lo = mid + 1
    return lo, random_spans_helper(lo, noise_density, mean_noise_span_length)[0]


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths of a uniformly random partition of ``num_items`` into
    ``num_segments`` non-empty segments (T5's ``_random_segmentation``): a
    shuffled indicator of segment starts over the items after the first."""
    first_in_segment = np.zeros(num_items, dtype=np.int64)
    first_in_segment[1:] = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
    segment_id = np.cumsum(first_in_segment)
    return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(length: int, rng: np.random.Generator, *, noise_density: float = 0.15,
                            mean_noise_span_length: float = 3.0) -> np.ndarray:
    """T5's ``random_spans_noise_mask``: alternating non-noise and noise spans.

    ``round(length * noise_density)`` tokens (clipped to [1, length - 1]) are
    noise, in ``max(1, round(num_noise / mean_noise_span_length))`` spans; the
    noise tokens and the non-noise tokens are each split into that many
    non-empty spans uniformly at random, and the spans interleave starting with
    non-noise, so the mask always ends with noise. Lengths under 2 are computed
    as 2 and cut back (T5's degeneracy guard).

    Returns: bool array, shape (length,).
    """
    if noise_density == 0.0:
        return np.zeros(length, dtype=bool)
    orig_length = length
    length = max(length, 2)
    num_noise_tokens = int(round(length * noise_density))
    num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
    num_noise_spans = max(int(round(num_noise_tokens / mean_noise_span_length)), 1)
    num_nonnoise_tokens = length - num_noise_tokens
    noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans, rng)
    nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans, rng)
    interleaved = np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1).reshape(-1)
    span_starts = np.cumsum(interleaved)[:-1]
    indicator = np.zeros(length, dtype=np.int64)
    indicator[span_starts] = 1
    is_noise = np.cumsum(indicator) % 2 == 1
    return is_noise[:orig_length]


def iid_noise_mask(length: int, rng: np.random.Generator, *, noise_density: float = 0.15) -> np.ndarray:
    """T5's ``iid_noise_mask``: each token is noise with probability noise_density."""
    return rng.random(length) < noise_density


def random_prefix_noise_mask(length: int, rng: np.random.Generator, *, noise_density: float = 0.5) -> np.ndarray:
    """T5's ``random_prefix_noise_mask``: bool ``(length,)``, a non-noise prefix of
    a length uniform in ``[max(1, round((1 - 2 * noise_density) * (length - 1))),
    length - 1]`` (so noise_density is the expected noise fraction), then noise.

    Raises:
      ValueError: noise_density > 0.5.
    """
    if noise_density > 0.5:
        raise ValueError(f"random_prefix_noise_mask needs noise_density <= 0.5 (got {noise_density=})")
    max_input_tokens = length - 1
    min_input_tokens = min(max_input_tokens, max(1, int(round((1 - 2 * noise_density) * max_input_tokens))))
    num_input_tokens = int(rng.integers(min_input_tokens, max_input_tokens + 1)) if length > 1 else 0
    return np.arange(length) >= num_input_tokens


NOISE_MASKS: dict[str, Callable] = {
    "random_spans": random_spans_noise_mask,
    "iid": iid_noise_mask,
    "random_prefix": random_prefix_noise_mask,
}


def noise_span_to_unique_sentinel(tokens: np.ndarray, noise_mask: np.ndarray, vocabulary, rng=None) -> np.ndarray:
    """Each noise span becomes one sentinel (``<extra_id_0>``, ``<extra_id_1>``,
    ... in order: ids descending from the last id); non-noise tokens stay."""
    tokens = np.asarray(tokens, dtype=np.int32)
    prev_noise = np.concatenate([[False], noise_mask[:-1]])
    first = noise_mask & ~prev_noise
    subsequent = noise_mask & prev_noise
    span_index = np.cumsum(first) - 1
    if first.any() and span_index[first].max() >= vocabulary.extra_ids:
        raise ValueError(f"{int(first.sum())} noise spans need as many sentinels, but the vocabulary has "
                         f"{vocabulary.extra_ids} extra ids (raise extra_ids or shorten the sequence length)")
    out = np.where(first, vocabulary.base_vocab_size + vocabulary.extra_ids - 1 - span_index, tokens)
    return out[~subsequent].astype(np.int32)


def nonnoise_span_to_unique_sentinel(tokens, noise_mask, vocabulary, rng=None) -> np.ndarray:
    """``noise_span_to_unique_sentinel`` of the non-noise spans (T5's targets)."""
    return noise_span_to_unique_sentinel(tokens, ~np.asarray(noise_mask), vocabulary)


def noise_span_to_sentinel(tokens, noise_mask, vocabulary, rng=None) -> np.ndarray:
    """Every noise span becomes the single sentinel ``<extra_id_0>``."""
    tokens = np.asarray(tokens, dtype=np.int32)
    if vocabulary.extra_ids < 1:
        raise ValueError("noise_span_to_sentinel needs a vocabulary with extra_ids >= 1")
    prev_noise = np.concatenate([[False], noise_mask[:-1]])
    out = np.where(noise_mask, vocabulary.sentinel_id(0), tokens)
    return out[~(noise_mask & prev_noise)].astype(np.int32)


def nonnoise_span_to_sentinel(tokens, noise_mask, vocabulary, rng=None) -> np.ndarray:
    """``noise_span_to_sentinel`` of the non-noise spans."""
    return noise_span_to_sentinel(tokens, ~np.asarray(noise_mask), vocabulary)


def drop_noise_tokens(tokens, noise_mask, vocabulary=None, rng=None) -> np.ndarray:
    """The non-noise tokens."""
    return np.asarray(tokens, dtype=np.int32)[~np.asarray(noise_mask)]


def drop_nonnoise_tokens(tokens, noise_mask, vocabulary=None, rng=None) -> np.ndarray:
    """The noise tokens."""
    return np.asarray(tokens, dtype=np.int32)[np.asarray(noise_mask)]


def noise_token_to_sentinel(tokens, noise_mask, vocabulary, rng=None) -> np.ndarray:
    """Every noise token becomes ``<extra_id_0>`` (BERT-style masking, one id)."""
    return np.where(noise_mask, vocabulary.sentinel_id(0), np.asarray(tokens, dtype=np.int32)).astype(np.int32)


def noise_token_to_random_token(tokens, noise_mask, vocabulary, rng) -> np.ndarray:
    """Every noise token becomes a uniformly random id of the base vocabulary
    above the special ids (pad 0, EOS 1, unk 2 are never drawn)."""
    random = rng.integers(3, vocabulary.base_vocab_size, size=len(tokens)).astype(np.int32)
    return np.where(noise_mask, random, np.asarray(tokens, dtype=np.int32)).astype(np.int32)


INPUTS_FNS: dict[str, Callable] = {
    "noise_span_to_unique_sentinel": noise_span_to_unique_sentinel,
    "noise_span_to_sentinel": noise_span_to_sentinel,
    "drop_noise_tokens": drop_noise_tokens,
    "noise_token_to_sentinel": noise_token_to_sentinel,
    "noise_token_to_random_token": noise_token_to_random_token,
}
TARGETS_FNS: dict[str, Callable] = {
    "nonnoise_span_to_unique_sentinel": nonnoise_span_to_unique_sentinel,
    "nonnoise_span_to_sentinel": nonnoise_span_to_sentinel,
    "drop_nonnoise_tokens": drop_nonnoise_tokens,
    "identity": lambda tokens, noise_mask, vocabulary=None, rng=None: np.asarray(tokens, dtype=np.int32),
}


def resolve_sentinels(inputs, targets, vocabulary) -> np.ndarray:
    """The original tokens of a span-corrupted example: each sentinel of
    ``inputs`` replaced by what follows the same sentinel in ``targets`` up to
    the next sentinel. A trailing EOS (id 1) on either feature is ignored.

    Raises:
      ValueError: a sentinel of ``inputs`` is missing from ``targets``.
    """
    first_sentinel = vocabulary.base_vocab_size
    inputs = [int(t) for t in inputs]
    targets = [int(t) for t in targets]
    for seq in (inputs, targets):
        if seq and seq[-1] == vocabulary.eos_id:
            seq.pop()
    spans: dict[int, list[int]] = {}
    current = None
    for t in targets:
        if t >= first_sentinel:
            current = t
            spans[current] = []
        elif current is not None:
            spans[current].append(t)
    out: list[int] = []
    for t in inputs:
        if t >= first_sentinel:
            if t not in spans:
                raise ValueError(f"sentinel {t} of the inputs is not in the targets")
            out.extend(spans[t])
        else:
            out.append(t)
    return np.asarray(out, dtype=np.int32)


def select_random_chunk(tokens: np.ndarray, max_length: int, rng: np.random.Generator) -> np.ndarray:
    """``min(len, max_length)`` tokens from a start uniform in ``[0, len -
    max_length]`` (seqio's ``select_random_chunk``, ``uniform_random_start=True``)."""
    n = len(tokens)
    if n <= max_length:
        return tokens
    start = int(rng.integers(0, n - max_length + 1))
    return tokens[start:start + max_length]


class denoise(Preprocessor):  # noqa: N801 (T5's name)
    """T5's ``denoise``: a noise mask over ``targets``, then new inputs and targets.

    For every example, ``tokens = example[input_feature]`` (after ``tokenize``),
    cut to a random chunk of ``chunk_length`` tokens when given;
    ``mask = noise_mask(len(tokens))``; ``inputs = inputs_fn(tokens, mask)`` and
    ``targets = targets_fn(tokens, mask)``. Run ``append_eos_after_trim`` after it.

    Args (keyword-only):
      noise_density: fraction of tokens that are noise (T5 default 0.15).
      noise_mask: ``"random_spans"`` (with ``mean_noise_span_length``), ``"iid"``
        or ``"random_prefix"`` (see ``NOISE_MASKS``).
      inputs_fn: a name in ``INPUTS_FNS`` (default ``noise_span_to_unique_sentinel``).
      targets_fn: a name in ``TARGETS_FNS`` (default ``nonnoise_span_to_unique_sentinel``).
      mean_noise_span_length: for ``"random_spans"`` (default 3.0).
      input_feature: the feature whose tokens are corrupted (default ``targets``).
      chunk_length: raw tokens kept per example (a random chunk), or None for all.

    Sentinels come from ``output_features["inputs"].vocabulary`` (its extra ids).

    Raises:
      ValueError: an unknown choice (names it and the choices); per example, a
        vocabulary with too few extra ids for the spans.
    """

    name = "denoise"

    def __init__(self, *, noise_density: float = 0.15, noise_mask: str = "random_spans",
                 inputs_fn: str = "noise_span_to_unique_sentinel",
                 targets_fn: str = "nonnoise_span_to_unique_sentinel", mean_noise_span_length: float = 3.0,
                 input_feature: str = "targets", chunk_length: int | None = None):
        for what, value, table in (("noise_mask", noise_mask, NOISE_MASKS), ("inputs_fn", inputs_fn, INPUTS_FNS),
                                   ("targets_fn", targets_fn, TARGETS_FNS)):
            if value not in table:
                raise ValueError(f"denoise: unknown {what} {value!r} (choose one of {sorted(table)})")
        if not 0.0 <= noise_density <= 1.0:
            raise ValueError(f"denoise: noise_density must be in [0, 1] (got {noise_density=})")
        if mean_noise_span_length <= 0:
            raise ValueError(f"denoise: mean_noise_span_length must be > 0 (got {mean_noise_span_length=})")
        self.noise_density = float(noise_density)
        self.noise_mask = noise_mask
        self.inputs_fn = inputs_fn
        self.targets_fn = targets_fn
        self.mean_noise_span_length = float(mean_noise_span_length)
        self.input_feature = input_feature
        self.chunk_length = None if chunk_length is None else int(chunk_length)

    def params(self) -> dict:
        return {"noise_density": self.noise_density, "noise_mask": self.noise_mask, "inputs_fn": self.inputs_fn,
                "targets_fn": self.targets_fn, "mean_noise_span_length": self.mean_noise_span_length,
                "input_feature": self.input_feature, "chunk_length": self.chunk_length}

    def _chunk_length(self, ctx: PreprocessContext) -> int | None:
        return self.chunk_length

    def _mask(self, length: int, rng: np.random.Generator) -> np.ndarray:
        fn = NOISE_MASKS[self.noise_mask]
        if self.noise_mask == "random_spans":
            return fn(length, rng, noise_density=self.noise_density,
                      mean_noise_span_length=self.mean_noise_span_length)
        return fn(length, rng, noise_density=self.noise_density)

    def process_batch(self, examples, ctx):  # the chunk length once per batch
        if "inputs" not in ctx.output_features:
            raise ValueError(f"{self.name}: the task needs an 'inputs' output feature "
                             f"(has {sorted(ctx.output_features)})")
        vocabulary = ctx.output_features["inputs"].vocabulary
        chunk_length = self._chunk_length(ctx)
        out = []
        for i, ex in enumerate(examples):
            tokens = ex.get(self.input_feature)
            if tokens is None or isinstance(tokens, str):
                raise ValueError(f"{self.name}: feature {self.input_feature!r} must be token ids; "
                                 "run tokenize() first")
            tokens = np.asarray(tokens, dtype=np.int32)
            rng = ctx.rng(i, salt=self.name)
            if chunk_length is not None:
                tokens = select_random_chunk(tokens, chunk_length, rng)
            if len(tokens) == 0:
                out.append(None)  # nothing to corrupt: dropped, as T5's filter on empty targets
                continue
            mask = self._mask(len(tokens), rng)
            out.append({**ex, "inputs": INPUTS_FNS[self.inputs_fn](tokens, mask, vocabulary, rng),
                        "targets": TARGETS_FNS[self.targets_fn](tokens, mask, vocabulary, rng)})
        return out


class span_corruption(denoise):  # noqa: N801 (T5's name)
    """T5's span corruption pre-training objective (Raffel et al. 2020, section
    3.1.4; ``t5.data.preprocessors.span_corruption``), per example:

    1. ``tokens_length, targets_length = random_spans_helper(inputs_length, ...)``
       with the task's ``inputs`` sequence length (or the one
       ``inputs_length_for_targets`` derives from a ``targets`` length alone);
       512 -> 568 raw tokens and 114 targets tokens at the defaults.
    2. A chunk of ``tokens_length`` tokens at a random start (all of a shorter
       document; without a sequence length, the whole document).
    3. ``random_spans_noise_mask``: ``round(n * noise_density)`` noise tokens in
       ``round(noise / mean_noise_span_length)`` spans.
    4. ``inputs``: non-noise tokens, each noise span replaced by one sentinel;
       ``targets``: each non-noise span replaced by one sentinel, then the noise
       tokens. Follow it with ``append_eos_after_trim``.

    Raises:
      ValueError: at run time, a ``targets`` length shorter than the derived one;
        a vocabulary with too few extra ids.
    """

    name = "span_corruption"

    def __init__(self, *, noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
                 input_feature: str = "targets"):
        super().__init__(noise_density=noise_density, mean_noise_span_length=mean_noise_span_length,
                         input_feature=input_feature)

    def params(self) -> dict:
        return {"noise_density": self.noise_density, "mean_noise_span_length": self.mean_noise_span_length,
                "input_feature": self.input_feature}

    def lengths(self, sequence_length) -> tuple[int, int, int] | None:
        """(inputs length, raw tokens length, targets length) for a task
        sequence length (a mapping with ``inputs`` and/or ``targets``), or None."""
        lengths = dict(sequence_length or {})
        if "inputs" in lengths:
            inputs_length = int(lengths["inputs"])
            tokens_length, targets_length = random_spans_helper(inputs_length, self.noise_density,
                                                                self.mean_noise_span_length)
        elif "targets" in lengths:
            inputs_length, tokens_length = inputs_length_for_targets(int(lengths["targets"]), self.noise_density,
                                                                     self.mean_noise_span_length)
            targets_length = random_spans_helper(inputs_length, self.noise_density, self.mean_noise_span_length)[1]
        else:
            return None
        num_noise = int(round(tokens_length * self.noise_density))
        if int(round(num_noise / self.mean_noise_span_length)) < 1:
            raise ValueError(f"span_corruption: inputs length {inputs_length} holds a chunk of {tokens_length} tokens, "
                             f"too short for one noise span at noise_density={self.noise_density} and "
                             f"mean_noise_span_length={self.mean_noise_span_length}: the examples would hold no "
                             "noise; use a longer sequence length")
        if "targets" in lengths and int(lengths["targets"]) < targets_length:
            raise ValueError(f"span_corruption: inputs length {inputs_length} gives targets of {targets_length} "
                             f"tokens, more than the targets sequence length {lengths['targets']} "
                             f"(use targets={targets_length})")
        return inputs_length, tokens_length, targets_length

    def _chunk_length(self, ctx):
        lengths = self.lengths(ctx.sequence_length)
        return None if lengths is None else lengths[1]


class prefix_lm(denoise):  # noqa: N801 (T5's name)
    """T5's prefix LM objective (``t5.data.preprocessors.prefix_lm``; Raffel et
    al. 2020, section 3.3.2): a random chunk of the document is split at a point
    drawn per example; the prefix becomes ``inputs`` and the rest ``targets``.

    The chunk is at most the ``inputs`` sequence length less one (room for EOS;
    else the ``targets`` length less one; else the whole document). The split is
    ``random_prefix_noise_mask`` with ``noise_density`` (default 0.5): the
    prefix length is uniform in [1, n - 1] at 0.5.
    """

    name = "prefix_lm"

    def __init__(self, *, noise_density: float = 0.5, input_feature: str = "targets"):
        super().__init__(noise_density=noise_density, noise_mask="random_prefix", inputs_fn="drop_noise_tokens",
                         targets_fn="drop_nonnoise_tokens", input_feature=input_feature)
        if noise_density > 0.5:
            raise ValueError(f"prefix_lm: noise_density must be <= 0.5 (got {noise_density=})")

    def params(self) -> dict:
        return {"noise_density": self.noise_density, "input_feature": self.input_feature}

    def _chunk_length(self, ctx):
        lengths = dict(ctx.sequence_length or {})
        for name in ("inputs", "targets"):
            if name in lengths:
                return max(2, int(lengths[name]) - 1)
        return None
