"""Sources: where a task's raw records come from, each with a stable record id.

A source lists its files (sorted by path) and streams the records of one file.
Every record carries a stable id, ``(file_index, record_number)``, and ``raw``: the
canonical bytes of the record, which the pipeline hashes (with the seed) into the
shuffle key. Because the key depends only on ``raw``, the cache order does not
depend on file order or on how records are split across files (guarantee G1).

Record numbers are 0-based within a file:

==================  ==========================================  ==========================================
source              record_number                               raw
==================  ==========================================  ==========================================
TextLineSource      line number (empty lines are records)       UTF-8 line without its terminator
TextFileSource      always 0 (one record per file)              the file's bytes
JsonLinesSource     line number (blank lines are skipped,       the line's bytes, stripped of surrounding
                    so numbers may have gaps)                   whitespace
ParquetSource       row number within the file                  canonical JSON of the selected columns
FunctionSource      index of the yielded dict                   canonical JSON of the yielded dict
==================  ==========================================  ==========================================

"Canonical JSON" is ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)`` encoded as UTF-8.

Bad input is sorted into kinds, and each source has a policy per kind
(``on_error``; see ``ErrorPolicy``):

======================  ==================================================  ==========================
kind                    what                                                actions (default first)
======================  ==================================================  ==========================
``invalid_utf8``        bytes that are not UTF-8                            raise, skip, replace
``carriage_return``     a CR inside a text line (old Mac line endings)      raise, skip, replace
``control_characters``  Unicode Cc characters other than the White_Space    raise, skip, replace, keep
                        ones (U+0000-0008, U+000E-001F, U+007F-0084,
                        U+0086-009F)
``u2581``               U+2581, SentencePiece's whitespace symbol, in the   raise, skip, replace, keep
                        text (usually text that was already tokenized)
``empty``               a text value that is ``""`` (an empty line or file)  raise, skip, keep
``whitespace``          a text value of whitespace only (``str.isspace``)    raise, skip, keep
``malformed``           a JSON line that does not parse or is not an object  raise, skip
``missing_field``       a selected JSON field that is absent                 raise, skip
``bad_value``           a value the task cannot use: a wrong type, a null,   raise, skip
                        a token id outside the vocabulary (``Task`` checks)
======================  ==================================================  ==========================

``"raise"`` raises ``ValueError`` naming the file, the record and what is wrong,
and says which option accepts it. ``"skip"`` yields the record with ``data ==
{SOURCE_ERROR_KEY: "<message>", SOURCE_ERROR_KIND_KEY: "<kind>"}`` instead, so
that the pipeline counts it and writes it to the quarantine file; ``Task.preprocess_batch`` never turns such a
record into an example. ``"replace"`` keeps the record, repaired, and marks it
with ``data[SOURCE_REPLACED_KEY] = "<message>"`` so that the pipeline counts and
lists it: invalid UTF-8 and control characters become U+FFFD, a carriage return
inside a line becomes a newline, U+2581 becomes a space (what a SentencePiece
model reads it as). ``"keep"`` accepts the text as it is. The content checks
(control characters, U+2581, empty, whitespace) apply to every string value a
source yields, after any repair.

Paths are local paths or, when they contain ``://`` (``gs://``, ``s3://``,
``hdfs://``), are matched and opened through Apache Beam's ``FileSystems``
(imported only then). Sources are small, picklable objects: they hold patterns
and options, never file contents or open handles.
"""

from __future__ import annotations

import abc
import fnmatch
import gzip
import io
import json
import logging
import os
import re
import zlib
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence

from seqcache import fs

log = logging.getLogger(__name__)

# Key of ``SourceRecord.data`` that marks a record a source could not read when
# ``on_error="skip"``; its value is the error message.
SOURCE_ERROR_KEY = "_source_error"
# Beside it: the kind of bad input (a key of ``ERROR_KINDS``).
SOURCE_ERROR_KIND_KEY = "_source_error_kind"
# Present in ``SourceRecord.data`` of a record repaired under ``on_error="replace"``;
# its value says what was repaired.
SOURCE_REPLACED_KEY = "_source_replaced"

# The kinds of bad input and the actions each allows (the first is the default).
ERROR_KINDS: dict[str, tuple[str, ...]] = {
    "invalid_utf8": ("raise", "skip", "replace"),
    "carriage_return": ("raise", "skip", "replace"),
    "control_characters": ("raise", "skip", "replace", "keep"),
    "u2581": ("raise", "skip", "replace", "keep"),
    "empty": ("raise", "skip", "keep"),
    "whitespace": ("raise", "skip", "keep"),
    "malformed": ("raise", "skip"),
    "missing_field": ("raise", "skip"),
    "bad_value": ("raise", "skip"),
}
_ON_ERROR = ("raise", "skip", "replace")
_BOM = b"\xef\xbb\xbf"



