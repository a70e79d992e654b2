"""The seqcache process's own settings, in one place: which process is one of
seqcache's own (the ``seqcache`` executable or a worker of its local engine),
its frozen heap (``gc.freeze``), glibc malloc's thresholds, and Beam imported
quietly and without pandas. Each is measured in benchmarks/README.md."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys

_own_process = False


# The cyclic collector's thresholds in seqcache's own processes (``gc.set_threshold``).
GC_THRESHOLDS = (10_000, 10, 10)


def own_process() -> None:
    """Marks this process as one of seqcache's own (the ``seqcache``
    executable or a worker of its local engine), whose heap ``freeze_heap``
    freezes, and whose cyclic collector runs its young generation every
    10,000 allocations (``GC_THRESHOLDS``; Python's 700): a command's
    imports and a build's listing of many files make hundreds of thousands
    of objects that live on, which 700 would have the collector walk again
    and again (0.15 s of a 2 s build of one file, 0.24 s of 50,000 files;
    0.06 and 0.07 s after: benchmarks/README.md). A program that calls
    ``build_task`` itself keeps its heap and its thresholds."""
    global _own_process
    _own_process = True
    gc.set_threshold(*GC_THRESHOLDS)


# glibc malloc's mmap and trim thresholds (``tune_allocator``).
MALLOC_MMAP_THRESHOLD = 32 << 20
MALLOC_TRIM_THRESHOLD = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def tune_allocator() -> bool:
    """Fixes glibc malloc's thresholds for a build's pattern of allocations
    (``mallopt``): blocks below ``MALLOC_MMAP_THRESHOLD`` (32 MiB) come from the
    heap, and a heap gives its free top back to the system only above
    ``MALLOC_TRIM_THRESHOLD`` (64 MiB). glibc's defaults (128 KiB, raised
    only as mapped blocks are freed) give a batch's buffers back to the system
    and fault them in again, zeroed, for the next batch: these halve the minor
    page faults and save 2.5% of CPU (benchmarks/README.md). An environment
    that sets a ``MALLOC_*`` variable or a ``glibc.malloc`` tunable in
    ``GLIBC_TUNABLES`` keeps its allocator.

    Returns:
      True if both thresholds were set; False elsewhere (not glibc, or the
      environment chose).
    """
    if not sys.platform.startswith("linux"):
        return False
    env = os.environ
    if any(k.startswith("MALLOC_") for k in env) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc's, not another C library's
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)
    trimmed = mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    return bool(mapped) and bool(trimmed)


def freeze_heap() -> None:
    """In seqcache's own processes (``own_process``), moves every object alive
    now (the imported modules: several hundred thousand objects) into the
    interpreter's permanent generation (``gc.freeze``), so that the cyclic
    garbage collections a build's short-lived objects trigger no longer walk
    them: about 4% of a build of short lines' CPU (benchmarks/README.md).
    Elsewhere (a program calling ``build_task``) it does nothing."""
    if _own_process:
        gc.freeze()


def import_beam():
    """Imports Beam (``apache_beam``) without its import-time warning about
    optional GCP client libraries (root logger, WARNING), which says nothing
    about seqcache's work, and without pandas.

    Beam imports pandas whenever it is installed, only to register pandas
    types for batched DoFns, which no seqcache pipeline uses: about a quarter
    of Beam's import time. While Beam is imported here, ``import pandas``
    fails (Beam then leaves those types out); afterwards it works as before.
    When pandas is already imported, Beam's import is left alone."""
    if "apache_beam.io.filesystems" not in sys.modules:
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)
        hidden = "pandas" not in sys.modules
        if hidden:
            sys.modules["pandas"] = None  # an import of it raises ImportError
        try:
            import apache_beam.io.filesystems  # noqa: F401  keeps Beam out of the feeder's import
        finally:
            root.setLevel(level)
            if hidden and sys.modules.get("pandas", 0) is None:
                del sys.modules["pandas"]
    return sys.modules["apache_beam"]
