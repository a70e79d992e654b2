"""JSON that seqcache did not just write itself, read within bounds.

A manifest, a shard checksum file, a feeder state, a mixture schedule, a train
config or a quarantine line may come from anywhere: edited by hand, damaged,
or made to break the reader. ``loads`` and ``read_file`` parse such text so
that nothing but the caller's own error class (``seqcache.format.CacheError``,
``seqcache.feeders.FeederStateError``, ``seqcache.training.config.ConfigError``)
comes out, with one line naming the file (and, for text that is not JSON or
not UTF-8, the line and column):

- text: UTF-8; a byte order mark at the file's first byte is dropped, as every
  reader of seqcache drops it (``decode_text``: YAML schedules, and the
  sources of a build, ``seqcache.tasks.sources.base.BOM``); one anywhere else
  is a character like any other;
- size: at most ``max_bytes`` bytes (a local file is not read past them);
- nesting: at most ``max_depth`` levels of objects and lists (Python's JSON
  parser recurses, and so does everything that walks the result);
- values: at most ``max_nodes`` values in all (objects, lists and scalars;
  a value reached twice, as YAML aliases or a dict handed over with shared
  parts make it, counts twice), so that the walk ends after that many steps
  whatever the input;
- keys: at most ``max_keys`` keys in one object, and no key twice (Python's
  ``json`` keeps the last value without a word, other readers the first: an
  edited file would mean one thing to one reader and another to the next);
- numbers: at most ``MAX_NUMBER_CHARS`` characters; ``NaN``, ``Infinity`` and
  ``-Infinity`` (which Python's ``json`` accepts, but JSON does not) are
  refused, and so are floats that overflow to infinity (``1e999``) and
  integers of 2^64 or more in magnitude.

The counts are bounded before anything is built: ``scan`` walks the text once
with numpy, a block of ``SCAN_BLOCK`` bytes at a time (strings told apart by
their quotes), and refuses an object of too many keys, too many values or too
deep a nesting at its line and column, so that a file of a million keys costs
a scan, not a million-entry dict. Text it passes goes to Python's JSON parser,
whose cost is then linear in the bounded counts; the scan runs only when the
text holds more colons than ``max_keys`` or more commas and brackets than
``max_nodes`` (strings can only lower the counts), which what seqcache
writes seldom does.

``check_tree`` applies the same nesting, size and number rules to a value that
is already decoded (a feeder state handed over as a dict by Orbax or a user, a
YAML mixture schedule).
``convert`` checks a whole value against a type (a ``msgspec.Struct`` with
``msgspec.Meta`` bounds) and names the field that fails: ``state.json:
mixture[0].rate: expected `float` >= 0.0 (got -1)``.
"""

from __future__ import annotations

import json
import math
import os
import re
import reprlib
import stat
from typing import Any

import msgspec
import numpy as np

from seqcache import fs

# Defaults: far above what seqcache writes (a manifest of 10,000 shards has 5
# levels and under 4 MB), far below what breaks a parser.
MAX_DEPTH = 64
MAX_BYTES = 64 << 20
# The most values (objects, lists, strings, numbers, booleans, nulls) a value
# may hold, counting a shared one each time it is reached: one per 8 bytes of
# MAX_BYTES (what seqcache writes has about one per 40 bytes: the manifest of a
# build of 500 files holds 5,700 values in 230 kB; the shard checksum file of
# 2^20 shards 2^21), walked in a few seconds, where 400 bytes of YAML aliases
# ("billion laughs") expand to 9^10 values that would take hours.
MAX_NODES = 2**23
# The most keys one object may have: far above what seqcache writes (a
# manifest's largest object, fingerprint_inputs or a feature table, has tens;
# a version-2 manifest's source file table is a list of small objects), and
# what Python's JSON parser builds in about 0.1 s; a million keys took 1.5 s and
# 150 MB before anything could look at them.
MAX_KEYS = 2**16
# The most characters a number may have: an int64 has at most 20, the
# shortest text of a double at most 24 (``repr``). Longer ones are refused
# before they are converted (int() of many digits is quadratic).
MAX_NUMBER_CHARS = 40
# The UTF-8 byte order mark. Every file seqcache reads drops one at its first
# byte (``decode_text``; the sources of a build too) and nowhere else.
BOM = b"\xef\xbb\xbf"
# The bytes ``scan`` looks at in one numpy pass (its memory: about 20 bytes a byte of a block).
SCAN_BLOCK = 1 << 20
# Integers a JSON file may hold at all, in magnitude: the uint64 range (each
# field has its own, tighter range).
MAX_INTEGER = 2**64
# What a count (records, examples, tokens, bytes) may be: exact in a double,
# and summable in int64.
MAX_COUNT = 2**53
# The most tokens per row a manifest, a feeder state or a train config may
# give (a row of int32 tokens of this length is 64 MiB).
MAX_SEQUENCE_LENGTH = 2**24

