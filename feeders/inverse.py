"""Inverse lookups: where in a run does an example appear?

The forward map of the global stream (``seqcache.feeders.stream``; index vocabulary
at the top of ``seqcache.feeders.feeder``) is

    position p -> (task t, ordinal k) -> (epoch e = k // N_t, element k mod N_t)
               -> cache index i = perm_{seed,t,e}(k mod N_t).

Every step of it is a bijection that can be inverted exactly, so for an example
(t, i) and an epoch e:

1. element = perm_{seed,t,e}^-1(i): the Feistel network run backwards, with cycle
   walking (``FeistelPermutation.inverse``; ``permutation.inverse_each`` for
   many epochs in one vectorised pass), O(1);
2. ordinal k = e * N_t + element;
3. position p = the inverse of the mixing: ``Mixer.position_of`` (closed form per
   level of the binary tree, O(log T)) or ``Schedule.position_of`` (binary search
   over the stages, then the stage's tree: O(log stages + log T));
4. step = p // B, row = p mod B; host h = row // (B / H) reads it, as its row
   row mod (B / H) (G5).

Each (example, epoch) costs O(1) for one task and O(log T) for a mixture, at any
position below 2^62, in exact Python integers. Which epochs to report: those that
started before ``until_step`` (the positions [0, until_step * B) hold
c_t(until_step * B) ordinals of task t, i.e. epochs 0 .. ceil(c / N_t) - 1, the
last one possibly in part), or every epoch of a finite run (``num_epochs``). An
example is reported in an epoch only where its position lies before the limit.

A source location (a file and a line, row, byte offset or record) becomes cache
indices through the provenance sidecars (``provenance.array_record-*``), which are
stored in cache order, not by source: finding them is a scan of every provenance
record of the caches that list the file, O(N) records read in batches (one-segment
records are decoded as one numpy block). A source record can give several
examples (packing splits a long document), and a packed example holds several
source records: every example with a segment from that record is reported.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from seqcache import fs
from seqcache.feeders import compat
from seqcache.feeders.permutation import epoch_permutation, inverse_each, round_keys_many
from seqcache.feeders.provenance import open_checked, check_as_feeder, provenance_segments, segment_numbers
from seqcache.feeders.stream import IndexStream, check_same_features, open_mixture

# More epochs than this for one example needs an explicit ``epochs=`` range.
MAX_EPOCHS = 1_000_000
# Epochs whose permutations are inverted together (uint64 (EPOCH_CHUNK, ROUNDS) keys).
EPOCH_CHUNK = 1 << 14
# Provenance records read and decoded together when scanning for a source record.
SCAN_CHUNK = 1 << 16
# How a source location names its record (``parse_source``), by the source's locator.
SOURCE_KINDS = ("line", "row", "byte", "record")


@dataclasses.dataclass(frozen=True)
class Occurrence:
    """One appearance of an example in the global stream; Python ints.

    Attributes:
      epoch: e, the epoch of the example's task in which it appears.
      ordinal: k = e * N_t + element: how many earlier positions went to the task.
      position: p, the global position.
      step: s = p // B.
      row: r = p mod B, the row in the global batch.
      host: h = r // (B / H), the host that reads it.
      host_row: r mod (B / H), its row in that host's batch.
    """

    epoch: int
    ordinal: int
    position: int
    step: int
    row: int
    host: int
    host_row: int

    def as_dict(self) -> dict:
        """The fields as a dict (JSON-serialisable)."""
        return {"epoch": self.epoch, "ordinal": self.ordinal, "position": self.position, "step": self.step,
                "row": self.row, "host": self.host, "host_row": self.host_row}


def position_in_epoch(stream: IndexStream, *, task: int, cache_index: int, epoch: int) -> tuple[int, int | None]:
    """(ordinal k, global position p) of example ``cache_index`` of ``task`` in
    ``epoch``; p is None when the task never reaches that ordinal (a task left
    out of the last stage of a schedule). For a finite run, k >= num_epochs * N_t
    is an epoch the run never reads (the caller checks). O(1) + the mixing's
    inverse (O(log T)).

    Raises:
      ValueError: a task outside [0, T), a cache index outside [0, N_t) or a
        negative epoch.
    """
    t, i, e = int(task), int(cache_index), int(epoch)
    if not 0 <= t < len(stream.sizes):
        raise ValueError(f"task index must be in [0, {len(stream.sizes)}) (got {t})")
    n = stream.sizes[t]
    if not 0 <= i < n:
        raise ValueError(f"cache index must be in [0, {n}) for {stream.readers[t].cache_dir} (got {i})")
    if e < 0:
        raise ValueError(f"epoch must be >= 0 (got {e})")
    # A fresh permutation, not the stream's LRU: a look-up over many epochs would
    # evict the orders of the steps a feeder is reading.
    perm = epoch_permutation(n=n, seed=stream.seed, task_key=stream.keys[t], epoch=e)
    element = int(perm.inverse(np.array([i], np.int64))[0])
    k = e * n + element
    return k, stream.mixer.position_of(t, k)


def ordinals_before(stream: IndexStream, *, task: int, until_step: int | None, global_batch_size: int) -> int:
    """How many ordinals of ``task`` the run takes in steps [0, until_step) (all
    of them, num_epochs * N_t, for a finite run when ``until_step`` is None).

    Raises:
      ValueError: ``until_step`` None for a run that repeats forever, or negative.
    """
    limit = None if stream.limits is None else stream.limits[task]
    if until_step is None:
        if limit is None:
            raise ValueError("the run repeats forever (num_epochs=None): give until_step, the step to look up to "
                             "(--until-step on the command line)")
        return limit
    if until_step < 0:
        raise ValueError(f"until_step must be >= 0 (got {until_step})")
    count = stream.mixer.count_before(task, int(until_step) * int(global_batch_size))
    return count if limit is None else min(count, limit)


def occurrences(
    stream: IndexStream,
    *,
    task: int,
    cache_index: int,
    global_batch_size: int,
    host_count: int = 1,
    until_step: int | None = None,
    epochs: Sequence[int] | range | None = None,
) -> list[Occurrence]:
    """Every appearance of example ``cache_index`` of ``task`` in steps
    [0, until_step) of the stream, one per epoch, in epoch (and so position)
    order.

    Args:
      stream: the run's index stream (``Feeder.stream``, ``OpenedMixture.stream``).
      task: t, the task index in mixture order.
      cache_index: i in [0, N_t).
      global_batch_size: B.
      host_count: H, for each occurrence's host and host row (H divides B).
      until_step: look at steps [0, until_step); None: the whole of a finite run.
      epochs: only these epochs (e.g. ``range(10**6, 10**6 + 3)``); default every
        epoch that started before ``until_step``.

    Returns:
      ``Occurrence`` list; empty when the example is not read before ``until_step``.
      Cost: O(1) per epoch looked at for one task, O(log T) for a mixture
      (O(log stages + log T) for a schedule).

    Raises:
      ValueError: a bad task, cache index, host count or until_step; a run that
        repeats forever without ``until_step``; more than ``MAX_EPOCHS`` epochs
        to look at without ``epochs``.
    """
    b = int(global_batch_size)
    compat.check_hosts(b, 0, host_count)
    t = int(task)
    if not 0 <= t < len(stream.sizes):
        raise ValueError(f"task index must be in [0, {len(stream.sizes)}) (got {t})")
    n = stream.sizes[t]
    count = ordinals_before(stream, task=t, until_step=until_step, global_batch_size=b)
    started = -(-count // n)  # epochs with at least one ordinal taken
    if epochs is None:
        if started > MAX_EPOCHS:
            raise ValueError(
                f"{started:,} epochs of {stream.readers[t].cache_dir} start before step {until_step}: more than "
                f"{MAX_EPOCHS:,} to look at; pass epochs=range(FIRST, LAST) (CLI: an earlier --until-step)"
            )
        wanted: Sequence[int] = range(started)
    else:
        wanted = sorted({int(e) for e in epochs if 0 <= int(e) < started})
    i = int(cache_index)
    if not 0 <= i < n:
        raise ValueError(f"cache index must be in [0, {n}) for {stream.readers[t].cache_dir} (got {i})")
    rows_per_host = b // int(host_count)
    out = []
    for lo in range(0, len(wanted), EPOCH_CHUNK):
        chunk = np.asarray(wanted[lo:lo + EPOCH_CHUNK], np.int64)
        # Step 1 for every epoch of the chunk at once: one vectorised Feistel
        # decryption with each epoch's round keys.
        keys = round_keys_many(seed=stream.seed, task_key=stream.keys[t], epochs=chunk)
        elements = inverse_each(n, keys, np.full(chunk.size, i, np.int64))
        for e, element in zip(chunk.tolist(), elements.tolist()):
            k = e * n + element
            if k >= count:
                continue
            p = stream.mixer.position_of(t, k)
            if p is None:
                continue
            step, row = divmod(p, b)
            host, host_row = divmod(row, rows_per_host)
            out.append(Occurrence(epoch=e, ordinal=k, position=p, step=step, row=row, host=host, host_row=host_row))
    return out


# --- source locations -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SourceLocation:
    """A record of a source file, as a person names it.

    Attributes:
      path: the file, as given (matched against the manifests' source tables).
      kind: one of ``SOURCE_KINDS``: "line" (1-based line of a text or JSON lines
        file), "row" (0-based row of a Parquet file or dataset), "byte" (byte
        offset of a line's first byte, as stored for text and JSON lines), or
        "record" (the stored record number, whatever it counts).
      number: the line, row, byte offset or record number.
    """

    path: str
    kind: str
    number: int


def parse_source(spec: str) -> SourceLocation:
    """Parses ``FILE:LINE`` (1-based line), ``FILE:row=N``, ``FILE:byte=N`` or
    ``FILE:record=N`` (the number after the last colon).

    Raises:
      ValueError: no ``:NUMBER`` part, an unknown kind, or a number that is not
        a non-negative integer (a line >= 1).
    """
    path, sep, tail = str(spec).rpartition(":")
    if not sep or not path:
        raise ValueError(f"source location {spec!r}: expected FILE:LINE, FILE:row=N, FILE:byte=N or FILE:record=N")
    kind, eq, number = tail.partition("=")
    if not eq:
        kind, number = "line", tail
    if kind not in SOURCE_KINDS:
        raise ValueError(f"source location {spec!r}: unknown kind {kind!r}; use one of {', '.join(SOURCE_KINDS)}")
    if not number.isdigit() or len(number) > 20:
        raise ValueError(f"source location {spec!r}: {number!r} is not a {kind} number (a non-negative integer)")
    value = int(number)
    if kind == "line" and value < 1:
        raise ValueError(f"source location {spec!r}: lines are numbered from 1")
    return SourceLocation(path=path, kind=kind, number=value)


def _same_file(given: str, stored: str) -> bool:
    """Whether ``given`` names the stored source path: the same path (absolute or
    relative to the working directory), or its last path components."""
    if given == stored:
        return True
    if fs.is_local(given) and fs.is_local(stored) and os.path.isabs(stored):
        if os.path.abspath(given) == os.path.normpath(stored):
            return True
    g = given.replace("\\", "/").strip("/").split("/")
    s = stored.replace("\\", "/").split("/")
    return not os.path.isabs(given) and len(g) <= len(s) and s[-len(g):] == g


def matching_sources(readers: Sequence, path: str) -> list[tuple[int, int, dict]]:
    """[(task, source_index, source entry)] of every manifest source that ``path``
    names (``_same_file``)."""
    out = []
    for t, reader in enumerate(readers):
        for s, entry in enumerate(reader.sources):
            stored = entry.get("path")
            if stored and _same_file(path, stored):
                out.append((t, s, entry))
    return out


def _line_start(path: str, line: int) -> int:
    """The byte offset at which 1-based line ``line`` of local file ``path``
    begins (decompressed for ``.gz`` and the other compressed suffixes), read
    1 MiB at a time.

    Raises:
      ValueError: the file is not local, cannot be read, or has fewer lines.
    """
    if not fs.is_local(path):
        raise ValueError(f"{path}: counting lines needs a local file; give FILE:byte=OFFSET (the line's first byte)")
    want, seen, offset = line - 1, 0, 0
    if want == 0:
        return 0
    try:
        with fs.open_binary(path) as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                found = chunk.count(b"\n")
                if seen + found >= want:
                    pos = -1
                    for _ in range(want - seen):
                        pos = chunk.index(b"\n", pos + 1)
                    start = offset + pos + 1
                    if start == offset + len(chunk) and not f.read(1):
                        break  # the last newline ends the file: no line starts there
                    return start
                seen += found
                offset += len(chunk)
    except (OSError, EOFError) as e:
        raise ValueError(f"{path}: cannot read it to find line {line} ({e}); give FILE:byte=OFFSET instead") from None
    raise ValueError(f"{path}: the file has fewer than {line} lines")


def record_number(location: SourceLocation, entry: Mapping[str, Any]) -> int:
    """The stored provenance record number of ``location`` in the source whose
    manifest entry is ``entry`` (its ``locator`` says what record numbers count).

    Raises:
      ValueError: a kind that does not fit the locator (a line of a Parquet file,
        a row of a text file), or a line that cannot be counted.
    """
    locator = entry.get("locator") or "record"
    kind, n, stored = location.kind, location.number, entry.get("path") or location.path
    if kind == "record":
        return n
    if locator == "byte_offset":
        if kind == "byte":
            return n
        if kind == "line":
            return _line_start(stored if fs.is_local(stored) and os.path.exists(stored) else location.path, n)
    elif locator == "line" and kind == "line":
        return n - 1
    elif locator == "row" and kind == "row":
        return n
    fits = {"byte_offset": "FILE:LINE or FILE:byte=N", "line": "FILE:LINE", "row": "FILE:row=N"}.get(
        locator, "FILE:record=N")
    raise ValueError(f"{stored}: its records are counted as {locator!r}, so a {kind} does not name one; give {fits}")


def find_source_examples(readers: Sequence, paths: Sequence[str], location: SourceLocation | str) -> list[dict]:
    """The examples holding a segment of source record ``location``.

    Scans the provenance sidecars of every cache whose source table names the
    file: O(N_t) records read per such cache, ``SCAN_CHUNK`` at a time.

    Returns:
      [{task_index, task, cache, cache_index, segment (1-based), source (the
      stored path), locator, record_number, token_offset}], by task then cache
      index; empty when no example came from that record (skipped, filtered or
      empty).

    Raises:
      ValueError: a bad location, a file that no cache lists as a source (the
        message names some of the listed files), or a location that does not
        fit the file's locator.
      seqcache.format.CacheError: a provenance shard is missing or damaged.
    """
    loc = parse_source(location) if isinstance(location, str) else location
    found = matching_sources(readers, loc.path)
    if not found:
        listed = sorted({e.get("path") for r in readers for e in r.sources if e.get("path")})
        shown = ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
        raise ValueError(f"{loc.path}: no cache of this run lists it as a source (they list: {shown or 'none'})")
    wanted: dict[int, dict[int, tuple[int, dict]]] = {}  # task -> source_index -> (record number, entry)
    for t, s, entry in found:
        wanted.setdefault(t, {})[s] = (record_number(loc, entry), entry)
    out = []
    for t, by_source in wanted.items():
        reader = readers[t]
        n = reader.num_examples
        for lo in range(0, n, SCAN_CHUNK):
            idx = np.arange(lo, min(n, lo + SCAN_CHUNK), dtype=np.int64)
            rows, src, rec, off = provenance_segments(reader, idx)
            hit = np.zeros(rows.size, bool)
            for s, (number, _) in by_source.items():
                hit |= (src == s) & (rec == np.uint64(number))
            if not hit.any():
                continue
            segno = segment_numbers(rows)
            for j in np.flatnonzero(hit).tolist():
                number, entry = by_source[int(src[j])]
                out.append({
                    "task_index": t, "task": reader.manifest.task, "cache": paths[t],
                    "cache_index": int(idx[rows[j]]), "segment": int(segno[j]),
                    "source": entry.get("path"), "locator": entry.get("locator") or "record",
                    "record_number": number, "token_offset": int(off[j]),
                })
    return out


def excluded_entries(readers: Sequence, paths: Sequence[str], location: SourceLocation | str) -> list[dict]:
    """The quarantine entries (``"action": "excluded"``: the record overlaps a
    benchmark of ``seqcache build --exclude-benchmark``) of source record
    ``location`` in the caches that list its file; each with ``task_index``,
    ``task`` and ``cache`` added. Reads only the quarantine files (one line per
    quarantined record), and only the lines that hold ``"excluded"``.

    Raises:
      ValueError: as ``find_source_examples`` for the location.
      OSError: a quarantine file the manifest names cannot be read.
    """
    loc = parse_source(location) if isinstance(location, str) else location
    wanted: dict[int, dict[int, int]] = {}  # task -> source_index -> record number
    for t, s, entry in matching_sources(readers, loc.path):
        wanted.setdefault(t, {})[s] = record_number(loc, entry)
    out = []
    for t, by_source in wanted.items():
        reader = readers[t]
        name = reader.manifest.quarantine
        if not name:
            continue
        with fs.open_binary(fs.join(reader.cache_dir, name)) as f:
            for line in f:
                if b'"excluded"' not in line:
                    continue
                entry = json.loads(line)
                if entry.get("action") == "excluded" and by_source.get(entry.get("source_index")) == entry.get(
                        "record_number"):
                    out.append({"task_index": t, "task": reader.manifest.task, "cache": paths[t], **entry})
    return out


# --- one entry point -----------------------------------------------------------


def task_index(stream: IndexStream, paths: Sequence[str], task: int | str | None) -> int:
    """The mixture index of ``task``: an index, a cache folder of the mixture or a
    task name (as in the manifests); None for a single cache.

    Raises:
      ValueError: no such task, an ambiguous name, or None for a mixture.
    """
    count = len(paths)
    if task is None:
        if count == 1:
            return 0
        names = [r.manifest.task for r in stream.readers]
        raise ValueError(f"the run mixes {count} caches: say which task the example is in (one of {names}, or "
                         f"an index in [0, {count}))")
    if isinstance(task, (int, np.integer)) and not isinstance(task, bool):
        if not 0 <= int(task) < count:
            raise ValueError(f"task index must be in [0, {count}) (got {task})")
        return int(task)
    text = str(task)
    if text.isdigit() and int(text) < count:
        return int(text)
    for t, p in enumerate(paths):
        if text == p or (fs.is_local(text) and fs.is_local(p) and os.path.abspath(text) == os.path.abspath(p)):
            return t
    named = [t for t, r in enumerate(stream.readers) if r.manifest.task == text]
    if len(named) == 1:
        return named[0]
    if named:
        raise ValueError(f"task {text!r} names {len(named)} caches of the run ({[paths[t] for t in named]}); give "
                         "the cache folder or its index")
    names = [r.manifest.task for r in stream.readers]
    raise ValueError(f"no task {text!r} in the run: its tasks are {names} (or give a cache folder or an index)")


def where(
    stream: IndexStream,
    paths: Sequence[str],
    *,
    global_batch_size: int,
    host_count: int = 1,
    until_step: int | None = None,
    cache_index: int | None = None,
    task: int | str | None = None,
    source: SourceLocation | str | None = None,
    epochs: Sequence[int] | range | None = None,
) -> list[dict]:
    """Where examples appear in the run: for ``cache_index`` (with ``task`` in a
    mixture) that example; for ``source`` (``"FILE:LINE"``, ``"FILE:row=N"``, ...;
    see ``parse_source``) every example holding a segment of that record.

    Returns:
      One JSON-serialisable dict per example: task_index, task, cache,
      cache_index, num_examples, until_step, epochs_started (epochs of the task
      begun before ``until_step``; the last may be partly read), occurrences
      (``Occurrence.as_dict()`` each: epoch, ordinal, position, step, row, host,
      host_row), and for ``source`` also segment, source, locator,
      record_number and token_offset.

    Raises:
      ValueError: neither or both of cache_index and source; see ``occurrences``,
        ``task_index`` and ``find_source_examples``.
    """
    if (cache_index is None) == (source is None):
        raise ValueError("give exactly one of cache_index= (with task= in a mixture) or source='FILE:LINE'")
    if source is not None:
        examples = find_source_examples(stream.readers, paths, source)
        if task is not None:
            t = task_index(stream, paths, task)
            examples = [x for x in examples if x["task_index"] == t]
    else:
        t = task_index(stream, paths, task)
        examples = [{"task_index": t, "task": stream.readers[t].manifest.task, "cache": paths[t],
                     "cache_index": int(cache_index)}]
    out = []
    for x in examples:
        t = x["task_index"]
        n = stream.sizes[t]
        count = ordinals_before(stream, task=t, until_step=until_step, global_batch_size=global_batch_size)
        occ = occurrences(stream, task=t, cache_index=x["cache_index"], global_batch_size=global_batch_size,
                          host_count=host_count, until_step=until_step, epochs=epochs)
        out.append({**x, "num_examples": n, "until_step": until_step, "epochs_started": -(-count // n),
                    "occurrences": [o.as_dict() for o in occ]})
    return out


def where_in_run(*, cache=None, mixture=None, caches_root=None, split: str = "train", global_batch_size: int,
                 seed: int = 0, num_epochs: int | None = None, **query: Any) -> list[dict]:
    """``where`` without a Feeder: opens the caches (``cache=`` or ``mixture=``, a
    schedule included, as for ``Feeder``), answers ``query`` (the keyword
    arguments of ``where``) for the stream with this seed, global batch size and
    number of epochs, and closes them."""
    opened = open_mixture(cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    try:
        check_same_features(opened.paths, opened.readers)  # as a Feeder over these caches
        stream = opened.stream(seed=seed, num_epochs=num_epochs, global_batch_size=global_batch_size)
        return where(stream, opened.paths, global_batch_size=global_batch_size, **query)
    finally:
        opened.close()


def where_in_state(state: Mapping[str, Any], *, cache=None, mixture=None, caches_root=None, split: str = "train",
                   **query: Any) -> list[dict]:
    """``where_in_run`` for the stream a saved feeder state denotes (its caches,
    rates or schedule, seed, global batch size and number of epochs), with the
    checks of ``seqcache.feeders.provenance.locate_row_in_state``. ``until_step``
    defaults to the state's step (what the run had read when it was saved).

    Raises:
      FeederStateError (a ValueError): not a valid state, or caches that differ
        from the state's.
    """
    opened = open_checked(state, cache=cache, mixture=mixture, caches_root=caches_root, split=split)
    try:
        b = state["global_batch_size"]
        query.setdefault("until_step", state["position"] // b)
        stream = opened.stream(seed=state["seed"], num_epochs=state["num_epochs"], global_batch_size=b)
        check_as_feeder(opened, stream, global_batch_size=b, num_epochs=state["num_epochs"],
                        feature=state["feature"], sequence_length=state["sequence_length"])
        return where(stream, opened.paths, global_batch_size=b, **query)
    finally:
        opened.close()
