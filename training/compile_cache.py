"""JAX's persistent compilation cache for the commands that compile (train,
eval, infer): a run that restarts (a preemption, ``--stop-at-step``, another
``seqcache eval`` of the same run) loads the executables XLA compiled before
instead of compiling them again. On one TPU v5e ``large`` and ``1b`` compile
their train step in about 56 s and 84 s (benchmarks/README.md); a program read
from the cache takes the time of reading its file.

Where the cache lives (``resolve``): ``--compilation-cache DIR``; else the
folder of ``JAX_COMPILATION_CACHE_DIR`` (JAX's own variable) where it is set;
else, on a TPU or GPU, ``$XDG_CACHE_HOME/seqcache/jax`` (``~/.cache/seqcache/jax``);
on a CPU no cache (its programs compile in seconds, and a CPU run's results do
not depend on it either way). ``--compilation-cache off`` turns it off.

An entry is keyed by JAX on the program, the compile options, the devices and
the versions of jax and jaxlib, so an executable is only ever reused for the
same program on the same kind of devices: results do not change. JAX writes
only programs that took at least ``jax_persistent_cache_min_compile_time_secs``
(1 s by default) to compile, and only from process 0; several hosts may
share one folder on a shared file system (MaxText's ``jax_cache_dir`` works
the same way). An entry that cannot be read (a process killed while JAX wrote
it) is compiled again, with JAX's warning naming the program, and is not
replaced: remove the folder to start over.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping

ENV_DIR = "JAX_COMPILATION_CACHE_DIR"


class CompileCacheError(ValueError):
    """A compilation cache folder that cannot be used (the message names it)."""


OFF = "off"
# The platforms whose compiles are long enough to keep by default.
ACCELERATORS = ("tpu", "gpu", "cuda", "rocm")


def default_dir(environ: Mapping[str, str] = os.environ) -> str:
    """``$XDG_CACHE_HOME/seqcache/jax``, ``~/.cache/seqcache/jax`` without it."""
    root = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "seqcache", "jax")


def resolve(flag: str | None, *, platform: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """The folder of the cache, or None for none (module docstring).

    Args:
      flag: ``--compilation-cache``: a folder, "off", or None (not given).
      platform: ``jax.default_backend()``: "cpu", "tpu", "gpu", ...
    """
    if flag == OFF:
        return None
    given = flag or environ.get(ENV_DIR)
    if given:
        return os.path.abspath(os.path.expanduser(given))
    return default_dir(environ) if platform in ACCELERATORS else None


@dataclasses.dataclass
class Counts:
    """What the cache did in this process: programs read from it (``hits``),
    programs compiled for want of an entry and written to it (``misses``;
    counted where JAX writes: on process 0, for programs over the minimum
    compile time; an entry already there is kept, not replaced) and the
    compile time the hits saved, in seconds (``saved_s``, as measured when
    they were written)."""

    directory: str | None = None
    hits: int = 0
    misses: int = 0
    saved_s: float = 0.0

    def as_dict(self) -> dict:
        return {"dir": self.directory, "hits": self.hits, "misses": self.misses, "saved_s": round(self.saved_s, 3)}


COUNTS = Counts()


def summary() -> dict:
    """``{"compilation_cache": COUNTS.as_dict()}`` where a cache is in use, else
    {}: the field of the commands' JSON summaries."""
    return {"compilation_cache": COUNTS.as_dict()} if COUNTS.directory else {}
_listening = False


def _on_event(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        COUNTS.hits += 1
    elif event == "/jax/compilation_cache/cache_misses":  # recorded before the entry is written
        COUNTS.misses += 1


def _on_duration(event: str, seconds: float, **_) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        COUNTS.saved_s += max(0.0, seconds)


def enable(flag: str | None) -> Counts:
    """Sets JAX's cache folder from ``flag`` (``resolve``, on the default
    backend; where that gives none, JAX's setting is left as it is, "off"
    clears it) and counts its hits in ``COUNTS``. Call it once, before
    anything is compiled (JAX reads the setting at the first compile).

    Off a GPU, JAX's extra XLA caches (the GPU autotuning cache, kept in a
    subfolder) are turned off: their folder enters the compile options and so
    every entry's key, and an entry would then be found only at the path it
    was written under (a folder moved, restored elsewhere or mounted at
    another path on another host would never hit).

    Raises:
      CompileCacheError: the folder cannot be created (naming it and where it
        came from).
    """
    import jax  # optional: jax

    global _listening
    platform = jax.default_backend()
    directory = resolve(flag, platform=platform)
    if directory is not None:
        try:
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise NotADirectoryError(0, "not a folder")
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            origin = ("--compilation-cache" if flag else ENV_DIR if os.environ.get(ENV_DIR)
                      else f"the default on a {platform.upper()}")
            raise CompileCacheError(f"cannot create the compilation cache folder {directory} (from {origin}): "
                                    f"{e.strerror or e}; give another folder or --compilation-cache off") from None
        jax.config.update("jax_compilation_cache_dir", directory)
        if platform not in ("gpu", "cuda", "rocm"):
            jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    elif flag == OFF:
        jax.config.update("jax_compilation_cache_dir", None)
    COUNTS.directory = jax.config.jax_compilation_cache_dir
    if COUNTS.directory and not _listening:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening = True
    return COUNTS
