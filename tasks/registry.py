"""Registries of tasks and mixtures by name (seqio style, class-level).

User code registers tasks at import time (``TaskRegistry.add("name", ...)``);
``seqcache build`` imports it (``import_definitions``) and looks names up with
``get_task_or_mixture``. ``resolve_name`` turns what a user types into cache
folders.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from typing import Any, ClassVar, Sequence

from seqcache import layout
from seqcache.tasks.mixture import Mixture
from seqcache.tasks.task import Task
from seqcache.tasks.task_registry import Registry, TaskRegistry, suggest

class MixtureRegistry(Registry[Mixture]):
    """Global registry of mixtures."""

    _kind = "mixture"
    _items: ClassVar[dict[str, Mixture]] = {}

    @classmethod
    def add(cls, name_or_mixture: str | Mixture, tasks=None, **kwargs) -> Mixture:
        """Registers a Mixture, or builds one with ``Mixture(name, tasks, **kwargs)``.

        Raises:
          ValueError: the name is already registered (or the Mixture is invalid).
        """
        if isinstance(name_or_mixture, Mixture):
            if tasks is not None or kwargs:
                raise TypeError("MixtureRegistry.add(mixture) takes no other arguments")
            return cls._add(name_or_mixture)
        if tasks is None:
            raise TypeError(f"MixtureRegistry.add({name_or_mixture!r}) needs tasks")
        return cls._add(Mixture(name_or_mixture, tasks, **kwargs))


def get_task_or_mixture(name: str) -> Task | Mixture:
    """The registered task, or else mixture, of that name.

    Raises:
      KeyError: neither is registered; the message lists the closest names.
    """
    if name in TaskRegistry._items:
        return TaskRegistry._items[name]
    if name in MixtureRegistry._items:
        return MixtureRegistry._items[name]
    every = TaskRegistry.names() + MixtureRegistry.names()
    raise KeyError(f"no task or mixture named {name!r}; {suggest(name, every)}")


# Module names given to task files imported by path (``import_definitions``).
USER_MODULE_PREFIX = "_seqcache_user_"


class DefinitionsError(Exception):
    """A task definitions module that raised while it was imported (a Task with
    a bad argument, a metric with a wrong signature, ...). The one-line message
    names the module, the exception and the module's line; the exception is
    chained (``__cause__``) for a full traceback."""


def import_definitions(module_or_path: str) -> None:
    """Imports a module that registers tasks: a dotted module name or a ``.py`` path.

    Raises:
      ImportError / FileNotFoundError: the module or file cannot be found.
      DefinitionsError: the module raised anything else while it was imported.
    """
    try:
        _import_definitions(module_or_path)
    except (ImportError, FileNotFoundError):
        raise
    except Exception as e:
        raise DefinitionsError(f"--module {module_or_path}: importing it raised {type(e).__name__}: {e}"
                               f"{_where(module_or_path, e)}") from e


def _where(module_or_path: str, error: BaseException) -> str:
    """`` (FILE, line N)``: the innermost frame of ``error``'s traceback in the
    module's own file; empty when there is none."""
    if module_or_path.endswith(".py") or os.sep in module_or_path:
        origin = os.path.abspath(module_or_path)
    else:
        try:
            spec = importlib.util.find_spec(module_or_path)
        except (ImportError, ValueError):
            spec = None
        origin = os.path.abspath(spec.origin) if spec is not None and spec.origin else None
    frames = [f for f in traceback.extract_tb(error.__traceback__) if os.path.abspath(f.filename) == origin]
    return f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _import_definitions(module_or_path: str) -> None:
    """``import_definitions`` without the wrapping of what the module raised."""
    if module_or_path.endswith(".py") or os.sep in module_or_path:
        path = os.path.abspath(module_or_path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"task definitions file {module_or_path!r} does not exist")
        mod_name = USER_MODULE_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:16]
        if mod_name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
        return
    # Like `python -m`: a module in the working folder is importable by name.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        importlib.import_module(module_or_path)
    except ModuleNotFoundError as e:
        if e.name != module_or_path.split(".")[0]:
            raise
        raise ModuleNotFoundError(
            f"no module named {module_or_path!r} (looked in {cwd} and on PYTHONPATH); "
            "pass the file's path (my_tasks.py) or add its folder to PYTHONPATH",
            name=e.name,
        ) from None


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What a name given by a user stands for.

    Attributes:
      kind: ``"folder"`` (a cache folder), ``"cache"`` (``CACHE_DIR/<name>/<split>``),
        ``"task"`` or ``"mixture"`` (registered; caches under ``CACHE_DIR``).
      cache_dirs: the cache folder of each task, in the mixture's task order.
      label: a short name for messages (``"wiki/train"``).
      mixture: the ``Mixture`` for kind ``"mixture"``, else None.
    """

    kind: str
    cache_dirs: tuple[str, ...]
    label: str
    mixture: Any = None


def resolve_name(name: str, *, split: str, cache_dir: str | None = None,
                 modules: Sequence[str] = ()) -> Resolved | None:
    """Resolves ``name``, in this order: a cache folder; ``cache_dir/<name>/<split>``
    when it is a cache; a task or mixture registered (after importing
    ``modules``), its caches under ``cache_dir``. Without ``cache_dir`` only
    the first applies. Returns a ``Resolved``, or None.
    """
    if layout.is_cache(name):
        return Resolved("folder", (os.fspath(name),), os.fspath(name))
    if not cache_dir:
        return None
    under = layout.cache_path(cache_dir, name, split)
    if layout.is_cache(under):
        return Resolved("cache", (under,), f"{name}/{split}")
    obj = registered(name, modules)
    if obj is None:
        return None
    if isinstance(obj, Mixture):
        # By name: a mixture's tasks need not be registered where it is read.
        dirs = tuple(layout.cache_path(cache_dir, n, split) for n in obj.task_names)
        return Resolved("mixture", dirs, name, obj)
    return Resolved("task", (layout.cache_path(cache_dir, obj.name, split),), f"{name}/{split}")


def registered(name: str, modules: Sequence[str] = ()):
    """The task or mixture registered as ``name`` after importing ``modules``;
    None when there is none (``not_registered`` says why)."""
    for module in modules:
        import_definitions(module)
    try:
        return get_task_or_mixture(name)
    except KeyError:
        return None


def not_registered(name: str) -> str:
    """Why ``name`` is no registered task or mixture (with close names)."""
    try:
        get_task_or_mixture(name)
    except KeyError as e:
        return str(e.args[0] if e.args else e)
    return f"{name!r} is registered"
