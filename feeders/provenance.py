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

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache.feeders import state as state_lib
from seqcache.feeders.reader import source_of
from seqcache.feeders.stream import (IndexStream, check_same_features, check_step, feature_layout, open_mixture,
                                     token_features)
from seqcache.lengths import fit_lengths


def _vocabulary(reader, feature: str):
    """(vocabulary or None, error message or None)."""
    if reader.manifest.vocabularies.get(feature) is None:
        return None, f"the manifest describes no vocabulary for {feature!r}"
    try:
        return reader.vocabulary(feature), None  # the model file's name is checked there
    except (ImportError, ValueError, OSError) as e:
        return None, str(e)


def segments_of(example: dict, feature: str) -> list[np.ndarray]:
    """The token ids of each segment of a decoded record, in order: split by
    ``<feature>_segment_ids`` when the cache is packed, else one segment."""
    tokens = np.asarray(example[feature])
    seg = example.get(f"{feature}_segment_ids")
    if seg is None:
        return [tokens]
    seg = np.asarray(seg)
    return [tokens[seg == value] for value in dict.fromkeys(seg.tolist()) if value != 0]


def which(stream: IndexStream, paths: Sequence[str], *, global_batch_size: int, step: int, row: int,
          feature: str = "targets", tokens: bool = True) -> dict:
    """Locates row r in [0, B) of global batch ``step`` s >= 0 (B the global batch
    size) of ``stream`` (``Feeder.stream``) over the cache folders ``paths``, in
    mixture order; ``tokens``: include each segment's token ids and text.

    Returns:
      A JSON-serialisable dict: step, row, position, padding (bool), task_index,
      task, split, cache, ordinal, epoch, element, num_examples, cache_index, shard
      (file name), record (offset in the shard), and segments: a list of dicts with
      segment (1-based), source_index, source (the file path from the manifest's
      source table), record_number, token_offset, num_tokens, and with ``tokens``
      also token_ids and text (None with a vocabulary_error when the vocabulary
      cannot be rebuilt). A padding row (finite run, exhausted task) has
      padding=True and no cache index and no epoch (None), as the feeder's
      batches give it epoch -1.

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
    past_end = stream.end_position is not None and position >= stream.end_position
    out = {"step": step, "row": row, "position": position, "padding": not loc["valid"] or past_end,
           "task_index": t, "task": m.task, "split": m.split, "cache": paths[t], "ordinal": loc["ordinal"],
           "epoch": loc["epoch"], "element": loc["element"], "num_examples": reader.num_examples}
    if out["padding"]:
        out.update(cache_index=None, shard=None, record=None, segments=[], epoch=None)
        return out
    names = token_features(m)
    if feature not in names:
        raise ValueError(f"{paths[t]}: the cache has no feature {feature!r} (its token features: {', '.join(names)})")
    i = loc["cache_index"]
    shard, offset = reader.locate([i])
    out["cache_index"] = i
    out["shard"] = m.shards[int(shard[0])].file
    out["record"] = int(offset[0])
    out["segments"] = _segments_of_record(reader, i, feature=feature, tokens=tokens)
    return out


def _segments_of_record(reader, i: int, *, feature: str, tokens: bool) -> list[dict]:
    """``which``'s segments of record ``i`` of the cache: each one's source (from
    the provenance sidecar) and, with ``tokens``, its token ids and text."""
    prov = reader.read_provenance([i])[0]
    example = reader.decode(reader.read([i])[0], i)
    segs = segments_of(example, feature) if feature in example else []
    vocab, vocab_error = _vocabulary(reader, feature) if tokens else (None, None)
    sources = reader.sources
    segments = []
    n_prov = len(prov["source_index"])
    for j in range(max(n_prov, len(segs))):
        seg: dict = {"segment": j + 1}
        if j < n_prov:
            seg.update(_segment_source(prov, j, sources))
        if j < len(segs):
            seg.update(_segment_tokens(segs[j], tokens=tokens, vocab=vocab, vocab_error=vocab_error))
        segments.append(seg)
    return segments


def _segment_source(prov: dict, j: int, sources: list) -> dict:
    """Segment ``j``'s source file, record number and token offset, from a
    decoded provenance record and the manifest's source table."""
    src = int(prov["source_index"][j])
    path, locator = source_of(sources, src)
    return {"source_index": src, "source": path, "record_number": int(prov["record_number"][j]),
            "locator": locator, "token_offset": int(prov["token_offset"][j])}


