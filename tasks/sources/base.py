"""What every source shares: records and their ids, splits, files, canonical
JSON, file matching, and the ``Source`` interface.

A record's id is ``(file_index, record_number)``; what ``record_number`` counts
is the source's ``locator``, and ``describe_record`` is the one function that
words a record's place. The helpers every source uses are public here
(``BOM``, ``READ_ERRORS``, ``read_error``, ``read_whole``, ``check_target``,
``FileSource``, ``TextSource``), with ``Source``'s methods for subclasses
(``_record``, ``_row_record``, ``_decode``, ``_bad``).
"""

from __future__ import annotations

import abc
import datetime
import decimal
import fnmatch
import gzip
import json
import logging
import os
import zlib
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from seqcache import bounded_json, compression, fs
from seqcache.tasks.sources.lines import check_target, line_number_at
from seqcache.tasks.sources.policy import (BadInputError, ErrorPolicy, Where, as_where, check_text_values, error_hint,
                                           with_path)

log = logging.getLogger(__name__)

BOM = bounded_json.BOM  # the UTF-8 byte order mark, removed at byte 0 of a file (as every reader of seqcache does)

# The values of ``Source.locator``: what ``SourceRecord.record_number`` counts.
LOCATORS = ("byte_offset", "row", "record", "file", "line")
# A record's place by locator (``describe_record``), stable and for people;
# ``{n}`` is the record number, ``{l}`` the 1-based line.
_STABLE_WORDS = {"byte_offset": "line at byte {n}", "line": "line {l}", "row": "row {n}", "record": "record {n}",
                 "file": "file"}
_WORDS = {"line": "line {l:,}", "row": "row {n:,}", "record": "record {n}", "file": "whole file"}
# The sources with a command-line form, by ``kind`` (``parse_source_spec``).
SPEC_KINDS: dict[str, type] = {}


class RecordIssue(NamedTuple):
    """What a source found wrong with one record and did under its policy.

    Attributes:
      action: ``"skipped"`` (no example; ``data`` is ``{}``) or ``"replaced"``
        (kept, repaired).
      kind: a key of ``ERROR_KINDS``; for a repair, the kinds, comma-separated.
      message: what is wrong, naming the file and the record by an id that does
        not depend on the split (``"/data/a.txt: line at byte 1234 is empty"``).
    """

    action: str
    kind: str
    message: str


class SourceRecord(NamedTuple):
    """One raw record of a source.

    Attributes:
      file_index: index of the file in ``Source.list_files()`` (sorted by path).
      record_number: the record's id within its file, counting what the
        source's ``locator`` names; it does not depend on the split.
      data: the record's fields, e.g. ``{"text": "..."}``; ``{}`` if skipped.
      raw: canonical bytes of the raw record, the shuffle key's input.
      issue: None for a clean record, else a ``RecordIssue``.
      kept: the kinds of bad input accepted as they are (action ``"keep"``),
        in the order met, counted in ``statistics.bad_input_records``.
    """

    file_index: int
    record_number: int
    data: dict[str, Any]
    raw: bytes
    issue: RecordIssue | None = None
    kept: tuple[str, ...] = ()


class Split(NamedTuple):
    """A part of one input file, the unit of reading work: the records whose
    first byte (byte splits) or row (row splits) lies in ``[start, stop)``;
    ``Split(i, path)`` is the whole file. The splits of a file hold each of its
    records exactly once, with ids that do not depend on the split.

    Attributes:
      file_index: the file's index in ``Source.list_files()``.
      path: the file's path.
      start: first byte or row of the split; 0 for a whole file.
      stop: end (exclusive, same unit), or None for the end of the file.
      num_bytes: the split's size (compressed, for row splits), for planning;
        0 when unknown.
    """

    file_index: int
    path: str
    start: int = 0
    stop: int | None = None
    num_bytes: int = 0

    @property
    def whole(self) -> bool:
        """True for a split that is the whole file."""
        return self.start == 0 and self.stop is None


# One input file: path, size in bytes and modification time in nanoseconds. The
# file system's listing entry itself (``fs.FileInfo``): a listing of many files
# is not copied into a second tuple type, one tuple per file.
SourceFile = fs.FileInfo


encode_json_string = json.encoder.encode_basestring  # json.dumps's own, ensure_ascii=False
# The bytes json.dumps escapes in a string (ensure_ascii=False), and their escapes.
_JSON_ESCAPES = {c: encode_json_string(chr(c))[1:-1].encode() for c in [*range(0x20), 0x22, 0x5C]}