_short_repr = reprlib.Repr()
_short_repr.maxlevel = 3
_short_repr.maxstring = 60
_short_repr.maxother = 60
_short_repr.maxlong = 40
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset"):
    setattr(_short_repr, _attr, 4)


def short(value: Any) -> str:
    """A bounded ``repr`` of a value for a message: at most 3 levels, 4 items
    per container, 60 characters per string and 40 digits per integer (an
    integer of 10,000 digits or a list nested 10,000 deep prints in one short
    line, where ``repr`` would fail or flood)."""
    try:
        return _short_repr.repr(value)
    except (RecursionError, ValueError):
        return f"<{type(value).__name__}>"


def bound(n: int) -> str:
    """``2^40`` for a power of two of 2^10 or more, else the number with commas."""
    if n >= 1024 and n & (n - 1) == 0:
        return f"2^{n.bit_length() - 1}"
    return f"{n:,}"


class _Refused:
    """What the parser's hooks return for a number JSON text may not hold here
    (``check_tree`` reports it with its place, then nothing else sees it)."""

    def __init__(self, text: str, reason: str):
        self.text, self.reason = text, reason


class _DuplicateKey:
    """What the parser's object hook returns for an object that has a key twice
    (``check_tree`` reports it with its place)."""

    def __init__(self, key: str):
        self.key = key


