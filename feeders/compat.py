"""Compatibility rules, each written once: what a saved feeder state (or the
checkpoint that holds it) must share with the run that restores it, and what a
cache allows of the run that reads it.

  global batch B     a global position is p = s * B + r, so a state saved with B
                     denotes its examples only with B (``check_global_batch``).
  hosts H            host h reads rows [h * B / H, (h + 1) * B / H): H divides B
                     (``check_hosts``); a restored run keeps B, only H can change.
  sequence length L  the caches' own by default; a given L only cuts rows
                     shorter (``seqcache.lengths.fit_lengths``).
  fingerprints       a state's cache is the cache with the same fingerprint and
                     example count, wherever it is found (``check_fingerprints``).

The feeder (``Feeder``, ``Feeder.restore``, ``state.stream_difference``) and the
trainer (its checkpoints, resume and data checks) call these. A caller that
reports in its own terms (a checkpoint's path, a CLI flag to change) wraps the
message in its own error type and adds its hint; it does not reword the rule.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Sequence

import numpy as np


class FeederStateError(ValueError):
    """A feeder state is malformed, from another version, or does not match the
    caches or the configuration it is restored into."""


# --- global batch ----------------------------------------------------------------

GLOBAL_BATCH_CONSEQUENCE = "a global position is step * B, so another B gives every later step other examples"


def global_batch_difference(restored: int, current: int, *, restored_from: str = "the feeder state was saved with",
                            current_from: str = "this run has") -> str | None:
    """Why a restored global batch size B (rows per step) is not the current
    one: "{restored_from} global batch size R, {current_from}
    global_batch_size=C; a global position is step * B, ...", or None when
    equal. ``restored_from``/``current_from`` start the clause naming each
    value, e.g. "checkpoint was saved with" and "the current config has"."""
    if int(restored) == int(current):
        return None
    return (f"{restored_from} global batch size {restored}, {current_from} global_batch_size={current}; "
            f"{GLOBAL_BATCH_CONSEQUENCE}")


def check_global_batch(restored: int, current: int, **names: str) -> None:
    """Refuses a restored global batch size that is not the current one.

    Raises:
      FeederStateError: ``global_batch_difference(restored, current, **names)``.
    """
    diff = global_batch_difference(restored, current, **names)
    if diff:
        raise FeederStateError(diff)


# --- hosts -----------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending (O(sqrt n))."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def host_counts_for(global_batch_size: int, wanted: int, *, shown: int = 8) -> str:
    """The host counts a state saved with this global batch restores onto, for a
    message: the first ``shown`` divisors of B, and the ones nearest ``wanted``
    (e.g. "1, 2, 3, 4, 6, 8, 12, 16, ..., 256 (nearest to 100: 96, 128)")."""
    ds = divisors(int(global_batch_size))
    text = ", ".join(map(str, ds[:shown]))
    if len(ds) > shown:
        text += f", ..., {ds[-1]}"
        below = [d for d in ds if d < wanted]
        above = [d for d in ds if d > wanted]
        near = [x for x in (below[-1] if below else None, above[0] if above else None)
                if x is not None and x not in ds[:shown] and x != ds[-1]]
        if near:
            text += f" (nearest to {wanted}: {', '.join(map(str, near))})"
    return text


def check_hosts(global_batch_size: int, host_index: int, host_count: int, *, saved: bool = False) -> None:
    """Refuses a host slicing of the global batch B (rows per step over all
    hosts) that is not exact: 1 <= H <= B, H divides B and 0 <= h < H.
    ``saved``: B comes from a saved feeder state, which a restored run keeps, so
    the message lists the host counts that divide B instead of other batches.

    Raises:
      FeederStateError (a ValueError): ``saved``, and H does not divide the
        state's B (the state cannot be restored on H hosts).
      ValueError: naming B and H (or h), and what would work.
    """
    b, h, n = global_batch_size, host_index, host_count
    if not isinstance(b, (int, np.integer)) or b < 1:
        raise ValueError(f"global_batch_size must be an integer >= 1 (got {b!r})")
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"host_count must be an integer >= 1 (got {n!r})")
    if saved and b % n:
        raise FeederStateError(
            f"the feeder state was saved with global_batch_size={b}, which host_count={n} does not "
            f"divide (every host reads B / H rows, and a restored run keeps B): restore on a host count that "
            f"divides {b}: {host_counts_for(b, n)}"
        )
    if n > b:
        raise ValueError(
            f"host_count={n} is larger than global_batch_size={b}: every host needs at least one row; "
            f"use a global batch of at least {n} rows"
        )
    if b % n:
        raise ValueError(
            f"global_batch_size={b} is not divisible by host_count={n}: every host reads B / H rows; "
            f"use a global batch that is a multiple of {n} (e.g. {b - b % n} or {b + n - b % n})"
        )
    if not isinstance(h, (int, np.integer)) or not 0 <= h < n:
        raise ValueError(f"host_index must be in [0, {n}) for host_count={n} (got {h!r})")


# --- fingerprints --------------------------------------------------------------------

def _paths(entries: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(str(e.get("path")) for e in entries)


def fingerprint_difference(saved: Sequence[Mapping[str, Any]], current: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the caches of a saved state are not the current ones, by fingerprint
    and example count in mixture order (paths are not compared), or None.

    ``saved``, ``current``: mixture entries (``state.mixture_entries``); only the
    first min(len(saved), len(current)) are compared (the callers decide
    whether another count of caches is allowed). The first difference names
    both values: the same caches in another order; a rebuilt cache ("the cache
    at PATH was rebuilt (fingerprint A, the state was saved with fingerprint B
    at PATH')"); another task's cache; another example count.
    """
    fps = lambda entries: [e.get("fingerprint") for e in entries]  # noqa: E731
    if len(saved) == len(current) and fps(saved) != fps(current) and sorted(fps(saved)) == sorted(fps(current)):
        return (
            f"this run lists the state's caches in another order (state: {_paths(saved)}; this run: "
            f"{_paths(current)}); the mixture order is part of the stream"
        )
    for i, (a, b) in enumerate(zip(saved, current)):
        diff = _entry_difference(i, a, b)
        if diff:
            return diff
    return None


def _entry_difference(i: int, saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    path, saved_path = current.get("path"), saved.get("path")
    if saved.get("fingerprint") != current.get("fingerprint"):
        if (saved.get("task"), saved.get("split")) == (current.get("task"), current.get("split")):
            # The saved path in ``state.location``'s form: absolute unless a URL.
            stored = saved_path if saved_path is None or "://" in saved_path else os.path.abspath(saved_path)
            where = "" if stored in (None, path) else f" at {saved_path}"
            return (
                f"the cache at {path} was rebuilt (fingerprint {current.get('fingerprint')}, the state was saved "
                f"with fingerprint {saved.get('fingerprint')}{where}), so the saved position no longer denotes the "
                "same examples"
            )
        return (
            f"mixture entry {i}: this run reads {path} (task {current.get('task')!r}, split {current.get('split')!r}, "
            f"fingerprint {current.get('fingerprint')}), but the state was saved with {saved_path} (task "
            f"{saved.get('task')!r}, split {saved.get('split')!r}, fingerprint {saved.get('fingerprint')})"
        )
    if saved.get("num_examples") != current.get("num_examples"):
        return (
            f"the cache at {path} has {current.get('num_examples')} examples, but the state records "
            f"{saved.get('num_examples')} for the same fingerprint; the state or the manifest was edited"
        )
    return None

