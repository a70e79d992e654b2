"""levanter: an ``AsyncDataset`` whose index i is row i of the Feeder's global stream.

levanter's ``DataLoader`` asks its dataset for global indices: the rows of step
s are indices [s * B, (s + 1) * B), and each process asks only for its own rows
(those of its devices). levanter resumes from the trainer's step alone
(``iter_from_step(state.step)``), with no data state, so index i must be the same
example on every process count. This module makes index i the Feeder's global
position i (row r of step s is index s * B + r), for one cache, a mixture or a
mixture schedule, finite or forever, so that levanter consumes the Feeder's
stream exactly, resumes on any process count, and changes nothing in levanter:

    from levanter.data.text import DirectDatasetComponent, LmDataConfig
    from seqcache.feeders.trainers.levanter import cache_dataset

    train = cache_dataset(cache="caches/wiki/train", global_batch_size=256, sequence_length=1024, seed=0)
    data = LmDataConfig(tokenizer="passthrough", vocab_size=32_000,
                        components={"seqcache": DirectDatasetComponent(datasets={"train": train})},
                        shuffle=False, mixture_block_size=1)

``shuffle=False`` and ``mixture_block_size=1`` keep the order: levanter's
``MixtureDataset`` (which ``LmDataConfig.train_set`` always builds, even over one
component) permutes indices within blocks of ``mixture_block_size`` rows (2,048 by
default) even with shuffling off. Mixing belongs to the Feeder here (``mixture=``,
schedules): levanter is given one component. docs/trainers/levanter.md has the
whole recipe.

Importing this module imports neither levanter nor JAX: ``FeederRows`` (the index
arithmetic and reads) needs neither, and the ``AsyncDataset`` subclass
``FeederDataset`` is defined when first asked for (``cache_dataset(...)``, or
``from seqcache.feeders.trainers.levanter import FeederDataset``), which imports levanter.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from typing import Any, Mapping, Sequence

import numpy as np

from seqcache.feeders.feeder import Feeder

# Feeders kept open at once, one per host slice asked for (usually one: this
# process's rows; levanter also asks for index 0 alone when its loader starts).
_OPEN_SLICES = 4

_FEEDER_ARGS = ("cache", "mixture", "caches_root", "split", "global_batch_size", "sequence_length", "seed",
                "num_epochs", "feature", "num_threads", "prefetch")


class FeederRows:
    """Rows of a Feeder's global stream by global position, any positions, any order.

    Args (keyword-only): those of ``Feeder`` that define the stream: ``cache`` or
      ``mixture`` (a mixture or a mixture schedule; ``caches_root`` and ``split``
      for a ``seqcache.tasks.Mixture``), ``global_batch_size`` (B),
      ``sequence_length`` (L; default the caches' own), ``seed``, ``num_epochs`` (None: forever),
      ``feature``; and ``num_threads``, ``prefetch`` (reading only). No host index
      or count: every position of the global stream can be asked for.

    Global position p is row r = p mod B of step s = p // B. ``rows(positions)``
    groups the positions by step and reads each step's rows through
    ``Feeder.get_batch``: for a step it picks the smallest host slice (h of H, H a
    divisor of B) that holds every row asked for in that step, so a process that
    asks for its own B / P rows reads those rows only, and one that asks for a
    whole step reads it once. A Feeder per slice is kept open (at most 4, least
    recently used closed first); each prefetches the steps after the one it read.

    Thread-safe. Picklable (the Feeders reopen in the new process).

    Raises (constructor):
      ValueError, seqcache.format.CacheError: as ``Feeder``'s constructor.
    """

    def __init__(self, *, cache=None, mixture=None, caches_root=None, split: str = "train",
                 global_batch_size: int, sequence_length: Mapping[str, int] | int | None = None, seed: int = 0, num_epochs: int | None = None,
                 feature: str = "targets", num_threads: int | None = None, prefetch: int | None = None):
        self.seed = seed
        self._args = dict(cache=cache, mixture=mixture, caches_root=caches_root, split=split,
                          global_batch_size=global_batch_size, sequence_length=sequence_length, seed=seed,
                          num_epochs=num_epochs, feature=feature, num_threads=num_threads, prefetch=prefetch)
        self._open()

    def _open(self) -> None:
        self._lock = threading.Lock()
        self._feeders: collections.OrderedDict[tuple[int, int], Feeder] = collections.OrderedDict()
        whole = Feeder(host_index=0, host_count=1, **self._args)  # checks the arguments and opens the caches
        self._feeders[(0, 1)] = whole
        self.global_batch_size = whole.global_batch_size
        self.sequence_length = whole.sequence_length
        self.feature = whole.feature
        self.num_steps: int | None = whole.num_steps
        self._row_counts = _divisors(self.global_batch_size)  # rows per host slice, ascending

    def __getstate__(self) -> dict:
        return {"_args": self._args}

    def __setstate__(self, state: dict) -> None:
        self._args = state["_args"]
        self.seed = self._args["seed"]
        self._open()

    @property
    def length(self) -> int | None:
        """num_steps * B positions for a finite run (its last steps may hold
        padding rows, which have zero loss weight), None when it repeats forever."""
        return None if self.num_steps is None else self.num_steps * self.global_batch_size

    def _slice_feeder(self, h: int, n_hosts: int) -> Feeder:
        key = (h, n_hosts)
        with self._lock:
            if self._args is None:
                raise RuntimeError("the dataset is closed")
            feeder = self._feeders.get(key)
            if feeder is not None:
                self._feeders.move_to_end(key)
                return feeder
        feeder = Feeder(host_index=h, host_count=n_hosts, **self._args)
        evicted = []
        with self._lock:
            if key in self._feeders:  # another thread opened it meanwhile
                evicted.append(feeder)
                feeder = self._feeders[key]
            else:
                self._feeders[key] = feeder
                while len(self._feeders) > _OPEN_SLICES:
                    evicted.append(self._feeders.popitem(last=False)[1])
        for f in evicted:
            f.close()
        return feeder

    def _step_rows(self, step: int, rows: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The batch of the smallest host slice holding ``rows`` (int64 (n,) in
        [0, B)) of ``step``, and the rows' indices into that batch."""
        lo, hi = int(rows.min()), int(rows.max())
        per_host = next(d for d in self._row_counts if lo // d == hi // d)
        h = lo // per_host
        batch = self._slice_feeder(h, self.global_batch_size // per_host).get_batch(step)
        return batch, rows - h * per_host

    def rows(self, positions: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The Feeder's fields of global positions ``positions`` (n of them, any
        order, repeats allowed), row j for positions[j]: the batch keys of
        ``Feeder`` (docs/feeder.md, "Batches"), "<feature>" int32 (n, L),
        "<feature>_segment_ids" int32 (n, L), "<feature>_positions" int32 (n, L),
        "<feature>_loss_weights" float32 (n, L), "task_index" int32 (n,),
        "cache_index" int64 (n,), "epoch" int64 (n,); plus "position" int64 (n,).

        Raises:
          IndexError: a negative position, or one at or past ``length`` in a finite run.
        """
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = p.size
        if n and (p.min() < 0 or (self.length is not None and p.max() >= self.length)):
            bad = int(p[(p < 0) | (p >= (self.length or 2**63 - 1))][0])
            end = "" if self.length is None else (
                f" [0, {self.length}): {self.num_steps} steps of {self.global_batch_size} rows")
            raise IndexError(f"global position {bad} is outside the stream{end}")
        steps, rows = np.divmod(p, self.global_batch_size)
        out: dict[str, np.ndarray] = {}
        for step in np.unique(steps).tolist():
            at = np.flatnonzero(steps == step)
            batch, idx = self._step_rows(step, rows[at])
            for key, arr in batch.items():
                if key not in out:
                    out[key] = np.empty((n,) + arr.shape[1:], arr.dtype)
                out[key][at] = arr[idx]
        if not n:
            out = _empty_rows(self.feature, self.sequence_length[self.feature])
        out["position"] = p
        return out

    def close(self) -> None:
        """Closes every open Feeder. Idempotent."""
        with self._lock:
            feeders, self._feeders = list(self._feeders.values()), collections.OrderedDict()
            self._args = None
        for f in feeders:
            f.close()


def _divisors(n: int) -> list[int]:
    """The divisors of n >= 1, ascending, in O(sqrt(n))."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _empty_rows(feature: str, length: int) -> dict[str, np.ndarray]:
    """The Feeder's batch keys with no rows."""
    out = {name: np.empty((0, length), dt) for name, dt in
           ((feature, np.int32), (f"{feature}_segment_ids", np.int32), (f"{feature}_positions", np.int32),
            (f"{feature}_loss_weights", np.float32))}
    out.update(task_index=np.empty(0, np.int32), cache_index=np.empty(0, np.int64), epoch=np.empty(0, np.int64))
    return out


def next_token_loss_weight(segment_ids: np.ndarray) -> np.ndarray:
    """levanter's loss weight for packed rows: position j predicts token j + 1, so
    it counts when token j + 1 is in the same segment as token j (not padding):
    w[j] = (seg[j] != 0) and (seg[j + 1] == seg[j]), and w[L - 1] = 0. The first
    token of each segment is never a target (levanter's examples have no
    beginning-of-sequence input), nor is anything predicted across segments.

    Args:
      segment_ids: int (..., L), 0 on padding.

    Returns:
      float32 (..., L).
    """
    seg = np.asarray(segment_ids)
    w = np.zeros(seg.shape, np.float32)
    w[..., :-1] = (seg[..., :-1] != 0) & (seg[..., 1:] == seg[..., :-1])
    return w


class _FeederDatasetBase:
    """The part of ``FeederDataset`` that needs no levanter: lengths, rows, repr."""

    def __init__(self, **feeder_args: Any):
        self._rows = FeederRows(**feeder_args)

    @property
    def global_batch_size(self) -> int:
        return self._rows.global_batch_size

    @property
    def sequence_length(self) -> dict[str, int]:
        """{feature: tokens per row}, the Feeder's (``Feeder.sequence_length``)."""
        return self._rows.sequence_length

    @property
    def num_steps(self) -> int | None:
        return self._rows.num_steps

    def is_finite(self) -> bool:
        return self._rows.length is not None

    async def async_len(self) -> int:
        if self._rows.length is None:
            raise ValueError("the Feeder's stream repeats forever (num_epochs=None): the dataset has no length; "
                             "give num_epochs= for a finite one")
        return self._rows.length

    async def final_length_is_known(self) -> bool:
        return self.is_finite()

    async def current_len(self) -> int | None:
        return self._rows.length

    async def wait_until_len_at_least(self, length: int) -> int:
        return length if self._rows.length is None else self._rows.length

    def rows(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """The Feeder's fields of these global positions: see ``FeederRows.rows``."""
        return self._rows.rows(indices)

    def close(self) -> None:
        """Closes the Feeders' threads and shard readers."""
        self._rows.close()

    def __repr__(self) -> str:
        n = "forever" if self._rows.num_steps is None else f"{self._rows.num_steps} steps"
        return (f"FeederDataset(B={self._rows.global_batch_size}, L={self._rows.sequence_length}, "
                f"seed={self._rows.seed}, {n})")


@functools.cache
def _dataset_class() -> type:
    """Defines ``FeederDataset`` (imports levanter, and so JAX)."""
    from levanter.data import AsyncDataset  # optional: levanter
    from levanter.data.text.examples import GrugLmExample  # optional: levanter
    from levanter.grug.attention import AttentionMask  # optional: levanter

    class FeederDataset(_FeederDatasetBase, AsyncDataset[GrugLmExample]):
        """A levanter ``AsyncDataset[GrugLmExample]`` whose index i is global
        position i of the Feeder's stream (row i mod B of step i // B).

        Args (keyword-only): as ``FeederRows`` (those of ``Feeder`` that define the
          stream, without host index or count).

        Examples (``GrugLmExample``, numpy leaves; levanter's loader stacks them):
          tokens: int32 (L,), the Feeder row's tokens (0 on padding).
          loss_weight: float32 (L,): ``next_token_loss_weight`` of the row's
            segment ids (0 on padding tokens, on padding rows, at each segment's
            last token and at position L - 1).
          attn_mask: causal, with the row's segment ids (int32 (L,), 0 on padding)
            for packed rows, so that no token attends across segments.

        Length: ``num_steps * B`` for a finite run (``num_epochs`` = E; its padding
        rows have zero loss weight), infinite (``is_finite()`` False,
        ``async_len`` raises ValueError) when ``num_epochs`` is None.

        ``rows(indices)`` gives the Feeder's fields of any indices, with
        "cache_index", "task_index" and "epoch": what levanter's step consumed.

        Raises (constructor):
          ValueError, seqcache.format.CacheError: as ``Feeder``'s constructor.
        """

        def examples(self, indices: Sequence[int] | np.ndarray) -> list:
            """The ``GrugLmExample`` of each index, read together (synchronous)."""
            rows = self._rows.rows(indices)
            f = self._rows.feature
            tokens, seg = rows[f], rows[f"{f}_segment_ids"]
            weights = next_token_loss_weight(seg)
            causal = AttentionMask.causal()
            return [GrugLmExample(tokens=tokens[j], loss_weight=weights[j],
                                  attn_mask=causal.with_segment_ids(seg[j]))
                    for j in range(tokens.shape[0])]

        async def get_batch(self, indices: Sequence[int]) -> Sequence[GrugLmExample]:
            # Reads block: they run on a worker thread, not in levanter's event loop.
            return await asyncio.to_thread(self.examples, list(indices))

        async def getitem_async(self, index: int) -> GrugLmExample:
            return (await self.get_batch([index]))[0]

    FeederDataset.__module__ = __name__
    FeederDataset.__qualname__ = "FeederDataset"
    return FeederDataset


def cache_dataset(**feeder_args: Any):
    """A ``FeederDataset`` (a levanter ``AsyncDataset[GrugLmExample]``) over the
    Feeder's stream: index i is global position i. Arguments (keyword-only) as
    ``FeederRows``: ``cache=`` or ``mixture=`` (mixture or schedule),
    ``global_batch_size``, ``sequence_length``, ``seed``, ``num_epochs``, ...

    Give levanter the same global batch (``trainer.train_batch_size = B``) so that
    levanter's step s reads the Feeder's step s, and use ``shuffle=False``,
    ``mixture_block_size=1`` (module docstring).

    Raises:
      ImportError: levanter is not installed.
      ValueError, seqcache.format.CacheError: as ``Feeder``'s constructor.
    """
    unknown = sorted(set(feeder_args) - set(_FEEDER_ARGS))
    if unknown:
        raise TypeError(f"cache_dataset() got unexpected argument(s) {unknown}; it takes {list(_FEEDER_ARGS)} "
                        "(no host index or count: levanter asks for global indices)")
    return _dataset_class()(**feeder_args)


def __getattr__(name: str):
    if name == "FeederDataset":
        return _dataset_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