class DuplicateKeyError(ValueError):
    """A JSON object has the key ``key`` twice (``unique_keys``)."""

    def __init__(self, key: str):
        super().__init__(f"the key {short(key)} appears twice in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    """A ``json.loads`` ``object_pairs_hook``: the object as a dict, unless it
    has a key twice.

    Raises:
      DuplicateKeyError: naming the first repeated key.
    """
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise DuplicateKeyError(_first_repeated(pairs))
    return obj


def _first_repeated(pairs: list[tuple[str, Any]]) -> str:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            return key
        seen.add(key)
    raise AssertionError("no repeated key")


def _unique_or_refused(pairs: list[tuple[str, Any]]):
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _DuplicateKey(_first_repeated(pairs))


def _parse_int(text: str):
    digits = text.lstrip("-")
    if len(digits) > 20 or abs(int(text)) >= MAX_INTEGER:
        shown = text if len(text) <= 24 else f"{text[:12]}...({len(digits)} digits)"
        return _Refused(shown, "is out of range (|n| < 2^64)")
    return int(text)


def _parse_float(text: str):
    if len(text) > MAX_NUMBER_CHARS:
        return _Refused(f"{text[:12]}...({len(text)} characters)",
                        f"has more than the {MAX_NUMBER_CHARS} characters a number may have")
    value = float(text)
    if not math.isfinite(value):
        return _Refused(text[:40], "overflows to infinity (expected a finite number)")
    return value


def _parse_constant(name: str):
    return _Refused(name, "is not a JSON number (expected a finite number)")


def place(text: str | bytes, offset: int, first_line: int = 1) -> str:
    """``line L, column C`` (1-based, C in characters) of ``offset`` in
    ``text`` (characters of a str, bytes of UTF-8 bytes); ``first_line``: the
    line the text starts at in its file."""
    newline = b"\n" if isinstance(text, bytes) else "\n"
    start = text.rfind(newline, 0, offset) + 1
    line = text.count(newline, 0, offset) + first_line
    head = text[start:offset]
    column = len(head.decode("utf-8", "replace")) if isinstance(head, bytes) else len(head)
    return f"line {line}, column {column + 1}"


def decode_text(data: str | bytes, *, path: str, error: type[Exception] = ValueError, what: str = "file",
                max_bytes: int = MAX_BYTES, first_line: int = 1) -> str:
    """The text of a file seqcache reads (JSON, YAML): at most ``max_bytes``
    bytes of UTF-8, without the byte order mark (``BOM``) its first byte may
    carry (``first_line`` 1: ``data`` starts the file). The one rule for
    every such file; the sources of a build follow it too.

    Raises:
      error: ``{path}: ...`` one line: too large; not UTF-8, naming the line
        and column of the first byte that is not (UTF-16 named as such).
    """
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise error(f"{path}: the {what} is larger than the {max_bytes:,} bytes allowed")
    if isinstance(data, str):
        return data.removeprefix("\ufeff") if first_line == 1 else data
    if first_line == 1:
        data = data.removeprefix(BOM)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        if first_line == 1 and data[:2] in (b"\xff\xfe", b"\xfe\xff"):
            refusal = f"the {what} is UTF-16 text (it starts with a UTF-16 byte order mark): save it as UTF-8"
        else:
            refusal = (f"{place(data, e.start, first_line)}: the {what} is not UTF-8 text (byte 0x{data[e.start]:02x}: "
                       f"{e.reason}); save it as UTF-8")
    del data  # the error's traceback keeps this frame: not the file's bytes
    raise error(f"{path}: {refusal}")


# scan's classes of bytes: brackets, colons and commas (structure outside strings), quotes, backslashes.
_OPEN, _CLOSE, _COLON, _COMMA, _QUOTE, _ESCAPE = 1, 2, 3, 4, 5, 6
_CLASS = np.zeros(256, np.uint8)
for _chars, _kind in ((b"[{", _OPEN), (b"]}", _CLOSE), (b":", _COLON), (b",", _COMMA), (b'"', _QUOTE),
                      (b"\\", _ESCAPE)):
    _CLASS[list(_chars)] = _kind


class _Scan:
    """``scan``'s state from one block to the next: inside a string or not,
    the backslashes that end the block, the depth, the values so far, and the
    keys and offset of each open object or list (outermost first)."""

    def __init__(self, max_depth: int, max_nodes: int, max_keys: int):
        self.max_depth, self.max_nodes, self.max_keys = max_depth, max_nodes, max_keys
        self.in_string, self.backslashes, self.depth, self.nodes = False, 0, 0, 1
        self.keys = np.zeros(0, np.int64)
        self.starts = np.zeros(0, np.int64)

    def feed(self, block: np.ndarray, offset: int) -> tuple[int, str] | None:
        """Scans the bytes ``block`` found at ``offset``: the first bound passed,
        as (offset, ``"depth"``, ``"values"`` or ``"keys"``), or None."""
        kinds = _CLASS[block]
        pos = np.flatnonzero(kinds)
        kind = kinds[pos]
        pos += offset
        quotes = self._real_quotes(pos, kind, offset, offset + len(block))
        structure = kind <= _COMMA
        pos, kind = pos[structure], kind[structure]
        # A byte is inside a string after an odd number of the quotes that open and close strings.
        outside = (np.searchsorted(quotes, pos) % 2 == 1) == self.in_string
        self.in_string ^= bool(len(quotes) % 2)
        pos, kind = pos[outside], kind[outside]
        if not pos.size:
            return None
        depth = self.depth + np.cumsum((kind == _OPEN).astype(np.int64) - (kind == _CLOSE))
        nodes = self.nodes + np.cumsum((kind == _OPEN) | (kind == _COMMA))
        # Each bound passed: (where it is passed, where it is reported, which).
        found = [(int(pos[i[0]]), int(pos[i[0]]), what) for i, what in (
            (np.flatnonzero(depth > self.max_depth), "depth"), (np.flatnonzero(nodes > self.max_nodes), "values"))
            if i.size]
        keys, stack = self._count_keys(pos, kind, depth)
        found += keys
        if found:
            _, offset, what = min(found)
            return offset, what
        self.keys, self.starts = stack
        self.depth, self.nodes = int(depth[-1]), int(nodes[-1])
        return None

    def _real_quotes(self, pos: np.ndarray, kind: np.ndarray, offset: int, end: int) -> np.ndarray:
        """The offsets of the quotes that open or close a string (those not
        after an odd run of backslashes); keeps the run that ends the block."""
        quotes, escapes = pos[kind == _QUOTE], pos[kind == _ESCAPE]
        if not escapes.size:
            run = np.where(quotes == offset, self.backslashes, 0)
            self.backslashes = 0
            return quotes[run % 2 == 0]
        first = np.ones(len(escapes), bool)
        first[1:] = np.diff(escapes) != 1
        start = escapes[np.maximum.accumulate(np.where(first, np.arange(len(escapes)), 0))]  # each run's first
        carried = np.where(start == offset, self.backslashes, 0)  # a run that began in the block before
        i = np.minimum(np.searchsorted(escapes, quotes - 1), len(escapes) - 1)
        run = np.where(escapes[i] == quotes - 1, quotes - start[i] + carried[i],
                       np.where(quotes == offset, self.backslashes, 0))
        self.backslashes = int(end - start[-1] + carried[-1]) if escapes[-1] == end - 1 else 0
        return quotes[run % 2 == 0]

    def _count_keys(self, pos: np.ndarray, kind: np.ndarray, depth: np.ndarray) -> tuple[list, tuple]:
        """Adds the block's keys (colons) to the object each belongs to: the
        last opened at its depth, in this block or before it. Returns the
        objects of more than ``max_keys`` keys, as ``feed`` words them (at
        the key past the bound, reported at the object's bracket), and the
        key counts and offsets of the objects left open."""
        opens, colons = np.flatnonzero(kind == _OPEN), np.flatnonzero(kind == _COLON)
        order = np.lexsort((opens, depth[opens]))  # by level, then place
        opens, levels = opens[order], depth[opens][order]
        n = len(kind)
        j = np.searchsorted(levels * n + opens, depth[colons] * n + colons) - 1
        own = (j >= 0) & (levels[np.maximum(j, 0)] == depth[colons]) if opens.size else np.zeros(len(colons), bool)
        counts = np.bincount(j[own], minlength=len(opens))
        before = depth[colons][~own]
        inside = (before >= 1) & (before <= len(self.keys))
        carried = self.keys + np.bincount(before[inside] - 1, minlength=len(self.keys))
        found = []
        for groups, colon, past, total, start in (
                (j[own], colons[own], np.zeros(len(opens), np.int64), counts, pos[opens]),
                (before[inside] - 1, colons[~own][inside], self.keys, carried, self.starts)):
            over = np.flatnonzero(total > self.max_keys)
            if over.size:  # the key past the bound: the (max_keys - past + 1)-th of its object in this block
                rank = np.argsort(groups, kind="stable")
                at = colon[rank[np.searchsorted(groups[rank], over) + self.max_keys - past[over]]]
                k = int(np.argmin(at))
                found.append((int(pos[at[k]]), int(start[over[k]]), "keys"))
        level = np.arange(1, max(int(depth[-1]), 0) + 1)
        last = np.searchsorted(levels, level, side="right") - 1
        mine = (last >= 0) & (levels[np.maximum(last, 0)] == level) if opens.size else np.zeros(len(level), bool)
        last = np.maximum(last, 0)
        kept = min(len(level), len(self.keys))
        keys, starts = np.zeros(len(level), np.int64), np.full(len(level), pos[0], np.int64)
        keys[:kept], starts[:kept] = carried[:kept], self.starts[:kept]
        if opens.size:
            keys, starts = np.where(mine, counts[last], keys), np.where(mine, pos[opens[last]], starts)
        return found, (keys, starts)


def scan(data: bytes, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES,
         max_keys: int = MAX_KEYS) -> tuple[int, str] | None:
    """The first place where the JSON text ``data`` (UTF-8) passes a bound,
    found before anything is built: ``(byte offset, what)``, ``what`` one of
    ``"depth"`` (the bracket that opens level ``max_depth`` + 1), ``"values"``
    (the comma or bracket of value ``max_nodes`` + 1) and ``"keys"`` (the
    bracket that opens an object of more than ``max_keys`` keys); None when
    it passes none. Strings are told apart by their quotes (a quote after an
    odd run of backslashes is escaped); text that is not JSON gets some
    answer, and is refused by the parser in any case. Linear time, one numpy
    pass of each ``SCAN_BLOCK`` bytes; memory O(``SCAN_BLOCK``)."""
    state = _Scan(max_depth, max_nodes, max_keys)
    for offset in range(0, len(data), SCAN_BLOCK):
        block = np.frombuffer(data, np.uint8, count=min(SCAN_BLOCK, len(data) - offset), offset=offset)
        found = state.feed(block, offset)
        if found is not None:
            return found
    return None


def _bound_words(what: str, found: str, *, max_depth: int, max_nodes: int, max_keys: int) -> str:
    return {"depth": f"the {what} is nested deeper than {max_depth} levels",
            "values": f"the {what} holds more than {max_nodes:,} values",
            "keys": f"an object of the {what} has more than {max_keys:,} keys"}[found]


def loads(data: str | bytes, *, path: str, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
          max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS,
          what: str = "JSON file", first_line: int = 1) -> Any:
    """Parses JSON text within bounds.

    Args:
      data: the text, or UTF-8 bytes (``decode_text``: a byte order mark
        that starts the file is dropped).
      path: the file (or option) it came from, for messages.
      error: the exception class to raise.
      max_depth: most levels of nested objects and lists.
      max_bytes: most bytes (UTF-8).
      max_nodes: most values in all (``check_tree``).
      max_keys: most keys in one object.
      what: what the file is, for messages ("manifest", "feeder state").
      first_line: the line of the file ``data`` starts at (a JSON-lines file's
        line), for messages.

    Returns:
      The decoded value (dicts, lists, str, int with |n| < 2^64, finite float,
      bool, None).

    Raises:
      error: ``{path}: ...`` one line: too large; not UTF-8 or not JSON (``{path}:
        line L, column C: the {what} is not valid JSON: Expecting value``);
        nested too deep, more than ``max_nodes`` values or an object of more
        than ``max_keys`` keys (at the line and column of the bracket, found
        by ``scan`` before anything is built, or at the field); a number of
        more than ``MAX_NUMBER_CHARS`` characters, NaN or Infinity, a number
        out of range, an object with a key twice (``{path}: mixture[0] has the
        key 'rate' twice ...``).
    """
    text = decode_text(data, path=path, error=error, what=what, max_bytes=max_bytes, first_line=first_line)
    # The bytes scan reads: the file's own (without its byte order mark), not a second copy of the text.
    raw = (data.removeprefix(BOM) if first_line == 1 else data) if isinstance(data, bytes) else text
    bounds = dict(max_depth=max_depth, max_nodes=max_nodes, max_keys=max_keys)
    refusal = None
    if text.count(":") > max_keys or 1 + text.count(",") + text.count("[") + text.count("{") > max_nodes:
        refusal = _bound_refusal(raw, what=what, first_line=first_line, **bounds)
    if refusal is None:
        try:
            value = json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                               object_pairs_hook=_unique_or_refused)
        except RecursionError:
            refusal = (_bound_refusal(raw, what=what, first_line=first_line, **bounds)
                       or f"the {what} is nested deeper than {max_depth} levels")
        except json.JSONDecodeError as e:
            refusal = f"{place(text, e.pos, first_line)}: the {what} is not valid JSON: {e.msg}"
    if refusal is not None:
        del data, raw, text  # the error's traceback keeps this frame: not the file's text
        raise error(f"{path}: {refusal}")
    check_tree(value, path=path, error=error, what=what, strings=_SURROGATE_ESCAPE.search(text) is not None, **bounds)
    return value


# A \\uD800-\\uDFFF escape: only a text that holds one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _bound_refusal(data: str | bytes, *, what: str, first_line: int, **bounds) -> str | None:
    """Where and which bound ``scan`` finds passed, in words; None when none is."""
    data = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    found = scan(data, **bounds)
    if found is None:
        return None
    offset, kind = found
    return f"{place(data, offset, first_line)}: {_bound_words(what, kind, **bounds)}"


def read_file(path: str, *, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
              max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS,
              what: str = "JSON file") -> Any:
    """``loads`` of the file at ``path`` (a local path or a URL, through
    ``seqcache.fs``); a local file is read no further than one byte past
    ``max_bytes``.

    Raises:
      error: as ``loads``; also a file that cannot be read (``OSError``).
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    return loads(read_bytes(path, error=error, max_bytes=max_bytes, what=what), path=path, error=error,
                 max_depth=max_depth, max_bytes=max_bytes, max_nodes=max_nodes, max_keys=max_keys, what=what)


def read_bytes(path: str, *, error: type[Exception] = ValueError, max_bytes: int = MAX_BYTES,
               what: str = "file") -> bytes:
    """The bytes of the file at ``path`` (a local path or a URL): a local file
    read no further than one byte past ``max_bytes`` (the readers refuse more).

    Raises:
      error: ``{path}: cannot read the {what}: ...`` (``OSError``).
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    try:
        if fs.is_local(path):
            # Opened without waiting (a FIFO would wait for a writer), then refused unless a regular file.
            fd = os.open(fs.local_path(path), os.O_RDONLY | os.O_NONBLOCK)
            try:
                kind = os.fstat(fd).st_mode
            except OSError:
                os.close(fd)
                raise
            if not stat.S_ISREG(kind):  # before open(): a folder's descriptor is refused there, named by number
                os.close(fd)
                raise error(f"{path}: cannot read the {what}: not a regular file "
                            f"({'a folder' if stat.S_ISDIR(kind) else 'a pipe, socket or device'})")
            with open(fd, "rb") as f:
                return f.read(max_bytes + 1)  # no more than one byte past the bound
        return fs.read_bytes(path)
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e}") from None


def check_tree(value: Any, *, path: str, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
               max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS, what: str = "JSON file",
               strings: bool = False) -> None:
    """Checks a decoded value without recursion: at most ``max_depth`` levels
    of dicts and lists, at most ``max_keys`` keys in a dict, at most
    ``max_nodes`` values in all (the value itself,
    every dict and list, every key's value and item, a shared one counted each
    time it is reached, so that a value built from aliases or shared parts is
    refused after ``max_nodes`` steps, not walked for hours; a cycle is refused
    too), no float that is NaN or infinite, no integer of 2^64 or more in
    magnitude, and nothing but JSON's types (dict with str keys, list, str,
    int, float, bool, None; tuples are taken as lists; keys are strings, or the
    scalars YAML allows), and, with ``strings`` (``loads`` asks for it when
    the text holds a ``\\ud800``-``\\udfff`` escape), no string or key that holds
    a lone surrogate (``"\\ud800"`` is JSON but no Unicode text: it cannot be
    printed or written as UTF-8).

    Raises:
      error: ``{path}: ...`` naming the first value that breaks a rule and where.
    """
    stack = [(value, 1, "")]
    nodes = 1
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, (dict, list, tuple)):
            if depth > max_depth:
                raise error(f"{path}: the {what} is nested deeper than {max_depth} levels (at {where or 'top'})")
            nodes += len(node)
            if nodes > max_nodes:
                raise error(f"{path}: the {what} holds more than {max_nodes:,} values (at {where or 'top'}; a "
                            "value reached twice, through an alias or a shared part, counts twice)")
            if isinstance(node, dict) and len(node) > max_keys:
                raise error(f"{path}: {where or 'the ' + what} has {len(node):,} keys, more than the {max_keys:,} "
                            "an object may have")
            if isinstance(node, dict):
                for key, item in node.items():
                    if isinstance(key, int) and not isinstance(key, bool) and not -MAX_INTEGER < key < MAX_INTEGER \
                            or not isinstance(key, (str, int, float, bool)) and key is not None:
                        raise error(f"{path}: {where or 'the ' + what} has the key {short(key)}, expected a string")
                    if not isinstance(item, (str, bool)) and item is not None:
                        stack.append((item, depth + 1, f"{where}.{key}" if where else key))
            else:
                for i, item in enumerate(node):
                    if not isinstance(item, (str, bool)) and item is not None:
                        stack.append((item, depth + 1, f"{where}[{i}]"))
        elif isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        elif isinstance(node, int):
            if not -MAX_INTEGER < node < MAX_INTEGER:
                raise error(f"{path}: {where or what} = {short(node)} is out of range (|n| < 2^64)")
        elif isinstance(node, float):
            if not math.isfinite(node):
                raise error(f"{path}: {where or what} = {node!r}, expected a finite number")
        elif isinstance(node, _Refused):
            raise error(f"{path}: {where or what} = {node.text} {node.reason}")
        elif isinstance(node, _DuplicateKey):
            raise error(f"{path}: {where or 'the ' + what} has the key {short(node.key)} twice (JSON readers "
                        "disagree on which value counts); keep one")
        else:
            raise error(f"{path}: {where or what} is a {type(node).__name__}, not a JSON value")
    if strings:
        _check_strings(value, path=path, error=error, what=what)


def _check_strings(value: Any, *, path: str, error: type[Exception], what: str) -> None:
    """Refuses a string or key of ``value`` that is not Unicode text (a lone
    surrogate), naming where. Depth first, holding one iterator a level: run
    after the bounds are checked (``check_tree``), it reads at most their
    number of values."""
    stack, trail = [iter(((None, value),))], []
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            if trail:
                trail.pop()
            continue
        key, node = step
        if isinstance(node, str):
            if not _is_text(node):
                raise error(f"{path}: {_where([*trail, key]) or what} holds a lone surrogate (a \\ud800-\\udfff "
                            "escape without its pair), not Unicode text")
        elif isinstance(node, dict):
            for name in node:
                if isinstance(name, str) and not _is_text(name):
                    raise error(f"{path}: {_where([*trail, key]) or 'the ' + what} has a key that holds a lone "
                                "surrogate (a \\ud800-\\udfff escape without its pair), not Unicode text")
            stack.append(iter(node.items()))
            trail.append(key)
        elif isinstance(node, (list, tuple)):
            stack.append(enumerate(node))
            trail.append(key)


def _where(keys: list) -> str:
    """``a.b[0]`` of the keys and indices leading to a value (None: the top)."""
    out = ""
    for key in keys:
        if key is None:
            continue
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _is_text(value: str) -> bool:
    """Whether ``value`` can be written as UTF-8 (holds no lone surrogate)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def convert(value: Any, model: Any, *, path: str, error: type[Exception] = ValueError, prefix: str = "") -> Any:
    """``msgspec.convert(value, model, strict=True)``: ``value`` as the type
    ``model`` (a ``msgspec.Struct``, a dataclass, ``int | None``, ...) without
    coercion (an int is taken where a float is expected; a bool is never a
    number), its ``msgspec.Meta`` bounds checked.

    Args:
      prefix: how messages name ``value`` (``model``; empty: by its fields alone).

    Raises:
      error: one line naming ``path`` (when not empty), the field and its value,
        in msgspec's words: ``{path}: mixture[0].rate: expected `float` >= 0.0
        (got -1)``, or ``{path}: mixture[0]: object missing required field `rate```.
    """
    try:
        return msgspec.convert(value, model, strict=True)
    except msgspec.ValidationError as e:
        refusal = read_validation_error(e, value, prefix)
    place = ": ".join(p for p in (path, refusal.field) if p)
    raise error(f"{place}: {refusal.text}" + (f" (got {short(refusal.value)})" if refusal.found else ""))


class Refusal(msgspec.Struct, frozen=True):
    """What a ``msgspec.ValidationError`` says (``read_validation_error``).

    Attributes:
      field: the refused value's place, ``PREFIX.statistics.tokens[2]`` (a
        dict's value named by its key where the dict has one key, else
        ``[...]``); empty for the value itself.
      text: msgspec's words, first letter in lower case (``expected `int```,
        ``object missing required field `x```); without its own ``got ...``
        part when ``found`` (the caller shows the value).
      found: whether ``value`` holds the refused value (False for a missing
        field, or a place the path does not reach).
      value: the refused value when ``found``, else None.
    """

    field: str
    text: str
    found: bool
    value: Any = None


# msgspec (0.18 to 0.23, checked against 0.23.0 by tests/test_bounded_json.py)
# gives a ValidationError only as text: "<words> - at `$<path>`", the path made
# of ".key" for an object's field, "[i]" for a list's item and "[...]" for a
# dict's value (whose key it does not give); no path at the top level.
_AT = " - at `$"
_PATH_PART = re.compile(r"\.([^.\[`]+)|\[(\d+|\.\.\.)\]")
_ITS_OWN_VALUE = re.compile(r", got `[^`]*`$|(?<=^invalid enum value) .*")


def read_validation_error(error: msgspec.ValidationError, value: Any, prefix: str = "") -> Refusal:
    """The one reading of msgspec's error text: where in ``value`` (what was
    converted) ``error`` refuses, and in which words (``Refusal``).

    Args:
      prefix: the name of ``value`` itself in ``Refusal.field`` (``shards``).
    """
    text, _, where = str(error).partition(_AT)
    name, found = prefix, True
    for key, index in _PATH_PART.findall(where):
        if index == "..." and isinstance(value, dict) and len(value) == 1:
            key = next(iter(value))
        if key:
            name += f".{key}"
            found = found and isinstance(value, dict) and key in value
            value = value[key] if found else None
        else:
            name += f"[{index}]"
            found = found and index.isdigit() and isinstance(value, list) and int(index) < len(value)
            value = value[int(index)] if found else None
    text = text[:1].lower() + text[1:]
    found = found and not text.startswith("object missing")
    if found:
        text = _ITS_OWN_VALUE.sub("", text)
    return Refusal(name.removeprefix("."), text, found, value if found else None)