def json_string_bodies(data: bytes, offsets) -> tuple[bytes, list[int]]:
    """The JSON string forms of a column of UTF-8 strings, escaped at once:
    ``escaped[out[i]:out[i + 1]]`` is value i's ``json.dumps(value,
    ensure_ascii=False)`` without its quotes, as UTF-8.

    Args:
      data: the values' UTF-8 bytes, one after the other.
      offsets: int array (n + 1,): value i is ``data[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]``.

    Returns:
      ``(escaped, out)``: bytes, and a list of n + 1 ints. Only ASCII bytes are
      escaped, which UTF-8 holds in no multi-byte sequence.
    """
    arr = np.frombuffer(data, dtype=np.uint8)
    base = np.asarray(offsets, dtype=np.int64) - int(offsets[0])
    special = np.flatnonzero((arr < 0x20) | (arr == 0x22) | (arr == 0x5C))
    if not len(special):
        return data, base.tolist()
    found = arr[special]
    present = np.unique(found).tolist()
    extra = np.zeros(256, dtype=np.int64)
    for c in present:
        extra[c] = len(_JSON_ESCAPES[c]) - 1
    rows = np.searchsorted(base[1:], special, side="right")
    per_row = np.bincount(rows, weights=extra[found], minlength=len(base) - 1).astype(np.int64)
    out = base.copy()
    out[1:] += np.cumsum(per_row)
    escaped = data.replace(b"\\", b"\\\\") if 0x5C in present else data  # first: escapes add backslashes
    for c in present:
        if c != 0x5C:
            escaped = escaped.replace(bytes([c]), _JSON_ESCAPES[c])
    return escaped, out.tolist()


def canonical_json_bytes(obj: Any, *, default: Callable[[Any], Any] | None = None,
                         surrogates: bool = False) -> bytes:
    """Canonical JSON (sorted keys, no whitespace, UTF-8, not ASCII-escaped):
    ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
    encoded as UTF-8; with ``surrogates``, a lone surrogate (a JSON ``\\u``
    escape of half a pair) is encoded as its three bytes (``"surrogatepass"``)
    instead of raising, so that the record still gets a key and the content
    checks decide (kind ``invalid_utf8``).

    Raises:
      TypeError: a value has no JSON form (``default`` may give one).
      ValueError: a string holds a lone surrogate (no UTF-8 form), without ``surrogates``.
    """
    try:
        if type(obj) is dict and all(type(k) is str and type(v) is str for k, v in obj.items()):
            # Text values only, as json.dumps writes them, without an encoder per call.
            quote = encode_json_string
            text = "{" + ",".join(f"{quote(k)}:{quote(obj[k])}" for k in sorted(obj)) + "}"
        else:
            text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default)
        return text.encode("utf-8", "surrogatepass" if surrogates else "strict")
    except UnicodeEncodeError as e:
        raise ValueError(f"text with no UTF-8 form: {e}") from None


