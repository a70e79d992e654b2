"""The work folder: what a build keeps of its work, so that a rerun after the
build died, or a build of a corpus that grew or changed, pays only for what is
new, and still writes the bytes of a build from scratch (G1).

A build is many pieces of pure work. The read step turns a work unit (splits of
input files, plan.py) into sorted spill sections (spill.py): every record's key
depends on the record alone (shuffle.py), so a unit's output depends on nothing
but its splits and the task. The work folder keeps that output, unit by unit,
under an address that names everything it depends on::

    <cache_dir>/<task>/.<split>.work/        (or build --work-dir)
        units/<address>.part     the ledger of a unit being read: its checkpoints
        units/<address>.json     ... of a complete unit
        runs/<address>-<attempt>-<k>.bin      the flush file of checkpoint k (spill.py)
        runs/<address>-<attempt>-<k>.q        the quarantine chunk of checkpoint k
        plan.json                the units of the last build kept for growing
        cache.json               the cache it serves (one cache a work folder)

- **The address** (``unit_addresses``): the sha256 of the work folder's
  format version, the cache's fingerprint inputs less the shard count, the
  file list (``address_base``: the task with its
  source's kind, parameters and ``on_error``, its preprocessors,
  vocabularies, seed, sequence lengths, packing, the record format and the
  shuffle scheme), and the unit's splits:
  each file's path, size and modification time, and the byte or row range.
  A unit of another vocabulary, seed, preprocessing or format has another
  address, so it is never read. A source whose fingerprint does not list its
  files the way ``list_files`` does (parallel text: a pair of files per
  record) keeps the whole file list in the base: its units are reused by a
  rerun of the same build only.
- **Checkpoints.** The read step checkpoints a unit every ``checkpoint_bytes``
  of examples (transforms.ReadUnit: 1 MiB, more with many shards, so that a
  shard's section stays >= 64 KiB) and at its end: it writes the flush file
  (sha256 computed while writing) and the quarantine chunk, then the ledger,
  atomically, with the records read since the last checkpoint and their
  per-file and bad-input counts. A unit killed in the middle resumes at its
  last checkpoint: its source is read again from the start, the records
  already done are skipped unread by the tokenizer.
- **Checked before it is used.** A later build reads a ledger, then checks the
  size and sha256 of every file it names, in order; the first that differs (a
  torn or corrupted file) and every checkpoint after it are redone, never
  read (counted in the manifest's ``work``).
- **Any shard count.** Sections are sorted by key, and shards are key ranges:
  a unit written for S shards is cut for another count by rows (spill.row_ranges).
- **File indices** in the sections are the unit's own (the rank of the file
  among the unit's files), mapped to the build's source table when the
  shards are written (``WorkTable.unit_files``): a unit written before files
  were added to the corpus still names the right files.
- **What is global is recomputed**: copy ranks of identical records and
  ``duplicate=skip`` come from the sections' columns in every build, the
  statistics from the units' counts, the quarantine from their chunks.

The lock of the cache (build.py) covers its work folder; a work folder given
with ``--work-dir`` is locked on its own (``WORK_LOCK``), locally. See
docs/scaling.md, "A build that dies, a corpus that grows".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import tempfile
import zlib
from typing import Any, Iterable, Iterator, Mapping, Sequence

import msgspec

from seqcache import format as fmt
from seqcache import fs
from seqcache.pipelines import spill

log = logging.getLogger(__name__)

# The work folder's own format: the ledgers, the flush files and their file
# indices (unit-local). A change makes every unit of an older folder unread.
WORK_VERSION = 1
UNITS_DIR, RUNS_DIR, PLAN_NAME, OWNER_NAME = "units", "runs", "plan.json", "cache.json"
PART_SUFFIX, DONE_SUFFIX, RUN_SUFFIX, CHUNK_SUFFIX = ".part", ".json", ".bin", ".q"
WORK_LOCK = ".lock"
# Characters of an address in file names (128 bits).
NAME_CHARS = 32
# A ledger or plan file larger than this is refused unread (bytes).
MAX_LEDGER_BYTES = 256 << 20
# Examples a unit buffers between checkpoints (bytes), at least; with S shards
# at least S * MIN_SECTION_BYTES (each shard's section of a flush file stays
# that large), at most the flush size.
CHECKPOINT_BYTES = 1 << 20
MIN_SECTION_BYTES = 64 << 10


def work_path(cache_dir: str, *, steps_run_here: bool = False) -> str:
    """The default work folder of the cache at ``cache_dir``:
    ``<task>/.<split>.work`` beside it; for a cache at a URL whose build runs
    every step on this machine (``steps_run_here``: the local engine, Prism),
    ``local_work_path(cache_dir)`` instead, on this machine's disk, where the
    shard writers read their sections without a request each."""
    if steps_run_here and not fs.is_local(cache_dir):
        return local_work_path(cache_dir)
    parent, _, name = cache_dir.rstrip("/").rpartition("/")
    if fs.is_local(cache_dir):
        parent, name = os.path.split(os.path.normpath(fs.local_path(cache_dir)))
    return fs.join(parent, f".{name}.work")


def local_work_path(cache_dir: str) -> str:
    """``<temp>/seqcache-work/<sha256 of the URL, 16 hex>``: the work folder
    on this machine of a cache at a URL (``work_path``)."""
    return os.path.join(tempfile.gettempdir(), "seqcache-work", hashlib.sha256(cache_dir.encode()).hexdigest()[:16])


def checkpoint_bytes(num_shards: int, flush_bytes: int) -> int:
    """Examples (bytes) a unit buffers between checkpoints: ``CHECKPOINT_BYTES``,
    or ``num_shards * MIN_SECTION_BYTES`` when larger, at most ``flush_bytes``."""
    return int(min(flush_bytes, max(CHECKPOINT_BYTES, num_shards * MIN_SECTION_BYTES)))


# -- addresses -------------------------------------------------------------------------


def address_base(inputs: Mapping[str, Any], files: Sequence[Any]) -> str:
    """sha256 (hex) of what every unit of a build depends on besides its
    splits: ``WORK_VERSION`` and the fingerprint inputs ``inputs``
    (``build.task_fingerprint_inputs``) less ``num_shards``, less the
    source's file list when that list is ``files`` (``SourceFile``s: path,
    size, modification time) as the build listed them."""
    inputs = json.loads(json.dumps(inputs))
    inputs.pop("num_shards", None)
    source = (inputs.get("task") or {}).get("source")
    listed = [{"path": f[0], "num_bytes": int(f[1]), "mtime_ns": int(f[2])} for f in files]
    if isinstance(source, dict) and source.get("files") == listed:
        del source["files"]
    # The duplicate action stays: copies are found after the read step (transforms.SpreadCopies), but
    # under duplicate=skip a unit's quarantine chunks note its records' kept kinds (spill.QuarantineBuffer.add_note).
    return fmt.fingerprint_of({"work_version": WORK_VERSION, "inputs": inputs})


def unit_addresses(base: str, files: Sequence[Any], units: Sequence[Any]) -> list[str]:
    """The address (sha256 hex) of each unit (``(unit_index, rows)``, rows
    ``(file_index, start, stop)``, stop -1 for the end of the file): ``base``
    then, per split, the file's path, size and modification time and the range."""
    out = []
    for _, rows in units:
        h = hashlib.sha256(base.encode())
        for file_index, start, stop in (rows.tolist() if hasattr(rows, "tolist") else rows):
            path, size, mtime = files[file_index][:3]
            h.update(f"{path}\0{int(size)}\0{int(mtime)}\0{int(start)}\0{int(stop)}\n".encode("utf-8", "surrogateescape"))
        out.append(h.hexdigest())
    return out


