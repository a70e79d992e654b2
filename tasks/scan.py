"""Scanning a task's input for every kind of bad input at once.

A build stops at the first record its source's policy raises on; ``scan_task``
instead reads the records with every kind set to ``"skip"``, runs the task's
preprocessors and checks (finding wrong types and out-of-range ids too) and
counts the records of each kind, in one pass. Nothing is written.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from typing import Callable

from seqcache.tasks.near_duplicates import NearDuplicates, removed_in_sample
from seqcache.tasks.sources import ERROR_KINDS, ErrorPolicy, is_error_record, read_failure
from seqcache.tasks.task import Task


@dataclasses.dataclass
class KindCount:
    """Records of one kind of bad input found by ``scan_task``.

    Attributes:
      kind: a key of ``ERROR_KINDS``.
      records: how many records have it (each record counts under its first
        problem only).
      first: the message of the first such record (file and record named).
      action: what the task's own policy does with this kind.
    """

    kind: str
    records: int
    first: str
    action: str


@dataclasses.dataclass
class ScanReport:
    """The result of ``scan_task``.

    Attributes:
      task: the task's name.
      records: source records read.
      files: source files read.
      kinds: the kinds found, in ``ERROR_KINDS`` order.
      complete: False when ``max_records`` stopped the scan early.
      unreadable_files: one message per file that could not be read to its end
        (a truncated ``.gz``, a Parquet file without the column); the records
        read before the failure are counted, and the scan goes on with the next
        file. A build raises on such a file whatever the policy.
      split: the split whose source was scanned, for a task with a source
        per split (``Task.for_split``); else None.
      near_duplicates: with ``scan_task(near=...)``, ``{"sampled": records
        with a signature among the first ``near_sample`` records that pass the
        source's checks, "removed": those near-duplicate removal would skip
        among them (``near_duplicates.removed_in_sample``), "parameters"}``.
    """

    task: str
    records: int
    files: int
    kinds: list[KindCount]
    complete: bool
    unreadable_files: list[str] = dataclasses.field(default_factory=list)
    split: str | None = None
    near_duplicates: dict | None = None

    @property
    def label(self) -> str:
        """``"task"``, or ``"task/split"`` for one split of a task with a source per split."""
        return self.task if self.split is None else f"{self.task}/{self.split}"

    @property
    def stops_build(self) -> KindCount | None:
        """The first kind (in ``ERROR_KINDS`` order) whose action is ``"raise"``:
        a build of the task would stop at its first such record. None if none."""
        return next((k for k in self.kinds if k.action == "raise"), None)

    def to_json(self) -> dict:
        return {"task": self.task, **({"split": self.split} if self.split is not None else {}), "records": self.records, "files": self.files, "complete": self.complete,
                "kinds": [dataclasses.asdict(k) for k in self.kinds], "unreadable_files": list(self.unreadable_files),
                **({"near_duplicates": self.near_duplicates} if self.near_duplicates is not None else {})}


def scan_task(task: Task, *, max_records: int | None = None, batch_records: int = 512,
              progress: Callable[[int], None] | None = None, near: NearDuplicates | None = None,
              near_sample: int = 10_000) -> ScanReport:
    """Reads ``task``'s records and counts every kind of bad input in them.

    The source is read with ``on_error="skip"`` for every kind, and the task's
    preprocessors and checks run on the records that pass (finding ``bad_value``
    records); sequence lengths are not applied. Files are read in path order.

    Args:
      task: the task to scan; it is not modified. One with a source per
        split must be resolved first (``task.for_split(split)``).
      max_records: stop after this many source records (None: all).
      batch_records: records per preprocessing batch.
      progress: called with the running count of records read, once per batch.
      near: estimate the share of near duplicates with these parameters on
        the first ``near_sample`` records that pass (``ScanReport.near_duplicates``).

    Returns:
      A ``ScanReport``.

    Raises:
      FileNotFoundError: a source pattern matches nothing.
    """
    own_policy = getattr(task.source, "on_error", ErrorPolicy())
    source = copy.copy(task.source)
    source.on_error = ErrorPolicy("skip")
    scanning = copy.copy(task)
    scanning.source = source
    counts: dict[str, list] = {}  # kind -> [records, first message]
    sample = _NearSample(near, near_sample)
    records = 0
    files = source.list_files()
    complete = True
    batch: list = []

    def flush() -> None:  # a batch holds records of one file
        live = [r for r in batch if not is_error_record(r)]
        for r in batch:
            if is_error_record(r):
                counts.setdefault(r.issue.kind, [0, r.issue.message])[0] += 1
        if live:
            rejected: list = []
            keys = [hashlib.blake2b(r.raw, digest_size=16).digest() for r in live]
            try:
                scanning.preprocess_batch(live, keys, seed=0, sequence_length=None, skipped=rejected)
            except ValueError as e:  # a preprocessor that raised: name the file, as a build does
                raise ValueError(f"{files[live[0].file_index].path}: {e}") from None
            for index, message in rejected:
                counts.setdefault("bad_value", [0, f"{files[live[index].file_index].path}: {message}"])[0] += 1
        batch.clear()
        if progress is not None:
            progress(records)

    unreadable: list[str] = []
    for file_index, f in enumerate(files):
        reading = iter(source.read_file(file_index, f.path))
        while True:
            try:
                record = next(reading)
            except StopIteration:
                break
            except Exception as e:  # the file itself, or a source's code: every record-level kind is skipped here
                unreadable.append(str(read_failure(e, f.path)))
                break
            if max_records is not None and records >= max_records:
                complete = False
                break
            records += 1
            batch.append(record)
            if len(batch) >= batch_records:
                flush()
        flush()
        if not complete:
            break
    flush()
    sample.read(task.source, files)
    kinds = [KindCount(k, counts[k][0], counts[k][1], own_policy.action(k)) for k in ERROR_KINDS if k in counts]
    return ScanReport(task.name, records, len(files), kinds, complete, unreadable, getattr(task, "split", None),
                      sample.found())


class _NearSample:
    """The texts near-duplicate detection reads, of the first ``size`` records
    that a build keeps (none without ``near``)."""

    def __init__(self, near: NearDuplicates | None, size: int):
        self.near, self.size, self.texts = near, int(size), []
        self.stopped: list[str] = []  # why a file's part of the sample ended early, one line a file

    def read(self, source, files) -> None:
        """The first ``size`` records of ``files`` that ``source`` keeps under
        its own policy, as a build reads them (the scan's own pass skips every
        kind it counts, such as control characters that a build keeps); a
        file that cannot be read, or a record the policy raises on, ends that
        file's part of the sample, and ``found`` says where.

        Raises:
          ValueError: a record lacks a field the parameters name, naming the
            file and record (as a build stops there).
        """
        if self.near is None:
            return
        for file_index, f in enumerate(files):
            reading = iter(source.read_file(file_index, f.path))
            while len(self.texts) < self.size:
                try:
                    r = next(reading)
                except StopIteration:
                    break
                except Exception as e:  # counted by the scan's own pass; a build would stop there
                    e = read_failure(e, f.path)
                    self.stopped.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
                    break
                if not is_error_record(r):
                    self.texts.append(self.near.text_of(r.data, f"{f.path}: record {r.record_number}"))
            if len(self.texts) >= self.size:
                return

    def found(self) -> dict | None:
        """``ScanReport.near_duplicates``, or None without ``near``: the
        records sampled, those removal would skip, the parameters, and where
        the source's policy ended a file's part of the sample (``stopped``:
        the files' first lines, when any)."""
        if self.near is None:
            return None
        sampled, removed = removed_in_sample(self.texts, self.near)
        return {"sampled": sampled, "removed": removed, "parameters": self.near.to_json(),
                **({"stopped": self.stopped} if self.stopped else {})}
