"""Where caches live, and the files inside one.

Layout (DESIGN.md, Cache format)::

    CACHE_DIR/<task>/<split>/          one task cache: cache_path(CACHE_DIR, task, split)
        manifest.json                  what makes a folder a cache: is_cache(folder)
        data.array_record-...          files the manifest names: cache_file(folder, name)
        provenance.array_record-...
        vocabulary-<feature>.model
        quarantine.jsonl

``cache_file`` is the one gate for every path a manifest names: the name must
be a plain file name, and for a local cache the file, once links are resolved,
must lie inside the cache folder. A manifest is data that anyone may edit or
ship; without this gate ``verify`` would hash ``/etc/passwd`` and a feeder
would read a shard linked from anywhere. An object-store URL has no links:
there the plain-name check is the whole check.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping

from seqcache import codec, fs

MANIFEST_NAME = codec.MANIFEST_NAME


class UnsafeCachePathError(codec.CacheError, ValueError):
    """A manifest names a file that is not a plain file name inside its cache
    folder, or a link in the cache leads out of it. A ``CacheError`` (what every
    reader of a cache reports) and a ``ValueError`` (what loading a vocabulary
    raises)."""


def cache_path(cache_dir: str, task: str, split: str) -> str:
    """``cache_dir/<task>/<split>``: the folder of one task's cache (a local path or a URL)."""
    return fs.join(os.fspath(cache_dir), task, split)


def is_cache(path: str) -> bool:
    """True for a local folder holding ``manifest.json`` (a finished cache;
    URLs are never caches here: they are opened, not looked up)."""
    path = os.fspath(path)
    return not fs.is_url(path) and os.path.isfile(os.path.join(path, MANIFEST_NAME))


def sibling_split(cache_dir: str, split: str) -> str:
    """The cache of ``split`` next to the cache folder ``cache_dir``
    (``CACHE_DIR/<task>/<other split>`` -> ``CACHE_DIR/<task>/<split>``)."""
    return os.path.join(os.path.dirname(os.path.normpath(os.fspath(cache_dir))), split)


is_plain_name = codec.is_plain_file_name


def cache_file(cache_dir: str, name: Any, *, what: str = "file", source: str | None = None) -> str:
    """The path of the file ``name`` that the manifest of the cache at
    ``cache_dir`` names, checked before anything opens it.

    Args:
      cache_dir: the cache folder (a local path or a URL).
      name: the name as the manifest gives it, e.g. ``shards[3].file``.
      what, source: what the file is and where the name comes from (default
        ``cache_dir/manifest.json``), for the message.

    Returns:
      ``cache_dir/name``; the file need not exist.

    Raises:
      UnsafeCachePathError: ``name`` is not a plain file name, or (local
        caches) it is a link whose target lies outside the cache folder; the
        message names the manifest, the value and, for a link, its target.
    """
    cache_dir = os.fspath(cache_dir)
    source = source or f"{cache_dir.rstrip('/')}/{MANIFEST_NAME}"  # no file system asked for a message
    if not is_plain_name(name):
        raise UnsafeCachePathError(f"{source}: {what} {name!r} is not a plain file name inside the cache folder; "
                                   "the manifest was edited or is not this cache's: rebuild the cache")
    path = fs.join(cache_dir, name)
    if fs.is_url(cache_dir):
        return path
    # A plain name has no folder part, so the file itself is the only link that
    # can lead elsewhere (the cache folder may be a link: it is resolved too).
    if os.path.islink(path):
        target = os.path.realpath(path)
        root = os.path.realpath(fs.local_path(cache_dir))  # file:// URLs are local paths too
        if os.path.commonpath([root, target]) != root or target == root:
            raise UnsafeCachePathError(f"{path}: {what} is a link to {target}, outside the cache folder {root}; "
                                       "a cache's files must lie inside it: copy the file in or rebuild the cache")
    return path


def check_named_files(cache_dir: str, manifest: "seqcache.manifest.Manifest") -> None:
    """``cache_file`` of every file the manifest names (``shards[i].file``,
    ``shards[i].provenance_file``, ``vocabularies.<feature>.file``,
    ``quarantine``): one lstat each for a local cache, nothing opened.

    Raises:
      UnsafeCachePathError: the first name that is not a plain file name
        inside the cache, or a link out of it."""
    for i, s in enumerate(manifest.shards):
        cache_file(cache_dir, s.file, what=f"shard file (shards[{i}].file)")
        cache_file(cache_dir, s.provenance_file, what=f"provenance file (shards[{i}].provenance_file)")
    for feature, desc in manifest.vocabularies.items():
        if desc.file is not None:
            cache_file(cache_dir, desc.file,
                       what=f"vocabulary model of feature {feature!r} (vocabularies.{feature}.file)")
    if manifest.quarantine is not None:
        cache_file(cache_dir, manifest.quarantine, what="quarantine file (quarantine)")


def read_recorded_file(cache_dir: str, recorded: Mapping[str, Any], what: str, *,
                       missing: str = ")") -> tuple[str, bytes]:
    """``(path, bytes)`` of the cache file the manifest records as ``{file,
    num_bytes, sha256}`` (the shard checksum file, the source table), checked
    against the record.

    Raises:
      CacheError: the file is missing (the message ends with ``missing``),
        cannot be read (a folder in its place), or its size or sha256 differs
        from the record, naming the file.
    """
    path = cache_file(cache_dir, recorded["file"], what=what)
    if not fs.exists(path):
        raise codec.CacheError(f"{path}: {what} is missing (the manifest lists it with {recorded['num_bytes']} bytes{missing}")
    try:
        data = fs.read_bytes(path)
    except OSError as e:  # a folder or an unreadable file in its place
        raise codec.CacheError(f"{path}: {what} cannot be read ({e.strerror or type(e).__name__}); rebuild the cache") \
            from None
    if len(data) != recorded["num_bytes"]:
        raise codec.CacheError(f"{path}: {what} has {len(data)} bytes, the manifest expects {recorded['num_bytes']}")
    actual = hashlib.sha256(data).hexdigest()
    if actual != recorded["sha256"]:
        raise codec.CacheError(f"{path}: {what} has sha256 {actual}, the manifest expects {recorded['sha256']}")
    return path, data
