"""One module for every file-system access: local paths, and URLs (``gs://``,
``s3://``, ``hdfs://``, any scheme Beam knows) through Apache Beam's
``FileSystems``, imported only when a URL is met.

Everything in seqcache that lists, opens, reads, writes, renames or deletes a
file goes through here, so local paths and object stores behave the same way
everywhere. The feeder's ArrayRecord reader opens local paths only:
``require_local`` gives it a clear error for a URL.

Object-store options (endpoint, credentials) are Beam pipeline options, e.g.
``--s3_endpoint_url=...``, handed to ``FileSystems`` by ``set_options`` (Beam's
workers get them from the pipeline). Without any, Beam's S3 client falls back
on boto3's own configuration (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``~/.aws``).

A failed request on a URL raises ``FileSystemError`` (an ``OSError``) naming
the URL, the cause and the fix where there is one; a missing object raises
``FileNotFoundError``.
"""

from __future__ import annotations

import bz2
import collections
import contextlib
import errno
import fnmatch
import functools
import glob
import gzip
import io
import lzma
import os
import pathlib
import shutil
import stat
import tempfile
from typing import Any, BinaryIO, Iterator, NamedTuple, Sequence

from seqcache import compression
from seqcache.process import import_beam


class FileSystemError(OSError):
    """A request on a URL failed for another reason than a missing file (an
    endpoint that does not answer, missing credentials or bucket, a denied
    request, a missing extra), naming the URL, the cause and the fix."""


# The extra that brings a scheme's client library (see pyproject.toml).
_EXTRAS = {"s3": "s3", "gs": "gcs"}


def _beam_fs():
    """Beam's ``FileSystems`` class, for calls that make no request (join)."""
    return import_beam().io.filesystems.FileSystems


def _url_file(path: str, what: str, *, create: bool = False) -> BinaryIO:
    """The object at the URL ``path`` opened (or, with ``create``, created)
    uncompressed through Beam's file system; errors as ``_url_errors``."""
    fsys = _beam(path)
    uncompressed = import_beam().io.filesystem.CompressionTypes.UNCOMPRESSED
    with _url_errors(path, what):
        return (fsys.create if create else fsys.open)(path, compression_type=uncompressed)


def _beam(path: str):
    """Beam's ``FileSystems``, ready for a request on the URL ``path``: options
    set (Beam's defaults when nobody set any), the scheme's file system
    installed (else ``FileSystemError`` naming the extra), an s3:// bucket
    checked once (``_check_s3``)."""
    FileSystems = _beam_fs()
    from apache_beam.options import pipeline_options, value_provider  # keeps Beam out of the feeder's import

    # FileSystems has no getter of its options: the ones set here (set_options), else a
    # Beam worker's (the SDK harness sets the runtime options), else Beam's defaults.
    options = _OPTIONS[0] if _OPTIONS else value_provider.RuntimeValueProvider.runtime_options
    if options is None:
        set_options(pipeline_options.PipelineOptions([]))
        options = _OPTIONS[0]
    scheme = path.partition("://")[0].lower()
    try:
        FileSystems.get_filesystem(path)
    except ValueError:
        extra = _EXTRAS.get(scheme)
        fix = f"pip install 'seqcache[{extra}]'" if extra else "install the Beam extra that provides it"
        raise FileSystemError(f"{path}: Beam has no file system for {scheme}:// URLs here; {fix}") from None
    if scheme == "s3":
        _check_s3(path, options)
    return FileSystems


_S3_CHECKED: set = set()


