"""Where caches live, and the files inside one.

Layout (DESIGN.md, Cache format)::

    CACHE_DIR/<task>/<split>/          one task cache: cache_path(CACHE_DIR, task, split)
        manifest.json                  what makes a folder a cache: is_cache(folder)
        data.array_record-...          files the manifest names: cache_file(folder, name)
        provenance.array_record-...
        vocabulary-<feature>.model
        quarantine.jsonl

``resolve_name`` turns what a user types (a cache folder, a task name under
``CACHE_DIR``, a registered task or mixture) into cache folders, the same way
for ``seqcache train`` and ``seqcache which``.

``cache_file`` is the one gate for every path a manifest names (shards,
provenance sidecars, vocabulary models, the quarantine file): the name must be a
plain file name, and for a local cache the file, once links are resolved, must
lie inside the cache folder. A manifest is data that anyone may edit or ship;
without this gate ``verify`` would hash ``/etc/passwd`` and a feeder would read
a shard linked from anywhere. An object-store URL has no links: there the
plain-name check is the whole check.

This module imports neither Beam nor JAX; ``seqcache.tasks`` is imported only
to look up a registered name.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from seqcache import format as fmt
from seqcache import fs

MANIFEST_NAME = fmt.MANIFEST_NAME


class UnsafeCachePathError(fmt.CacheError, ValueError):
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


# True for a non-empty file name with no folder part (see seqcache.format).
is_plain_name = fmt.is_plain_file_name


def cache_file(cache_dir: str, name: Any, *, what: str = "file", source: str | None = None) -> str:
    """The path of the file ``name`` that the manifest of the cache at
    ``cache_dir`` names, checked before anything opens it.

    Args:
      cache_dir: the cache folder (a local path or a URL).
      name: the name as the manifest gives it, e.g. ``shards[3].file``.
      what: what the file is, for the message (``"vocabulary model of feature
        'targets'"``).
      source: where the name comes from, for the message (default:
        ``cache_dir/manifest.json``).

    Returns:
      ``cache_dir/name`` (through ``seqcache.fs.join``). The file need not exist:
      a missing file is the caller's error to report.

    Raises:
      UnsafeCachePathError (a ``CacheError`` and a ``ValueError``): ``name``
        is not a plain file name, or (local caches) it is a link whose target
        lies outside the cache folder. The message names the manifest, the
        field's value and, for a link, its target.
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


def named_files(manifest: "fmt.Manifest") -> list[tuple[str, Any]]:
    """``(what, name)`` of every file the manifest names, as it names them:
    each shard and provenance sidecar, each vocabulary model, the quarantine
    file (the fields ``shards[i].file``, ``shards[i].provenance_file``,
    ``vocabularies.<feature>.file``, ``quarantine``)."""
    out: list[tuple[str, Any]] = []
    for i, s in enumerate(manifest.shards):
        out.append((f"shard file (shards[{i}].file)", s.file))
        out.append((f"provenance file (shards[{i}].provenance_file)", s.provenance_file))
    for feature, desc in manifest.vocabularies.items():
        if isinstance(desc, dict) and "file" in desc:
            out.append((f"vocabulary model of feature {feature!r} (vocabularies.{feature}.file)", desc["file"]))
    if manifest.quarantine is not None:
        out.append(("quarantine file (quarantine)", manifest.quarantine))
    return out


def check_named_files(cache_dir: str, manifest: "fmt.Manifest") -> None:
    """``cache_file`` of every file the manifest names (``named_files``): one
    lstat each for a local cache, nothing opened.

    Raises:
      UnsafeCachePathError: the first name that is not a plain file name
        inside the cache, or a link out of it."""
    for what, name in named_files(manifest):
        cache_file(cache_dir, name, what=what)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a name given by a user stands for.

    Attributes:
      kind: ``"folder"`` (the name is a cache folder), ``"cache"``
        (``CACHE_DIR/<name>/<split>`` is a cache), ``"task"`` (a registered
        task: its cache under ``CACHE_DIR``, built or not) or ``"mixture"`` (a
        registered mixture).
      cache_dirs: the cache folder of each task, in the mixture's task order.
      label: a short name for messages (``"wiki/train"``).
      mixture: the ``seqcache.tasks.Mixture`` for kind ``"mixture"``, else None.
    """

    kind: str
    cache_dirs: tuple[str, ...]
    label: str
    mixture: Any = None


def resolve_name(name: str, *, split: str, cache_dir: str | None = None,
                 modules: Sequence[str] = ()) -> Resolved | None:
    """Resolves ``name``, in this order: a cache folder; ``cache_dir/<name>/<split>``
    when it is a cache; a task or mixture registered in ``seqcache.tasks``
    (after importing ``modules``), its caches under ``cache_dir``. Without
    ``cache_dir`` only the first applies.

    Returns:
      A ``Resolved``, or None when ``name`` is none of these (the caller says
      what was tried: ``cache_path(cache_dir, name, split)`` and the registries).
    """
    if is_cache(name):
        return Resolved("folder", (os.fspath(name),), os.fspath(name))
    if not cache_dir:
        return None
    under = cache_path(cache_dir, name, split)
    if is_cache(under):
        return Resolved("cache", (under,), f"{name}/{split}")
    obj = registered(name, modules)
    if obj is None:
        return None
    from seqcache import tasks

    if isinstance(obj, tasks.Mixture):
        # By name: a mixture's tasks need not be registered where it is read.
        dirs = tuple(cache_path(cache_dir, n, split) for n in obj.task_names)
        return Resolved("mixture", dirs, name, obj)
    return Resolved("task", (cache_path(cache_dir, obj.name, split),), f"{name}/{split}")


def registered(name: str, modules: Sequence[str] = ()):
    """The task or mixture registered as ``name`` after importing ``modules``;
    None when there is none or ``seqcache.tasks`` cannot be imported
    (``not_registered`` says why)."""
    try:
        from seqcache import tasks
    except ImportError:
        return None
    for module in modules:
        tasks.import_definitions(module)
    try:
        return tasks.get_task_or_mixture(name)
    except KeyError:
        return None


def not_registered(name: str) -> str:
    """Why ``name`` is no registered task or mixture, in the registry's words
    (with close names it knows), for messages after ``resolve_name`` gave None."""
    try:
        from seqcache import tasks
    except ImportError as e:
        return f"seqcache.tasks cannot be imported to look up {name!r}: {e}"
    try:
        tasks.get_task_or_mixture(name)
    except KeyError as e:
        return str(e.args[0] if e.args else e)
    return f"{name!r} is registered"
