"""Line-oriented files read in byte ranges: the splitting shared by text lines
and JSON lines.

A line is the bytes from just after a ``b"\\n"`` (or the start of the file) up to
and including the next ``b"\\n"`` (or the end of the file); ``b"\\r\\n"`` ends a
line because it ends with ``b"\\n"``. A line is named by its **byte offset**: the
offset of its first byte in the file (in the decompressed stream for a
compressed file). The offset does not depend on how the file is split, unlike
a line number counted from the start of a split.

Splitting: a range ``[start, stop)`` holds the lines whose first byte lies in it.
Reading it seeks to ``start - 1`` and passes over everything through the first
``b"\\n"`` (so a line that begins exactly at ``start`` is kept, and an edge
between ``\\r`` and ``\\n`` falls inside the line before), then reads lines while
a line's first byte is below ``stop``; the last line may run past ``stop``.
``b"\\n"`` never occurs inside a multi-byte UTF-8 character, so an edge inside
one needs no care. The ranges of a file therefore hold every line exactly once.

Compressed files (``seqcache.compression``) are one range, read whole.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Sequence

from seqcache import compression, fs

is_compressed = compression.is_compressed

_CHUNK = 1 << 20  # bytes per read when counting lines


def check_target(target_bytes: int) -> None:
    """Raises ``ValueError`` unless ``target_bytes`` (a split's wanted size) is an int >= 1."""
    if not isinstance(target_bytes, int) or target_bytes < 1:
        raise ValueError(f"target_bytes must be an int >= 1 (got {target_bytes=})")


def byte_ranges(num_bytes: int, target_bytes: int) -> list[tuple[int, int | None]]:
    """``[start, stop)`` byte ranges of at most ``target_bytes``, sizes within one
    byte of each other, covering a file of ``num_bytes`` bytes in order; the
    last has ``stop=None`` (to the end of the file).

    Raises:
      ValueError: ``target_bytes < 1``.
    """
    check_target(target_bytes)
    if num_bytes <= target_bytes:
        return [(0, None)]
    n = -(-num_bytes // target_bytes)
    bounds = [num_bytes * i // n for i in range(n)]
    return [(a, bounds[i + 1] if i + 1 < n else None) for i, a in enumerate(bounds)]


@contextlib.contextmanager
def _open_at_line(path: str, start: int, stop: int | None):
    """``(file, offset)``: ``path`` opened (decompressed) at the first line that
    starts at or after ``start``. ``ValueError`` for a bad range, or
    ``start > 0`` in a compressed file."""
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"{path}: bad byte range [{start}, {stop})")
    if start > 0 and is_compressed(path):
        raise ValueError(f"{path}: a compressed file is read whole (got a range from byte {start})")
    with fs.open_binary(path) as f:
        offset = 0
        if start > 0:
            f.seek(start - 1)
            offset = start - 1 + len(f.readline())  # through the first b"\n" at or after start - 1
        yield f, offset


def read_lines(path: str, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, bytes]]:
    """``(offset, line)`` for each line whose first byte lies in ``[start, stop)``
    (``stop=None``: to the end), ``line`` with its terminator, one at a time.

    Raises:
      ValueError: ``start > 0`` for a compressed file.
      OSError, EOFError, zlib.error: the file cannot be read (the caller names it).
    """
    with _open_at_line(path, start, stop) as (f, offset):
        for line in iter(f.readline, b""):  # Beam's decompressing files have readline, not iteration
            if stop is not None and offset >= stop:
                break
            yield offset, line
            offset += len(line)


def read_line_blocks(path: str, start: int = 0, stop: int | None = None,
                     block_bytes: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """``(offset, block)``: the lines of ``read_lines(path, start, stop)`` in
    blocks of whole lines of about ``block_bytes`` (more for a longer line),
    starting at byte ``offset``. Memory: one block.

    Raises:
      ValueError: as ``read_lines``.
      OSError, EOFError, zlib.error: the file cannot be read (the caller names it).
    """
    data = _small_whole_file(path, block_bytes) if start == 0 and stop is None else None
    if data is not None:
        yield from whole_blocks(data)
        return
    with _open_at_line(path, start, stop) as (f, offset):
        size = _plain_size(path, f)
        pending = b""
        while stop is None or offset < stop:
            # No more than the file holds: a read allocates its size first.
            data = f.read(block_bytes if size is None else max(1, min(block_bytes, size - f.tell())))
            if not data:
                if pending:
                    yield offset, pending  # the last line, without its newline
                return
            pending += data
            end = pending.rfind(b"\n") + 1
            if not end:
                continue  # a line longer than the block: read on
            block, pending = pending[:end], pending[end:]
            if stop is not None and offset + len(block) > stop:
                # The lines that start before ``stop``.
                block = block[:block.find(b"\n", stop - 1 - offset) + 1]
                yield offset, block
                return
            yield offset, block
            offset += len(block)


def whole_blocks(data: bytes) -> tuple[tuple[int, bytes], ...]:
    """``read_line_blocks`` of a whole file's ``data`` (of at most one block):
    ``(0, its whole lines)`` and ``(offset, the last line)`` when that has no
    newline; each only when not empty."""
    end = data.rfind(b"\n") + 1
    if end == len(data):
        return ((0, data),) if end else ()
    return ((0, data[:end]), (end, data[end:])) if end else ((0, data),)


def small_whole_files(splits: Sequence[Any], block_bytes: int) -> Iterator[tuple[Any, bytes | None]]:
    """``(split, data)`` for each of ``splits`` (``Split``s, in order):
    ``data`` is the file's bytes (maybe empty) for a whole split of an
    uncompressed local file of at most ``block_bytes``, read in one call
    (open, read, close; ``fstat`` too when the split's ``num_bytes`` is 0,
    unknown); None for any other split, and for a file that cannot be read
    so (or whose size is unknown, 0, and not what ``fstat`` said): read it
    with ``read_line_blocks``, whose errors name the file. The data's lines are ``whole_blocks(data)``.
    Raises ``ValueError`` (``file_changed``) for a file whose size is not
    the split's ``num_bytes``, its size as listed. Compressed files are found with one scan of the paths
    (``compression.paths_ending_in``), not one test each: a work unit of many
    small files reads them in one loop."""
    compressed = set(compression.paths_ending_in([s.path for s in splits], compression.COMPRESSED_SUFFIXES))
    open_file, stat_of, read, close, flags = os.open, os.fstat, os.read, os.close, os.O_RDONLY
    for k, split in enumerate(splits):
        _, path, start, stop, listed = split  # one unpacking: no attribute look-ups per file
        data = size = None
        if not start and stop is None and listed <= block_bytes and k not in compressed and "://" not in path:
            try:
                fd = open_file(path, flags)
                try:
                    size = listed or stat_of(fd).st_size
                    data = read(fd, size + 1) if size <= block_bytes else None
                finally:
                    close(fd)
            except OSError:
                data = None
            if data is not None and len(data) != size:
                if listed:  # its size as listed: it changed since, and the fingerprint says otherwise
                    raise file_changed(path, size, len(data))
                data = None
        yield split, data


def file_changed(path: str, listed: int, read: int) -> ValueError:
    """The error of a file whose size is not the one listed when the build
    planned (``listed`` bytes; ``read``: the bytes a read of ``listed + 1``
    gave)."""
    now = f"{read:,} bytes" if read <= listed else f"more than {listed:,} bytes"
    return ValueError(f"{path}: changed since it was listed ({listed:,} bytes then, {now} now); a source file "
                      "must not change while a build reads it: run the build again once it is complete")


def _small_whole_file(path: str, block_bytes: int) -> bytes | None:
    """The bytes of an uncompressed local file of at most ``block_bytes``,
    read in one call (a many-small-files corpus opens each file once, without
    the seek and size logic of a range); None for any other file, or one whose
    read did not give exactly its size (it changed, or the read came back
    short: read as a range then).

    Raises:
      OSError: the file cannot be read.
    """
    if is_compressed(path) or not fs.is_local(path):
        return None
    fd = os.open(fs.local_path(path), os.O_RDONLY)  # no file object: four system calls and nothing else
    try:
        size = os.fstat(fd).st_size
        if size > block_bytes:
            return None
        data = os.read(fd, size + 1)
    finally:
        os.close(fd)
    return data if len(data) == size else None  # a short read, or a file that changed: read as a range


def _plain_size(path: str, f) -> int | None:
    """The size of an uncompressed local file open as ``f``, else None."""
    if is_compressed(path) or not fs.is_local(path):
        return None
    try:
        return os.fstat(f.fileno()).st_size
    except (OSError, AttributeError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None


def line_number_at(path: str, offset: int) -> int:
    """The 0-based number of the line that begins at byte ``offset`` of ``path``
    (decompressed), read up to there in chunks of 1 MiB: for messages.

    Raises:
      ValueError: no line begins at ``offset`` (the file ends before it, or the
        byte before it is not ``b"\\n"``: the file changed).
      OSError, EOFError, zlib.error: the file cannot be read.
    """
    if offset < 0:
        raise ValueError(f"{path}: byte offset {offset} is negative")
    count, left, last = 0, offset, b"\n"
    with fs.open_binary(path) as f:
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ValueError(f"{path}: the file ends before byte {offset}")
            count += chunk.count(b"\n")
            left -= len(chunk)
            last = chunk[-1:]
        if not f.read(1) and offset > 0:
            raise ValueError(f"{path}: the file ends at byte {offset}; no line begins there")
    if last != b"\n":
        raise ValueError(f"{path}: no line begins at byte {offset} (the byte before it is not a newline)")
    return count
