"""Feature converters: feeder batches -> the model fields t5x uses.

A converter takes per-feature batches as ``Feeder`` makes them (for feature
``f``: ``f``, ``f_segment_ids``, ``f_positions``, ``f_loss_weights``, each
(R, L_f)) and returns the fields of seqio's / t5x's feature converters
(``seqio.LMFeatureConverter``, ``EncDecFeatureConverter``,
``PrefixLMFeatureConverter``):

=====================  ======================================================
converter              fields (int32 (R, L), loss weights float32)
=====================  ======================================================
``lm``                 decoder_target_tokens, decoder_input_tokens,
                       decoder_loss_weights, decoder_segment_ids,
                       decoder_positions
``encdec``             encoder_input_tokens, encoder_segment_ids,
                       encoder_positions, and the decoder fields of ``lm``
                       (over ``targets``)
``prefix_lm``          the decoder fields over ``inputs`` + ``targets`` of each
                       segment, concatenated, plus decoder_causal_attention;
                       loss only on the targets
=====================  ======================================================

``decoder_input_tokens`` are the targets shifted right by one inside each
segment, with 0 (the pad id, T5's decoder start id) at every segment start
(t5x's ``autoregressive_inputs``). ``ConvertedFeeder`` feeds one feeder per
feature over the same caches, seed and batch size, all at the same step, so
every guarantee of ``Feeder`` (exactly once, O(1) resume, elastic hosts, exact
mixing) holds for the converted stream: the feeders locate the same examples.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from seqcache import bounded_json
from seqcache.feeders import state as state_lib
from seqcache.feeders.feeder import Feeder, MixtureArg, Prefetcher, resolve_threads, restore_with
from seqcache.feeders.reader import ClosedOnExit
from seqcache.feeders.stream import (CONVERTER_FEATURES, check_same_features, describe_features, open_mixture,
                                     token_features)
from seqcache.lengths import sequence_lengths

CONVERTERS = tuple(CONVERTER_FEATURES)  # ("lm", "encdec", "prefix_lm")
ROW_KEYS = ("task_index", "cache_index", "epoch")


def autoregressive_inputs(targets: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Targets shifted right by one within each segment; 0 at segment starts
    (t5x ``layers``/seqio ``autoregressive_inputs``). int32, shape (R, L)."""
    targets = np.asarray(targets, np.int32)
    seg = np.asarray(segment_ids)
    shifted = np.zeros_like(targets)
    shifted[:, 1:] = targets[:, :-1]
    prev_seg = np.zeros_like(seg)
    prev_seg[:, 1:] = seg[:, :-1]
    return np.where(seg == prev_seg, shifted, 0).astype(np.int32)


def _decoder(batch: Mapping[str, np.ndarray], f: str) -> dict[str, np.ndarray]:
    return {
        "decoder_target_tokens": np.asarray(batch[f], np.int32),
        "decoder_input_tokens": autoregressive_inputs(batch[f], batch[f"{f}_segment_ids"]),
        "decoder_loss_weights": np.asarray(batch[f"{f}_loss_weights"], np.float32),
        "decoder_segment_ids": np.asarray(batch[f"{f}_segment_ids"], np.int32),
        "decoder_positions": np.asarray(batch[f"{f}_positions"], np.int32),
    }


def _rows(batch):
    return {k: batch[k] for k in ROW_KEYS if k in batch}


