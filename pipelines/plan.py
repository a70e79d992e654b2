"""The build plan: what one build does, decided by the driver before any work.

``BuildPlan`` is the one object the driver passes around: the task and the
options that define the cache, the input files, the shard count, the
fingerprint, where the cache goes, and how the work runs (runner, exchange,
split size). Only the first half defines the cache's bytes.

Work units: each input file is cut into splits by its source
(``Source.splits``: byte ranges of uncompressed text and JSON lines, row groups
of Parquet, whole files otherwise) of about ``split_size`` bytes; consecutive
small splits (small files) are grouped into one unit of about ``split_size``.
A unit is ``(unit_index, splits)``, an int64 array of ``(file_index, start,
stop)`` rows: small, picklable, and independent of everything but the file
list and the split size. How the work is cut never changes the cache: record
ids are byte offsets or row indices, and shards are key ranges.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from seqcache import fs
from seqcache.compression import COMPRESSED_SUFFIXES, decompressor, paths_ending_in
from seqcache.tasks.sources import Source
from seqcache.tasks.sources.lines import check_target, is_compressed

# Units of reading work: about this much input each, at most MAX_UNITS in all
# (a runner such as Dataflow carries Create's elements in the job graph).
DEFAULT_SPLIT_BYTES = 64 << 20
MIN_SPLIT_BYTES = 1 << 20
MAX_UNITS = 100_000
# Splits of one unit at most (many tiny files).
MAX_SPLITS_PER_UNIT = 4096
# Content size (for the shard count): compressed bytes decompressed per sampled
# file, and files sampled per kind (the others get the sampled ratio).
SAMPLE_BYTES = 1 << 20
MAX_SAMPLED_FILES = 64


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything one build needs, decided before the pipeline starts.

    Attributes:
      task, config: the task and the ``BuildConfig`` (they define the cache).
      files: the input files (``SourceFile``: path, bytes, mtime), sorted;
        total_bytes: their size in bytes.
      num_shards: the shard count; shard_size and content_bytes (the
        uncompressed size of the files' text): what it was derived from (None
        when the count was given).
      inputs, fingerprint: the fingerprint's inputs and the fingerprint.
      out_dir: ``cache_dir/<task>/<split>``.
      runner: the Beam runner (resolved name); options: its ``PipelineOptions``.
      exchange: ``"runner"`` or ``"spill"`` (runner.py).
      split_size: bytes of input per work unit.
      fs_options: the pipeline options that file systems read, for workers.
      exclusion: the benchmarks whose overlapping records the build leaves
        out (``exclusion.Exclusion``), or None.
      work_dir: the work folder the build keeps its work in (work.py), or
        None (a build that keeps nothing); keep_work: keep it once the cache
        is complete (for a build of a grown corpus).
    """

    task: Any
    config: Any
    files: Sequence[Any]
    total_bytes: int
    num_shards: int
    shard_size: int | None
    inputs: Mapping[str, Any]
    fingerprint: str
    out_dir: str
    runner: str
    exchange: str
    split_size: int
    options: Any = None
    fs_options: Sequence[str] = ()
    content_bytes: int | None = None
    exclusion: Any = None
    work_dir: str | None = None
    keep_work: bool = False