class ErrorPolicy:
    """What a source does with each kind of bad input (see the module docstring).

    ``ErrorPolicy("raise")`` (the default), ``ErrorPolicy("skip")`` and
    ``ErrorPolicy("replace")`` apply one action to every kind; ``"replace"``
    skips the kinds that cannot be repaired. A mapping sets the action per kind,
    with ``"default"`` (``"raise"`` unless given) for the kinds it does not name::

        ErrorPolicy({"empty": "skip", "control_characters": "keep"})
        ErrorPolicy({"default": "skip", "u2581": "replace"})

    Raises:
      ValueError: an unknown kind or action, or an action a kind does not allow
        (e.g. ``{"empty": "replace"}``); the message lists what is allowed.
    """

    __slots__ = ("actions",)

    def __init__(self, spec: "str | Mapping[str, str] | ErrorPolicy" = "raise"):
        if isinstance(spec, ErrorPolicy):
            self.actions = dict(spec.actions)
            return
        if isinstance(spec, str):
            spec = {"default": spec}
        if not isinstance(spec, Mapping):
            raise ValueError(f"on_error must be one of {_ON_ERROR} or a mapping kind -> action (got {spec!r})")
        spec = dict(spec)
        default = spec.pop("default", "raise")
        if default not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR} (got {default!r}); "
                             "'keep' is set per kind, e.g. {'empty': 'keep'}")
        actions = {}
        for kind, allowed in ERROR_KINDS.items():
            actions[kind] = default if default in allowed else "skip"
        for kind, action in spec.items():
            if kind not in ERROR_KINDS:
                raise ValueError(f"unknown kind of bad input {kind!r} in on_error (kinds: {', '.join(ERROR_KINDS)})")
            if action not in ERROR_KINDS[kind]:
                raise ValueError(f"on_error[{kind!r}] must be one of {ERROR_KINDS[kind]} (got {action!r})")
            actions[kind] = action
        self.actions = actions

    def action(self, kind: str) -> str:
        """The action for ``kind``: ``"raise"``, ``"skip"``, ``"replace"`` or ``"keep"``."""
        return self.actions[kind]

    def to_json(self) -> dict[str, str]:
        """Every kind with its action (part of the source's fingerprint)."""
        return dict(self.actions)

    def __eq__(self, other) -> bool:
        if isinstance(other, (str, Mapping)):
            other = ErrorPolicy(other)
        return isinstance(other, ErrorPolicy) and self.actions == other.actions

    def __getstate__(self):
        return self.actions

    def __setstate__(self, state):
        self.actions = state

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.actions.items() if v != "raise"}
        return f"ErrorPolicy({changed or 'raise'!r})"


def parse_on_error(values: "str | Sequence[str]") -> "str | dict[str, str]":
    """The ``on_error`` of command-line values: ``"raise"``, ``"skip"``,
    ``"replace"`` or ``"KIND=ACTION"`` (several may be given, e.g.
    ``["skip", "empty=keep"]``).

    Raises:
      ValueError: a malformed value, an unknown kind or action.
    """
    if isinstance(values, str):
        values = [values]
    spec: dict[str, str] = {}
    for value in values:
        kind, sep, action = value.partition("=")
        kind, action = (kind.strip(), action.strip()) if sep else ("default", value.strip())
        if kind == "default" and action not in _ON_ERROR:
            raise ValueError(f"{value!r}: one action for every kind is one of {', '.join(_ON_ERROR)}; "
                             f"'keep' is given per kind, e.g. empty=keep")
        if kind != "default" and kind not in ERROR_KINDS:
            raise ValueError(f"{value!r}: unknown kind {kind!r} (kinds: {', '.join(ERROR_KINDS)})")
        if kind != "default" and action not in ERROR_KINDS[kind]:
            raise ValueError(f"{value!r}: {kind} can be {', '.join(ERROR_KINDS[kind])}")
        if kind in spec and spec[kind] != action:
            shown = kind if kind != "default" else "the action for every kind"
            raise ValueError(f"{shown} given twice: {spec[kind]!r} and {action!r}")
        spec[kind] = action
    ErrorPolicy(spec)  # validates
    return spec.get("default", "raise") if set(spec) <= {"default"} else spec


_CONTROL_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
_SURROGATE_RE = re.compile("[\ud800-\udfff]")
# Any character some content kind looks at: one scan tells a clean text apart.
_SUSPECT_RE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f\u2581\ud800-\udfff]")
_HOW = {
    "invalid_utf8": "'replace' (U+FFFD) or 'skip'",
    "carriage_return": "'replace' (a newline) or 'skip'",
    "control_characters": "'keep', 'replace' (U+FFFD) or 'skip'",
    "u2581": "'keep', 'replace' (a space) or 'skip'",
    "empty": "'skip' or 'keep'",
    "whitespace": "'skip' or 'keep'",
    "malformed": "'skip'",
    "missing_field": "'skip'",
    "bad_value": "'skip'",
}


def error_hint(kind: str) -> str:
    """How to accept, repair or skip records of ``kind``, for error messages."""
    return (f"set the source's on_error={{{kind!r}: ...}} to {_HOW[kind]} "
            f"(with --source on the command line: --on-error {kind}=ACTION)")


