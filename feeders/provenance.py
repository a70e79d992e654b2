"""Provenance (G6): what did the model see at step s, row r?

``which`` maps a (step, row) of the global stream back to its task, cache index,
shard and record, and, through the cache's provenance sidecar
(``provenance.array_record-*``, one record per example with one element per
segment: source_index, record_number, token_offset; see
``seqcache.format.PROVENANCE_FEATURES``), to the source file and record number of
every segment, with the segment's tokens and, when the cache's vocabulary can be
rebuilt (``seqcache.tasks.vocabulary_from_json``), its text.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from seqcache.feeders import state as state_lib
from seqcache.feeders.stream import IndexStream, open_mixture


def _vocabulary(reader, feature: str):
    """(vocabulary or None, error message or None)."""
    desc = reader.manifest.vocabularies.get(feature)
    if not desc:
        return None, f"the manifest describes no vocabulary for {feature!r}"
    try:
        from seqcache.tasks import vocabulary_from_json
    except ImportError as e:  # seqcache.tasks is optional for readers
        return None, f"cannot import seqcache.tasks to rebuild the vocabulary: {e}"
    try:
        return vocabulary_from_json(desc, reader.cache_dir), None
    except (ValueError, OSError) as e:
        return None, str(e)


def segments_of(example: dict, feature: str) -> list[np.ndarray]:
    """The token ids of each segment of a decoded record, in order: split by
    ``<feature>_segment_ids`` when the cache is packed, else one segment."""
    tokens = np.asarray(example[feature])
    seg = example.get(f"{feature}_segment_ids")
    if seg is None:
        return [tokens]
    seg = np.asarray(seg)
    out = []
    ids = []
    for value in seg.tolist():
        if value != 0 and value not in ids:
            ids.append(value)
    for value in ids:
        out.append(tokens[seg == value])
    return out


def which(
    stream: IndexStream,
    paths: Sequence[str],
    *,
    global_batch_size: int,
    step: int,
    row: int,
    feature: str = "targets",
    tokens: bool = True,
) -> dict:
    """Locates row ``row`` of global batch ``step``.

    Args:
      stream: the feeder's index stream (``Feeder.stream``).
      paths: the cache folders, in mixture order.
      global_batch_size: B.
      step, row: s >= 0 and r in [0, B).
      feature: the token feature.
      tokens: include token ids and text per segment.

    Returns:
      A JSON-serialisable dict: step, row, position, padding (bool), task_index,
      task, split, cache, ordinal, epoch, element, num_examples, cache_index, shard
      (file name), record (offset in the shard), and segments: a list of dicts with
      segment (1-based), source_index, source (the file path from the manifest's
      source table), record_number, token_offset, num_tokens, and with ``tokens``
      also token_ids and text (None with a vocabulary_error when the vocabulary
      cannot be rebuilt). A padding row (finite run, exhausted task) has
      padding=True and no cache index.

    Raises:
      ValueError: a negative step or a row outside [0, B).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    if not 0 <= row < global_batch_size:
        raise ValueError(f"row must be in [0, {global_batch_size}) for global batch size {global_batch_size} (got {row})")
    position = step * global_batch_size + row
    loc = stream.locate_one(position)
    t = loc["task"]
    reader = stream.readers[t]
    m = reader.manifest
    out = {
        "step": step,
        "row": row,
        "position": position,
        "padding": not loc["valid"],
        "task_index": t,
        "task": m.task,
        "split": m.split,
        "cache": paths[t],
        "ordinal": loc["ordinal"],
        "epoch": loc["epoch"],
        "element": loc["element"],
        "num_examples": reader.num_examples,
    }
    if stream.end_position is not None and position >= stream.end_position:
        out["padding"] = True
    if out["padding"]:
        out.update(cache_index=None, shard=None, record=None, segments=[])
        return out
    i = loc["cache_index"]
    shard, offset = reader.locate([i])
    out["cache_index"] = i
    out["shard"] = m.shards[int(shard[0])].file
    out["record"] = int(offset[0])
    prov = reader.read_provenance([i])[0]
    example = reader.decode(reader.read([i])[0], i)
    segs = segments_of(example, feature) if feature in example else []
    vocab, vocab_error = (None, None)
    if tokens:
        vocab, vocab_error = _vocabulary(reader, feature)
    sources = m.sources
    segments = []
    n_prov = len(prov["source_index"])
    for j in range(max(n_prov, len(segs))):
        seg: dict = {"segment": j + 1}
        if j < n_prov:
            src = int(prov["source_index"][j])
            seg["source_index"] = src
            seg["source"] = sources[src].get("path") if 0 <= src < len(sources) else None
            seg["record_number"] = int(prov["record_number"][j])
            # What record_number counts in that file (byte_offset, row, ...; older caches: record).
            seg["locator"] = (sources[src].get("locator") if 0 <= src < len(sources) else None) or "record"
            seg["token_offset"] = int(prov["token_offset"][j])
        if j < len(segs):
            ids = segs[j]
            seg["num_tokens"] = int(ids.size)
            if tokens:
                seg["token_ids"] = [int(x) for x in ids]
                if vocab is not None:
                    seg["text"] = vocab.decode([int(x) for x in ids])
                else:
                    seg["text"] = None
                    seg["vocabulary_error"] = vocab_error
        segments.append(seg)
    out["segments"] = segments
    return out


