"""The seqcache process's own settings, in one place: which process is one of
seqcache's own (the ``seqcache`` executable or a worker of its local engine),
its frozen heap (``gc.freeze``), glibc malloc's thresholds, and Beam imported
quietly and without pandas. Each is measured in benchmarks/README.md."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
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


# Fault injection, for the tests of builds that die at a chosen moment (docs/bad-input.md,
# "A build that dies"). Unset, ``fault_point`` is one dictionary lookup.
FAULT_VARIABLE = "SEQCACHE_FAULT"
FAULT_LOG_VARIABLE = "SEQCACHE_FAULT_LOG"
FAULT_ACTIONS = ("kill", "killgroup", "stop", "raise")
_fault_counts: dict[str, int] = {}  # passages of each point under _fault_spec (counted anew when it changes)
_fault_spec: list = [None, None]  # the spec counted under; the spec ``inherit_fault`` set


class InjectedFault(RuntimeError):
    """Raised at a fault point by ``SEQCACHE_FAULT=<point>:<n>:raise``."""


def fault_point(name: str) -> None:
    """A moment of a build at which a test can make this process die
    (``$SEQCACHE_FAULT`` = ``<name>:<n>:<action>``: at the n-th time this
    process passes the point ``name``, ``kill`` sends itself SIGKILL,
    ``killgroup`` SIGKILLs its process group, ``stop`` sends itself SIGSTOP
    and ``raise`` raises ``InjectedFault``), and record the moments it passes
    (``$SEQCACHE_FAULT_LOG``: a file the name is appended to, one line each).
    Neither variable set: nothing happens.

    Raises:
      InjectedFault: the ``raise`` action.
      ValueError: ``$SEQCACHE_FAULT`` is not ``<name>:<n>:<action>``.
    """
    env = os.environ
    log_path = env.get(FAULT_LOG_VARIABLE)
    spec = env.get(FAULT_VARIABLE)
    if not spec and not log_path:
        return
    if log_path:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(name + "\n")
    if not spec:
        return
    try:
        point, n, action = spec.rsplit(":", 2)
        n = int(n)
    except ValueError:
        raise ValueError(f"${FAULT_VARIABLE}={spec!r} is not <point>:<n>:<action>") from None
    if action not in FAULT_ACTIONS:
        raise ValueError(f"${FAULT_VARIABLE}={spec!r}: the action must be one of {', '.join(FAULT_ACTIONS)}")
    if _fault_spec[0] != spec:
        _fault_spec[0] = spec
        _fault_counts.clear()
    if point != name:
        return
    count = _fault_counts[name] = _fault_counts.get(name, 0) + 1
    if count != n:
        return
    if action == "raise":
        raise InjectedFault(f"fault injected at {name} #{n} (${FAULT_VARIABLE})")
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    if action == "killgroup":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def inherit_fault(spec: str | None) -> None:
    """Hands a fault spec (``$SEQCACHE_FAULT`` of the process that made a
    build's steps) to a worker that did not inherit the variable (a Dask
    worker), so that a test's fault follows the build to any runner; None
    (a build without one) takes back a spec set so before."""
    if spec:
        if not os.environ.get(FAULT_VARIABLE):
            os.environ[FAULT_VARIABLE] = _fault_spec[1] = spec
    elif _fault_spec[1] is not None and os.environ.get(FAULT_VARIABLE) == _fault_spec[1]:
        del os.environ[FAULT_VARIABLE]  # the build that set it is over: a worker that lives on forgets it
        _fault_spec[1] = None


def reset_faults() -> None:
    """Forgets the passages counted (a test that sets the same ``$SEQCACHE_FAULT`` again in one process)."""
    _fault_counts.clear()
    _fault_spec[0] = None