class RecordBatch:
    """Consecutive records in file order, as columns: what the pipeline reads
    (``Source.read_batches``), with no Python object per clean record.

    A sequence of ``SourceRecord`` (``batch[i]``, ``len(batch)``): the records
    a source built one by one (``from_records``), or, for sources with a
    columnar fast path, clean records held as columns (one text field) with the
    others (skipped, repaired, kept bad input) as ``SourceRecord`` objects at
    their positions. ``concat`` joins the batches of small files.

    Attributes:
      file_index: the split's file index: every record's, unless ``file_indices``.
      file_indices: None, or (a source whose records name several files, or
        a batch of several splits) each record's ``file_index``, int list (n,).
      record_numbers: int list (n,): each record's ``record_number``.
      raws: bytes list (n,): each record's ``raw`` (the shuffle key's input).
    """

    __slots__ = ("file_index", "file_indices", "record_numbers", "raws", "_field", "_texts", "_odd", "_records")

    def __init__(self, file_index: int, record_numbers: list[int], raws: list[bytes], *, field: str | None,
                 texts: list | None, odd: dict[int, SourceRecord] | None, file_indices: list[int] | None = None,
                 records: list[SourceRecord] | None = None):
        """Column form: record i is ``odd[i]`` where present, else the clean
        ``SourceRecord(file_indices[i] or file_index, record_numbers[i],
        {field: texts[i]}, raws[i])``. With ``records``, those records."""
        self.file_index = file_index
        self.file_indices = file_indices
        self.record_numbers = record_numbers
        self.raws = raws
        self._field, self._texts, self._odd, self._records = field, texts, odd, records

    @classmethod
    def from_records(cls, records: Sequence[SourceRecord]) -> "RecordBatch":
        """A batch of records built one by one (each source's ``read_split``)."""
        records = list(records)
        first = records[0].file_index if records else 0
        indices = [r.file_index for r in records]
        return cls(first, [r.record_number for r in records], [r.raw for r in records], field=None, texts=None,
                   odd=None, file_indices=None if all(i == first for i in indices) else indices, records=records)

    @classmethod
    def concat(cls, batches: Sequence["RecordBatch"]) -> "RecordBatch":
        """The records of ``batches``, in order, as one batch: columns when all
        are columns of the same field. ``file_indices`` is set for several files.

        Raises:
          ValueError: ``batches`` is empty.
        """
        if not batches:
            raise ValueError("RecordBatch.concat needs at least one batch")
        if len(batches) == 1:
            return batches[0]
        first = batches[0]
        if any(b._records is not None or b._field != first._field for b in batches):
            return cls.from_records([b[i] for b in batches for i in range(len(b))])
        odd, offset = {}, 0
        for b in batches:
            odd.update((offset + i, r) for i, r in b._odd.items())
            offset += len(b)
        one_file = all(b.file_indices is None and b.file_index == first.file_index for b in batches)
        return cls(first.file_index, [n for b in batches for n in b.record_numbers],
                   [r for b in batches for r in b.raws], field=first._field,
                   texts=[t for b in batches for t in b._texts], odd=odd,
                   file_indices=None if one_file else [
                       i for b in batches for i in (b.file_indices if b.file_indices is not None else [b.file_index] * len(b))])

    def __len__(self) -> int:
        return len(self.raws)

    def __getitem__(self, i: int) -> SourceRecord:
        if self._records is not None:
            return self._records[i]
        r = self._odd.get(i)
        if r is not None:
            return r
        file_index = self.file_index if self.file_indices is None else self.file_indices[i]
        return SourceRecord(file_index, self.record_numbers[i], {self._field: self._texts[i]}, self.raws[i])

    def take(self, start: int, stop: int) -> "RecordBatch":
        """Records ``start`` to ``stop`` (exclusive) as a batch of their own,
        in the same form (columns stay columns); ``file_indices`` None when
        they come from one file."""
        rows = self._records is not None
        file_index, files = self.file_index, self.file_indices
        if files is not None:
            files = files[start:stop]
            if files and files.count(files[0]) == len(files):
                file_index, files = files[0], None
        return RecordBatch(file_index, self.record_numbers[start:stop], self.raws[start:stop], field=self._field,
                           texts=None if rows else self._texts[start:stop],
                           odd=None if rows else {i - start: r for i, r in self._odd.items() if start <= i < stop},
                           file_indices=files, records=self._records[start:stop] if rows else None)

    def pieces(self, size: int) -> Iterator["RecordBatch"]:
        """The batch in consecutive pieces of at most ``size`` records (``take``)."""
        for start in range(0, len(self), size):
            yield self.take(start, start + size)

    def special(self) -> Iterator[tuple[int, SourceRecord]]:
        """``(position, record)`` of the records with an issue or kept bad input, in order."""
        if self._records is not None:
            return ((i, r) for i, r in enumerate(self._records) if r.issue is not None or r.kept)
        return ((i, self._odd[i]) for i in sorted(self._odd) if self._odd[i].issue is not None or self._odd[i].kept)

    def text_values(self, key: str, index: Sequence[int]) -> list | None:
        """The ``str`` values of field ``key`` of the records at ``index``; None
        when the batch is not in column form for ``key`` or a value is no ``str``."""
        if self._records is not None or key != self._field:
            return None
        texts, odd = self._texts, self._odd
        if not odd:
            return texts if len(index) == len(texts) else [texts[i] for i in index]
        if any(type(odd[i].data.get(key)) is not str for i in index if i in odd):
            return None
        return [odd[i].data[key] if i in odd else texts[i] for i in index]


def is_error_record(record: SourceRecord) -> bool:
    """True for a record that its source skipped under its ``on_error`` policy
    (``record.issue.action == "skipped"``); a repaired record is not one."""
    return record.issue is not None and record.issue.action == "skipped"


