"""``TextLineSource``: one record per line of text files, split by byte ranges;
and the helpers it shares with ``JsonLinesSource`` (splits, lines, messages)."""

from __future__ import annotations

import zlib
from typing import Iterator

from seqcache.tasks.sources.base import (
    _BOM,
    _READ_ERRORS,
    Split,
    SourceFile,
    SourceRecord,
    _check_target,
    _read_error,
    _TextSource,
)
from seqcache.tasks.sources.lines import byte_ranges, is_compressed, line_number_at, read_lines
from seqcache.tasks.sources.policy import Where, is_clean_text


def line_where(path: str, offset: int) -> Where:
    """The ``Where`` of the line at byte ``offset``: ``"{path}: line at byte
    {offset}"`` for skipped and repaired records, ``"{path}: line {n} (byte
    {offset})"`` for raised errors (the line number counted on that path only)."""

    def raised() -> str:
        try:
            return f"{path}: line {line_number_at(path, offset) + 1} (byte {offset})"
        except (OSError, EOFError, ValueError, zlib.error):
            return f"{path}: line at byte {offset}"

    return Where(f"{path}: line at byte {offset}", raised)


def line_splits(file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
    """Byte-range splits of a line-oriented file (see ``seqcache.tasks.sources.lines``):
    about ``target_bytes`` each; one whole-file split for a compressed file.

    Raises:
      ValueError: ``target_bytes < 1``.
    """
    _check_target(target_bytes)
    if is_compressed(file.path):
        return [Split(file_index, file.path, 0, None, file.num_bytes)]
    return [Split(file_index, file.path, a, b, (file.num_bytes if b is None else b) - a)
            for a, b in byte_ranges(file.num_bytes, target_bytes)]


def split_lines(split: Split) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line with its terminator)`` of the lines of ``split``,
    with read errors turned into a ``ValueError`` that names the file.

    Raises:
      ValueError: the file cannot be read (a truncated ``.gz``, an I/O error), or
        a split that starts inside a compressed file.
    """
    count, offset = 0, split.start
    try:
        for offset, line in read_lines(split.path, split.start, split.stop):
            yield offset, line
            count += 1
    except _READ_ERRORS as e:
        after = None if not count else (f"line {count}" if split.start == 0 else f"the line at byte {offset}")
        raise _read_error(split.path, e, after) from None


class LineSplits:
    """The splits of every line-oriented source (text lines, JSON lines, TSV)."""

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """Byte ranges of about ``target_bytes`` bytes (one split for a compressed
        file); a line belongs to the range where its first byte lies."""
        return line_splits(file_index, file, target_bytes)


class TextLineSource(LineSplits, _TextSource):
    """One record per line of text files (plain or compressed, e.g. ``.gz``).

    ``record_number`` is the **byte offset** of the line's first byte in the file
    (in the decompressed stream for a compressed file), so it does not depend on
    how the file is split; ``locator`` is ``"byte_offset"`` and
    ``describe_record`` turns it into a line number. The line terminator
    (``"\\n"`` or ``"\\r\\n"``) is removed; a last line without a newline is a
    record. Every line is a record: empty and whitespace-only lines are bad input
    of the kinds ``empty`` and ``whitespace`` (skipped and counted by default;
    ``on_error={"empty": "keep"}`` keeps them as empty examples). A UTF-8 byte
    order mark at byte 0 is removed from the first record (from both ``data`` and
    ``raw``); elsewhere it is text.

    Uncompressed files are split into byte ranges (``splits``); a compressed file
    is one split.

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      field: key of the line's text in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec: None (every kind's default),
        ``"raise"``, ``"skip"``, ``"replace"`` or a mapping kind -> action.
        Kinds met here: ``invalid_utf8``,
        ``carriage_return`` (a CR that does not end the line) and the content
        kinds.

    Raises (from ``read_split`` / ``read_file``):
      ValueError: bad input whose action is ``"raise"``; names the file, the
        line (number and byte offset) and the option that accepts, repairs or
        skips it. A file that cannot be read.
    """

    kind = "text"
    locator = "byte_offset"

    def describe(self) -> str:
        return f"text lines of {self._pattern_text()}"


    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        field, file_index, path = self.field, split.file_index, split.path
        for offset, line in split_lines(split):
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            elif line.endswith(b"\r"):
                line = line[:-1]  # a last line ended by a lone CR
            if offset == 0 and line.startswith(_BOM):
                line = line[len(_BOM):]
            try:  # the common case first: clean text needs no message
                text = line.decode("utf-8")
                if is_clean_text(text):
                    yield SourceRecord(file_index, offset, {field: text}, line)
                    continue
            except UnicodeDecodeError:
                pass
            where = line_where(path, offset)
            repairs = []
            text, bad = self._decode(file_index, offset, line, where, repairs)
            if bad is not None:
                yield bad
                continue
            if "\r" in text:
                problem = " contains a carriage return that does not end the line (old Mac line endings?)"
                if self.on_error.actions["carriage_return"] != "replace":
                    yield self._bad("carriage_return", file_index, offset, line, where, problem)
                    continue
                text = text.replace("\r", "\n")
                repairs.append(("carriage_return", f"{where.text}{problem}"))
            yield self._record(file_index, offset, line, where, {field: text}, repairs)