# -- ledgers ---------------------------------------------------------------------------


class FileRecord(msgspec.Struct, frozen=True):
    """One file of a checkpoint: its name in ``runs/``, size (bytes) and sha256."""

    name: str
    num_bytes: int
    sha256: str


class Checkpoint(msgspec.Struct):
    """One checkpoint of a unit: the source ``records`` read since the one
    before (records), the flush file of the examples (``run``, written for
    ``num_shards`` shards; None when none were buffered), the quarantine
    chunk (``chunk`` or None; its lines name the files by the build's file
    indices of the time, ``chunk_files``: those of the unit's files), and the
    counts of those records: ``files``, ``transforms.FileCounts.columns``
    with the unit's own file indices, and ``bad_input``
    (``stats.BadInputCounts.to_json``)."""

    records: int
    run: FileRecord | None = None
    num_shards: int = 0
    chunk: FileRecord | None = None
    chunk_files: list[int] = []
    files: list[list[int]] = []
    bad_input: dict[str, dict[str, int]] = {}


class Ledger(msgspec.Struct):
    """A unit's ledger: its address, its checkpoints in order, and whether
    the unit is complete."""

    version: int
    address: str
    checkpoints: list[Checkpoint]
    complete: bool = False


def seal(data: bytes) -> bytes:
    """``data``, a newline and its sha256 (hex) and a newline: how the work
    folder's own files (ledgers, shard marks, the kept plan) are written, so
    that one flipped bit in them is found (``unseal``) rather than trusted."""
    return data + b"\n" + hashlib.sha256(data).hexdigest().encode() + b"\n"