def describe_record(path: str | None, locator: str | None, record_number: int | None, *, stable: bool = False) -> str:
    """Where record ``record_number`` of a source with ``locator`` lies in
    ``path``, in words: the one function that words a record's place.

    ===============  ============================  =================================
    locator          words (default)               ``stable=True``
    ===============  ============================  =================================
    ``byte_offset``  ``"line 12 (byte 1,234)"``    ``"line at byte 1234"``
    ``line``         ``"line 12"`` (number 11)     ``"line 12"``
    ``row``          ``"row 7"`` (0-based)         ``"row 7"``
    ``record``       ``"record 3"`` (0-based)      ``"record 3"``
    ``file``         ``"whole file"``              ``"file"``
    other            ``"<locator> <number>"``      ``"<locator> <number>"``
    ===============  ============================  =================================

    A locator of None is ``record``; a record number of None gives ``"record ?"``.
    The default counts the lines of a local file up to a byte offset (for
    ``show``, ``which`` and raised errors, not for every record) and says
    ``"byte 1,234"`` when the file is not local, cannot be read or changed.
    ``stable=True`` reads nothing: words that do not depend on the split, for
    skipped records and quarantine entries. Never raises for an unreadable file.
    """
    if record_number is None:
        return "record ?"
    n, locator = int(record_number), locator or "record"
    if stable:
        return _STABLE_WORDS.get(locator, locator + " {n}").format(n=n, l=n + 1)
    if locator == "byte_offset":
        if path and fs.is_local(path):
            try:
                return f"line {line_number_at(path, n) + 1:,} (byte {n:,})"
            except (ValueError,) + READ_ERRORS:  # "never raises for an unreadable file"
                pass
        return f"byte {n:,}"
    return _WORDS.get(locator, locator + " {n:,}").format(n=n, l=n + 1)


def match_files(patterns: Sequence[str], *, exclude: Sequence[str] = ()) -> list[SourceFile]:
    """Files matching any of ``patterns`` (glob; ``**`` is recursive), sorted by
    path, less those matching an ``exclude`` pattern (fnmatch: ``*`` also
    crosses ``/``; one without ``/`` matches file names, a relative one is
    taken from the working directory). An exclude pattern that leaves out
    nothing is logged as a warning. Local paths are made absolute (fingerprints
    do not depend on the working directory); directories are ignored.

    Raises:
      FileNotFoundError: a pattern matches no file (the message names the pattern).
    """
    excluders = [_excluder(x) for x in exclude]
    used = [False] * len(excluders)

    def excluded(path: str) -> bool:
        hit = False
        for k, test in enumerate(excluders):
            if test(path):
                used[k] = hit = True
        return hit

    listings: list[list[SourceFile]] = []
    for pattern in patterns:
        matched = fs.match(pattern)  # sorted by path
        if not matched:
            raise FileNotFoundError(f"no file matches the source pattern {pattern!r}")
        if exclude:
            kept = [f for f in matched if not excluded(f.path)]
            if not kept:
                raise FileNotFoundError(
                    f"every file matching the source pattern {pattern!r} is excluded by {list(exclude)}"
                )
            matched = kept
        listings.append(matched)
    for k, x in enumerate(exclude):
        if not used[k] and (x, tuple(patterns)) not in _WARNED:
            _WARNED.add((x, tuple(patterns)))
            log.warning("the exclude pattern %r leaves out no file of %s", x, list(patterns))
    if len(listings) == 1:  # one listing, already sorted: no table of paths
        return _without_repeats(listings[0])
    found = {f.path: f for matched in listings for f in matched}
    return [found[p] for p in sorted(found)]


def _without_repeats(files: list[SourceFile]) -> list[SourceFile]:
    """``files`` (sorted by path) with each path once."""
    paths = [f.path for f in files]
    if len(set(paths)) == len(paths):
        return files
    return [f for k, f in enumerate(files) if k == 0 or paths[k - 1] != f.path]


_WARNED: set = set()  # (exclude pattern, source patterns) already warned about in this process


def _excluder(pattern: str) -> Callable[[str], bool]:
    if "/" not in pattern:
        return lambda path: fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    if not (fs.is_url(pattern) or pattern.startswith(("/", "*", "~"))):
        pattern = os.path.abspath(pattern)
    pattern = os.path.expanduser(pattern)
    return lambda path: fnmatch.fnmatchcase(path, pattern)


# What reading a file may raise (I/O, truncated or corrupt compressed data): ``read_error`` words them.
READ_ERRORS = (EOFError, OSError, zlib.error) + compression.read_errors()


