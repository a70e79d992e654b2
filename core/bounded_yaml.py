"""YAML that seqcache did not write itself, read within bounds: the subset a
mixture schedule needs, under the YAML 1.2 core schema.

What is read is one document of mappings, sequences and scalars (JSON text is
such a document, and reads as ``seqcache.bounded_json`` reads it). A plain
(unquoted) scalar is resolved as the YAML 1.2 core schema says: ``null``,
``~`` or nothing is None; ``true``/``false`` (and their capitalised forms)
are booleans; ``[-+]?[0-9]+``, ``0o7``, ``0x1f`` are integers; decimal
numbers with an optional exponent are floats (``.inf`` and ``.nan`` too,
refused as not finite); anything else is a string. A quoted or block scalar
is a string.

What YAML 1.1 readers (PyYAML's ``SafeLoader``) do beyond that is not done,
and the file reads as YAML 1.2 readers read it:

- ``1:59:59`` is a string, not a base-60 integer (PyYAML's conversion of one
  is quadratic: 1.2 MB took 46.6 s);
- ``yes``, ``no``, ``on``, ``off`` are strings, not booleans;
- ``010`` is the integer 10, not octal 8; ``0b101`` and ``1_000`` are strings;
- ``2024-01-01`` is a string, not a date.

Refused, in one line naming the file, the line and the column:

- anchors and aliases (``&name``, ``*name``), and so ``<<: *name``: a schedule
  never needs them, and ten lines of nine aliases of the line before ("billion
  laughs", 341 bytes) stand for 9^10 values; a merge key (``<<``) itself;
- tags (``!!str``, ``!!python/object``, ``!custom``), more than one document,
  a mapping key that is not a scalar, a key twice in one mapping (YAML
  readers disagree on which value counts);
- past ``seqcache.bounded_json``'s bounds: the size, the nesting, the values,
  the keys of one mapping, the characters of a number (and integers of 2^64
  or more), counted as the parser's events arrive, so that nothing past a
  bound is built;
- text that is not YAML (the parser's own words), not UTF-8 (a byte order
  mark at the first byte is dropped, ``bounded_json.decode_text``).

The parser is libyaml's (PyYAML's ``CParser``), linear in the text, used for
its events only: this module builds the value, a node at a time. Without
libyaml, PyYAML's own parser gives the same events, slower. PyYAML is
optional: a YAML file read without it is refused with the advice to install
it or write the file as JSON.
"""

from __future__ import annotations

import re
from typing import Any

from seqcache import bounded_json
from seqcache.bounded_json import MAX_BYTES, MAX_DEPTH, MAX_KEYS, MAX_NODES, MAX_NUMBER_CHARS

# The YAML 1.2 core schema's plain scalars (https://yaml.org/spec/1.2.2/#1032-tag-resolution).
_PLAIN = re.compile(r"""(?P<null>~|null|Null|NULL|)|(?P<true>true|True|TRUE)|(?P<false>false|False|FALSE)
    |(?P<int>[-+]?[0-9]+)|(?P<oct>0o[0-7]+)|(?P<hex>0x[0-9a-fA-F]+)
    |(?P<float>[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?)
    |(?P<inf>[-+]?\.(?:inf|Inf|INF))|(?P<nan>\.(?:nan|NaN|NAN))""", re.X)
_BASES = {"int": 10, "oct": 8, "hex": 16}


class _Refusal(Exception):
    """A refusal at ``mark`` (a YAML mark: 0-based line and column)."""

    def __init__(self, mark, text: str):
        super().__init__(text)
        self.mark, self.text = mark, text