def text_problems(text: str) -> list[tuple[str, str]]:
    """The content problems of one text value, as ``(kind, description)`` pairs
    (kinds ``invalid_utf8`` for a lone surrogate, ``control_characters``,
    ``u2581``, ``empty``, ``whitespace``).
    The description locates the first offending character (0-based index)."""
    if not text:
        return [("empty", "is empty")]
    out = []
    m = _SURROGATE_RE.search(text)
    if m:  # only a JSON \\u escape or a Python string can carry one; it has no UTF-8 form
        out.append(("invalid_utf8", f"contains a lone surrogate U+{ord(m.group()):04X} at character {m.start()} "
                                    "(a broken \\u escape?), which is not valid UTF-8"))
    m = _CONTROL_RE.search(text)
    if m:
        n = len(_CONTROL_RE.findall(text))
        out.append(("control_characters",
                    f"contains control character U+{ord(m.group()):04X} at character {m.start()}"
                    + (f" ({n} in all)" if n > 1 else "")))
    i = text.find("\u2581")
    if i >= 0:
        n = text.count("\u2581")
        out.append(("u2581", f"contains U+2581 (SentencePiece's whitespace symbol) at character {i}"
                             + (f" ({n} in all)" if n > 1 else "")))
    if text.isspace():
        out.append(("whitespace", "holds only whitespace"))
    return out


_REPAIRS = {
    "invalid_utf8": lambda t: _SURROGATE_RE.sub("\ufffd", t),
    "control_characters": lambda t: _CONTROL_RE.sub("\ufffd", t),
    "u2581": lambda t: t.replace("\u2581", " "),
}


def check_text_values(data: dict, where: str,
                      policy: ErrorPolicy) -> tuple[dict | None, list[str], tuple[str, str] | None]:
    """Applies ``policy`` to the content problems of the string values of ``data``.

    Returns ``(data, repairs, skip)``: the (possibly repaired) data, the repairs
    made as ``(kind, message)`` pairs, and ``(kind, message)`` when the record is
    to be skipped (then ``data`` is None).

    Raises:
      ValueError: a problem whose action is ``"raise"``; names ``where`` (file and
        record), the field when there are several, the problem and the option.
    """
    repairs: list[tuple[str, str]] = []
    out = data
    for key, value in data.items():
        label = where if len(data) == 1 else f"{where}, field {key!r},"
        if isinstance(value, (list, tuple)) and not value and policy.actions["empty"] != "keep":
            message = f"{label} is empty (no token ids)"
            if policy.actions["empty"] == "raise":
                raise ValueError(f"{message}; {error_hint('empty')}")
            return None, repairs, ("empty", message)
        if not isinstance(value, str) or (key.startswith("_source_")):
            continue
        while True:  # each repair removes its kind, but can expose another (U+2581 -> whitespace)
            problems = [(k, d) for k, d in text_problems(value) if policy.actions[k] != "keep"]
            if not problems:
                break
            kind, description = problems[0]
            message = f"{label} {description}"
            action = policy.actions[kind]
            if action == "raise":
                raise ValueError(f"{message}; {error_hint(kind)}")
            if action == "skip":
                return None, repairs, (kind, message)
            value = _REPAIRS[kind](value)
            repairs.append((kind, message))
        if value is not data[key]:
            if out is data:
                out = dict(data)
            out[key] = value
    return out, repairs, None

class SourceRecord(NamedTuple):
    """One raw record of a source.

    Attributes:
      file_index: index of the file in ``Source.list_files()`` (sorted by path).
      record_number: 0-based number of the record within its file (see the module
        docstring for what it counts in each source).
      data: the record's fields, e.g. ``{"text": "..."}``.
      raw: canonical bytes of the raw record: the input of the shuffle key.
    """

    file_index: int
    record_number: int
    data: dict[str, Any]
    raw: bytes
    issue: "RecordIssue | None" = None


class RecordIssue(NamedTuple):
    """What a source found wrong with one record and did under its policy.

    Attributes:
      action: ``"skipped"`` (the record gives no example) or ``"replaced"`` (it
        was repaired and is kept).
      kind: the kind of bad input, a key of ``ERROR_KINDS``; for a repair, the
        kinds repaired, comma-separated.
      message: what is wrong, naming the file and the record.
    """

    action: str
    kind: str
    message: str


class Split(NamedTuple):
    """A part of one input file: the unit of reading work.

    The records of a split are those whose first byte (byte splits) or row (row
    splits) lies in ``[start, stop)``; ``stop=None`` reads to the end of the
    file. A record's id never depends on the split that reads it.

    Attributes:
      file_index: the file's index in ``Source.list_files()``.
      path: the file's path.
      start: first byte or row of the split (0 for a whole file).
      stop: end of the split (exclusive), or None for the end of the file.
      num_bytes: the split's size in bytes (an estimate for row splits), used to
        plan the work.
    """

    file_index: int
    path: str
    start: int = 0
    stop: "int | None" = None
    num_bytes: int = 0