def read_error(path: str, error: BaseException, after: str | None) -> ValueError:
    """A ``ValueError`` naming ``path`` for a file that fails while being read
    (``after``: the last line, byte or row read, None when it failed at the start)."""
    kind = compression.format_name(path)
    if kind and isinstance(error, (EOFError, gzip.BadGzipFile) + compression.read_errors()):
        what = f"truncated or corrupt {kind} data"
    else:
        what = f"cannot be read ({type(error).__name__})"
    where = f"after {after}" if after else "at the start"
    return ValueError(f"{path}: {what} {where}: {error}; replace the file, or leave it out "
                      "(exclude=... in the source, --exclude on the command line)")


def read_failure(error: Exception, path: str) -> ValueError:
    """What a read of ``path`` that raised ``error`` says, as one ``ValueError``
    line naming the file: a ``ValueError`` with the path first (``with_path``;
    a ``BadInputError`` stays one); any other error (a subclass's code that
    raised ``KeyError`` or ``TypeError``) as ``"{path}: reading it raised
    KeyError: 'text'"``."""
    if isinstance(error, ValueError):
        return with_path(error, path)
    return ValueError(f"{path}: reading it raised {type(error).__name__}: {error}")


def read_whole(path: str) -> bytes:
    """The whole (decompressed) file. Raises ``ValueError`` (``read_error``) when it cannot be read."""
    try:
        with fs.open_binary(path) as f:
            return f.read()
    except READ_ERRORS as e:
        raise read_error(path, e, None) from None