def choose_split_size(total_bytes: int) -> int:
    """Bytes per work unit: about 64 units for a small corpus (so that every
    worker has work), ``DEFAULT_SPLIT_BYTES`` for a large one, and large enough
    that there are at most ``MAX_UNITS`` units."""
    size = max(MIN_SPLIT_BYTES, min(DEFAULT_SPLIT_BYTES, -(-int(total_bytes) // 64)))
    return max(size, -(-int(total_bytes) // MAX_UNITS))


def plan_units(source, files: Sequence[Any], split_size: int, *, kept=None,
               sizes: list | None = None) -> list[tuple[int, np.ndarray]]:
    """The work units of a build (see the module docstring).

    Args:
      source: the task's source (its ``splits`` cuts each file).
      files: ``source.list_files()``.
      split_size: bytes of input per unit (>= 1).
      kept: the plan of a build kept for growing (``work.KeptPlan``) or None:
        each of its units whose files are all unchanged (path, size and
        modification time) is kept as it is, so that its work is reused; the
        other splits of unchanged files keep their ranges, and only new or
        changed files are cut again (``plan_kept``).
      sizes: when a list, it gets each unit's split sizes (int64 arrays, bytes).

    Returns:
      ``[(unit_index, splits), ...]`` in file order, ``splits`` an int64
      array (n, 3) of ``(file_index, start, stop)``, ``stop`` -1 for the end
      of the file (one array a unit: the build's work table pickles it as
      its bytes).

    Raises:
      ValueError: ``split_size`` < 1, or a source's read error for a file whose
        splits need its metadata (a Parquet footer), naming the file.
    """
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1 byte (got {split_size})")
    whole_when_small = type(source).splits is Source.splits or getattr(source, "small_files_whole", False)
    if kept is not None:
        return plan_kept(source, files, split_size, kept, whole_when_small, sizes)
    table, row_sizes = _split_table(source, files, split_size, whole_when_small)
    return _grouped(table, row_sizes, split_size, sizes)


def _grouped(table: np.ndarray, row_sizes: np.ndarray, split_size: int, sizes: list | None,
             first_index: int = 0) -> list[tuple[int, np.ndarray]]:
    """Splits (rows of ``table``, in order) grouped greedily into units: a unit
    takes the next splits while they fit in ``split_size`` bytes and
    ``MAX_SPLITS_PER_UNIT`` splits (at least one split)."""
    ends = np.zeros(len(row_sizes) + 1, dtype=np.int64)
    np.cumsum(np.maximum(row_sizes, 1), out=ends[1:])
    units: list = []
    i, n = 0, len(row_sizes)
    while i < n:
        j = int(np.searchsorted(ends, ends[i] + split_size, side="right")) - 1
        j = min(max(j, i + 1), i + MAX_SPLITS_PER_UNIT, n)
        units.append((first_index + len(units), table[i:j]))
        if sizes is not None:
            sizes.append(np.asarray(row_sizes[i:j], dtype=np.int64))
        i = j
    return units


def plan_kept(source, files: Sequence[Any], split_size: int, kept, whole_when_small: bool,
              sizes: list | None = None) -> list[tuple[int, np.ndarray]]:
    """``plan_units`` given the plan of a kept build (``work.KeptPlan``).

    A kept unit stays a unit when every file of it is in ``files`` unchanged
    (same path, size and modification time) and its splits stay in file
    order; the splits of the other kept units whose files are unchanged
    keep their ranges (every split of a file comes from one plan, so none
    overlaps another) and are grouped again with the splits of new and
    changed files, cut as ``plan_units`` cuts them. Units are numbered in the
    order of their first split. The result depends only on ``files`` and
    ``kept``, so a rerun of a build that died plans the same units.
    """
    where = {f[0]: (i, int(f[1]), int(f[2])) for i, f in enumerate(files)}
    same = np.full(len(kept.files), -1, dtype=np.int64)  # kept file -> its index in files, or -1
    for k, (path, size, mtime) in enumerate(kept.files):
        now = where.get(path)
        if now is not None and now[1:] == (int(size), int(mtime)):
            same[k] = now[0]
    kept_units, loose = [], []
    for unit in kept.units:
        rows = np.asarray(unit.rows, dtype=np.int64).reshape(-1, 4)
        mapped = rows.copy()
        mapped[:, 0] = same[rows[:, 0]]
        step_file, step_start = np.diff(mapped[:, 0]), np.diff(mapped[:, 1])
        ordered = bool(np.all((step_file > 0) | ((step_file == 0) & (step_start > 0))))
        if len(mapped) and (mapped[:, 0] >= 0).all() and ordered:
            kept_units.append(mapped)
        else:
            loose.append(mapped[mapped[:, 0] >= 0])
    covered = np.zeros(len(files), dtype=bool)
    covered[same[same >= 0]] = True
    fresh = np.flatnonzero(~covered)
    table, row_sizes = _split_table(source, [files[i] for i in fresh.tolist()], split_size, whole_when_small)
    table[:, 0] = fresh[table[:, 0]] if len(table) else table[:, 0]
    loose_rows = np.concatenate([*loose, np.concatenate([table, row_sizes[:, None]], axis=1)])
    loose_rows = loose_rows[np.lexsort((loose_rows[:, 1], loose_rows[:, 0]))]
    new_sizes: list = []
    grouped = _grouped(loose_rows[:, :3], loose_rows[:, 3], split_size, new_sizes)
    every = [(rows[:, :3], rows[:, 3]) for rows in kept_units]
    every += [(rows, unit_sizes) for (_, rows), unit_sizes in zip(grouped, new_sizes)]
    every.sort(key=lambda u: (int(u[0][0, 0]), int(u[0][0, 1])))
    if sizes is not None:
        sizes.extend(np.asarray(s, dtype=np.int64) for _, s in every)
    return [(i, np.ascontiguousarray(rows, dtype=np.int64)) for i, (rows, _) in enumerate(every)]


def _split_table(source, files: Sequence[Any], split_size: int,
                 whole_when_small: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every split of ``files`` in order, as an int64 array (n, 3) of
    ``(file_index, start, stop)`` (stop None as -1), and their sizes in bytes
    (n,): ``source.splits`` of each file; or, when ``whole_when_small`` (the
    source reads a file of at most ``split_size`` bytes as one whole split),
    those of the larger files only (no ``Split`` and no call per small file,
    which a corpus of many small files makes by the hundred thousand)."""
    def cut(item):
        return source.splits(*item, split_size)

    sizes = np.fromiter((f.num_bytes for f in files), dtype=np.int64, count=len(files))
    if whole_when_small:
        check_target(split_size)
        big = np.flatnonzero(sizes > split_size).tolist()
        per_file: dict = {i: cut((i, files[i])) for i in big}
        if not big:
            table = np.stack([np.arange(len(files), dtype=np.int64), np.zeros(len(files), dtype=np.int64),
                              np.full(len(files), -1, dtype=np.int64)], axis=1)
            return table, sizes
    else:
        items = list(enumerate(files))
        if len(items) > 8 and type(source).splits is not Source.splits and getattr(source, "splits_read_files", True):
            # Splits that open files (Parquet footers) are looked up in parallel (a
            # round trip each on an object store); those from the file size are not.
            with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                per_file = dict(enumerate(pool.map(cut, items)))
        else:
            per_file = {i: cut(item) for i, item in enumerate(items)}
    rows, row_sizes = [], []
    for i in range(len(files)):
        splits = per_file.get(i)
        if splits is None:  # a small file, whole
            rows.append((i, 0, -1))
            row_sizes.append(int(sizes[i]))
            continue
        for s in splits:
            rows.append((int(s.file_index), int(s.start), -1 if s.stop is None else int(s.stop)))
            row_sizes.append(int(s.num_bytes))
    return np.array(rows, dtype=np.int64).reshape(-1, 3), np.array(row_sizes, dtype=np.int64)


def content_bytes(source, files: Sequence[Any]) -> int:
    """The uncompressed size of the input's text in bytes (int >= 0), which the
    shard count follows (a shard is sorted in one worker's memory).

    - Parquet files: the uncompressed sizes of the column chunks the source
      reads (``source.columns``; ``total_uncompressed_size`` in the footer's
      row-group metadata).
    - Compressed files (``.gz``, ``.bz2``, ``.xz``/``.lzma``, ``.zst``): the file
      size times the compression ratio of its first ``SAMPLE_BYTES`` compressed
      bytes (exact for smaller files; its file size if it cannot be decoded).
    - Anything else: the file size.

    At most ``MAX_SAMPLED_FILES`` files of each kind are opened, in parallel
    (evenly spaced in file order, so the result depends only on the file
    list); the others get the ratio of content to file bytes of those sampled.

    Raises:
      ValueError: a Parquet file whose footer cannot be read, naming the file.
    """
    parquet = getattr(source, "kind", None) == "parquet"
    columns = sorted(set(getattr(source, "columns", {}).values())) if parquet else None
    kinds: dict[str, list[int]] = {"parquet": [], "compressed": []}
    total = 0
    # Only the files whose paths end in a suffix of those kinds are looked at one by one.
    suffixed = set() if parquet else set(paths_ending_in([f.path for f in files], (".parquet", *COMPRESSED_SUFFIXES)))
    for i in (range(len(files)) if parquet else sorted(suffixed)):
        f = files[i]
        if f.path.lower().endswith(".parquet") or parquet:
            kinds["parquet"].append(i)
        elif is_compressed(f.path):
            kinds["compressed"].append(i)
        else:
            suffixed.discard(i)
    if not parquet:
        total = sum(int(f.num_bytes) for f in files) - sum(int(files[i].num_bytes) for i in suffixed)
    for kind, members in kinds.items():
        if not members:
            continue
        step = max(1, -(-len(members) // MAX_SAMPLED_FILES))
        sampled = members[::step]
        measure = (lambda i: _parquet_content(files[i].path, columns)) if kind == "parquet" else \
            (lambda i: _compressed_content(files[i].path, int(files[i].num_bytes)))
        if len(sampled) > 1:
            with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
                sizes = dict(zip(sampled, pool.map(measure, sampled)))
        else:
            sizes = {i: measure(i) for i in sampled}
        sampled_file_bytes = sum(int(files[i].num_bytes) for i in sampled)
        ratio = sum(sizes.values()) / sampled_file_bytes if sampled_file_bytes else 1.0
        for i in members:
            total += sizes[i] if i in sizes else int(round(int(files[i].num_bytes) * ratio))
    return int(total)


def _parquet_content(path: str, columns: Sequence[str] | None) -> int:
    """Uncompressed bytes of the column chunks named ``columns`` (all when None
    or when none of them is found) over every row group of a Parquet file."""
    try:
        with fs.open_binary(path, decompress=False) as f:
            md = pq.ParquetFile(f).metadata
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: cannot read the Parquet footer to size the shards: {e}") from None
    wanted = set(columns or ())
    chosen = total = 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            size = int(col.total_uncompressed_size)
            total += size
            if col.path_in_schema.split(".")[0] in wanted:
                chosen += size
    return chosen if chosen else total


def _compressed_content(path: str, num_bytes: int) -> int:
    """Decompressed size of a compressed file: exact when the file has at most
    ``SAMPLE_BYTES`` bytes, else ``num_bytes`` times the ratio of its first
    ``SAMPLE_BYTES`` compressed bytes. Concatenated members (``cat a.gz b.gz``)
    are followed. Unknown suffixes count their file size."""
    make = decompressor(path)
    if make is None or num_bytes <= 0:
        return int(num_bytes)
    try:
        with fs.open_binary(path, decompress=False) as f:
            data = f.read(SAMPLE_BYTES)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it to size the shards: {e}") from None
    out = 0
    pending = data
    try:
        while pending:
            d = make()
            out += len(d.decompress(pending))
            if not d.eof:
                break
            pending = d.unused_data
    except Exception:  # not decodable: the source reports it when it reads it; here it counts its size
        return int(num_bytes)
    if len(data) >= num_bytes:
        return out
    return int(round(out * num_bytes / max(len(data), 1)))