def _resolve(text: str, mark=None) -> Any:
    """The value of a plain scalar under the YAML 1.2 core schema (None, bool,
    int, float or the text itself).

    Raises:
      _Refusal: a number of more than ``MAX_NUMBER_CHARS`` characters, an
        integer of 2^64 or more in magnitude, or a float that is not finite.
    """
    match = _PLAIN.fullmatch(text)
    kind = match.lastgroup if match else None
    if kind is None:
        return text
    if kind in ("null", "true", "false"):
        return None if kind == "null" else kind == "true"
    if len(text) > MAX_NUMBER_CHARS:
        raise _Refusal(mark, f"{text[:12]}...({len(text)} characters) has more than the {MAX_NUMBER_CHARS} "
                             "characters a number may have")
    if kind in _BASES:
        value = int(text if kind == "int" else text[2:], _BASES[kind])
        if not -bounded_json.MAX_INTEGER < value < bounded_json.MAX_INTEGER:
            raise _Refusal(mark, f"{text} is out of range (|n| < 2^64)")
        return value
    if kind == "float":
        return float(text)
    raise _Refusal(mark, f"{text} is not a finite number, expected a finite number")


class _Composer:
    """Builds the value of a YAML event stream, a node at a time, within bounds
    (``bounded_json``'s), refusing what ``seqcache.bounded_yaml`` does not read."""

    def __init__(self, yaml, *, max_depth: int, max_nodes: int, max_keys: int, what: str):
        self.yaml, self.what = yaml, what
        self.max_depth, self.max_nodes, self.max_keys = max_depth, max_nodes, max_keys
        self.stack: list[list] = []  # [container, key or _KEY (a mapping's next node is a key)]
        self.nodes = self.documents = 0
        self.root: Any = None

    _KEY = object()

    def feed(self, event) -> None:
        """Takes one parser event.

        Raises:
          _Refusal: at the event's mark.
        """
        yaml, kind = self.yaml, type(event)
        if kind is yaml.ScalarEvent:
            if event.anchor is not None or event.tag is not None:
                self.refuse(event)
            if event.style:  # quoted, literal or folded: a string
                self.add(event.value, event, scalar=True)
                return
            if event.value == "<<" and self.stack and self.stack[-1][1] is self._KEY:
                raise _Refusal(event.start_mark, f"merge key <<: a {self.what} may not use YAML merge keys; write "
                                                 "the keys out in full")
            self.add(_resolve(event.value, event.start_mark), event, scalar=True)
        elif kind is yaml.SequenceStartEvent or kind is yaml.MappingStartEvent:
            if event.anchor is not None or event.tag is not None:
                self.refuse(event)
            if len(self.stack) >= self.max_depth:
                raise _Refusal(event.start_mark, f"the {self.what} is nested deeper than {self.max_depth} levels")
            container: Any = [] if kind is yaml.SequenceStartEvent else {}
            self.add(container, event, scalar=False)
            self.stack.append([container, self._KEY if kind is yaml.MappingStartEvent else None])
        elif kind is yaml.SequenceEndEvent or kind is yaml.MappingEndEvent:
            self.stack.pop()
        elif kind is yaml.AliasEvent:
            self.refuse(event)
        elif kind is yaml.DocumentStartEvent:
            self.documents += 1
            if self.documents > 1:
                raise _Refusal(event.start_mark, f"a second YAML document (---): a {self.what} is one document")

    def refuse(self, event) -> None:
        """Refuses an alias, an anchor or a tag.

        Raises:
          _Refusal: always.
        """
        if event.anchor is not None:
            alias = type(event) is self.yaml.AliasEvent
            raise _Refusal(event.start_mark, f"{'alias *' if alias else 'anchor &'}{event.anchor}: a {self.what} may "
                                             "not use YAML anchors or aliases (&name, *name, <<: *name); write each "
                                             "value out in full")
        raise _Refusal(event.start_mark, f"tag {event.tag}: a {self.what} may not use YAML tags (!!str, !name); "
                                         "write the value without it")

    def add(self, value: Any, event, *, scalar: bool) -> None:
        """Puts a node in its place: the value, a list's item, a mapping's key or value."""
        top = self.stack[-1] if self.stack else None
        mark = event.start_mark
        if top is not None and top[1] is self._KEY:
            container = top[0]
            if not scalar:
                raise _Refusal(mark, "a mapping key that is not a scalar (? [...] or ? {...}): keys are strings "
                                     "or numbers")
            if value in container:
                raise _Refusal(mark, f"the key {bounded_json.short(value)} appears twice in one mapping (YAML "
                                     "readers disagree on which value counts); keep one")
            if len(container) >= self.max_keys:
                raise _Refusal(mark, f"a mapping of the {self.what} has more than {self.max_keys:,} keys")
            top[1] = value
            return
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise _Refusal(mark, f"the {self.what} holds more than {self.max_nodes:,} values")
        if top is None:
            self.root = value
        elif isinstance(top[0], list):
            top[0].append(value)
        else:
            top[0][top[1]] = value
            top[1] = self._KEY


