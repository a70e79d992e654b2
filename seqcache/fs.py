"""One module for every file-system access: local paths, and URLs (``gs://``,
``s3://``, ``hdfs://``, any scheme Beam knows) through Apache Beam's
``FileSystems``, imported only when a URL is met.

Everything in seqcache that lists, opens, reads, writes, renames or deletes a
file goes through here (the build, its workers, the sources, ``info``,
``verify`` and ``show``), so local paths and object stores behave the same way
everywhere. The feeder reads ArrayRecord files with their C++ reader, which
opens local paths only: ``require_local`` gives it a clear error for a URL.

Object-store options (endpoint, credentials) are Beam pipeline options, for
example ``--s3_endpoint_url=...``; ``set_options`` hands them to
``FileSystems`` (the build does it with its pipeline options, the CLI with the
Beam-style options it is given, workers in their ``setup``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any, BinaryIO, Iterator, NamedTuple, Sequence

def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    """The local file system path of a local path or file:// URL."""
    return path[len("file://"):] if path.startswith("file://") else path


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.join(base, *parts)


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.exists(path)


def makedirs(path: str) -> None:
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
    # Object stores have no folders: nothing to create.


def read_text(path: str) -> str:
    if is_local(path):
        with open(local_path(path), encoding="utf-8") as f:
            return f.read()
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as f:
        return f.read().decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Writes a new file (not atomically: for build-internal files that are named
    to a reader only after they are complete)."""
    if is_local(path):
        with open(local_path(path), "wb") as f:
            f.write(data)
        return
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path) as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    if is_local(path):
        with open(local_path(path), "rb") as f:
            return f.read()
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path) as f:
        return f.read()


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that readers see either nothing or all of it."""
    if is_local(path):
        path = local_path(path)
        d = os.path.dirname(path) or "."
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    from apache_beam.io.filesystems import FileSystems

    # Object stores make a finished upload visible at once: create() then close()
    # publishes the whole object or nothing.
    with FileSystems.create(path) as f:
        f.write(data)


def move_into_place(local_tmp: str, dest: str) -> None:
    """Moves a finished local file to ``dest`` (local rename, or upload then delete)."""
    if is_local(dest):
        os.replace(local_tmp, local_path(dest))
        return
    from apache_beam.io.filesystems import FileSystems

    with open(local_tmp, "rb") as src, FileSystems.create(dest) as out:
        shutil.copyfileobj(src, out, length=1 << 22)
    os.unlink(local_tmp)


def remove_tree(path: str) -> None:
    if is_local(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    from apache_beam.io.filesystems import FileSystems

    # An object, or a "folder": every object under the prefix.
    targets = [path] if FileSystems.exists(path) else []
    targets += [m.path for m in FileSystems.match([path.rstrip("/") + "/**"])[0].metadata_list]
    if targets:
        FileSystems.delete(sorted(set(targets)))


@contextlib.contextmanager
def open_read(path: str) -> Iterator[BinaryIO]:
    """A binary file open for reading (local, or through Beam's FileSystems)."""
    if is_local(path):
        with open(local_path(path), "rb") as f:
            yield f
        return
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        yield f


@contextlib.contextmanager
def open_write(path: str) -> Iterator[BinaryIO]:
    """A new binary file open for writing, not atomic (for build-internal files
    that are named to a reader only after they are complete)."""
    if is_local(path):
        with open(local_path(path), "wb") as f:
            yield f
        return
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.create(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        yield f


@contextlib.contextmanager
def open_write_atomic(path: str) -> Iterator[BinaryIO]:
    """Like ``write_bytes_atomic``, streaming: readers see nothing at ``path``
    until the ``with`` block ends without an error, then the whole file. Locally
    a temporary file beside ``path``, fsynced and renamed; on an object store the
    upload is published when it closes, and deleted again if the block failed."""
    if is_local(path):
        path = local_path(path)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path) or ".")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    try:
        with open_write(path) as f:
            yield f
    except BaseException:
        remove_tree(path)
        raise


class FileInfo(NamedTuple):
    """One file: path (or URL), size in bytes, modification time in nanoseconds
    (0 where the file system does not say)."""

    path: str
    num_bytes: int
    mtime_ns: int


def is_url(path: str) -> bool:
    """True for ``scheme://...`` paths other than ``file://``."""
    return not is_local(path)


def has_magic(pattern: str) -> bool:
    """True when ``pattern`` holds a glob character (``*``, ``?``, ``[``)."""
    return any(c in pattern for c in "*?[")


