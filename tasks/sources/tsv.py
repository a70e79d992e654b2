"""``TsvSource``: one record per line of tab-separated files, values by column."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from seqcache.tasks.sources.base import BOM, Split, SourceRecord, FileSource, canonical_json_bytes
from seqcache.tasks.sources.text_lines import LineSplits, split_lines

DEFAULT_COLUMNS = {"inputs": 0, "targets": 1}


class TsvSource(LineSplits, FileSource):
    """One record per line of tab-separated files (``.tsv``, ``.tsv.gz``, or any
    name), such as the source/reference pairs of translation corpora.

    ``columns`` maps an output key to a 0-based column index (default
    ``{"inputs": 0, "targets": 1}``). No quoting or escaping: a field is the
    bytes between two tabs, as ``cut -f`` reads them. A line with too few
    columns is ``malformed``; an empty field is ``empty`` / ``whitespace``; a
    blank line is layout, not a record. With ``header=True`` each file's first
    line is not a record. ``record_number`` is the line's byte offset, as for
    ``TextLineSource``. ``raw`` (the shuffle key's input, and what
    ``duplicate=skip`` compares) is the canonical JSON of the columns read,
    keyed by their indices (``{"0": "...", "1": "..."}``): lines that differ
    only in columns the task does not read are the same record. A skipped
    line keeps the line without its terminator as its ``raw``.

    Args:
      columns: output key -> 0-based column index.
      header: whether each file's first line is a header to skip.
      on_error: the ``ErrorPolicy`` spec. Kinds met here: ``invalid_utf8``,
        ``malformed`` and the content kinds.

    Raises:
      ValueError: no columns, a bad index; bad input whose action is
        ``"raise"``, naming the file, the line and the column count.
    """

    kind = "tsv"
    locator = "byte_offset"
    spec_forms = "'tsv:PATTERN[#inputs=0,targets=1]' (tab-separated columns by 0-based index)"

    @classmethod
    def from_spec(cls, spec) -> "TsvSource":
        """``tsv:PATTERN[#KEY=INDEX,...]``: 0-based column indices."""
        pattern, _, named = spec.rest.partition("#")
        if not pattern:
            raise spec.error()
        columns = spec.named(named) if named else None
        example = "e.g. 'tsv:pairs.tsv#inputs=0,targets=1'"
        if named and columns is None:
            raise ValueError(f"bad source spec {spec.text!r}: a tsv source names its columns as KEY=INDEX, {example}")
        try:
            indices = {k: int(v) for k, v in columns.items()} if columns else None
        except ValueError:
            raise ValueError(f"bad source spec {spec.text!r}: tsv columns are 0-based indices, {example}") from None
        return cls(pattern, columns=indices, exclude=spec.exclude, on_error=spec.on_error)

    def __init__(self, pattern: str | Sequence[str], *, columns: Mapping[str, int] | None = None,
                 header: bool = False, on_error: "str | Mapping[str, str] | None" = None,
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        columns = dict(DEFAULT_COLUMNS if columns is None else columns)
        if not columns:
            raise ValueError("TsvSource: columns must name at least one column")
        for key, index in columns.items():
            if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                raise ValueError(f"TsvSource: column of {key!r} is {index!r}, expected a 0-based index >= 0")
        self.columns = dict(sorted(columns.items()))
        self.header = bool(header)
        self._needed = max(self.columns.values()) + 1

    def _params(self) -> dict:
        # "record": what ``raw`` holds (the columns read; see the class docstring).
        return {"columns": self.columns, "header": self.header, "record": "selected"}

    def describe(self) -> str:
        sel = ", ".join(f"column {i} as {k}" for k, i in self.columns.items())
        return f"tab-separated lines of {self._pattern_text()} ({sel})"

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        file_index, path = split.file_index, split.path
        for offset, line in split_lines(split):
            line = line.rstrip(b"\r\n")
            if offset == 0:
                line = line.removeprefix(BOM)
                if self.header:
                    continue
            if not line.strip():
                continue  # a blank line is layout, not a record
            where = self.where(path, offset)
            repairs = []
            text, bad = self._decode(file_index, offset, line, where, repairs)
            if bad is not None:
                yield bad
                continue
            fields = text.split("\t")
            if len(fields) < self._needed:
                yield self._bad("malformed", file_index, offset, line, where,
                                f" has {len(fields)} tab-separated column(s), column {self._needed - 1} was asked for")
                continue
            data = {key: fields[index] for key, index in self.columns.items()}
            selected = canonical_json_bytes({str(index): fields[index] for index in self.columns.values()},
                                            surrogates=True)
            yield self._record(file_index, offset, selected, where, data, repairs)