def _segment_tokens(ids: np.ndarray, *, tokens: bool, vocab, vocab_error: str | None) -> dict:
    """A segment's number of tokens and, with ``tokens``, its token ids and text
    (None, with the vocabulary error, when the vocabulary cannot be rebuilt)."""
    seg: dict = {"num_tokens": int(ids.size)}
    if tokens:
        from seqcache.tasks import decode_with_sentinels  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

        seg["token_ids"] = ids.tolist()
        seg["text"] = None if vocab is None else decode_with_sentinels(vocab, seg["token_ids"])
        if vocab is None:
            seg["vocabulary_error"] = vocab_error
    return seg


def locate_row(*, cache=None, mixture=None, caches_root=None, split: str = "train", global_batch_size: int,
               step: int, row: int, seed: int = 0, num_epochs: int | None = None, feature: str = "targets",
               tokens: bool = True) -> dict:
    """``which`` without a Feeder: opens the caches (``cache=`` or ``mixture=``, as
    for ``Feeder``), locates (step, row) of the stream with this seed, global batch
    size and number of epochs, and closes them. See ``which`` for the result.
    No sequence length is needed: records are shown whole."""
    opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    return _answer(opened, dict(seed=seed, num_epochs=num_epochs, global_batch_size=global_batch_size,
                                feature=feature), step=step, row=row, tokens=tokens)