def _json_default(value: Any) -> Any:
    """The JSON form of Parquet's dates, times and decimals (ISO / decimal strings)."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, datetime.timedelta)):
        return str(value)
    raise TypeError(f"a value of type {type(value).__name__} has no JSON form")


def _text_of_bytes(data: dict) -> tuple[dict, str | None]:
    """``data`` with top-level ``bytes`` values decoded as UTF-8 (U+FFFD for
    bad bytes), and a description of the first value that is not UTF-8, or None."""
    if not any(isinstance(v, (bytes, bytearray)) for v in data.values()):
        return data, None
    out, problem = {}, None
    for key, value in data.items():
        if isinstance(value, (bytes, bytearray)):
            try:
                value = bytes(value).decode("utf-8")
            except UnicodeDecodeError as e:
                problem = problem or f"value {key!r} is not valid UTF-8: {e}"
                value = bytes(value).decode("utf-8", errors="replace")
        out[key] = value
    return out, problem


def _patterns(pattern: str | Sequence[str]) -> tuple[str, ...]:
    if isinstance(pattern, (str, os.PathLike)):
        out = (os.fspath(pattern),)
    else:
        out = tuple(os.fspath(p) for p in pattern)
    if not out or any(not p for p in out):
        raise ValueError(f"a source needs at least one non-empty file pattern (got {pattern!r})")
    return out


class Source(abc.ABC):
    """A collection of raw records, split into files, each record with a stable id.

    Subclasses implement ``list_files``, ``fingerprint``, ``describe`` and either
    ``read_split`` (with ``splits`` when a file can be read in parts) or
    ``read_file`` (whole files only). They are pickled to pipeline workers.

    A subclass of a source that reads its files itself (``TextLineSource``,
    ``ParquetSource``, ...) overrides ``read_split`` alone, which every path
    reads through (docs/architecture.md, "A source"); it derives a record
    from its parent's with ``with_data``. Overriding ``read_file`` or
    ``read_batches`` there instead is refused when the class is defined (those
    paths would not call it). Outside seqcache, its class (module and name)
    and ``version`` enter the fingerprint: bump ``version`` when a change of
    its code changes its records, as ``FunctionSource``'s.
    """

    kind: str = "source"
    # A subclass outside seqcache: bump it when its code changes the records it gives (it enters the fingerprint).
    version: int = 1
    on_error: ErrorPolicy = ErrorPolicy()
    locator: str = "record"  # what ``SourceRecord.record_number`` counts, one of ``LOCATORS``
    # Whether ``splits`` opens the file (a Parquet footer): planned in threads.
    splits_read_files: bool = True
    # Whether ``splits`` gives a file of at most ``target_bytes`` as one whole
    # split (then the plan makes no call per small file); true of the default.
    small_files_whole: bool = False

    def __init_subclass__(cls, **kwargs):
        """Registers a subclass that sets ``kind`` and has ``from_spec(spec)``
        as the command-line form ``KIND:...`` of ``parse_source_spec``."""
        super().__init_subclass__(**kwargs)
        _check_overrides(cls)
        if "kind" in cls.__dict__ and hasattr(cls, "from_spec"):
            SPEC_KINDS[cls.kind] = cls

    @abc.abstractmethod
    def list_files(self) -> list[SourceFile]:
        """The input files, sorted by path (deterministic).

        Raises:
          FileNotFoundError: a pattern matches nothing (the message names it).
        """

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity: kind, parameters and files (path, num_bytes, mtime_ns)."""

    def fingerprint_of_files(self, files: Sequence[SourceFile]) -> dict:
        """``fingerprint()`` for a listing already made: ``files`` is what
        ``list_files()`` just gave, and the value is the one ``fingerprint()``
        gives, without listing the files again (a build lists them once). The
        default calls ``fingerprint()``; a source whose fingerprint holds
        ``list_files()`` overrides it."""
        return self.fingerprint()

    @abc.abstractmethod
    def describe(self) -> str:
        """Short human-readable description, e.g. ``"text lines of data/*.txt"``."""

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """The splits of ``file`` (index ``file_index`` in ``list_files()``),
        each about ``target_bytes`` bytes, in file order, together holding
        each record once. The default is one split, the whole file.

        Raises:
          ValueError: ``target_bytes < 1``; a file whose layout cannot be read
            (names the file).
        """
        check_target(target_bytes)
        return [Split(file_index, file.path, 0, None, file.num_bytes)]

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        """Streams the records of one split in file order, in memory that does
        not grow with the file. The default reads whole files with ``read_file``.

        Raises:
          BadInputError (a ValueError): a record the ``on_error`` policy
            raises on, naming the file and the record.
          ValueError: the file cannot be read, naming it; a split a
            whole-file source cannot read.
          TypeError: the subclass defines neither ``read_split`` nor ``read_file``.
        """
        if type(self).read_file is Source.read_file:
            raise TypeError(f"{type(self).__name__} implements neither read_split nor read_file: a Source "
                            "subclass defines at least one of them")
        self._require_whole(split)
        return self.read_file(split.file_index, split.path)

    def overrides_read_split(self, cls: type["Source"]) -> bool:
        """Whether this source's class overrides ``cls.read_split``. A class
        whose batch path (``read_batches``, ``read_batches_of``) reads its
        files without calling ``read_split`` (``TextLineSource``,
        ``ParquetSource``) asks this first, and reads through ``read_split``
        (``Source.read_batches``) when a subclass overrides it: a subclass
        that changes ``read_split`` alone is honoured by every path (build,
        scan, ``read_all``)."""
        return type(self).read_split is not cls.read_split

    def read_batches(self, split: Split, batch_records: int) -> Iterator[RecordBatch]:
        """The records of ``read_split(split)`` in ``RecordBatch``es of up to
        ``batch_records``; a columnar fast path gives the same records.
        Raises ``ValueError`` as ``read_split``."""
        batch: list[SourceRecord] = []
        for record in self.read_split(split):
            batch.append(record)
            if len(batch) >= batch_records:
                yield RecordBatch.from_records(batch)
                batch = []
        if batch:
            yield RecordBatch.from_records(batch)

    def read_batches_of(self, splits: Sequence[Split], batch_records: int) -> Iterator[RecordBatch]:
        """The records of consecutive ``splits`` (a work unit), in order, in
        batches of up to ``batch_records`` (the default: ``read_batches`` of
        each; a source may gather small splits into one batch).

        Raises:
          ValueError: as ``read_split``, the message starting with the file's
            path; any other error ``read_split`` raises as one too
            (``read_failure``).
        """
        for split in splits:
            path = str(split.path)
            try:
                yield from self.read_batches(split, batch_records)
            except Exception as e:
                named = read_failure(e, path)
                if named is e:
                    raise
                raise named from None if isinstance(e, ValueError) else e

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        """The records of one whole file: ``read_split(Split(file_index, path))``."""
        return self.read_split(Split(file_index, path))

    def read_all(self) -> Iterator[SourceRecord]:
        """All records of all files, file by file (a convenience for small sources)."""
        for i, f in enumerate(self.list_files()):
            yield from self.read_file(i, f.path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.describe()}>"

    def where(self, path: str, record_number: int) -> Where:
        """The place of a record of ``path`` for messages (``describe_record``):
        ``"{path}: line at byte 1234"``; raised, ``"{path}: line 12 (byte 1,234)"``."""
        text = f"{path}: {describe_record(path, self.locator, record_number, stable=True)}"
        if self.locator != "byte_offset":
            return Where(text)
        return Where(text, lambda: f"{path}: {describe_record(path, self.locator, record_number)}")

    def with_data(self, record: SourceRecord, change: "Mapping[str, Any] | Callable[[dict], Mapping[str, Any]]", *,
                  path: str) -> SourceRecord:
        """A record derived from ``record`` (one its parent's ``read_split``
        gave) with other data, checked again by the ``on_error`` policy (control
        characters, empty text, ...: ``check_text_values``) as a record the
        source made itself: a subclass's ``read_split`` changes records with it.

        Args:
          record: the record to derive from; one the policy skipped (``data``
            is ``{}``) is returned as it is.
          change: the new data (field -> value), or a function of the old
            data (a dict) that returns it.
          path: the file ``record`` comes from (``split.path``), for messages.

        Returns:
          the ``SourceRecord`` with the same file index, record number and
          ``raw`` (the shuffle key's input, and what ``duplicate=skip``
          compares); repaired, kept or skipped as the policy says.

        Raises:
          BadInputError: the policy raises on the new data (naming the record).
        """
        if is_error_record(record):
            return record
        data = dict(change(dict(record.data)) if callable(change) else change)
        repairs = [(record.issue.kind, record.issue.message)] if record.issue is not None else []
        return self._record(record.file_index, record.record_number, record.raw,
                            self.where(str(path), record.record_number), data, repairs)

    def _require_whole(self, split: Split) -> None:
        if not split.whole:
            raise ValueError(f"{split.path}: {type(self).__name__} reads whole files only "
                             f"(got the split [{split.start}, {split.stop}))")

    def _record(self, file_index: int, record_number: int, raw: bytes, where: "str | Where", data: dict,
                repairs: Sequence[tuple[str, str]] = ()) -> SourceRecord:
        """The record after the content checks of ``check_text_values``; marked
        as repaired when ``repairs`` (made earlier) or the checks repaired it."""
        kept: list[str] = []
        checked, more, skip = check_text_values(data, where, self.on_error, kept)
        if skip is not None:
            return SourceRecord(file_index, record_number, {}, raw, RecordIssue("skipped", skip[0], skip[1]))
        repairs = [*repairs, *more]
        if repairs:
            kinds = ",".join(dict.fromkeys(kind for kind, _ in repairs))
            message = "; ".join(m for _, m in repairs)
            return SourceRecord(file_index, record_number, checked, raw, RecordIssue("replaced", kinds, message),
                                tuple(kept))
        return SourceRecord(file_index, record_number, checked, raw, None, tuple(kept))

    def _row_record(self, file_index: int, record_number: int, where: "str | Where", row: dict,
                    keys: Mapping[str, str] | None = None) -> SourceRecord:
        """The record of a row of values (a Parquet row, a function's dict):
        ``raw`` its canonical JSON (dates and decimals as strings; bytes read as
        UTF-8, else ``invalid_utf8``; ``bad_value`` without a JSON form),
        ``data`` the values of ``keys`` (output key -> row key; None: all)."""
        row, problem = _text_of_bytes(row)
        repairs = []
        if problem is not None:
            if self.on_error.actions["invalid_utf8"] != "replace":
                return self._bad("invalid_utf8", file_index, record_number, b"", where, f": {problem}")
            repairs.append(("invalid_utf8", f"{where}: {problem}"))
        try:
            raw = canonical_json_bytes(row, default=_json_default)
        except (TypeError, ValueError) as e:
            return self._bad("bad_value", file_index, record_number, b"", where, f": {e}")
        data = row if keys is None else {k: row[c] for k, c in keys.items()}
        return self._record(file_index, record_number, raw, where, data, repairs)

    def _decode(self, file_index: int, record_number: int, raw: bytes, where: "str | Where",
                repairs: list) -> tuple[str | None, SourceRecord | None]:
        """``(text, None)`` for UTF-8 ``raw``; under ``replace`` also for other
        bytes (U+FFFD, the repair noted in ``repairs``); else ``(None, the record
        marked skipped)``, or raises."""
        try:
            return raw.decode("utf-8"), None
        except UnicodeDecodeError as e:
            problem = f" is not valid UTF-8: {e}"
            if self.on_error.actions["invalid_utf8"] != "replace":
                return None, self._bad("invalid_utf8", file_index, record_number, raw, where, problem)
            repairs.append(("invalid_utf8", f"{as_where(where).text}{problem}"))
            return raw.decode("utf-8", errors="replace"), None

    def _bad(self, kind: str, file_index: int, record_number: int, raw: bytes, where: "str | Where",
             problem: str) -> SourceRecord:
        """A record of ``kind`` that cannot be repaired: raised, or marked skipped;
        the message is ``where`` then ``problem`` (``" is not valid JSON: ..."``)."""
        where = as_where(where)
        if self.on_error.actions[kind] == "raise":
            raise BadInputError(f"{where.raised()}{problem}; {error_hint(kind)}")
        return SourceRecord(file_index, record_number, {}, raw, RecordIssue("skipped", kind, f"{where.text}{problem}"))


