"""``JsonLinesSource``: one record per JSON line, split by byte ranges."""

from __future__ import annotations

import json
from typing import Any, Iterator, Mapping, Sequence

from seqcache.tasks.sources.base import BOM, Split, SourceRecord, FileSource, canonical_json_bytes
from seqcache.tasks.sources.text_lines import LineSplits, split_lines


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


class JsonLinesSource(LineSplits, FileSource):
    """One record per JSON line of ``.jsonl`` / ``.jsonl.gz`` files.

    Each line holds a JSON object; ``field`` is a key or a dotted path
    (``"metadata.title"``), its value stored under ``output_key``;
    ``fields={output_key: dotted_path, ...}`` selects several. Blank lines are
    layout. ``record_number``, the byte order mark and the splits are as for
    ``TextLineSource``.

    ``raw`` (the shuffle key's input, and what ``duplicate=skip`` compares) is
    the canonical JSON of the values read, keyed by their dotted paths
    (``{"text": "..."}``; ``canonical_json_bytes``), not the line: the same
    text under another ``url``, or with other spacing or key order, is the
    same record, and a JSON line and a Parquet row holding the same selected
    values get the same key (``ParquetSource``'s ``raw``). A line that is
    skipped (malformed, a missing field) keeps the line as its ``raw``.

    Args:
      field: dotted path of the value to read.
      output_key: key of that value in ``SourceRecord.data``.
      fields: optional mapping output key -> dotted path (several values).
      on_error: the ``ErrorPolicy`` spec. Kinds met here: ``invalid_utf8``,
        ``malformed``, ``missing_field`` and the content kinds (for string
        values).

    Raises (from ``read_split`` / ``read_file``):
      ValueError: a line that is not a JSON object or lacks a field (action
        ``"raise"``), naming the file, the line and the field; an unreadable file.
    """

    kind = "jsonl"
    locator = "byte_offset"
    spec_forms = "'jsonl:PATTERN#FIELD' (FIELD may be dotted, default 'text'), 'jsonl:PATTERN#inputs=FIELD,targets=FIELD'"

    @classmethod
    def from_spec(cls, spec) -> "JsonLinesSource":
        """``jsonl:PATTERN[#FIELD]`` or ``jsonl:PATTERN#KEY=FIELD,...``."""
        pattern, names = spec.one_or_named("field", "fields")
        return cls(pattern, **names, exclude=spec.exclude, on_error=spec.on_error)

    def __init__(self, pattern: str | Sequence[str], *, field: str = "text", output_key: str = "text",
                 fields: dict[str, str] | None = None, on_error: "str | Mapping[str, str] | None" = None,
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        if fields is None:
            fields = {output_key: field}
        if not fields:
            raise ValueError("JsonLinesSource: fields must name at least one field")
        self.fields = dict(sorted(fields.items()))
        self._parts = {k: _split_path(v) for k, v in self.fields.items()}

    def _params(self) -> dict:
        # "record": what ``raw`` holds (the selected values), so that a cache keyed by whole lines
        # (before this choice) has another fingerprint and is never taken for this one.
        return {"fields": self.fields, "record": "selected"}

    def describe(self) -> str:
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.fields.items())
        return f"JSON lines of {self._pattern_text()} (field {sel})"

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        file_index, path = split.file_index, split.path
        for offset, line in split_lines(split):
            raw = line.strip().removeprefix(BOM).strip() if offset == 0 else line.strip()
            if not raw:
                continue  # a blank line between objects is layout, not a record
            where = self.where(path, offset)
            repairs = []
            line_text, bad = self._decode(file_index, offset, raw, where, repairs)
            if bad is not None:
                yield bad
                continue
            try:
                obj = json.loads(line_text)
            except ValueError as e:
                yield self._bad("malformed", file_index, offset, raw, where, f" is not valid JSON: {e}")
                continue
            except RecursionError:  # Python's parser recurses: a line nested thousands deep
                yield self._bad("malformed", file_index, offset, raw, where, " is not valid JSON: nested deeper "
                                "than Python's JSON parser reads")
                continue
            if not isinstance(obj, dict):
                yield self._bad("malformed", file_index, offset, raw, where,
                                f" is a JSON {type(obj).__name__}, expected an object")
                continue
            data = {}
            try:
                for key, parts in self._parts.items():
                    data[key] = _lookup(obj, parts)
            except KeyError:
                yield self._bad("missing_field", file_index, offset, raw, where,
                                f" has no field {self.fields[key]!r} (top-level keys: {sorted(obj)[:20]})")
                continue
            selected = canonical_json_bytes({self.fields[k]: v for k, v in data.items()}, surrogates=True)
            yield self._record(file_index, offset, selected, where, data, repairs)
