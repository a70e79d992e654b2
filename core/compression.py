"""Compressed files by suffix, as Apache Beam's ``CompressionTypes`` names
them (in any case): gzip ``.gz``, bzip2 ``.bz2``, xz and lzma ``.xz`` /
``.lzma``, zlib ``.deflate``, zstd ``.zst`` / ``.zstd``.

``decompressor(path)`` gives a streaming decompressor (zstandard's for zstd,
else the standard library's). ``Decompressed`` reads a binary stream through
one, for the files no standard-library file class opens (zlib and zstd, and
every compressed file at a URL). It follows concatenated members, and a file
that ends inside a member raises ``EOFError``, as the standard library's files
do (Beam's own decompressing file would lose a truncated file's end silently).
"""

from __future__ import annotations

import bisect
import bz2
import io
import itertools
import lzma
import re
import zlib
from typing import Callable, Sequence

# Every suffix a file is decompressed by, and its format's name.
_FORMAT_NAMES = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".lzma": "lzma", ".deflate": "zlib", ".zst": "zstd",
                 ".zstd": "zstd"}
COMPRESSED_SUFFIXES = tuple(_FORMAT_NAMES)

_CHUNK = 1 << 16  # compressed bytes per read


def is_compressed(path: str) -> bool:
    """True when ``path`` ends in one of ``COMPRESSED_SUFFIXES`` (any case)."""
    return path.lower().endswith(COMPRESSED_SUFFIXES)


def paths_ending_in(paths: Sequence[str], suffixes: Sequence[str]) -> list[int]:
    """The indices (sorted) of ``paths`` that may end in one of ``suffixes``
    (any case): every one that does, found with one scan of the paths joined
    (a path that holds a newline may add one that does not: test each), so
    that a list of a million paths is not tested path by path."""
    if not paths:
        return []
    joined = "\n".join(paths) + "\n"
    pattern = re.compile("(?:" + "|".join(map(re.escape, suffixes)) + ")\n", re.IGNORECASE)
    ends = [m.end() for m in pattern.finditer(joined)]
    if not ends:
        return []
    bounds = list(itertools.accumulate(len(p) + 1 for p in paths))  # where each path's line ends
    return sorted({bisect.bisect_left(bounds, end) for end in ends})


def format_name(path: str) -> str | None:
    """The compression format of ``path`` by its suffix ("gzip", "bzip2", "xz",
    "lzma", "zlib", "zstd"), or None when it is not compressed."""
    lower = path.lower()
    return next((name for suffix, name in _FORMAT_NAMES.items() if lower.endswith(suffix)), None)


def decompressor(path: str) -> Callable | None:
    """A factory of streaming decompressors for ``path``'s suffix: each object
    has ``decompress(data) -> bytes``, ``unused_data`` (the input after its
    member's end) and ``eof`` (the member's end was reached); None for an
    unknown suffix, or for zstd without the zstandard package."""
    name = format_name(path)
    if name == "zstd":
        try:
            import zstandard  # optional: zstandard
        except ImportError:
            return None
        return lambda: zstandard.ZstdDecompressor().decompressobj()
    return _STDLIB_DECOMPRESSORS.get(name)


_STDLIB_DECOMPRESSORS = {"gzip": lambda: zlib.decompressobj(wbits=31), "bzip2": bz2.BZ2Decompressor,
                         "xz": lzma.LZMADecompressor, "lzma": lzma.LZMADecompressor, "zlib": zlib.decompressobj}


def read_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged compressed file raises besides ``EOFError`` and
    ``OSError``: zlib's, lzma's and zstandard's errors."""
    try:
        import zstandard  # optional: zstandard
    except ImportError:
        return (zlib.error, lzma.LZMAError)
    return (zlib.error, lzma.LZMAError, zstandard.ZstdError)


class Decompressed(io.RawIOBase):
    """The decompressed bytes of the binary stream ``raw``, for a buffered
    reader (``io.BufferedReader(Decompressed(...))``); closing it closes
    ``raw``. ``make`` is a ``decompressor`` factory; gzip's null padding after
    a member is skipped, as ``gzip.GzipFile`` does.

    Raises (from ``read``):
      EOFError: the stream ends inside a member.
      zlib.error, lzma.LZMAError, OSError, zstandard.ZstdError: damaged data.
    """

    def __init__(self, raw, make: Callable, *, skip_nulls: bool = False):
        super().__init__()
        self._raw, self._make, self._skip_nulls = raw, make, skip_nulls
        self._d = None  # the current member's decompressor; None before the first one
        self._out = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._out:
            if not self._more():
                return 0
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _more(self) -> bool:
        """Decompresses more input into ``_out`` (possibly nothing yet); False
        at the end of the stream after a whole member (or of an empty one)."""
        if self._d is None or self._d.eof:
            rest = b"" if self._d is None else self._d.unused_data
            while True:  # the next member's first bytes
                if self._skip_nulls:
                    rest = rest.lstrip(b"\0")
                if rest:
                    break
                rest = self._raw.read(_CHUNK)
                if not rest:
                    return False
            self._d = self._make()
            self._out = self._d.decompress(rest)
            return True
        data = self._raw.read(_CHUNK)
        if not data:
            raise EOFError("Compressed file ended before the end-of-stream marker was reached")
        self._out = self._d.decompress(data)
        return True

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()