def users_class(source: Source) -> str | None:
    """``module.Name`` of ``source``'s class when it is defined outside seqcache
    (a user's subclass, whose code seqcache cannot see), else None."""
    kind = type(source)
    return None if kind.__module__.startswith("seqcache.") else f"{kind.__module__}.{kind.__qualname__}"


# (a method a subclass may override, the method that every read of a source
# that defines the second one passes through instead): ``_check_overrides``.
_READ_THROUGH = (("read_file", "read_split"), ("read_batches", "read_batches_of"))


def _check_overrides(cls: type) -> None:
    """TypeError for a subclass that overrides a reading method its parent's
    reads do not call: ``read_file`` where a parent reads splits itself
    (``read_split``), ``read_batches`` where a parent reads work units itself
    (``read_batches_of``). ``read_split`` is the method to override."""
    for method, through in _READ_THROUGH:
        if method not in cls.__dict__ or through in cls.__dict__:
            continue
        parent = next((c for c in cls.__mro__[1:] if through in c.__dict__ and c is not Source), None)
        if parent is not None:
            raise TypeError(f"{cls.__name__} overrides {method}, which the reads of {parent.__name__} do not call "
                            f"({parent.__name__}.{through} reads its files itself): override read_split, the "
                            "records of one split of a file, which every path reads through")