class SourceFile(NamedTuple):
    """One input file: path, size in bytes and modification time in nanoseconds."""

    path: str
    num_bytes: int
    mtime_ns: int


def canonical_json_bytes(obj: Any, *, default: Callable[[Any], Any] | None = None) -> bytes:
    """Canonical JSON (sorted keys, no whitespace, UTF-8, not ASCII-escaped).

    Raises:
      TypeError: a value has no JSON form (``default`` may give one).
      ValueError: a string holds a lone surrogate (no UTF-8 form).
    """
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default)
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text with no UTF-8 form: {e}") from None


def is_error_record(record: SourceRecord) -> bool:
    """True for a record that a source with ``on_error="skip"`` could not read."""
    return SOURCE_ERROR_KEY in record.data


# ---------------------------------------------------------------------------
# File system helpers: local paths directly, URLs through Beam's FileSystems.


def _is_url(path: str) -> bool:
    return fs.is_url(path)


def match_files(patterns: Sequence[str], *, exclude: Sequence[str] = ()) -> list[SourceFile]:
    """Files matching any of ``patterns`` (glob; ``**`` is recursive), sorted by path,
    less those matching any of the ``exclude`` patterns (fnmatch, where ``*`` also
    crosses ``/``: ``*/site-packages/*`` drops a whole folder). An exclude pattern
    without ``/`` matches file names (``notes.txt``, ``*.md``); a relative one with
    ``/`` is taken from the working directory, like the source patterns. An exclude
    pattern that leaves out nothing is logged as a warning.

    Local paths are made absolute so that the list (and every fingerprint built on
    it) does not depend on the working directory. Directories are ignored.

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

    found: dict[str, SourceFile] = {}
    for pattern in patterns:
        matched = [SourceFile(*f) for f in fs.match(pattern)]
        if not matched:
            raise FileNotFoundError(f"no file matches the source pattern {pattern!r}")
        if exclude:
            kept = [f for f in matched if not excluded(f.path)]
            if not kept:
                raise FileNotFoundError(
                    f"every file matching the source pattern {pattern!r} is excluded by {list(exclude)}"
                )
            matched = kept
        for f in matched:
            found[f.path] = f
    for k, x in enumerate(exclude):
        if not used[k] and (x, tuple(patterns)) not in _WARNED:
            _WARNED.add((x, tuple(patterns)))
            log.warning("the exclude pattern %r leaves out no file of %s", x, list(patterns))
    return [found[p] for p in sorted(found)]


_WARNED: set = set()  # (exclude pattern, source patterns) already warned about in this process


def _excluder(pattern: str) -> Callable[[str], bool]:
    if "/" not in pattern:
        return lambda path: fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    if not (_is_url(pattern) or pattern.startswith(("/", "*", "~"))):
        pattern = os.path.abspath(pattern)
    pattern = os.path.expanduser(pattern)
    return lambda path: fnmatch.fnmatchcase(path, pattern)


def open_binary(path: str, *, decompress: bool = True) -> io.BufferedIOBase:
    """Opens ``path`` for binary reading; ``.gz`` files are decompressed on the fly."""
    return fs.open_binary(path, decompress=decompress)


_READ_ERRORS = (EOFError, OSError, zlib.error)


def _read_error(path: str, error: BaseException, after: str | None) -> ValueError:
    """A ``ValueError`` naming ``path`` for a file that fails while being read
    (``after``: the last line or row read, None when it failed at the start)."""
    if path.endswith(".gz") and isinstance(error, (EOFError, zlib.error, gzip.BadGzipFile)):
        what = "truncated or corrupt gzip data"
    else:
        what = f"cannot be read ({type(error).__name__})"
    where = f"after {after}" if after else "at the start"
    return ValueError(f"{path}: {what} {where}: {error}; replace the file, or leave it out "
                      "(exclude=... in the source, --exclude on the command line)")


def _lines(path: str) -> Iterator[bytes]:
    """The lines of ``path`` (decompressed), with read errors named by ``_read_error``."""
    count = 0
    try:
        with open_binary(path) as f:
            for line in f:
                yield line
                count += 1
    except _READ_ERRORS as e:
        raise _read_error(path, e, f"line {count}" if count else None) from None


def _read_whole(path: str) -> bytes:
    try:
        with open_binary(path) as f:
            return f.read()
    except _READ_ERRORS as e:
        raise _read_error(path, e, None) from None


def _json_default(value: Any) -> Any:
    """Canonical JSON of the values Parquet gives that JSON lacks (dates, times,
    decimals: their ISO / decimal strings); anything else is refused."""
    import datetime
    import decimal

    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, datetime.timedelta)):
        return str(value)
    raise TypeError(f"a value of type {type(value).__name__} has no JSON form")


def _text_of_bytes(data: dict) -> tuple[dict, str | None]:
    """``data`` with top-level ``bytes`` values decoded as UTF-8 text (a binary
    Parquet column, a function yielding bytes). Returns the data and, when a value
    is not UTF-8, a description of the first such value (the bytes are then
    decoded with U+FFFD)."""
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


def _check_on_error(on_error) -> ErrorPolicy:
    return ErrorPolicy(on_error)


# ---------------------------------------------------------------------------


class Source(abc.ABC):
    """A collection of raw records, split into files, each record with a stable id.

    Subclasses implement ``list_files``, ``read_file``, ``fingerprint`` and
    ``describe``. Implementations must be picklable and cheap to pickle: they are
    shipped to pipeline workers.
    """

    kind: str = "source"
    on_error: ErrorPolicy = ErrorPolicy("raise")

    @abc.abstractmethod
    def list_files(self) -> list[SourceFile]:
        """The input files, sorted by path (deterministic).

        Raises:
          FileNotFoundError: a pattern matches nothing (the message names it).
        """

    @abc.abstractmethod
    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        """Streams the records of one file; memory does not grow with file size.

        Args:
          file_index: the file's index in ``list_files()``; copied into each record.
          path: the file's path, as in ``list_files()``.

        Raises:
          ValueError: a record cannot be read (``on_error="raise"``); the message
            names the file and the record number.
        """

    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity: kind, parameters and files (path, num_bytes, mtime_ns)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Short human-readable description, e.g. ``"text lines of data/*.txt"``."""

    # What ``SourceRecord.record_number`` counts in this source's files
    # ("line" / "byte_offset" / "row" / "record" / "file"), recorded in the manifest's source table.
    locator: str = "record"

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """The splits of one input file, each about ``target_bytes`` bytes.

        The default is the whole file, one split; sources that can start
        reading in the middle of a file (byte ranges, row groups) override it.
        """
        return [Split(file_index, file.path, 0, None, file.num_bytes)]

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        """Streams the records of one split (see ``Split``); the default reads
        the whole file."""
        if split.start != 0 or split.stop is not None:
            raise ValueError(f"{type(self).__name__} reads whole files only (got {split})")
        return self.read_file(split.file_index, split.path)

    def read_all(self) -> Iterator[SourceRecord]:
        """All records of all files, file by file (a convenience for small sources)."""
        for i, f in enumerate(self.list_files()):
            yield from self.read_file(i, f.path)

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.describe()}>"

    def _record(self, file_index: int, record_number: int, raw: bytes, where: str, data: dict,
                repairs: Sequence[tuple[str, str]] = ()) -> SourceRecord:
        """The record after the content checks of ``check_text_values``; marked
        as repaired when ``repairs`` (made earlier) or the checks repaired it."""
        checked, more, skip = check_text_values(data, where, self.on_error)
        if skip is not None:
            return SourceRecord(file_index, record_number, {SOURCE_ERROR_KEY: skip[1], SOURCE_ERROR_KIND_KEY: skip[0]},
                                raw, RecordIssue("skipped", skip[0], skip[1]))
        repairs = [*repairs, *more]
        if repairs:
            kinds = ",".join(dict.fromkeys(kind for kind, _ in repairs))
            message = "; ".join(m for _, m in repairs)
            checked = {**checked, SOURCE_REPLACED_KEY: message, SOURCE_ERROR_KIND_KEY: kinds}
            return SourceRecord(file_index, record_number, checked, raw, RecordIssue("replaced", kinds, message))
        return SourceRecord(file_index, record_number, checked, raw)

    def _decode(self, file_index: int, record_number: int, raw: bytes, where: str,
                repairs: list) -> tuple[str | None, SourceRecord | None]:
        """``(text, None)`` for UTF-8 ``raw``; under ``replace`` also for other
        bytes (U+FFFD, the repair noted in ``repairs``); else ``(None, the record
        marked skipped)``, or raises."""
        try:
            return raw.decode("utf-8"), None
        except UnicodeDecodeError as e:
            message = f"{where} is not valid UTF-8: {e}"
            if self.on_error.actions["invalid_utf8"] != "replace":
                return None, self._bad("invalid_utf8", file_index, record_number, raw, message)
            repairs.append(("invalid_utf8", message))
            return raw.decode("utf-8", errors="replace"), None

    def _bad(self, kind: str, file_index: int, record_number: int, raw: bytes, message: str) -> SourceRecord:
        """A record of ``kind`` that cannot be repaired: raised or marked skipped."""
        if self.on_error.actions[kind] == "raise":
            raise ValueError(f"{message}; {error_hint(kind)}")
        return SourceRecord(file_index, record_number, {SOURCE_ERROR_KEY: message, SOURCE_ERROR_KIND_KEY: kind}, raw,
                            RecordIssue("skipped", kind, message))