def loads(data: str | bytes, *, path: str, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
          max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS,
          what: str = "YAML file") -> Any:
    """Parses YAML text (this module's subset) within bounds.

    Args:
      data: the text, or UTF-8 bytes.
      path: the file it came from, for messages.
      error: the exception class to raise.
      max_depth, max_bytes, max_nodes, max_keys: as ``seqcache.bounded_json.loads``.
      what: what the file is, for messages ("mixture schedule").

    Returns:
      The value (dicts, lists, str, int with |n| < 2^64, finite float, bool,
      None); an empty document is None.

    Raises:
      error: one line, ``{path}: line L, column C: ...`` where the place is
        known: not UTF-8, not YAML (``... the mixture schedule is not valid
        YAML: did not find expected ',' or ']'``), an anchor, alias, merge
        key, tag or second document, a key twice, a bound passed; PyYAML
        missing.
    """
    text = bounded_json.decode_text(data, path=path, error=error, what=what, max_bytes=max_bytes)
    try:
        import yaml  # optional: PyYAML (a JSON file needs none)
    except ImportError:
        raise error(f"{path}: reading a YAML {what} needs PyYAML (pip install pyyaml); or write it as JSON") \
            from None
    composer = _Composer(yaml, max_depth=max_depth, max_nodes=max_nodes, max_keys=max_keys, what=what)
    parser = getattr(getattr(yaml, "cyaml", None), "CParser", None) or yaml.SafeLoader  # libyaml, where PyYAML has it
    events = parser(text)
    try:
        while True:
            event = events.get_event()
            if isinstance(event, yaml.StreamEndEvent):
                break
            composer.feed(event)
    except _Refusal as e:
        raise error(f"{path}: {_at(e.mark)}: {e.text}" if e.mark is not None else f"{path}: {e.text}") from None
    except yaml.MarkedYAMLError as e:
        context = f" ({e.context} at {_at(e.context_mark)})" if e.context and e.context_mark else ""
        where = f"{_at(e.problem_mark)}: " if e.problem_mark is not None else ""
        raise error(f"{path}: {where}the {what} is not valid YAML: {e.problem}{context}") from None
    except yaml.reader.ReaderError as e:
        raise error(f"{path}: {bounded_json.place(text, e.position)}: the {what} is not valid YAML: "
                    f"character {e.character!r}: {e.reason}") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: the {what} is not valid YAML: {' '.join(str(e).split())}") from None
    finally:
        events.dispose()
    bounded_json.check_tree(composer.root, path=path, error=error, max_depth=max_depth, max_nodes=max_nodes,
                            max_keys=max_keys, what=what)
    return composer.root


def _at(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def read_file(path: str, *, error: type[Exception] = ValueError, max_depth: int = MAX_DEPTH,
              max_bytes: int = MAX_BYTES, max_nodes: int = MAX_NODES, max_keys: int = MAX_KEYS,
              what: str = "YAML file") -> Any:
    """``loads`` of the file at ``path`` (a local path or a URL); a local file
    is read no further than one byte past ``max_bytes``.

    Raises:
      error: as ``loads``; also a file that cannot be read.
      seqcache.fs.FileSystemError: (URLs) the object store cannot be reached.
    """
    data = bounded_json.read_bytes(path, error=error, max_bytes=max_bytes, what=what)
    return loads(data, path=path, error=error, max_depth=max_depth, max_bytes=max_bytes, max_nodes=max_nodes,
                 max_keys=max_keys, what=what)