class FileSource(Source):
    """Shared code of the sources that read files matched by glob patterns.

    Args (every file source):
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      on_error: the ``ErrorPolicy`` spec (None: every kind's default).
      exclude: glob patterns of paths to leave out (``match_files``).
    """

    def __init__(self, pattern: str | Sequence[str], *, on_error: "str | Mapping[str, str] | None" = None,
                 exclude: str | Sequence[str] = ()):
        if isinstance(pattern, Mapping):  # seqio's split_to_filepattern: a Task takes one source per split
            kind = type(self).__name__
            raise TypeError(f"{kind} takes a file pattern, not a mapping (keys {list(pattern)!r}); for a source per "
                            f"split give the Task a mapping of split -> source instead: Task(..., source="
                            f"{{'train': {kind}('train*'), 'validation': {kind}('valid*')}})")
        self.patterns = _patterns(pattern)
        self.on_error = ErrorPolicy(on_error)
        self.exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)

    def list_files(self) -> list[SourceFile]:
        return match_files(self.patterns, exclude=self.exclude)

    def _params(self) -> dict:
        return {}

    def fingerprint(self) -> dict:
        return self._fingerprint_of(self.list_files())

    def fingerprint_of_files(self, files: Sequence[SourceFile]) -> dict:
        """``fingerprint()`` without listing the files again; for a subclass
        that overrides ``fingerprint`` alone, its own ``fingerprint()``."""
        kind = type(self)
        own_fingerprint = kind.fingerprint is not FileSource.fingerprint
        if own_fingerprint and kind.fingerprint_of_files is FileSource.fingerprint_of_files:
            return self.fingerprint()
        return self._fingerprint_of(files)

    def _fingerprint_of(self, files: Sequence[SourceFile]) -> dict:
        # The files identify the input, not the patterns as typed.
        out = {
            "kind": self.kind,
            "params": self._params(),
            "on_error": self.on_error.to_json(),
            "files": [{"path": path, "num_bytes": size, "mtime_ns": mtime} for path, size, mtime in files],
        }
        own = users_class(self)
        if own is not None:  # a subclass of the user's: its code is an input
            out["class"], out["version"] = own, self.version
        return out

    def _pattern_text(self) -> str:
        return ", ".join(self.patterns)


class TextSource(FileSource):
    """Shared constructor of the sources whose records are plain text."""

    @classmethod
    def from_spec(cls, spec) -> "TextSource":
        """``KIND:PATTERN`` (``text:``, ``files:``): the text under ``"text"``."""
        return cls(spec.rest, exclude=spec.exclude, on_error=spec.on_error)

    def __init__(self, pattern: str | Sequence[str], *, field: str = "text",
                 on_error: "str | Mapping[str, str] | None" = None, exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        self.field = field

    def _params(self) -> dict:
        return {"field": self.field}
