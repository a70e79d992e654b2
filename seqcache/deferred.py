"""Deferred imports: modules that another library imports at its own start-up
but that a run may never use, loaded on their first use instead.

Apache Beam imports boto3 (for its S3 file system) and httplib2 (its HTTP
client) as it starts, together with botocore, s3transfer and pyparsing behind
them: about 0.2 s of a build's fixed cost, for clients that a local build
never calls. ``deferring(names)`` puts such a module into
``sys.modules`` as a deferred module: ``import boto3`` succeeds and Beam
registers its S3 file system as before, and the module's code runs when one of
its attributes is first read (a later ``import boto3`` statement reads one), in
whichever thread reads it.

This is ``importlib.util.LazyLoader``'s scheme, with one difference: before
Python 3.12.3 ``LazyLoader`` lets a second thread read a module that the first
is still running, and see it half-filled. Here each deferred module runs under
a lock of its own, and stays deferred until it has run, so every thread sees
it whole.

A submodule imported before its deferred package has run (``import
boto3.session``) is imported as usual, and the package runs when one of its
own attributes is read: the import system reads only the package's
``__path__``. A package can be deferred only when its submodules can be
imported that way, before the package itself. boto3's and httplib2's can
(tests/test_deferred.py imports them so); requests' cannot, as they import
one another through the package.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Iterable, Iterator


class _Loader(importlib.abc.Loader):
    """Wraps a module's own loader: the module is created as usual, but its
    code runs on the first attribute read (``_DeferredModule``)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = self.loader
        module.__loader__ = self.loader
        module.__class__ = _deferred_class(self.loader, dict(module.__dict__))


# Module attributes that exist before the module's code runs, and that the
# import system reads; a deferred module gives them without running.
_SET_BEFORE_RUNNING = frozenset({"__name__", "__spec__", "__path__", "__loader__", "__package__", "__file__",
                                 "__cached__", "__class__"})


def _deferred_class(loader, attrs_then: dict) -> type:
    """The class of one deferred module: its first attribute read runs the
    module (``loader.exec_module``) under a lock, and only then makes it a
    plain module. Another thread that reads meanwhile waits for the lock and
    finds the module whole; reads from the module's own code while it runs
    (its imports of its submodules) are plain reads. Attributes set on the
    module before it ran (``import boto3.x`` sets ``x``) are kept, as in
    ``importlib.util.LazyLoader``. The attributes the import system reads
    (``_SET_BEFORE_RUNNING``: ``__path__``, ``__spec__``, ...) are read without
    running the module or waiting for it, so that a thread importing a
    submodule while another runs the module does not wait for a lock the
    other needs; and the module pickles by name, loaded or not."""
    lock = threading.RLock()
    running = []

    class _DeferredModule(types.ModuleType):
        def __getattribute__(self, attr):
            if attr in _SET_BEFORE_RUNNING:
                # What the import system reads: a thread importing a submodule
                # reads its parent's __path__ holding the submodule's import
                # lock, which the module's own code may be waiting for.
                return types.ModuleType.__getattribute__(self, attr)
            if attr in ("__reduce_ex__", "__reduce__"):
                name = types.ModuleType.__getattribute__(self, "__name__")
                return lambda *_: (importlib.import_module, (name,))  # pickled by name, as modules are
            with lock:
                if type(self) is _DeferredModule:
                    if running:  # the module's own code, in this thread
                        return types.ModuleType.__getattribute__(self, attr)
                    running.append(True)
                    try:
                        namespace = types.ModuleType.__getattribute__(self, "__dict__")
                        set_since = {k: v for k, v in namespace.items()
                                     if k not in attrs_then or attrs_then[k] is not v}
                        loader.exec_module(self)
                        namespace.update(set_since)
                    finally:
                        running.clear()
                        self.__class__ = types.ModuleType
            return getattr(self, attr)

        def __delattr__(self, attr):
            self.__getattribute__(attr)  # runs the module first
            delattr(self, attr)

    return _DeferredModule


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the top-level modules ``names`` on ``sys.path`` and hands them out
    with a deferring loader; any other name goes to the next finder."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)

    def find_spec(self, name, path=None, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # not installed (the import raises as usual), or a loader that cannot defer
        spec.loader = _Loader(spec.loader)
        return spec


@contextlib.contextmanager
def deferring(names: Iterable[str]) -> Iterator[None]:
    """While the block runs, an import of a top-level module in ``names`` that
    is installed and not yet imported gives a deferred module, run on its first
    attribute read (which also runs its imports, and raises what they raise).
    Modules already imported, modules that are not installed and submodules
    (``import boto3.session`` loads ``boto3`` first) import as usual."""
    finder = _Finder(n for n in names if n not in sys.modules)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)


def is_deferred(name: str) -> bool:
    """Whether ``sys.modules[name]`` is a deferred module not loaded yet."""
    module = sys.modules.get(name)
    return module is not None and type(module).__name__ == "_DeferredModule"