class _FileSource(Source):
    """Shared code of the sources that read files matched by glob patterns."""

    def __init__(self, pattern: str | Sequence[str], *, on_error: "str | Mapping[str, str]" = "raise",
                 exclude: str | Sequence[str] = ()):
        self.patterns = _patterns(pattern)
        self.on_error = _check_on_error(on_error)
        self.exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)

    def list_files(self) -> list[SourceFile]:
        return match_files(self.patterns, exclude=self.exclude)

    def _params(self) -> dict:
        return {}

    def fingerprint(self) -> dict:
        # The files themselves (absolute paths, sizes, mtimes) identify the input;
        # the patterns as typed do not: "*.txt", "./a.txt" and "/abs/a.txt" that
        # match the same file give the same fingerprint.
        return {
            "kind": self.kind,
            "params": self._params(),
            "on_error": self.on_error.to_json(),
            "files": [{"path": f.path, "num_bytes": f.num_bytes, "mtime_ns": f.mtime_ns} for f in self.list_files()],
        }

    def _pattern_text(self) -> str:
        return ", ".join(self.patterns)

class _TextSource(_FileSource):
    """Shared constructor of the sources whose records are plain text."""

    def __init__(self, pattern: str | Sequence[str], *, field: str = "text",
                 on_error: "str | Mapping[str, str]" = "raise", exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        self.field = field

    def _params(self) -> dict:
        return {"field": self.field}


class TextLineSource(_TextSource):
    """One record per line of text files (plain or ``.gz``).

    The line terminator (``"\\n"`` or ``"\\r\\n"``) is removed; a last line without
    a newline is a record. Every line is numbered, so record numbers equal
    0-based line numbers; empty and whitespace-only lines are bad input of the
    kinds ``empty`` and ``whitespace`` (raised by default; for paragraph-separated
    text use ``on_error={"empty": "skip"}``). A UTF-8 byte order mark at the start
    of a file is removed from the first record (from both ``data`` and ``raw``).

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      field: key of the line's text in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec: ``"raise"``, ``"skip"``, ``"replace"``
        or a mapping kind -> action. Kinds met here: ``invalid_utf8``,
        ``carriage_return`` (a CR that does not end the line) and the content
        kinds.

    Raises (from ``read_file``):
      ValueError: bad input whose action is ``"raise"``; names the file, the
        line and the option that accepts, repairs or skips it.
    """

    kind = "text"
    locator = "line"

    def describe(self) -> str:
        return f"text lines of {self._pattern_text()}"

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        field = self.field
        for number, line in enumerate(_lines(path)):
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            elif line.endswith(b"\r"):
                line = line[:-1]  # a last line ended by a lone CR
            if number == 0 and line.startswith(_BOM):
                line = line[len(_BOM):]
            try:  # the common case first: clean text needs no message
                text = line.decode("utf-8")
                if "\r" not in text and text and _SUSPECT_RE.search(text) is None and not text.isspace():
                    yield SourceRecord(file_index, number, {field: text}, line)
                    continue
            except UnicodeDecodeError:
                pass
            where = f"{path}: line {number + 1} (record {number})"
            repairs = []
            text, bad = self._decode(file_index, number, line, where, repairs)
            if bad is not None:
                yield bad
                continue
            if "\r" in text:
                message = f"{where} contains a carriage return that does not end the line (old Mac line endings?)"
                if self.on_error.actions["carriage_return"] != "replace":
                    yield self._bad("carriage_return", file_index, number, line, message)
                    continue
                text = text.replace("\r", "\n")
                repairs.append(("carriage_return", message))
            yield self._record(file_index, number, line, where, {field: text}, repairs)


class TextFileSource(_TextSource):
    """One record per whole file (plain or ``.gz``), e.g. for code corpora.

    ``record_number`` is always 0 and ``raw`` is the file's (decompressed) bytes; a
    leading UTF-8 byte order mark is removed. One file is held in memory at a time.

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      field: key of the file's text in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec. Kinds met here: ``invalid_utf8`` and the
        content kinds (an empty file is ``empty``).

    Raises (from ``read_file``):
      ValueError: bad input whose action is ``"raise"``; names the file.
    """

    kind = "files"
    locator = "file"

    def describe(self) -> str:
        return f"whole files of {self._pattern_text()}"

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        raw = _read_whole(path)
        if raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        where = f"{path}: file"
        repairs = []
        text, bad = self._decode(file_index, 0, raw, where, repairs)
        yield bad if bad is not None else self._record(file_index, 0, raw, where, {self.field: text}, repairs)


def _split_path(dotted: str) -> tuple[str, ...]:
    parts = tuple(dotted.split("."))
    if not dotted or any(not p for p in parts):
        raise ValueError(f"bad field path {dotted!r}: expected names separated by dots, e.g. 'metadata.title'")
    return parts


def _lookup(obj: Any, parts: tuple[str, ...]) -> Any:
    for p in parts:
        if not isinstance(obj, dict) or p not in obj:
            raise KeyError(p)
        obj = obj[p]
    return obj


class JsonLinesSource(_FileSource):
    """One record per JSON line of ``.jsonl`` / ``.jsonl.gz`` files.

    Each line must hold a JSON object. ``field`` is a key or a dotted path into
    nested objects (``"metadata.title"``); its value is stored under
    ``output_key`` (default ``"text"``). Several fields can be selected at once
    with ``fields={output_key: dotted_path, ...}``, which replaces ``field``.
    Blank lines are skipped; ``record_number`` is the 0-based line number.

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      field: dotted path of the value to read.
      output_key: key of that value in ``SourceRecord.data``.
      fields: optional mapping output key -> dotted path (several values).
      on_error: the ``ErrorPolicy`` spec. Kinds met here: ``malformed``,
        ``missing_field`` and the content kinds (for string values).

    Raises (from ``read_file``):
      ValueError: a line is not a JSON object or lacks a field; names the file,
        the line and the field.
    """

    kind = "jsonl"
    locator = "line"

    def __init__(self, pattern: str | Sequence[str], *, field: str = "text", output_key: str = "text",
                 fields: dict[str, str] | None = None, on_error: "str | Mapping[str, str]" = "raise",
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        if fields is None:
            fields = {output_key: field}
        if not fields:
            raise ValueError("JsonLinesSource: fields must name at least one field")
        self.fields = dict(sorted(fields.items()))
        self._parts = {k: _split_path(v) for k, v in self.fields.items()}

    def _params(self) -> dict:
        return {"fields": self.fields}

    def describe(self) -> str:
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.fields.items())
        return f"JSON lines of {self._pattern_text()} (field {sel})"

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        for number, line in enumerate(_lines(path)):
            raw = line.strip()
            if number == 0 and raw.startswith(_BOM):
                raw = raw[len(_BOM):].strip()
            if not raw:
                continue  # a blank line between objects is layout, not a record
            where = f"{path}: line {number + 1} (record {number})"
            repairs = []
            line_text, bad = self._decode(file_index, number, raw, where, repairs)
            if bad is not None:
                yield bad
                continue
            try:
                obj = json.loads(line_text)
            except ValueError as e:
                yield self._bad("malformed", file_index, number, raw, f"{where} is not valid JSON: {e}")
                continue
            if not isinstance(obj, dict):
                yield self._bad("malformed", file_index, number, raw,
                                f"{where} is a JSON {type(obj).__name__}, expected an object")
                continue
            data = {}
            try:
                for key, parts in self._parts.items():
                    data[key] = _lookup(obj, parts)
            except KeyError:
                yield self._bad("missing_field", file_index, number, raw,
                                f"{where} has no field {self.fields[key]!r} "
                                f"(top-level keys: {sorted(obj)[:20]})")
                continue
            yield self._record(file_index, number, raw, where, data, repairs)


class ParquetSource(_FileSource):
    """One record per row of Parquet files, read with pyarrow in record batches.

    Memory is bounded by ``batch_size`` rows (``ParquetFile.iter_batches``), not by
    the file size. ``column`` is stored under ``output_key``; several columns can
    be selected with ``columns={output_key: column, ...}``.

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      column: the column to read.
      output_key: key of the value in ``SourceRecord.data``.
      columns: optional mapping output key -> column (several values).
      batch_size: rows per record batch.
      on_error: the ``ErrorPolicy`` spec for the content kinds (string values)
        and the task's checks; a missing column always raises (it is a property
        of the file, not of a record).

    Raises (from ``read_file``):
      ValueError: a column is missing from a file; names the file, the column and
        the columns the file has.
    """

    kind = "parquet"
    locator = "row"

    def __init__(self, pattern: str | Sequence[str], *, column: str = "text", output_key: str = "text",
                 columns: dict[str, str] | None = None, batch_size: int = 1024,
                 on_error: "str | Mapping[str, str]" = "raise",
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        if columns is None:
            columns = {output_key: column}
        if not columns:
            raise ValueError("ParquetSource: columns must name at least one column")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size=})")
        self.columns = dict(sorted(columns.items()))
        self.batch_size = int(batch_size)

    def _params(self) -> dict:
        return {"columns": self.columns}

    def describe(self) -> str:
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.columns.items())
        return f"Parquet rows of {self._pattern_text()} (column {sel})"

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        import pyarrow.parquet as pq

        import pyarrow as pa

        number = 0
        try:
            with open_binary(path, decompress=False) as f:
                pf = pq.ParquetFile(f)
                names = pf.schema_arrow.names
                wanted = sorted(set(self.columns.values()))
                missing = [c for c in wanted if c not in names]
                if missing:
                    raise ValueError(f"{path}: Parquet file has no column {missing[0]!r} (columns: {names}); "
                                     "leave the file out with exclude if it belongs to another dataset")
                for batch in pf.iter_batches(batch_size=self.batch_size, columns=wanted):
                    values = {c: batch.column(c).to_pylist() for c in wanted}
                    for i in range(batch.num_rows):
                        yield self._row(file_index, number, path, {c: values[c][i] for c in wanted})
                        number += 1
        except (pa.ArrowException, OSError) as e:
            raise _read_error(path, e, f"row {number}" if number else None) from None

    def _row(self, file_index: int, number: int, path: str, row: dict) -> SourceRecord:
        where = f"{path}: record {number} (row index {number})"
        row, problem = _text_of_bytes(row)
        repairs = []
        if problem is not None:
            message = f"{where}: {problem}"
            if self.on_error.actions["invalid_utf8"] != "replace":
                return self._bad("invalid_utf8", file_index, number, b"", message)
            repairs.append(("invalid_utf8", message))
        try:
            raw = canonical_json_bytes(row, default=_json_default)
        except (TypeError, ValueError) as e:
            return self._bad("bad_value", file_index, number, b"", f"{where}: {e}")
        return self._record(file_index, number, raw, where, {k: row[c] for k, c in self.columns.items()}, repairs)