def _check_s3(path: str, options: Any) -> None:
    """One ``HeadBucket`` request (two attempts at most) per bucket and client
    configuration (``options``: a ``PipelineOptions`` or Beam's runtime dict;
    the ``AWS_*`` variables), so that a missing boto3, endpoint, credentials or
    bucket fails at once with the fix (``FileSystemError``), not after Beam's
    minutes of retries. A denied check (403) or a redirect is left to the
    requests themselves, which Beam does not retry."""
    from apache_beam.options.pipeline_options import PipelineOptions, S3Options  # keeps Beam out of the feeder's import

    if isinstance(options, PipelineOptions):
        view = options.view_as(S3Options)
        get = lambda name: getattr(view, name, None)  # noqa: E731
    else:
        get = options.get
    # The arguments Beam's boto3 client (apache_beam.io.aws.clients.s3.boto3_client) is created with.
    kwargs = {"region_name": get("s3_region_name"), "api_version": get("s3_api_version"),
              "use_ssl": not get("s3_disable_ssl"), "verify": get("s3_verify"), "endpoint_url": get("s3_endpoint_url"),
              "aws_access_key_id": get("s3_access_key_id"), "aws_secret_access_key": get("s3_secret_access_key"),
              "aws_session_token": get("s3_session_token")}
    bucket = path[len("s3://"):].split("/", 1)[0]
    # What the client is made of: the options, and boto3's environment for what they leave unset.
    key = (bucket, tuple(sorted(kwargs.items(), key=lambda kv: kv[0])),
           tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    if key in _S3_CHECKED:
        return
    try:
        import boto3  # optional: boto3
        from botocore.config import Config  # optional: botocore
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError  # optional: botocore
    except ImportError:
        raise FileSystemError(f"{path}: s3:// URLs need boto3: pip install 'seqcache[s3]'") from None
    config = Config(retries={"total_max_attempts": 2, "mode": "standard"}, connect_timeout=10, read_timeout=30)
    try:
        client = boto3.session.Session().client("s3", config=config, **kwargs)
    except (BotoCoreError, ValueError) as e:
        raise FileSystemError(f"{path}: cannot create an S3 client from the s3 options: {e}") from None
    endpoint = client.meta.endpoint_url
    try:
        client.head_bucket(Bucket=bucket)
    except NoCredentialsError:
        raise FileSystemError(f"{path}: no S3 credentials: pass --s3_access_key_id=... --s3_secret_access_key=..., "
                              "or set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or an AWS profile)") from None
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = e.response.get("Error", {}).get("Code")
        if status == 404 or code in ("404", "NoSuchBucket"):
            raise FileSystemError(f"s3://{bucket}: no such bucket at {endpoint} (asked for {path}); check the bucket "
                                  "name and --s3_endpoint_url, or create the bucket") from None
    except BotoCoreError as e:  # EndpointConnectionError, ConnectTimeoutError, SSLError, ...
        raise FileSystemError(f"cannot reach the S3 endpoint {endpoint} (asked for {path}): {e}; check "
                              "--s3_endpoint_url (or AWS_ENDPOINT_URL)") from None
    _S3_CHECKED.add(key)


@contextlib.contextmanager
def _url_errors(path: str, what: str) -> Iterator[None]:
    """Inside the block, an error of Beam's file systems on ``path`` becomes a
    ``FileNotFoundError`` or a ``FileSystemError`` naming the URL, ``what`` was
    being done and the cause. Wraps this module's own calls only."""
    try:
        yield
    except (FileSystemError, FileNotFoundError):
        raise
    except Exception as e:
        cause = e
        for _ in range(8):  # a BeamIOError's first per-path error; wrappers nest a few levels at most
            details = getattr(cause, "exception_details", None)
            errors = details.values() if isinstance(details, dict) else ()
            inner = next((x for x in errors if isinstance(x, BaseException)), None)
            if inner is None:
                break
            cause = inner
        if (getattr(cause, "code", None) == 404 or getattr(cause, "errno", None) == errno.ENOENT
                or isinstance(cause, FileNotFoundError)):
            raise FileNotFoundError(f"{path}: no such file") from e
        text = getattr(cause, "message", None)  # Beam's S3ClientError keeps it here, not in args
        text = text if isinstance(text, str) and text else str(cause) or type(cause).__name__
        raise FileSystemError(f"{path}: cannot {what}: {text}") from e


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    """The local file system path of a local path or file:// URL."""
    return path[len("file://"):] if path.startswith("file://") else path


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    try:
        return _beam_fs().join(base, *parts)
    except ValueError:  # no file system for the scheme: say which extra is missing
        _beam(base)
        raise


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fsys = _beam(path)
    with _url_errors(path, "check whether it exists"):
        return fsys.exists(path)


def makedirs(path: str) -> None:
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)
    # Object stores have no folders: nothing to create.


