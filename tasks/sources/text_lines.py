"""``TextLineSource``: one record per line of text files, split by byte ranges;
and the helpers it shares with ``JsonLinesSource`` (splits, lines, messages)."""

from __future__ import annotations

import itertools
import re
from typing import Iterator, Sequence

import numpy as np

from seqcache.tasks.sources.base import (
    BOM,
    READ_ERRORS,
    RecordBatch,
    Source,
    Split,
    SourceFile,
    SourceRecord,
    check_target,
    read_error,
    TextSource,
)
from seqcache.tasks.sources.lines import byte_ranges, is_compressed, read_line_blocks, read_lines, small_whole_files
from seqcache.tasks.sources.policy import SUSPECT_CHARACTERS, is_clean_text

# A line fails ``is_clean_text`` or holds a CR: whitespace only, these characters, no text.
_WHITESPACE_LINE_RE = re.compile(r"\n[^\S\n]+(?=\n|\Z)")
_LINE_SUSPECT_RE = re.compile(f"[\r{SUSPECT_CHARACTERS}]+")
# The ASCII bytes that are none of those characters.
_CLEAN_ASCII = bytes(b for b in range(128) if not _LINE_SUSPECT_RE.match(chr(b)))


def split_lines(split: Split) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, line with its terminator)`` of the lines of ``split``.

    Raises:
      ValueError: the file cannot be read (names it and the last line read),
        or a split that starts inside a compressed file.
    """
    count, offset = 0, split.start
    try:
        for offset, line in read_lines(split.path, split.start, split.stop):
            yield offset, line
            count += 1
    except READ_ERRORS as e:
        raise _read_error(split, e, count, offset) from None


def _read_error(split: Split, error: BaseException, count: int, offset: int) -> ValueError:
    """``read_error`` after ``count`` lines of ``split``, the last at byte ``offset``."""
    after = None if not count else (f"line {count}" if split.start == 0 else f"the line at byte {offset}")
    return read_error(split.path, error, after)


class LineSplits:
    """The splits of every line-oriented source (text lines, JSON lines, TSV)."""

    splits_read_files = False  # byte ranges from the file size alone
    small_files_whole = True  # a file of at most the target size is one whole split (plan.plan_units)

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """Byte ranges of about ``target_bytes`` (``lines.byte_ranges``); one split
        for a compressed file. Raises ``ValueError`` for ``target_bytes < 1``."""
        check_target(target_bytes)
        if file.num_bytes <= target_bytes or is_compressed(file.path):  # one split (small files: no more checks)
            return [Split(file_index, file.path, 0, None, file.num_bytes)]
        return [Split(file_index, file.path, a, b, (file.num_bytes if b is None else b) - a)
                for a, b in byte_ranges(file.num_bytes, target_bytes)]


class TextLineSource(LineSplits, TextSource):
    """One record per line of text files (plain or compressed, e.g. ``.gz``).

    ``record_number`` is the **byte offset** of the line's first byte (in the
    decompressed stream for a compressed file; ``locator`` ``"byte_offset"``).
    The terminator (``"\\n"`` or ``"\\r\\n"``) is removed; a last line without a
    newline is a record. Empty and whitespace-only lines are bad input of the
    kinds ``empty`` and ``whitespace`` (skipped by default). A UTF-8 byte order
    mark at byte 0 is removed (from ``data`` and ``raw``). Uncompressed files
    are split into byte ranges; a compressed file is one split.

    Args:
      field: key of the line's text in ``SourceRecord.data``.
      on_error: kinds met here: ``invalid_utf8``, ``carriage_return`` (a CR
        that does not end the line) and the content kinds.

    Raises (from ``read_split`` / ``read_file``):
      ValueError: bad input whose action is ``"raise"``; names the file, the
        line (number and byte offset) and the option that accepts, repairs or
        skips it. A file that cannot be read.
    """

    kind = "text"
    locator = "byte_offset"
    spec_forms = "'text:PATTERN' (one record per line)"
    block_bytes = 1 << 20

    def describe(self) -> str:
        return f"text lines of {self._pattern_text()}"

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        file_index, path = split.file_index, split.path
        for offset, line in split_lines(split):
            yield self._line_record(file_index, path, offset, line)

    def read_batches(self, split: Split, batch_records: int) -> Iterator[RecordBatch]:
        """``read_split`` in batches, without a Python object per clean line: the
        file is read in blocks of whole lines (``block_bytes``), each decoded
        and split at once, and one scan per block finds the lines that need a
        look of their own, read as ``read_split`` reads them.

        Raises:
          ValueError: as ``read_split`` (naming the last line read)."""
        if self.overrides_read_split(TextLineSource):  # a subclass's read_split: the plain path
            return Source.read_batches(self, split, batch_records)
        return self.read_batches_of([split], batch_records)

    def read_batches_of(self, splits: Sequence[Split], batch_records: int) -> Iterator[RecordBatch]:
        """``read_batches`` of consecutive splits, the blocks of small files
        gathered up to ``block_bytes`` and read together (a batch may hold the
        lines of several files). Raises ``ValueError`` as ``read_batches``."""
        if self.overrides_read_split(TextLineSource):
            yield from Source.read_batches_of(self, splits, batch_records)
            return
        pending: list[tuple[int, str, int, bytes]] = []
        size, block_bytes = 0, self.block_bytes
        # Small whole files are read in one loop (no generators per file); anything else, or a
        # file that cannot be read that way, as a range (which names the file in its errors).
        # A whole file's data is one segment, its last line maybe without a newline.
        for split, data in small_whole_files(splits, block_bytes):
            if data is not None:  # a whole file (no loop of its blocks)
                if data:
                    pending.append((split[0], split[1], 0, data))
                    size += len(data)
                    if size >= block_bytes:
                        yield from self._segment_batches(pending, batch_records)
                        pending, size = [], 0
                continue
            for offset, block in self._split_blocks(split):
                pending.append((split.file_index, split.path, offset, block))
                size += len(block)
                if size >= block_bytes:
                    yield from self._segment_batches(pending, batch_records)
                    pending, size = [], 0
        if pending:
            yield from self._segment_batches(pending, batch_records)

    def _split_blocks(self, split: Split) -> Iterator[tuple[int, bytes]]:
        """``read_line_blocks`` of ``split``; read errors as ``split_lines``'s."""
        path = split.path
        count, offset = 0, split.start
        try:
            for offset, block in read_line_blocks(path, split.start, split.stop, self.block_bytes):
                yield offset, block
                count += block.count(b"\n") + (not block.endswith(b"\n"))
        except READ_ERRORS as e:
            if is_compressed(path):
                for _ in split_lines(split):  # raises the error after the exact line
                    pass
            raise _read_error(split, e, count, offset) from None

    def _segment_batches(self, segments: list[tuple[int, str, int, bytes]],
                         batch_records: int) -> Iterator[RecordBatch]:
        """The lines of ``segments`` (``(file_index, path, offset, block)``: whole
        lines from byte ``offset``) in batches, the blocks joined and read as one."""
        if len(segments) == 1:
            yield from self._block_batches(*segments[0], batch_records)
            return
        file_ids, _, offsets, blocks = zip(*segments)  # columns, without a loop per segment
        unended = [not block.endswith(b"\n") for block in blocks]
        joined = b"".join(block + b"\n" if u else block for block, u in zip(blocks, unended))
        try:
            texts = joined.decode("utf-8").split("\n")
        except UnicodeDecodeError:
            # A block that is not UTF-8 is read on its own, the runs between together.
            run: list = []
            for segment in segments:
                try:
                    segment[3].decode("utf-8")
                except UnicodeDecodeError:
                    yield from self._segment_batches(run, batch_records) if run else ()
                    yield from self._block_batches(*segment, batch_records)
                    run = []
                else:
                    run.append(segment)
            yield from self._segment_batches(run, batch_records) if run else ()
            return
        texts.pop()
        lines = joined.split(b"\n")
        lines.pop()
        n = len(lines)
        counts = np.fromiter(map(bytes.count, blocks, itertools.repeat(b"\n")), dtype=np.int64, count=len(blocks))
        counts += np.fromiter(unended, dtype=bool, count=len(blocks))
        sizes = np.fromiter(map(len, lines), dtype=np.int64, count=n)
        at = np.zeros(n, dtype=np.int64)  # each line's first byte in ``joined``
        np.cumsum(sizes[:-1] + 1, out=at[1:])
        first = np.zeros(len(blocks), dtype=np.int64)  # each block's first line
        np.cumsum(counts[:-1], out=first[1:])
        segment_of = np.repeat(np.arange(len(blocks)), counts)
        base = np.array(offsets, dtype=np.int64) - at[first]
        numbers = (at + base[segment_of]).tolist()
        file_of = np.array(file_ids, dtype=np.int64)[segment_of].tolist()
        odd_lines = set(self._suspect_lines(texts, sizes))
        last = (first + counts - 1).tolist()
        if BOM in joined:  # rare: look for it at each file's start
            odd_lines.update(int(first[k]) for k, (offset, block) in enumerate(zip(offsets, blocks))
                             if offset == 0 and block.startswith(BOM))
        odd = {}
        segment_of = segment_of.tolist()
        for i in sorted(odd_lines):
            k = segment_of[i]
            line = lines[i] if unended[k] and i == last[k] else lines[i] + b"\n"
            odd[i] = self._line_record(file_of[i], segments[k][1], numbers[i], line)
            lines[i] = odd[i].raw  # the raw column is the records' raw (no CR, no byte order mark)
        yield from RecordBatch(file_of[0], numbers, lines, field=self.field, texts=texts, odd=odd,
                               file_indices=file_of).pieces(batch_records)

    def _block_batches(self, file_index: int, path: str, offset: int, block: bytes,
                       batch_records: int) -> Iterator[RecordBatch]:
        """The lines of ``block`` (whole lines from byte ``offset``), in batches."""
        ended = block.endswith(b"\n")
        lines = block.split(b"\n")
        if ended:
            lines.pop()
        n = len(lines)
        if not n:
            return
        sizes = np.fromiter(map(len, lines), dtype=np.int64, count=n)
        starts = np.empty(n, dtype=np.int64)
        starts[0] = offset
        np.cumsum(sizes[:-1] + 1, out=starts[1:])
        starts[1:] += offset
        try:
            texts = block.decode("utf-8").split("\n")
            if ended:
                texts.pop()
            odd_lines = self._suspect_lines(texts, sizes)
        except UnicodeDecodeError:
            texts, odd_lines = [None] * n, range(n)
        numbers = starts.tolist()
        if offset == 0 and lines and lines[0].startswith(BOM):
            odd_lines = sorted({0, *odd_lines})
        odd = {}
        for i in odd_lines:
            line = lines[i] + b"\n" if ended or i + 1 < n else lines[i]
            odd[i] = self._line_record(file_index, path, numbers[i], line)
            lines[i] = odd[i].raw  # the raw column is the records' raw (no CR, no byte order mark)
        yield from RecordBatch(file_index, numbers, lines, field=self.field, texts=texts,
                               odd=odd).pieces(batch_records)

    @staticmethod
    def _suspect_lines(texts: list[str], sizes: np.ndarray) -> Sequence[int]:
        """Indices of the lines ``is_clean_text`` would not pass, or with a CR:
        empty ones by size, then one scan each for whitespace-only lines and
        for the characters."""
        joined = "\n" + "\n".join(texts)
        positions = [m.start() for m in _WHITESPACE_LINE_RE.finditer(joined)]
        if not (joined.isascii() and not joined.encode("ascii").translate(None, _CLEAN_ASCII)):
            positions += [m.start() - 1 for m in _LINE_SUSPECT_RE.finditer(joined)]
        odd = np.flatnonzero(sizes == 0).tolist()
        if positions:
            # joined[p] is the newline before line k for p in [ends[k-1], ends[k]).
            ends = np.cumsum(np.fromiter(map(len, texts), dtype=np.int64, count=len(texts)) + 1)
            odd = sorted({*odd, *np.searchsorted(ends, positions, side="right").tolist()})
        return odd

    def _line_record(self, file_index: int, path: str, offset: int, line: bytes) -> SourceRecord:
        """The record of one line (``line`` with its terminator, if it has one)."""
        if line.endswith(b"\n"):
            line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
        elif line.endswith(b"\r"):
            line = line[:-1]  # a last line ended by a lone CR
        line = line.removeprefix(BOM) if offset == 0 else line
        try:  # the common case first: clean text needs no message
            text = line.decode("utf-8")
            if is_clean_text(text):
                return SourceRecord(file_index, offset, {self.field: text}, line)
        except UnicodeDecodeError:
            pass
        where = self.where(path, offset)
        repairs = []
        text, bad = self._decode(file_index, offset, line, where, repairs)
        if bad is not None:
            return bad
        if "\r" in text:
            problem = " contains a carriage return that does not end the line (old Mac line endings?)"
            if self.on_error.actions["carriage_return"] != "replace":
                return self._bad("carriage_return", file_index, offset, line, where, problem)
            text = text.replace("\r", "\n")
            repairs.append(("carriage_return", f"{where.text}{problem}"))
        return self._record(file_index, offset, line, where, {self.field: text}, repairs)