class FunctionSource(Source):
    """Records produced by a Python function, e.g. for small synthetic tasks.

    ``fn()`` returns an iterable of dicts; they form one pseudo-file named
    ``"<function NAME>"`` whose records are numbered 0, 1, ... in the order
    yielded. ``fn`` must be deterministic and picklable (a module-level function).

    The fingerprint holds only ``name`` and ``version``: seqcache cannot see the
    function's code, so **bump ``version`` whenever the function's output
    changes**, or a stale cache is reused.

    Args:
      fn: a callable with no arguments returning an iterable of dicts.
      name: the source's name (in the pseudo-file name and the fingerprint).
      version: the version of the function's output.
      on_error: the policy for the content of string values (control
        characters, U+2581, empty, whitespace) and for the task's checks.

    Raises (from ``read_file``):
      ValueError: ``fn`` yields something that is not a dict.
    """

    kind = "function"
    locator = "record"

    def __init__(self, fn: Callable[[], Iterable[dict]], *, name: str, version: str = "0",
                 on_error: "str | Mapping[str, str]" = "raise"):
        if not callable(fn):
            raise TypeError(f"FunctionSource {name!r}: fn must be callable (got {type(fn).__name__})")
        if not name:
            raise ValueError("FunctionSource needs a non-empty name")
        self.fn = fn
        self.name = name
        self.version = str(version)
        self.on_error = _check_on_error(on_error)

    @property
    def path(self) -> str:
        return f"<function {self.name}>"

    def list_files(self) -> list[SourceFile]:
        return [SourceFile(self.path, 0, 0)]

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        for number, item in enumerate(self.fn()):
            if not isinstance(item, dict):
                kind = type(item).__name__
                raise ValueError(f"{self.path}: record {number} is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                                 "expected a dict")
            where = f"{self.path}: record {number}"
            data, problem = _text_of_bytes(dict(item))
            repairs = []
            if problem is not None:
                if self.on_error.actions["invalid_utf8"] != "replace":
                    yield self._bad("invalid_utf8", file_index, number, b"", f"{where}: {problem}")
                    continue
                repairs.append(("invalid_utf8", f"{where}: {problem}"))
            try:
                raw = canonical_json_bytes(data, default=_json_default)
            except (TypeError, ValueError) as e:
                yield self._bad("bad_value", file_index, number, b"", f"{where}: {e}")
                continue
            yield self._record(file_index, number, raw, where, data, repairs)

    def fingerprint(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "version": self.version,
            "on_error": self.on_error.to_json(),
            "files": [{"path": self.path, "num_bytes": 0, "mtime_ns": 0}],
        }

    def describe(self) -> str:
        return f"function {self.name} (version {self.version})"


_SPEC_HELP = (
    "accepted source specs: 'text:PATTERN' (one record per line), "
    "'files:PATTERN' (one record per file), 'jsonl:PATTERN#FIELD' (FIELD may be dotted, "
    "default 'text'), 'parquet:PATTERN#COLUMN' (default 'text')"
)


def parse_source_spec(spec: str, *, exclude: Sequence[str] = (),
                      on_error: "str | Mapping[str, str]" = "raise") -> Source:
    """Builds a source from its command-line form.

    Forms: ``text:PATTERN``, ``files:PATTERN``, ``jsonl:PATTERN#FIELD`` and
    ``parquet:PATTERN#COLUMN`` (FIELD / COLUMN default to ``text``). The value is
    stored under the key ``"text"``. ``exclude``: glob patterns of paths to leave out;
    ``on_error``: the source's ``ErrorPolicy`` spec (see ``parse_on_error``).

    Raises:
      ValueError: an unknown kind or an empty pattern; the message lists the forms.
    """
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
    if kind == "text":
        return TextLineSource(rest, exclude=exclude, on_error=on_error)
    if kind == "files":
        return TextFileSource(rest, exclude=exclude, on_error=on_error)
    if kind in ("jsonl", "parquet"):
        pattern, _, name = rest.rpartition("#") if "#" in rest else (rest, "", "text")
        if not pattern or not name:
            raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
        if kind == "jsonl":
            return JsonLinesSource(pattern, field=name, exclude=exclude, on_error=on_error)
        return ParquetSource(pattern, column=name, exclude=exclude, on_error=on_error)
    raise ValueError(f"bad source spec {spec!r}: unknown kind {kind!r}; {_SPEC_HELP}")