def locate_row_in_state(state: Mapping[str, Any], *, step: int, row: int, cache=None, mixture=None,
                        caches_root=None, split: str = "train", feature: str | None = None,
                        tokens: bool = True) -> dict:
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
    opened = open_checked(state, cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    return _answer(opened, _state_stream(state, feature), step=step, row=row, tokens=tokens)


def open_checked(state, *, cache, mixture, caches_root, split):
    """A checked state's caches, opened (at its paths, with its schedule, or at
    ``cache=``/``mixture=``); refused (and closed) when they differ from the
    caches the state was saved with. The caller closes what it returns (an
    ``OpenedMixture``, as ``open_mixture`` returns it); the provenance, inverse,
    ``which`` and ``overlap`` code paths open a state's caches through it.

    Raises:
      FeederStateError: not a valid state, or caches that differ from the state's.
    """
    state_lib.check_state(state)
    if cache is None and mixture is None:
        mixture = state_lib.mixture_argument(state)
    opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    diff = state_difference(state, opened)
    if diff:
        opened.close()
        raise state_lib.FeederStateError(
            f"{diff}; the state's steps and rows denote examples of the caches it was saved with: ask with "
            "those caches"
        )
    return opened


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


def check_as_feeder(opened, stream, *, global_batch_size: int, num_epochs, feature: str, sequence_length=None,
                    last_step: int | None = None) -> None:
    """The checks a ``Feeder`` (and ``Feeder.restore``/``get_batch``) runs over
    the same caches and stream, so that a provenance answer is given only for a
    row a feeder would feed: every cache of a mixture has the same features
    (``stream.check_same_features``), each has ``feature``, ``sequence_length``
    (when given: a state's) is not longer than the caches' own
    (``seqcache.lengths.fit_lengths``), and ``last_step`` is a step of the run
    (``stream.check_step``: a finite run ends).

    Raises:
      ValueError: the feeder's message.
    """
    check_same_features(opened.paths, opened.readers)
    for reader in opened.readers:
        feature_layout(reader, feature)
    if sequence_length is not None:
        fit_lengths(sequence_length, {p: r.manifest for p, r in zip(opened.paths, opened.readers)}, [feature])
    if last_step is not None:
        check_step(last_step, global_batch_size=global_batch_size, num_steps=stream.num_steps(global_batch_size),
                   num_epochs=num_epochs)


def _checked_stream(opened, *, seed: int, **checks) -> IndexStream:
    """The stream of the opened caches, after ``check_as_feeder(**checks)``."""
    stream = opened.stream(seed=seed, num_epochs=checks["num_epochs"], global_batch_size=checks["global_batch_size"])
    check_as_feeder(opened, stream, **checks)
    return stream


def _last_step(steps) -> int | None:
    """The largest of ``steps`` (a range, O(1), or a list), None when empty."""
    if isinstance(steps, range):
        return max(steps[0], steps[-1]) if len(steps) else None
    return max(steps, default=None)


def _state_stream(state, feature) -> dict:
    """``_checked_stream``'s arguments for a state's stream; the state's sequence
    length only when ``feature`` is its feature."""
    return dict(seed=state["seed"], num_epochs=state["num_epochs"], global_batch_size=state["global_batch_size"],
                feature=feature or state["feature"],
                sequence_length=state["sequence_length"] if feature in (None, state["feature"]) else None)


def _answer(opened, args: dict, *, step, row, tokens) -> dict:
    """``which`` over opened caches (closed after), with the stream's parameters in the answer."""
    try:
        stream = _checked_stream(opened, **args, last_step=step)
        out = which(stream, opened.paths, global_batch_size=args["global_batch_size"], step=step, row=row,
                    feature=args["feature"], tokens=tokens)
    finally:
        opened.close()
    out["seed"] = args["seed"]
    out["global_batch_size"] = args["global_batch_size"]
    out["mixture"] = [{"path": p, "rate": r} for p, r in zip(opened.paths, opened.rates)]
    return out


# --- whole steps: one row per (step, row, segment) ---------------------------

# Columns of ``trace``, in order.
TRACE_COLUMNS = ("step", "row", "position", "padding", "task_index", "task", "cache", "ordinal", "epoch",
                 "cache_index", "shard", "record", "segment", "source_index", "source", "locator", "record_number",
                 "token_offset", "num_tokens", "text")

# A provenance record of one segment: three uint32 counts of 1 and the elements
# (uint32 source_index, uint64 record_number, uint32 token_offset).
_ONE_SEGMENT = np.dtype([("n0", "<u4"), ("source_index", "<u4"), ("n1", "<u4"), ("record_number", "<u8"),
                         ("n2", "<u4"), ("token_offset", "<u4")])


def provenance_segments(reader, indices: np.ndarray):
    """(row of each segment, source_index, record_number, token_offset), each
    (n_segments,), of the provenance records at cache indices ``indices`` (int64
    (n,)): segments in row order, each row's in segment order; int64 but
    record_number uint64. One-segment records (unpacked caches) are decoded as
    one numpy block, the others one by one.

    Raises:
      seqcache.format.CacheError: a provenance shard is missing or damaged.
    """
    records = reader.read_provenance_records(indices)
    lengths = np.fromiter(map(len, records), np.int64, len(records))
    one = lengths == _ONE_SEGMENT.itemsize
    e = np.zeros(0, np.int64)
    rows, src, rec, off = [e], [e], [e.astype(np.uint64)], [e]
    if one.any():
        sel = np.flatnonzero(one)
        block = np.frombuffer(b"".join(records[i] for i in sel.tolist()), _ONE_SEGMENT)
        if (block["n0"] == 1).all() and (block["n1"] == 1).all() and (block["n2"] == 1).all():
            rows.append(sel)
            src.append(block["source_index"].astype(np.int64))
            rec.append(block["record_number"].astype(np.uint64))
            off.append(block["token_offset"].astype(np.int64))
        else:
            one[:] = False
    for i in np.flatnonzero(~one).tolist():
        p = fmt.decode_example(fmt.PROVENANCE_FEATURES, records[i],
                               where=reader.describe(int(indices[i]), provenance=True))
        rows.append(np.full(len(p["source_index"]), i, np.int64))
        src.append(p["source_index"].astype(np.int64))
        rec.append(p["record_number"].astype(np.uint64))
        off.append(p["token_offset"].astype(np.int64))
    rows_a = np.concatenate(rows)
    order = np.argsort(rows_a, kind="stable")
    return rows_a[order], np.concatenate(src)[order], np.concatenate(rec)[order], np.concatenate(off)[order]


def trace(stream: IndexStream, paths: Sequence[str], *, global_batch_size: int, steps, feature: str = "targets",
          text: bool = False, chunk_steps: int = 64):
    """Provenance of whole steps: one row per (step, row, segment), as a pyarrow Table.

    Computed from positions (``IndexStream.locate``, no replay): its cost depends
    on the number of rows asked for, not on where the steps are. Only the
    provenance sidecars are read (one batched ArrayRecord read per shard touched,
    ``chunk_steps`` steps at a time), unless ``text`` asks for the tokens too.

    Args:
      stream, paths, global_batch_size: as for ``which``.
      steps: a ``range`` (e.g. ``range(91000, 91050)``) or any iterable of steps >= 0.
      feature: the token feature (for ``text``).
      text: also read the data records: ``num_tokens`` (of the segment in the row)
        and ``text`` (decoded with the cache's vocabulary; null when it cannot be
        rebuilt). Without it both columns are null.
      chunk_steps: steps located and read together.

    Returns:
      pyarrow.Table with ``TRACE_COLUMNS``: step, row, position (int64), padding
      (bool; a padding row of a finite run has one row with nulls after it,
      its epoch included),
      task_index (int32), task, cache (its folder), ordinal, epoch, cache_index
      (int64), shard (file name), record (offset in the shard, int64), segment
      (1-based, int32), source_index (int64), source (the file path from the
      manifest's source table), locator (what record_number counts:
      ``byte_offset``, ``row``, ``file``, ``record``), record_number (uint64),
      token_offset (int64: where the segment starts in its source record's
      tokens), num_tokens (int64) and text (string). The token span of a segment
      in its source record is [token_offset, token_offset + num_tokens).

    Raises:
      ValueError: a negative step.
      seqcache.format.CacheError: a provenance shard is missing or damaged.
    """
    steps = list(steps) if not isinstance(steps, range) else steps
    if len(steps) and min(steps) < 0:
        raise ValueError(f"steps must be >= 0 (got {min(steps)})")
    import pyarrow as pa  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

    b = int(global_batch_size)
    vocabs: dict[int, Any] = {}
    return pa.concat_tables([  # no steps: one empty chunk, for the columns' types
        _trace_chunk(stream, paths, np.asarray(steps[c:c + chunk_steps], np.int64), b, feature=feature, text=text,
                     vocabs=vocabs) for c in range(0, max(len(steps), 1), chunk_steps)])


class _Segments(NamedTuple):
    """A chunk's segments in row order, each row's in segment order: its row (in
    the chunk), source_index, record_number (uint64), token_offset, and with
    ``text`` num_tokens and text (else None); int64 arrays (n,) but text, a list."""

    row: np.ndarray
    source_index: np.ndarray
    record_number: np.ndarray
    token_offset: np.ndarray
    num_tokens: np.ndarray | None
    text: list | None


def _trace_chunk(stream: IndexStream, paths: Sequence[str], chunk: np.ndarray, b: int, *, feature: str,
                 text: bool, vocabs: dict):
    """``trace``'s table of the steps in ``chunk`` (int64) for global batch size ``b``."""
    positions = (chunk[:, None] * b + np.arange(b, dtype=np.int64)[None, :]).ravel()
    loc = stream.locate(positions)
    valid = loc.valid.copy()
    if stream.end_position is not None:
        valid &= positions < stream.end_position
    segments = _chunk_segments(stream, loc, valid, feature=feature, text=text, vocabs=vocabs)
    return _chunk_table(stream, paths, positions, loc, valid, segments, b=b, text=text)


def _chunk_segments(stream: IndexStream, loc, valid: np.ndarray, *, feature: str, text: bool,
                    vocabs: dict) -> _Segments:
    """The segments of a located chunk's valid rows: per task one batched read of
    the provenance records (with ``text``, of the data records too)."""
    e = np.zeros(0, np.int64)
    seg_row, seg_src, seg_rec, seg_off, seg_ntok, seg_text = [e], [e], [e.astype(np.uint64)], [e], [e], []
    for t in np.unique(loc.task[valid]).tolist():
        rows = np.flatnonzero(valid & (loc.task == t))
        reader = stream.readers[t]
        idx = loc.cache_index[rows]
        r, src, rec, off = provenance_segments(reader, idx)
        seg_row.append(rows[r])
        seg_src.append(src)
        seg_rec.append(rec)
        seg_off.append(off)
        if text:
            ntok, txt = _segment_texts(reader, idx, r, feature, vocabs, t)
            seg_ntok.append(ntok)
            seg_text.extend(txt)
    srow = np.concatenate(seg_row)
    order = np.argsort(srow, kind="stable")
    return _Segments(
        row=srow[order],
        source_index=np.concatenate(seg_src)[order],
        record_number=np.concatenate(seg_rec)[order],
        token_offset=np.concatenate(seg_off)[order],
        num_tokens=np.concatenate(seg_ntok)[order] if text else None,
        text=[seg_text[i] for i in order.tolist()] if text else None,
    )


def segment_numbers(seg_rows: np.ndarray) -> np.ndarray:
    """Each segment's number, 1-based within its row, for segments in row order."""
    first = np.ones(seg_rows.size, bool)
    first[1:] = seg_rows[1:] != seg_rows[:-1]
    starts = np.flatnonzero(first)
    return np.arange(seg_rows.size) - np.repeat(starts, np.diff(np.append(starts, seg_rows.size))) + 1


def _chunk_table(stream: IndexStream, paths: Sequence[str], positions: np.ndarray, loc, valid: np.ndarray,
                 segments: _Segments, *, b: int, text: bool):
    """The pyarrow table of a chunk: one row per segment, and one row of nulls per padding row."""
    import pyarrow as pa  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

    srow = segments.row
    segno = segment_numbers(srow)
    # Padding rows: one table row each, with nulls.
    pad = np.flatnonzero(~valid)
    all_rows = np.concatenate([srow, pad])
    order = np.argsort(all_rows, kind="stable")
    all_rows = all_rows[order]
    m, k = srow.size, pad.size
    is_seg = order < m
    segi = np.where(is_seg, order, 0)

    def full(values, dtype):
        arr = np.zeros(m + k, dtype)
        if m:
            arr[is_seg] = values[segi[is_seg]]
        return arr

    def seg_col(values, dtype):
        return pa.array(full(values, dtype), mask=~is_seg)

    task_of = loc.task[all_rows]
    shard_names, record_offsets = _shards_of(stream, task_of, loc.cache_index[all_rows], is_seg)
    manifests = [r.manifest for r in stream.readers]
    src_path, src_loc = _source_columns(stream.readers, task_of, full(segments.source_index, np.int64), is_seg)
    valid_rows = valid[all_rows]
    txt = segments.text
    return pa.table({
        "step": pa.array(positions[all_rows] // b),
        "row": pa.array(positions[all_rows] % b),
        "position": pa.array(positions[all_rows]),
        "padding": pa.array(~valid_rows),
        "task_index": pa.array(task_of.astype(np.int32)),
        "task": pa.array([manifests[t].task for t in task_of.tolist()], pa.string()),
        "cache": pa.array([paths[t] for t in task_of.tolist()], pa.string()),
        "ordinal": pa.array(loc.ordinal[all_rows]),
        "epoch": pa.array(loc.epoch[all_rows], mask=~valid_rows),
        "cache_index": pa.array(np.where(valid_rows, loc.cache_index[all_rows], 0), mask=~valid_rows),
        "shard": pa.array(shard_names, pa.string()),
        "record": pa.array(record_offsets, mask=~is_seg),
        "segment": pa.array(full(segno, np.int32), mask=~is_seg),
        "source_index": seg_col(segments.source_index, np.int64),
        "source": pa.array(src_path, pa.string()),
        "locator": pa.array(src_loc, pa.string()),
        "record_number": seg_col(segments.record_number, np.uint64),
        "token_offset": seg_col(segments.token_offset, np.int64),
        "num_tokens": seg_col(segments.num_tokens, np.int64) if text else pa.nulls(m + k, pa.int64()),
        "text": pa.array([txt[i] if s else None for s, i in zip(is_seg.tolist(), segi.tolist())], pa.string())
        if text else pa.nulls(m + k, pa.string()),
    })


def _source_columns(readers, task_of: np.ndarray, source_index: np.ndarray, is_seg: np.ndarray):
    """(source path, locator) per table row, from the caches' source tables
    (each read when a row needs it); None for a padding row."""
    found = [source_of(readers[t].sources, s) if is_s else (None, None)
             for is_s, t, s in zip(is_seg.tolist(), task_of.tolist(), source_index.tolist())]
    return [path for path, _ in found], [locator for _, locator in found]


def _shards_of(stream, task, cache_index, is_seg):
    """(shard file name or None, record offset in the shard) per table row."""
    names: list = [None] * task.size
    offsets = np.zeros(task.size, np.int64)
    for t in np.unique(task[is_seg]).tolist():
        sel = np.flatnonzero(is_seg & (task == t))
        reader = stream.readers[t]
        shard, off = reader.locate(cache_index[sel])
        files = reader.manifest.shards.files
        for j, s in zip(sel.tolist(), shard.tolist()):
            names[j] = files[s]
        offsets[sel] = off
    return names, offsets


def _segment_texts(reader, idx, seg_rows, feature, vocabs, t):
    """Per segment (``seg_rows``: the index into ``idx`` of each segment's row, in
    order): its number of tokens and text (None without a vocabulary)."""
    from seqcache.tasks import decode_with_sentinels  # the feeder imports numpy, array_record and msgspec only (trainers install seqcache --no-deps)

    if t not in vocabs:
        vocabs[t] = _vocabulary(reader, feature)[0]
    vocab = vocabs[t]
    segs = [segments_of(ex, feature) if feature in ex else [] for ex in reader.read_examples(idx)]
    ntok = np.zeros(seg_rows.size, np.int64)
    texts: list = [None] * seg_rows.size
    for k, (r, j) in enumerate(zip(seg_rows.tolist(), (segment_numbers(seg_rows) - 1).tolist())):
        if j < len(segs[r]):
            ntok[k] = segs[r][j].size
            texts[k] = None if vocab is None else decode_with_sentinels(vocab, segs[r][j].tolist())
    return ntok, texts


def trace_rows(*, cache=None, mixture=None, caches_root=None, split: str = "train", global_batch_size: int, steps,
               seed: int = 0, num_epochs: int | None = None, feature: str = "targets", text: bool = False):
    """``trace`` without a Feeder: opens the caches (``cache=`` or ``mixture=``, a
    schedule included, as for ``Feeder``), traces ``steps`` of the stream with this
    seed, global batch size and number of epochs, and closes them."""
    opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    return _trace_opened(opened, dict(seed=seed, num_epochs=num_epochs, global_batch_size=global_batch_size,
                                      feature=feature), steps=steps, text=text)


def trace_rows_in_state(state: Mapping[str, Any], *, steps, cache=None, mixture=None, caches_root=None,
                        split: str = "train", feature: str | None = None, text: bool = False):
    """``trace_rows`` for the stream a saved feeder state denotes (its caches,
    rates or schedule, seed, global batch size and number of epochs), with the
    checks of ``locate_row_in_state``."""
    opened = open_checked(state, cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    return _trace_opened(opened, _state_stream(state, feature), steps=steps, text=text)


def _trace_opened(opened, args: dict, *, steps, text: bool):
    """``trace`` over opened caches, after the checks of ``check_as_feeder``; closes them."""
    steps = steps if isinstance(steps, range) else list(steps)
    try:
        stream = _checked_stream(opened, **args, last_step=_last_step(steps))
        return trace(stream, opened.paths, global_batch_size=args["global_batch_size"], steps=steps,
                     feature=args["feature"], text=text)
    finally:
        opened.close()