def unseal(sealed: bytes, what: str) -> bytes:
    """The data ``seal`` sealed.

    Raises:
      ValueError: the sha256 is missing or does not match (``what`` names the file).
    """
    data, _, digest = sealed.rstrip(b"\n").rpartition(b"\n")
    if not _ or hashlib.sha256(data).hexdigest().encode() != digest:
        raise ValueError(f"{what}: its sha256 does not match its content (a torn or changed file)")
    return data


def file_sha256(url: str) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in blocks of 4 MiB."""
    if fs.is_local(url):
        path = fs.local_path(url)
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()
    h, size = hashlib.sha256(), 0
    with fs.open_read(url) as f:
        while True:
            block = f.read(4 << 20)
            if not block:
                return size, h.hexdigest()
            h.update(block)
            size += len(block)


@dataclasses.dataclass
class UnitLedger:
    """One unit's place in the work folder, as its read step keeps it.

    Attributes:
      folder: the work folder (local path or URL).
      address: the unit's address (``unit_addresses``).
      checkpoints: the checkpoints found and checked (``restore``), then those
        added (``commit``).
      complete: the ledger found was complete and every file checked out.
      rejected: checkpoints found whose files did not match (redone).
    """

    folder: str
    address: str
    checkpoints: list = dataclasses.field(default_factory=list)
    complete: bool = False
    rejected: int = 0

    def url(self, *parts: str) -> str:
        return fs.join(self.folder, *parts)

    def _ledger_url(self, suffix: str) -> str:
        return self.url(UNITS_DIR, self.address[:NAME_CHARS] + suffix)

    def restore(self, num_files: int | None = None) -> None:
        """Reads the unit's ledger, if any, and keeps the checkpoints whose
        files check out (size and sha256; the unit's ``num_files`` files),
        up to the first that does not."""
        found = self._read()
        if found is None:
            return
        for k, cp in enumerate(found.checkpoints):
            bad = self._check(cp, num_files)
            if bad is not None:
                self.rejected = len(found.checkpoints) - k
                log.warning("work unit %s: %s; its last %d checkpoint(s) are read again", self.address[:12], bad,
                            self.rejected)
                break
            self.checkpoints.append(cp)
        self.complete = found.complete and not self.rejected

    def _read(self) -> "Ledger | None":
        for suffix in (DONE_SUFFIX, PART_SUFFIX):
            url = self._ledger_url(suffix)
            try:
                if fs.size(url) is None:
                    continue
                data = fs.read_bytes(url)
            except OSError as e:
                log.warning("%s: the ledger cannot be read (%s); the unit is read again", url, e)
                return None
            try:
                if len(data) > MAX_LEDGER_BYTES:
                    raise ValueError(f"{len(data):,} bytes")
                ledger = msgspec.json.decode(unseal(data, "the ledger"), type=Ledger)
                if ledger.version != WORK_VERSION or ledger.address != self.address:
                    raise ValueError(f"version {ledger.version}, address {ledger.address[:12]}")
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                log.warning("%s: not a ledger of this unit (%s); the unit is read again", url, e)
                self.rejected = 1
                return None
            return ledger
        return None

    def _check(self, cp: Checkpoint, num_files: int | None = None) -> str | None:
        """Why a checkpoint's files cannot be used, or None: each must be one
        of this unit's, of its recorded size and sha256, and its counts must
        name the unit's ``num_files`` files."""
        if num_files is not None and ((cp.chunk is not None and len(cp.chunk_files) != num_files) or any(
                i < 0 or i >= num_files for i in (cp.files[0] if cp.files else ()))):
            return f"a checkpoint names files the unit does not have ({num_files} files)"
        if cp.records < 0:
            return f"a checkpoint of {cp.records} records"
        for record in (cp.run, cp.chunk):
            if record is None:
                continue
            if not record.name.startswith(self.address[:NAME_CHARS] + "-") or "/" in record.name:
                return f"a checkpoint names {record.name!r}, not a file of this unit"
            url = self.url(RUNS_DIR, record.name)
            try:
                size, digest = file_sha256(url)
            except OSError as e:
                return f"{url} cannot be read ({e})"
            if size != record.num_bytes:
                return f"{url} has {size:,} bytes, its ledger says {record.num_bytes:,}"
            if digest != record.sha256:
                return f"{url} is not the file its ledger names (sha256 {digest[:12]}, recorded {record.sha256[:12]})"
        return None

    def records_done(self) -> int:
        """Source records the kept checkpoints cover, from the unit's start."""
        return sum(cp.records for cp in self.checkpoints)

    def run_name(self, attempt: str, k: int, suffix: str) -> str:
        """The name in ``runs/`` of checkpoint ``k``'s file of this attempt."""
        return f"{self.address[:NAME_CHARS]}-{attempt}-{k:05d}{suffix}"

    def commit(self, cp: Checkpoint, *, complete: bool) -> None:
        """Adds checkpoint ``cp`` (its files already written) and writes the
        ledger atomically; a complete unit's ledger takes its final name."""
        self.checkpoints.append(cp)
        ledger = Ledger(WORK_VERSION, self.address, self.checkpoints, complete)
        data = seal(msgspec.json.encode(ledger))
        if complete:
            fs.write_bytes_atomic(self._ledger_url(DONE_SUFFIX), data, fsync=False)
            with contextlib.suppress(OSError):
                fs.remove_file(self._ledger_url(PART_SUFFIX))
        else:
            fs.write_bytes_atomic(self._ledger_url(PART_SUFFIX), data, fsync=False)

    def attempts(self) -> list[str]:
        """The attempts whose files the checkpoints name (``runs/`` names' middle part)."""
        out = []
        for cp in self.checkpoints:
            for record in (cp.run, cp.chunk):
                if record is not None:
                    attempt = record.name[NAME_CHARS + 1:].rsplit("-", 1)[0]
                    if attempt not in out:
                        out.append(attempt)
        return out


# -- a checkpoint's values, again -------------------------------------------------------


def replay_run(url: str, num_bytes: int, *, unit: int, written_for: int, num_shards: int, num_features: int,
               exchange: str, shard_of_keys) -> Iterator[tuple[int, Any]]:
    """The values of a checkpoint's flush file, as the read step emits them
    (transforms.ReadUnit): per section ``(shard, (url, offset, length, unit,
    -1, -1))`` for the spill exchange, ``(shard, (unit, section bytes))`` for
    the runner's. Written for another shard count (``written_for``), each
    section is cut by the key ranges of ``num_shards`` (``spill.row_ranges``):
    row ranges of it, or (runner) sections of their own."""
    files = fs.RangeReader()
    try:
        read = functools.partial(files.read, url)
        sections = spill.read_flush_index(lambda a, b: read(a, b - a), num_bytes, url)
        for shard, offset, length in sections:
            where = f"{url} at byte {offset}"
            if written_for == num_shards:
                if exchange == "spill":
                    yield shard, (url, offset, length, unit, -1, -1)
                else:
                    yield shard, (unit, read(offset, length))
                continue
            keys = spill.section_keys(lambda a, b, at=offset: read(at + a, b - a), where)
            ranges = spill.row_ranges(keys, num_shards, shard_of_keys)
            if exchange == "spill":
                for new_shard, lo, hi in ranges:
                    yield new_shard, (url, offset, length, unit, lo, hi)
                continue
            section = read(offset, length)
            for new_shard, lo, hi in ranges:
                yield new_shard, (unit, spill.slice_section(section, num_features, lo, hi, where))
    finally:
        files.close()


def replay_chunk(url: str, written_files: Sequence[int], files: Sequence[int], *, scratch_dir: str) -> str:
    """A checkpoint's quarantine chunk as this build names its files: ``url``
    itself when the unit's files have the build file indices they had
    (``written_files``, now ``files``); else a copy in ``scratch_dir`` whose
    lines name them by the new ones (a monotone map, so the lines stay sorted)."""
    written, now = [int(f) for f in written_files], [int(f) for f in files]
    if written == now:
        return url
    if len(written) != len(now):
        raise ValueError(f"{url}: a quarantine chunk of {len(written)} files for a unit of {len(now)}")
    mapping = dict(zip(written, now))
    out = []
    for line in fs.read_bytes(url).splitlines(keepends=True):
        old = int(line[:10])
        new = mapping[old]
        head = b'{"source_index": %d,' % old
        entry_at = line.index(b"\t{") + 1
        if not line.startswith(head, entry_at):
            raise ValueError(f"{url}: quarantine line {line[:80]!r} does not start its entry with its file index")
        out.append(b"%010d" % new + line[10:entry_at] + b'{"source_index": %d,' % new + line[entry_at + len(head):])
    copy = fs.join(scratch_dir, f"{spill.QUARANTINE_PREFIX}remapped-{os.urandom(6).hex()}.txt")
    fs.write_bytes(copy, b"".join(out))
    return copy


# -- the folder ------------------------------------------------------------------------


def completed(folder: str, addresses: Iterable[str]) -> set[str]:
    """The addresses among ``addresses`` whose complete ledger is in ``folder``
    (one listing; nothing is checked)."""
    names = fs.sizes_in(fs.join(folder, UNITS_DIR))
    return {a for a in addresses if a[:NAME_CHARS] + DONE_SUFFIX in names}


def usage(folder: str) -> tuple[int, int, int]:
    """(complete units, unit ledgers, bytes) in a work folder; zeros when there is none."""
    ledgers = fs.sizes_in(fs.join(folder, UNITS_DIR))
    runs = fs.sizes_in(fs.join(folder, RUNS_DIR))
    done = sum(1 for n in ledgers if n.endswith(DONE_SUFFIX))
    plan = fs.size(fs.join(folder, PLAN_NAME)) or 0
    return done, len(ledgers), sum(ledgers.values()) + sum(runs.values()) + plan


# What a work folder holds (``foreign_entry``).
WORK_NAMES = (UNITS_DIR, RUNS_DIR, PLAN_NAME, WORK_LOCK, OWNER_NAME)


def claim(folder: str, cache_dir: str) -> None:
    """Makes ``folder`` the work folder of the cache at ``cache_dir``
    (``cache.json`` names it), or checks that it is: a work folder serves one
    cache, since a build that keeps its work keeps only its own units.

    Raises:
      ValueError: the folder is another cache's (names both), or is a file.
    """
    if fs.is_local(cache_dir):
        cache_dir = os.path.realpath(fs.local_path(cache_dir))
    url = fs.join(folder, OWNER_NAME)
    try:
        owner = json.loads(fs.read_bytes(url)).get("cache") if fs.exists(url) else None
    except (OSError, ValueError, AttributeError):
        owner = None  # unreadable: this build's from now on (its units are checked one by one anyway)
    if owner is not None and owner != cache_dir:
        raise ValueError(f"{folder} is the work folder of the cache {owner}, not of {cache_dir}: give each cache "
                         "a work folder of its own (--work-dir), or remove that one (seqcache clean)")
    if owner is None:
        fs.makedirs(folder)
        fs.write_bytes_atomic(url, json.dumps({"cache": cache_dir}).encode(), fsync=False)


def foreign_entry(folder: str) -> str | None:
    """The first entry of ``folder`` that no build writes in a work folder, or
    None: a folder to be removed whole must be one."""
    if fs.is_local(folder):
        names = sorted(os.listdir(fs.local_path(folder)))
    else:
        prefix = folder.rstrip("/") + "/"
        names = sorted({f.path[len(prefix):].split("/", 1)[0] for f in fs.match(prefix + "**")
                        if f.path.startswith(prefix)})
    return next((n for n in names if n not in WORK_NAMES), None)


def remove(folder: str) -> None:
    """Removes a work folder (nothing when there is none): its plan first, so
    that a removal killed half way leaves a folder no build keeps."""
    fs.remove_file(fs.join(folder, PLAN_NAME))
    fs.remove_tree(folder)


def keep_only(folder: str, attempts: Mapping[str, Sequence[str]]) -> int:
    """Removes from ``folder`` every ledger and run file that is not of a unit
    of ``attempts`` (address -> the attempts its ledger names); returns the
    files removed. What a build kept for growing holds its own units only."""
    wanted = {a[:NAME_CHARS]: set(v) for a, v in attempts.items()}
    doomed = []
    for name in fs.sizes_in(fs.join(folder, UNITS_DIR)):
        if name.split(".", 1)[0] not in wanted or name.endswith(PART_SUFFIX):
            doomed.append(fs.join(folder, UNITS_DIR, name))
    for name in fs.sizes_in(fs.join(folder, RUNS_DIR)):
        prefix, _, rest = name.partition("-")
        if rest.rsplit("-", 1)[0] not in wanted.get(prefix, ()):
            doomed.append(fs.join(folder, RUNS_DIR, name))
    for url in doomed:
        fs.remove_file(url)
    return len(doomed)


# -- the plan of the last build kept for growing ---------------------------------------


class PlannedUnit(msgspec.Struct, array_like=True):
    """One unit of a kept build: its splits as rows ``(file_index, start,
    stop, num_bytes)`` (stop -1: the file's end; file indices into the
    plan's ``files``)."""

    rows: list[tuple[int, int, int, int]]


class KeptPlan(msgspec.Struct):
    """The units of the last build kept for growing (``plan.json``): the
    address base they were made under, the files ``[path, size, mtime_ns]``
    and the units."""

    version: int
    base: str
    files: list[tuple[str, int, int]]
    units: list[PlannedUnit]


def write_plan(folder: str, base: str, files: Sequence[Any], units: Sequence[Any], sizes: Sequence[Any]) -> None:
    """Writes ``plan.json`` (zlib-compressed JSON): the build's units
    (``(unit_index, rows)``) with each split's planned size (``sizes``, per
    unit, bytes), for the next build to keep them (plan.plan_units)."""
    plan = KeptPlan(WORK_VERSION, base, [(f[0], int(f[1]), int(f[2])) for f in files],
                    [PlannedUnit([(int(r[0]), int(r[1]), int(r[2]), int(n))
                                  for r, n in zip(rows.tolist() if hasattr(rows, "tolist") else rows, unit_sizes)])
                     for (_, rows), unit_sizes in zip(units, sizes)])
    fs.write_bytes_atomic(fs.join(folder, PLAN_NAME), zlib.compress(seal(msgspec.json.encode(plan)), 1), fsync=False)


def read_plan(folder: str, base: str) -> "KeptPlan | None":
    """The kept plan of ``folder`` made under the same ``base``, else None
    (none, another task or options, or unreadable: said in the log)."""
    url = fs.join(folder, PLAN_NAME)
    try:
        size = fs.size(url)
        if size is None:
            return None
        if size > MAX_LEDGER_BYTES:
            raise ValueError(f"{size:,} bytes")
        plan = msgspec.json.decode(unseal(zlib.decompress(fs.read_bytes(url)), "the plan"), type=KeptPlan)
    except (OSError, ValueError, zlib.error, msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("%s: cannot be read (%s); the work units are planned anew", url, e)
        return None
    if plan.version != WORK_VERSION or plan.base != base:
        return None
    return plan