def match(pattern: str) -> list[FileInfo]:
    """The files matching a glob ``pattern`` (``**`` is recursive; a pattern
    without a glob character names one file), sorted by path. Local paths are
    made absolute; folders are left out. An empty list when nothing matches."""
    import glob

    if is_local(pattern):
        expanded = os.path.expanduser(local_path(pattern))
        names = glob.glob(expanded, recursive=True) if has_magic(expanded) else [expanded]
        out = []
        for name in names:
            if os.path.isfile(name):
                st = os.stat(name)
                out.append(FileInfo(os.path.abspath(name), st.st_size, st.st_mtime_ns))
        return sorted(out)
    from apache_beam.io.filesystems import FileSystems

    out = []
    for result in FileSystems.match([pattern]):
        for meta in result.metadata_list:
            if meta.path.endswith("/"):
                continue
            mtime = getattr(meta, "last_updated_in_seconds", 0.0) or 0.0
            out.append(FileInfo(meta.path, int(meta.size_in_bytes), int(round(mtime * 1e9))))
    return sorted(out)


def size(path: str) -> int | None:
    """The size of ``path`` in bytes, or None when there is no such file."""
    if is_local(path):
        p = local_path(path)
        return os.path.getsize(p) if os.path.isfile(p) else None
    found = [f for f in match(path) if f.path == path]
    return found[0].num_bytes if found else None


def isfile(path: str) -> bool:
    """True when ``path`` is a file (locally: not a folder)."""
    if is_local(path):
        return os.path.isfile(local_path(path))
    return size(path) is not None


def isdir(path: str) -> bool:
    """Locally, True for a folder; on an object store, True when some object
    lies under the prefix ``path/``."""
    if is_local(path):
        return os.path.isdir(local_path(path))
    from apache_beam.io.filesystems import FileSystems

    return bool(FileSystems.match([path.rstrip("/") + "/*"])[0].metadata_list)


def open_binary(path: str, *, decompress: bool = True) -> BinaryIO:
    """``path`` open for binary reading; ``.gz`` files are decompressed on the
    fly when ``decompress`` (the caller closes it)."""
    if is_local(path):
        p = local_path(path)
        if decompress and p.endswith(".gz"):
            import gzip

            return gzip.open(p, "rb")
        return open(p, "rb")
    from apache_beam.io.filesystems import CompressionTypes, FileSystems

    compression = CompressionTypes.AUTO if decompress else CompressionTypes.UNCOMPRESSED
    return FileSystems.open(path, compression_type=compression)


def read_range(path: str, offset: int, length: int) -> bytes:
    """``length`` bytes of ``path`` from byte ``offset`` (one seek, one read).

    Raises:
      ValueError: the file ends before ``offset + length`` (the file is named).
    """
    with open_binary(path, decompress=False) as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise ValueError(f"{path}: {length} bytes expected at byte {offset}, the file has {len(data)} there")
    return data


@contextlib.contextmanager
def local_copy(path: str, *, suffix: str = "") -> Iterator[str]:
    """A local path holding the bytes of ``path``: ``path`` itself when local,
    else a temporary copy that is removed when the block ends (for readers such
    as ArrayRecord's that open local files only)."""
    if is_local(path):
        yield local_path(path)
        return
    fd, tmp = tempfile.mkstemp(prefix="seqcache-", suffix=suffix)
    try:
        with os.fdopen(fd, "wb") as out, open_read(path) as src:
            shutil.copyfileobj(src, out, length=1 << 22)
        yield tmp
    finally:
        os.unlink(tmp)


def require_local(path: str, what: str = "this reader") -> str:
    """The local path of ``path``.

    Raises:
      ValueError: ``path`` is a URL; the message says how to read it (mount the
        bucket, e.g. with gcsfuse or mountpoint-s3, or copy the cache).
    """
    if is_local(path):
        return local_path(path)
    raise ValueError(
        f"{path}: {what} reads local or mounted paths only; mount the bucket (gcsfuse for gs://, "
        "mountpoint-s3 or s3fs for s3://) and pass the mounted path, or copy the cache to a local folder "
        "(seqcache info, verify and show read URLs directly)"
    )


_OPTIONS_SET: list = []


def set_options(options: Any) -> None:
    """Hands Beam pipeline options (a ``PipelineOptions`` or a list of
    ``--flag=value`` strings) to Beam's ``FileSystems``: object-store endpoints
    and credentials (``--s3_endpoint_url``, ``--s3_access_key_id``, ...)."""
    from apache_beam.io.filesystems import FileSystems
    from apache_beam.options.pipeline_options import PipelineOptions

    if not isinstance(options, PipelineOptions):
        options = PipelineOptions(list(options or []))
    FileSystems.set_options(options)
    _OPTIONS_SET[:] = [options]


def options_set() -> Any:
    """The options last given to ``set_options`` (None before)."""
    return _OPTIONS_SET[0] if _OPTIONS_SET else None