def read_text(path: str) -> str:
    if is_local(path):
        return pathlib.Path(local_path(path)).read_text(encoding="utf-8")
    return read_bytes(path).decode("utf-8")


def write_bytes(path: str, data: bytes) -> None:
    """Writes a new file (not atomically: for build-internal files that are named
    to a reader only after they are complete)."""
    if is_local(path):
        pathlib.Path(local_path(path)).write_bytes(data)
        return
    with _url_errors(path, "write"), _url_file(path, "write", create=True) as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    if is_local(path):
        return pathlib.Path(local_path(path)).read_bytes()
    with _url_errors(path, "read"), _url_file(path, "read") as f:
        return f.read()


def write_bytes_atomic(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Writes ``data`` to ``path`` so that readers see either nothing or all of
    it: ``open_write_atomic`` for bytes already in memory."""
    with open_write_atomic(path, fsync=fsync) as f:
        f.write(data)


def remove_tree(path: str) -> None:
    if is_local(path):
        shutil.rmtree(local_path(path), ignore_errors=True)
        return
    fsys = _beam(path)
    # An object, or a "folder": every object under the prefix.
    with _url_errors(path, "delete"):
        targets = [path] if fsys.exists(path) else []
        targets += [m.path for m in fsys.match([path.rstrip("/") + "/**"])[0].metadata_list]
        if targets:
            fsys.delete(sorted(set(targets)))


def remove_file(path: str) -> None:
    """Removes one file (nothing when there is none)."""
    if is_local(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(local_path(path))
        return
    fsys = _beam(path)
    with _url_errors(path, "delete"):
        if fsys.exists(path):
            fsys.delete([path])


def rename(sources: Sequence[str], destinations: Sequence[str]) -> None:
    """Moves each file of ``sources`` to the same position of ``destinations``
    (locally ``os.replace``; on an object store, copy then delete, one object
    at a time as Beam's file system does it)."""
    if len(sources) != len(destinations):
        raise ValueError(f"rename: {len(sources)} sources, {len(destinations)} destinations")
    if not sources:
        return
    if all(is_local(p) for p in (*sources, *destinations)):
        for src, dst in zip(sources, destinations):
            os.replace(local_path(src), local_path(dst))
        return
    fsys = _beam(destinations[0])
    with _url_errors(destinations[0].rstrip("/").rpartition("/")[0] or destinations[0], "move objects into it"):
        fsys.rename(list(sources), list(destinations))


@contextlib.contextmanager
def open_read(path: str) -> Iterator[BinaryIO]:
    """A binary file open for reading (local, or through Beam's FileSystems).

    Raises:
      FileNotFoundError: no such file.
      FileSystemError: (URLs) the request failed.
    """
    if is_local(path):
        with open(local_path(path), "rb") as f:
            yield f
        return
    with _url_file(path, "open it") as f:
        yield f


@contextlib.contextmanager
def open_write(path: str) -> Iterator[BinaryIO]:
    """A new binary file open for writing, not atomic (for build-internal files
    that are named to a reader only after they are complete)."""
    if is_local(path):
        with open(local_path(path), "wb") as f:
            yield f
        return
    f = _url_file(path, "create it", create=True)
    try:
        yield f
    except BaseException:
        with contextlib.suppress(Exception):  # the block's own error is the one to report
            f.close()
        raise
    with _url_errors(path, "write"):
        f.close()


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """The one way seqcache replaces a file atomically: a local temporary path
    to write ``path``'s new content to; when the ``with`` block ends without an
    error the file there becomes ``path``, and readers see the old file or the
    whole new one, never a part.

    Locally the temporary file lies beside ``path``, named ``.tmp-<12 hex
    digits>-<name>`` (unique to the attempt), and ``os.replace`` moves it into
    place. For a URL it lies in the system's temporary folder and is uploaded
    when the block ends (an object store publishes an upload whole). The
    temporary file is removed whatever happens.

    Raises:
      FileNotFoundError: the block wrote no file at the temporary path.
      FileSystemError: (URLs) the upload failed.
    """
    if is_local(path):
        folder, name = os.path.split(local_path(path))
    else:
        folder, name = tempfile.gettempdir(), path.rstrip("/").rpartition("/")[2]
    tmp = os.path.join(folder, f".tmp-{os.urandom(6).hex()}-{name}")
    try:
        yield tmp
        if is_local(path):
            os.replace(tmp, local_path(path))
            return
        with _url_errors(path, "upload"), open(tmp, "rb") as src, _url_file(path, "upload", create=True) as out:
            shutil.copyfileobj(src, out, length=1 << 22)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def open_write_atomic(path: str, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """A binary file open for writing whose content readers see at ``path``
    only when the ``with`` block ends without an error, then whole. Locally
    ``atomic_path``, flushed to the disk before the rename with ``fsync=True``
    (a crash then leaves the old file or the new one); on an object store the
    upload is streamed, published when it closes, deleted if the block failed.

    Raises:
      FileSystemError: (URLs) the object store refused the upload.
    """
    if is_local(path):
        with atomic_path(path) as tmp, open(tmp, "xb") as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        return
    block_ended = False
    try:
        with open_write(path) as f:
            yield f
            block_ended = True
    except BaseException:
        if not block_ended:
            remove_tree(path)  # closing published what the block had written
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


def match(pattern: str) -> list[FileInfo]:
    """The files matching a glob ``pattern`` (``**`` is recursive), sorted by
    path; local paths made absolute, folders left out. An empty list when
    nothing matches (on an object store, also when the bucket does not exist).

    Raises:
      FileSystemError: (URLs) the listing failed.
    """
    if is_local(pattern):
        return _match_local(os.path.expanduser(local_path(pattern)))
    fsys = _beam(pattern)
    with _url_errors(pattern, "list it"):
        results = fsys.match([pattern])
    found = [meta for result in results for meta in result.metadata_list if not meta.path.endswith("/")]
    return sorted(FileInfo(meta.path, int(meta.size_in_bytes),
                           int(round((getattr(meta, "last_updated_in_seconds", 0.0) or 0.0) * 1e9))) for meta in found)


def _match_local(expanded: str) -> list[FileInfo]:
    """``match`` of a local pattern (user folder expanded): one ``stat`` per
    name; a pattern whose only wildcards are in its last part
    (``/data/*.txt``) lists that folder once, each name tested and stat'ed
    within it (``_names_in_folder``), without ``glob``'s work per name."""
    # glob gives normalised absolute names for a normalised absolute pattern: abspath only otherwise.
    absolute = os.path.isabs(expanded) and os.path.normpath(expanded) == expanded
    folder, last = os.path.split(expanded)
    folder_fd = None
    if absolute and _has_magic(last) and not _has_magic(folder) and "**" not in last:
        names, folder_fd = _names_in_folder(folder, last)
        prefix = folder if folder.endswith("/") else folder + "/"
    else:
        names = glob.glob(expanded, recursive=True) if _has_magic(expanded) else [expanded]
        if not absolute:
            names = [os.path.abspath(name) for name in names]
        prefix = ""
    names.sort()  # the paths, not the tuples: the same order, compared faster
    try:
        stats = _stats(names, folder_fd)
    finally:
        if folder_fd is not None:
            os.close(folder_fd)
    is_file, make = stat.S_ISREG, tuple.__new__
    return [make(FileInfo, (prefix + name, st.st_size, st.st_mtime_ns))
            for name, st in zip(names, stats) if st is not None and is_file(st.st_mode)]


def _stats(names: Sequence[str], folder_fd: int | None) -> list:
    """``os.stat`` of each of ``names`` (relative to ``folder_fd`` when given),
    one call each, or None for a name gone since the listing or a broken link
    (not a file, as ``isfile`` says)."""
    stat_at = functools.partial(os.stat, dir_fd=folder_fd)
    try:
        return list(map(stat_at, names))  # no Python loop per file
    except OSError:
        pass
    out = []
    for name in names:
        try:
            out.append(stat_at(name))
        except OSError:
            out.append(None)
    return out


def _has_magic(pattern: str) -> bool:
    """Whether ``pattern`` holds a glob wildcard (``*``, ``?`` or ``[``)."""
    return any(c in pattern for c in "*?[")


def _names_in_folder(folder: str, pattern: str) -> tuple[list[str], int | None]:
    """The names in ``folder`` that ``pattern`` (no ``/``) matches as ``glob``
    matches them (a name starting with ``.`` only when the pattern does), and
    the folder open for ``os.stat(name, dir_fd=...)`` (None when it is not a
    readable folder: then no names)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return [], None
    try:
        names = os.listdir(fd)
    except OSError:
        os.close(fd)
        return [], None
    if not pattern.startswith("."):
        names = [n for n in names if not n.startswith(".")]
    suffix = pattern[1:]
    if pattern.startswith("*") and not _has_magic(suffix) and os.path.normcase(suffix) == suffix:
        return [n for n in names if n.endswith(suffix)], fd  # ``*.txt``: fnmatch's answer, one test per name
    return fnmatch.filter(names, pattern), fd


def size(path: str) -> int | None:
    """The size of ``path`` in bytes, or None when there is no such file."""
    if is_local(path):
        p = local_path(path)
        return os.path.getsize(p) if os.path.isfile(p) else None
    found = [f for f in match(path) if f.path == path]
    return found[0].num_bytes if found else None


def sizes_in(folder: str) -> dict[str, int]:
    """{file name: size in bytes} of the files directly inside ``folder`` (not
    in its subfolders); empty when there is no such folder. One listing request
    on an object store, where ``size`` of each file would take one per file."""
    if is_local(folder):
        try:
            entries = list(os.scandir(local_path(folder)))
        except (FileNotFoundError, NotADirectoryError):
            return {}
        return {e.name: e.stat().st_size for e in entries if e.is_file()}
    prefix = folder.rstrip("/") + "/"
    sizes = {f.path[len(prefix):]: f.num_bytes for f in match(prefix + "*") if f.path.startswith(prefix)}
    return {name: n for name, n in sizes.items() if name and "/" not in name}


def isfile(path: str) -> bool:
    """True when ``path`` is a file (locally: not a folder)."""
    if is_local(path):
        return os.path.isfile(local_path(path))
    return size(path) is not None


def isdir(path: str) -> bool:
    """Locally, True for a folder; on an object store, True when some object
    lies under the prefix ``path/`` (the listing stops at the first one)."""
    if is_local(path):
        return os.path.isdir(local_path(path))
    fsys = _beam(path)
    with _url_errors(path, "list it"):
        return bool(fsys.match([path.rstrip("/") + "/**"], limits=[1])[0].metadata_list)


# Local compressed files the standard library opens itself; the others are
# read through ``seqcache.compression.Decompressed``.
_STDLIB_FILES = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open, ".lzma": lzma.open}


def open_binary(path: str, *, decompress: bool = True) -> BinaryIO:
    """``path`` open for binary reading (the caller closes it). With
    ``decompress``, a file whose name ends in a suffix of Beam's
    ``CompressionTypes`` (``seqcache.compression.COMPRESSED_SUFFIXES``:
    ``.gz``, ``.bz2``, ``.xz``, ``.lzma``, ``.deflate``, ``.zst``, ``.zstd``,
    in any case) is decompressed on the fly, for a local path as for a URL;
    reading a file that ends inside a compressed member raises ``EOFError``."""
    make = compression.decompressor(path) if decompress else None
    stdlib_file = _STDLIB_FILES.get(os.path.splitext(path)[1].lower()) if make and is_local(path) else None
    if stdlib_file is not None:
        return stdlib_file(local_path(path), "rb")
    raw = open(local_path(path), "rb") if is_local(path) else _url_file(path, "open it")
    if make is None:
        return raw
    return io.BufferedReader(compression.Decompressed(raw, make, skip_nulls=path.lower().endswith(".gz")),
                             buffer_size=1 << 20)


class RangeReader:
    """Ranged reads of many files, each kept open between reads (at most
    ``max_open`` at once, the least recently read closed first): one seek and
    one read a call. ``close()`` closes them all."""

    def __init__(self, max_open: int = 64):
        self.max_open = int(max_open)
        self._files: "collections.OrderedDict[str, BinaryIO]" = collections.OrderedDict()

    def read(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes of ``path`` from byte ``offset``.

        Raises:
          ValueError: the file ends before ``offset + length`` (the file is named).
        """
        f = self._files.get(path)
        if f is None:
            while len(self._files) >= self.max_open:
                self._files.popitem(last=False)[1].close()
            f = self._files[path] = open_binary(path, decompress=False)
        else:
            self._files.move_to_end(path)
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise ValueError(f"{path}: {length} bytes expected at byte {offset}, the file has {len(data)} there")
        return data

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()


@contextlib.contextmanager
def local_copy(path: str, *, suffix: str = "", dir: str | None = None) -> Iterator[str]:
    """A local path holding the bytes of ``path``: ``path`` itself when local,
    else a temporary copy in ``dir`` (default the system's temporary folder),
    removed when the block ends.

    Raises:
      FileNotFoundError: no such file.
      FileSystemError: (URLs) the download failed.
    """
    if is_local(path):
        yield local_path(path)
        return
    fd, tmp = tempfile.mkstemp(prefix="seqcache-", suffix=suffix, dir=dir)
    try:
        with os.fdopen(fd, "wb") as out, open_read(path) as src, _url_errors(path, "download it"):
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
    raise ValueError(f"{path}: {what} reads local or mounted paths only; mount the bucket (gcsfuse for gs://, "
                     "mountpoint-s3 or s3fs for s3://) and pass the mounted path, or copy the cache to a local folder "
                     "(seqcache info, verify and show read URLs directly)")


def set_options(options: Any) -> None:
    """Hands Beam pipeline options (a ``PipelineOptions`` or a list of
    ``--flag=value`` strings) to Beam's ``FileSystems``: object-store endpoints
    and credentials (``--s3_endpoint_url``, ``--s3_access_key_id``, ...). Call
    it before the first file-system call on a URL that needs them; Beam's
    ``Pipeline`` sets its own options again when it is created. None: no
    options at all, as in a fresh process (Beam's defaults at the next
    request)."""
    FileSystems = _beam_fs()
    from apache_beam.options.pipeline_options import PipelineOptions  # keeps Beam out of the feeder's import

    if options is None:
        FileSystems.set_options(None)
        _OPTIONS.clear()
        return
    if not isinstance(options, PipelineOptions):
        options = PipelineOptions(list(options or []))
    FileSystems.set_options(options)
    _OPTIONS[:] = [options]


# The options last handed to FileSystems by set_options (none yet: empty).
_OPTIONS: list = []