def convert_lm(batches: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``lm``: ``batches["targets"]`` -> decoder fields."""
    return {**_decoder(batches["targets"], "targets"), **_rows(batches["targets"])}


def convert_encdec(batches: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``encdec``: ``batches["inputs"]`` -> encoder fields, ``batches["targets"]``
    -> decoder fields. Segment k of a packed encoder row pairs with segment k of
    the decoder row (first-fit packing numbers them alike)."""
    inputs = batches["inputs"]
    return {
        "encoder_input_tokens": np.asarray(inputs["inputs"], np.int32),
        "encoder_segment_ids": np.asarray(inputs["inputs_segment_ids"], np.int32),
        "encoder_positions": np.asarray(inputs["inputs_positions"], np.int32),
        **convert_lm(batches),
    }


def convert_prefix_lm(batches: Mapping[str, Mapping[str, np.ndarray]], *, length: int) -> dict[str, np.ndarray]:
    """``prefix_lm``: per segment, the inputs then the targets in one decoder
    row of ``length`` tokens (seqio's ``PrefixLMFeatureConverter``).

    ``decoder_causal_attention`` is 1 on the inputs of each segment and on the
    first target position (whose decoder input is the last input token), else
    0; ``decoder_loss_weights`` is 1 on the targets only. A row whose segments
    need more than ``length`` tokens is cut at ``length``.
    """
    inputs, targets = batches["inputs"], batches["targets"]
    rows = inputs["inputs"].shape[0]
    tokens = np.zeros((rows, length), np.int32)
    seg = np.zeros((rows, length), np.int32)
    pos = np.zeros((rows, length), np.int32)
    causal = np.zeros((rows, length), np.int32)
    weights = np.zeros((rows, length), np.float32)
    for r in range(rows):
        s_in, s_tg = inputs["inputs_segment_ids"][r], targets["targets_segment_ids"][r]
        w_tg = targets["targets_loss_weights"][r]
        at = 0
        for s in range(1, int(max(s_in.max(initial=0), s_tg.max(initial=0))) + 1):
            a = inputs["inputs"][r][s_in == s]
            b = targets["targets"][r][s_tg == s]
            wb = w_tg[s_tg == s]
            n = min(len(a) + len(b), length - at)
            if n <= 0:
                break
            joined = np.concatenate([a, b])[:n]
            tokens[r, at:at + n] = joined
            seg[r, at:at + n] = s
            pos[r, at:at + n] = np.arange(n)
            causal[r, at:at + min(len(a) + 1, n)] = 1
            weights[r, at + min(len(a), n):at + n] = wb[:max(0, n - len(a))]
            at += n
    return {
        "decoder_target_tokens": tokens,
        "decoder_input_tokens": autoregressive_inputs(tokens, seg),
        "decoder_loss_weights": weights,
        "decoder_segment_ids": seg,
        "decoder_positions": pos,
        "decoder_causal_attention": causal,
        **_rows(targets),
    }


def _check_caches(converter: str, feeder_args: Mapping[str, Any]) -> None:
    """Refuses caches the converter cannot read whole (different features in a
    mixture, or a feature it reads missing), from the manifests alone."""
    where = {k: feeder_args.get(k) for k in ("cache", "mixture", "caches_root")}
    opened = open_mixture(**where, split=feeder_args.get("split", "train"))
    try:
        check_same_features(opened.paths, opened.readers, converters_only=True)
        have = token_features(opened.readers[0].manifest)
        needs = CONVERTER_FEATURES[converter]
        missing = [f for f in needs if f not in have]
        if missing:
            fits = [c for c, n in CONVERTER_FEATURES.items() if set(n) <= set(have)]
            hint = (f"use converter={' or '.join(map(repr, fits))}" if fits else
                    "no converter reads these features; rebuild the task with 'targets' (and 'inputs')")
            raise ValueError(f"converter {converter!r} reads features {list(needs)}, but "
                             f"{describe_features(opened.paths, opened.readers)} (no {missing}); {hint}")
    finally:
        opened.close()


class ConvertedFeeder(ClosedOnExit):
    """A feeder of t5x fields: one ``Feeder`` per feature, all at the same step.

    Args (keyword-only):
      converter: ``"lm"``, ``"encdec"`` or ``"prefix_lm"``.
      sequence_length: feature -> length: ``{"targets": L}`` for ``lm``,
        ``{"inputs": Li, "targets": Lt}`` for ``encdec`` and ``prefix_lm``
        (``prefix_lm`` rows have Li + Lt tokens); an int is every feature's
        (``seqcache.lengths.sequence_lengths``). A feature left out (or None)
        gets the caches' own length (``seqcache.lengths.fit_lengths``: a given
        length only cuts rows shorter, a longer one is refused).
      **feeder_args: the ``Feeder`` arguments (cache or mixture, global batch
        size, hosts, seed, num_epochs, start_step, ...) except ``feature`` and
        ``sequence_length``. ``num_threads`` and ``prefetch`` are this
        feeder's: its threads read and convert whole steps ahead (the
        per-feature feeders read none ahead).

    Attributes:
      sequence_length: dict str -> int, {feature: tokens per row} of every
        feature the converter reads, in its order, e.g. ``{"inputs": 512,
        "targets": 114}``.

    Batches: the converter's fields (module docstring), each (R, L), plus
    ``task_index``, ``cache_index`` and ``epoch`` (R,). A record is read once
    per feature. The converter may read fewer features than the caches have
    (``lm`` over translation caches reads their targets), but every cache of a
    mixture must have the same features, and each the converter's.

    Raises:
      seqcache.lengths.SequenceLengthError (a ValueError): a length longer
        than the caches' own, or none where a cache records none.
      ValueError: an unknown converter; a length for a feature it does not
        read; a mixture whose caches have different features, or caches without a
        feature the converter reads (naming every cache's task and features and
        the converters that fit them).
    """

    def __init__(self, *, converter: str, sequence_length: Mapping[str, int] | int | None = None,
                 **feeder_args: Any):
        if converter not in CONVERTERS:
            raise ValueError(f"unknown feature converter {converter!r} (choose one of {CONVERTERS})")
        names = CONVERTER_FEATURES[converter]
        asked = sequence_lengths(sequence_length, names)
        if "feature" in feeder_args:
            raise ValueError("ConvertedFeeder sets feature= itself, per feature")
        num_threads, prefetch = resolve_threads(feeder_args.pop("num_threads", None), feeder_args.pop("prefetch", None))
        _check_caches(converter, feeder_args)
        self.converter = converter
        self.num_threads, self.prefetch = num_threads, prefetch
        self.feeders: dict[str, Feeder] = {}
        self._prefetch: Prefetcher | None = None
        try:
            for n in names:
                # Read ahead here, converted: one thread makes the whole step (every
                # feature and the conversion), so the caller only takes it.
                self.feeders[n] = Feeder(feature=n, sequence_length=asked.get(n), num_threads=num_threads,
                                         prefetch=0, **feeder_args)
        except BaseException:
            self.close()
            raise
        self.sequence_length: dict[str, int] = {n: f.sequence_length[n] for n, f in self.feeders.items()}
        self._prefetch = Prefetcher(self._convert, num_threads=num_threads, depth=prefetch, num_steps=self.num_steps)

    @property
    def step(self) -> int:
        return self.feeders["targets"].step

    @step.setter
    def step(self, value: int) -> None:
        for f in self.feeders.values():
            f.step = value

    @property
    def num_steps(self):
        return self.feeders["targets"].num_steps

    def get_batch(self, step: int) -> dict[str, np.ndarray]:
        """This host's converted rows of global batch ``step``. Random access, as
        ``Feeder.get_batch``; converts steps step+1 .. step+prefetch in the background.

        Raises:
          ValueError: a negative step, or a step past the end of a finite run.
          RuntimeError: the feeder is closed.
        """
        self.feeders["targets"]._check_step(int(step))
        return self._prefetch.get(int(step))

    def _convert(self, step: int) -> dict[str, np.ndarray]:
        batches = {n: f.get_batch(step) for n, f in self.feeders.items()}
        if self.converter == "prefix_lm":
            return convert_prefix_lm(batches, length=sum(self.sequence_length.values()))
        return (convert_lm if self.converter == "lm" else convert_encdec)(batches)

    __iter__, __next__ = Feeder.__iter__, Feeder.__next__

    def state(self) -> dict:
        """The feeder state (JSON-able) with the converter and its lengths; the
        per-feature feeders share every other field."""
        state = dict(self.feeders["targets"].state())
        state["converter"] = {"name": self.converter, "sequence_length": dict(self.sequence_length)}
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Moves every feature's feeder to ``state``'s position (``Feeder.set_state``).

        Raises:
          FeederStateError (a ValueError): a damaged state or converter field;
            another converter or lengths; what ``Feeder.set_state`` refuses.
        """
        state = state_lib.read_state(state)
        name, lengths = state_lib.check_converter(state)
        if (name, lengths) != (self.converter, self.sequence_length):
            raise state_lib.FeederStateError(
                f"the state was saved with converter {name!r} and sequence lengths {lengths}, this feeder has "
                f"converter {self.converter!r} and sequence lengths {self.sequence_length}")
        for n, f in self.feeders.items():
            s = {k: v for k, v in state.items() if k != "converter"}
            s["feature"], s["sequence_length"] = n, {n: self.sequence_length[n]}
            f.set_state(s)

    @classmethod
    def restore(cls, state: Mapping[str, Any], *, host_index: int | None = None, host_count: int | None = None,
                num_threads: int | None = None, prefetch: int | None = None, cache: str | os.PathLike | None = None,
                mixture: MixtureArg = None, caches_root: str | os.PathLike | None = None, split: str = "train",
                seed: int | None = None, global_batch_size: int | None = None, converter: str | None = None,
                sequence_length: Mapping[str, int] | int | None = None,
                num_epochs: Any = Feeder._UNSET) -> "ConvertedFeeder":
        """``Feeder.restore`` for a ``ConvertedFeeder.state()``, with the state's
        converter and lengths; ``converter`` and ``sequence_length`` (feature ->
        length, or an int for every feature) are expectations too.

        Raises:
          FeederStateError (a ValueError): a damaged state or converter field;
            not a ``ConvertedFeeder``'s state (restore it with ``Feeder.restore``);
            what ``Feeder.restore`` refuses (every refusal of the state, a host
            count that does not divide the saved global batch included).
          ValueError: a bad ``host_index``, ``num_threads`` or ``prefetch``.
          seqcache.format.CacheError: a cache cannot be opened where it is looked for.
        """
        state = state_lib.read_state(state)
        if "converter" not in state:
            raise state_lib.FeederStateError(
                "feeder state: the state has no 'converter' field, it was saved by a Feeder of feature "
                f"{bounded_json.short(state['feature'])}; restore it with Feeder.restore(state, ...)")
        name, lengths = state_lib.check_converter(state)
        if converter is not None and converter != name:
            raise state_lib.FeederStateError(f"feeder state has converter {name!r}, but this run has converter "
                                             f"{converter!r}{state_lib.RESTORE_HINT}")
        expected = sequence_lengths(sequence_length, lengths) if sequence_length is not None else None
        if expected is not None and expected != lengths:
            raise state_lib.FeederStateError(f"feeder state has sequence lengths {lengths}, but this run has "
                                             f"{expected}{state_lib.RESTORE_HINT}")
        return restore_with(state, lambda **arguments: cls(converter=name, sequence_length=lengths, **arguments),
                            expected=dict(seed=seed, global_batch_size=global_batch_size, num_epochs=num_epochs),
                            cache=cache, mixture=mixture, caches_root=caches_root, split=split,
                            host_index=host_index, host_count=host_count, num_threads=num_threads, prefetch=prefetch)

    @classmethod
    def restore_file(cls, path: str | os.PathLike, **kwargs: Any) -> "ConvertedFeeder":
        """``restore`` of the state saved at ``path`` (a JSON file or a
        checkpoint step folder), read by ``seqcache.feeders.state.load_state``
        (bounded, no key twice): as ``Feeder.restore_file``.

        Raises:
          FeederStateError, ValueError, seqcache.format.CacheError: as
            ``Feeder.restore_file`` and ``restore``.
        """
        return cls.restore(state_lib.load_state(path), **kwargs)

    def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.close()
        for f in self.feeders.values():
            f.close()
