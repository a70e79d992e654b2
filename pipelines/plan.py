"""The build plan: what one build does, decided by the driver before any work.

``BuildPlan`` is the one object the driver passes around: the task and the
options that define the cache, the input files, the shard count, the
fingerprint, where the cache goes, and how the work runs (runner, exchange,
split size). Only the first half defines the cache's bytes.

Work units: each input file is cut into splits by its source
(``Source.splits``: byte ranges of uncompressed text and JSON lines, row groups
of Parquet, whole files otherwise) of about ``split_size`` bytes; consecutive
small splits (small files) are grouped into one unit of about ``split_size``,
so that a corpus of a million small files is not a million units. A unit is
``(unit_index, ((file_index, start, stop), ...))``: small, picklable, and
independent of everything but the file list and the split size. How the work
is cut never changes the cache: record ids are byte offsets or row indices,
and shards are key ranges.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Mapping, Sequence

# Units of reading work: about this much input each, at most MAX_UNITS in all
# (a runner such as Dataflow carries Create's elements in the job graph).
DEFAULT_SPLIT_BYTES = 64 << 20
MIN_SPLIT_BYTES = 1 << 20
MAX_UNITS = 100_000
# Splits of one unit at most (many tiny files).
MAX_SPLITS_PER_UNIT = 4096


@dataclasses.dataclass(frozen=True)
class BuildPlan:
    """Everything one build needs, decided before the pipeline starts.

    Attributes:
      task, config: the task and the ``BuildConfig`` (they define the cache).
      files: the input files (``SourceFile``: path, bytes, mtime), sorted.
      total_bytes: their size in bytes.
      num_shards: the shard count.
      shard_size: the raw bytes per shard it was derived from (None when the
        count was given).
      inputs, fingerprint: the fingerprint's inputs and the fingerprint.
      out_dir: ``cache_dir/<task>/<split>``.
      runner: the Beam runner (resolved name); options: its ``PipelineOptions``.
      exchange: ``"runner"`` or ``"spill"`` (runner.py).
      split_size: bytes of input per work unit.
      fs_options: the pipeline options that file systems read, for workers.
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


def choose_split_size(total_bytes: int) -> int:
    """Bytes per work unit: about 64 units for a small corpus (so that every
    worker has work), ``DEFAULT_SPLIT_BYTES`` for a large one, and large enough
    that there are at most ``MAX_UNITS`` units."""
    size = max(MIN_SPLIT_BYTES, min(DEFAULT_SPLIT_BYTES, -(-int(total_bytes) // 64)))
    return max(size, -(-int(total_bytes) // MAX_UNITS))


def plan_units(source, files: Sequence[Any], split_size: int) -> list[tuple[int, tuple[tuple[int, int, Any], ...]]]:
    """The work units of a build (see the module docstring).

    Args:
      source: the task's source (its ``splits`` cuts each file).
      files: ``source.list_files()``.
      split_size: bytes of input per unit (>= 1).

    Returns:
      ``[(unit_index, ((file_index, start, stop), ...)), ...]``, in file order.

    Raises:
      ValueError: ``split_size`` < 1, or a source's read error for a file whose
        splits need its metadata (a Parquet footer), naming the file.
    """
    if split_size < 1:
        raise ValueError(f"split_size must be >= 1 byte (got {split_size})")

    def cut(item):
        i, f = item
        return source.splits(i, f, split_size)

    items = list(enumerate(files))
    if len(items) > 8 and type(source).splits is not _default_splits():
        # Splits that open files (Parquet footers) are looked up in parallel: on
        # an object store each is a round trip.
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            per_file = list(pool.map(cut, items))
    else:
        per_file = [cut(item) for item in items]
    units: list = []
    current: list = []
    current_bytes = 0
    for splits in per_file:
        for s in splits:
            size = max(int(s.num_bytes), 1)
            if current and (current_bytes + size > split_size or len(current) >= MAX_SPLITS_PER_UNIT):
                units.append((len(units), tuple(current)))
                current, current_bytes = [], 0
            current.append((int(s.file_index), int(s.start), None if s.stop is None else int(s.stop)))
            current_bytes += size
    if current:
        units.append((len(units), tuple(current)))
    return units


def _default_splits():
    from seqcache.tasks.sources import Source

    return Source.splits