def locate_row(
    *,
    cache=None,
    mixture=None,
    caches_root=None,
    split: str = "train",
    global_batch_size: int,
    step: int,
    row: int,
    seed: int = 0,
    num_epochs: int | None = None,
    feature: str = "targets",
    tokens: bool = True,
) -> dict:
    """``which`` without a Feeder: opens the caches (``cache=`` or ``mixture=``, as
    for ``Feeder``), locates (step, row) of the stream with this seed, global batch
    size and number of epochs, and closes them. See ``which`` for the result.
    No sequence length is needed: records are shown whole."""
    opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    try:
        return _answer(opened, seed=seed, num_epochs=num_epochs, global_batch_size=global_batch_size,
                       step=step, row=row, feature=feature, tokens=tokens)
    finally:
        opened.close()


def locate_row_in_state(
    state: Mapping[str, Any],
    *,
    step: int,
    row: int,
    cache=None,
    mixture=None,
    caches_root=None,
    split: str = "train",
    feature: str | None = None,
    tokens: bool = True,
) -> dict:
    """``locate_row`` for the stream a saved feeder state denotes: its caches,
    rates, seed, global batch size and number of epochs.

    The caches are opened at the state's paths, or at ``cache=``/``mixture=`` (their
    current locations, as for ``Feeder.restore``), and must be the state's: the
    same fingerprints, rates and mixture order. ``feature`` defaults to the state's.

    Raises:
      FeederStateError (a ValueError): not a valid state, or a cache that differs
        from the state's, e.g. "the cache at PATH was rebuilt (fingerprint A, the
        state was saved with fingerprint B)".
      ValueError: a row outside [0, B).
      seqcache.format.CacheError: a cache cannot be opened.
    """
    state_lib.check_state(state)
    opened = open_state_caches(state, cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    try:
        diff = state_difference(state, opened)
        if diff:
            raise state_lib.FeederStateError(
                f"{diff}; the state's steps and rows denote examples of the caches it was saved with: ask with "
                "those caches"
            )
        return _answer(opened, seed=state["seed"], num_epochs=state["num_epochs"],
                       global_batch_size=state["global_batch_size"], step=step, row=row,
                       feature=feature or state["feature"], tokens=tokens)
    finally:
        opened.close()


def open_state_caches(state, *, cache=None, mixture=None, caches_root=None, split: str = "train"):
    """Opens a checked state's caches: at its paths (with its schedule, if any), or
    at ``cache=``/``mixture=``."""
    if cache is None and mixture is None:
        mixture = state_lib.mixture_argument(state)
    return open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)


def state_difference(state, opened) -> str | None:
    """Why the opened caches (and schedule) do not denote the state's stream, or None."""
    current = dict(state, mixture=state_lib.mixture_entries(opened.paths, opened.rates, opened.weights,
                                                            opened.readers))
    current.pop("schedule", None)
    if opened.stages is not None:
        current["schedule"] = opened.stages
    if state.get("schedule") is None and opened.stages is None:
        return state_lib.stream_difference(state, current)
    diff = state_lib.schedule_difference(state, current)
    if diff is None and state_lib.stages_of(state) != state_lib.stages_of(current):
        # Answers about steps past the saved one must use the state's own schedule.
        diff = "the mixture schedule differs from the state's"
    return diff


def _answer(opened, *, seed, num_epochs, global_batch_size, step, row, feature, tokens) -> dict:
    """``which`` over opened caches, with the stream's parameters in the answer."""
    stream = opened.stream(seed=seed, num_epochs=num_epochs, global_batch_size=global_batch_size)
    out = which(stream, opened.paths, global_batch_size=global_batch_size, step=step, row=row,
                feature=feature, tokens=tokens)
    out["seed"] = seed
    out["global_batch_size"] = global_batch_size
    out["mixture"] = [{"path": p, "rate": r} for p, r in zip(opened.paths, opened.rates)]
    return out
