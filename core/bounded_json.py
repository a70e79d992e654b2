"""JSON that seqcache did not just write itself, read within bounds.

A manifest, a shard checksum file, a feeder state, a mixture schedule, a train
config or a quarantine line may come from anywhere: edited by hand, damaged,
or made to break the reader. ``loads`` and ``read_file`` parse such text so
that nothing but the caller's own error class (``seqcache.format.CacheError``,
``seqcache.feeders.FeederStateError``, ``seqcache.training.config.ConfigError``)
comes out, with one line naming the file:

- size: at most ``max_bytes`` bytes (a local file is not read past them);
- nesting: at most ``max_depth`` levels of objects and lists (Python's JSON
  parser recurses, and so does everything that walks the result);
- values: at most ``max_nodes`` values in all (objects, lists and scalars;
  a value reached twice, as YAML aliases or a dict handed over with shared
  parts make it, counts twice), so that the walk ends after that many steps
  whatever the input;
- numbers: ``NaN``, ``Infinity`` and ``-Infinity`` (which Python's ``json``
  accepts, but JSON does not) are refused, and so are floats that overflow to
  infinity (``1e999``) and integers of 2^64 or more in magnitude;
- keys: an object that has a key twice is refused (Python's ``json`` keeps
  the last value without a word, other readers the first: an edited file
  would mean one thing to one reader and another to the next).

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
import re
import reprlib
from typing import Any

import msgspec

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
    value = float(text)
    if not math.isfinite(value):
        return _Refused(text[:40], "overflows to infinity (expected a finite number)")
    return value


def _parse_constant(name: str):
    return _Refused(name, "is not a JSON number (expected a finite number)")


def loads(data: str | bytes, *, path: str, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
          max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, what: str = "JSON file") -> Any:
    """Parses JSON text within bounds.

    Args:
      data: the text, or UTF-8 bytes.
      path: the file (or option) it came from, for messages.
      error: the exception class to raise.
      max_depth: most levels of nested objects and lists.
      max_bytes: most bytes (UTF-8).
      max_nodes: most values in all (``check_tree``).
      what: what the file is, for messages ("manifest", "feeder state").

    Returns:
      The decoded value (dicts, lists, str, int with |n| < 2^64, finite float,
      bool, None).

    Raises:
      error: ``{path}: ...`` one line: too large, not UTF-8, not JSON, nested
        too deep, more than ``max_nodes`` values, NaN or Infinity, a number
        out of range, an object with a key twice (``{path}: mixture[0] has the
        key 'rate' twice ...``).
    """
    size = len(data) if isinstance(data, bytes) else len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise error(f"{path}: the {what} is larger than the {max_bytes:,} bytes allowed")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{path}: the {what} is not UTF-8 text: {e}") from None
    try:
        value = json.loads(data, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant,
                           object_pairs_hook=_unique_or_refused)
    except RecursionError:
        raise error(f"{path}: the {what} is nested deeper than {max_depth} levels") from None
    except ValueError as e:  # json.JSONDecodeError, and int() of too many digits
        raise error(f"{path}: the {what} is not valid JSON: {e}") from None
    check_tree(value, path=path, error=error, max_depth=max_depth, max_nodes=max_nodes, what=what)
    return value


def read_file(path: str, *, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
              max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, what: str = "JSON file") -> Any:
    """``loads`` of the file at ``path`` (a local path or a URL, through
    ``seqcache.fs``); a local file is read no further than one byte past
    ``max_bytes``.

    Raises:
      error: as ``loads``; also a file that cannot be read (``OSError``).
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    try:
        if fs.is_local(path):
            with open(fs.local_path(path), "rb") as f:
                data = f.read(max_bytes + 1)  # no more than one byte past the bound
        else:
            data = fs.read_bytes(path)
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e}") from None
    return loads(data, path=path, error=error, max_depth=max_depth, max_bytes=max_bytes, max_nodes=max_nodes,
                 what=what)


def check_tree(value: Any, *, path: str, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
               max_nodes: int = MAX_NODES, what: str = "JSON file") -> None:
    """Checks a decoded value without recursion: at most ``max_depth`` levels
    of dicts and lists, at most ``max_nodes`` values in all (the value itself,
    every dict and list, every key's value and item, a shared one counted each
    time it is reached, so that a value built from aliases or shared parts is
    refused after ``max_nodes`` steps, not walked for hours; a cycle is refused
    too), no float that is NaN or infinite, no integer of 2^64 or more in
    magnitude, and nothing but JSON's types (dict with str keys, list, str,
    int, float, bool, None; tuples are taken as lists; keys are strings, or the
    scalars YAML allows).

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
        text, _, where = str(e).partition(" - at `$")
    name = prefix
    for key, index in re.findall(r"\.(\w+)|\[(\d+|\.\.\.)\]", where):  # the field path of a value msgspec reached
        if index == "...":  # a value of a dict, whose key msgspec does not give: the dict is shown
            break
        name, value = (f"{name}.{key}", value[key]) if key else (f"{name}[{index}]", value[int(index)])
    text = re.sub(r", got `[^`]*`$", "", text[:1].lower() + text[1:])
    place = ": ".join(p for p in (path, name.removeprefix(".")) if p)
    raise error(f"{place}: {text}" + ("" if text.startswith("object missing") else f" (got {short(value)})"))
