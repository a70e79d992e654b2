"""PyTorch: a ``Stateful`` data loader over the Feeder's global stream.

``FeederLoader`` yields this rank's rows of each global batch as torch tensors in
torchtitan's ``(input_dict, labels)`` form, and its ``state_dict()`` is the
Feeder's JSON state (the global position), so a run resumes exactly on any
data-parallel world size that divides the global batch (G4, G5)::

    from seqcache.feeders.torch import FeederLoader

    loader = FeederLoader(cache="caches/wiki/train", global_batch_size=256, sequence_length=512)
    for input_dict, labels in loader:       # rank r of R: rows [r*256/R, (r+1)*256/R) of each step
        logits = model(input_dict["input"])  # int64 (256 // R, 512)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.save(loader.state_dict(), ...)     # or DCP, next to the model: {"dataloader": loader}

Three ways in, one stream:

- a plain loop over ``FeederLoader`` (above);
- torchdata's ``StatefulDataLoader(FeederDataset(...), batch_size=None)``: the
  dataset is itself ``Stateful``, so the loader's ``state_dict()`` carries the
  Feeder's JSON under ``"dataset_state"``;
- torchtitan: ``TorchtitanDataLoader``, a ``torchtitan.components.dataloader.
  BaseDataLoader`` built by ``Trainer.Config(dataloader=TorchtitanDataLoader.Config(...))``
  (created when first accessed, so that importing this module does not import
  torchtitan; docs/trainers/torchtitan.md has the recipe).

Why it resumes on another world size: every rank's state is the same global
position (a step boundary), so DCP writes it once and every rank of the next run,
however many there are, reads it and takes its own rows of the same next step.
torchtitan's own loaders keep one state per data-parallel rank and refuse a
changed data-parallel degree.

Importing ``seqcache.feeders`` does not import this module (nor torch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data

from seqcache import bounded_json
from seqcache.feeders.feeder import Feeder
from seqcache.feeders.state import FeederStateError

IGNORE_INDEX = -100
"""The label of a token that has no loss (torch's ``cross_entropy`` default
``ignore_index``, torchtitan's ``IGNORE_INDEX``)."""

STATE_KEY = "seqcache_feeder_state"
"""Key of the Feeder's JSON state (a str) in ``state_dict()``."""

MICROBATCH_KEY = "microbatches_served"
"""Key of the number of microbatches of the current step already served (0 at a
step boundary, where every checkpoint of a training loop is taken)."""


def dist_rank_and_world_size(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): the given ones; each None from ``torch.distributed``
    when it is initialised, else 0 and 1."""
    if rank is None or world_size is None:
        on = dist.is_available() and dist.is_initialized()
        if rank is None:
            rank = dist.get_rank() if on else 0
        if world_size is None:
            world_size = dist.get_world_size() if on else 1
    return int(rank), int(world_size)


def next_token_labels(tokens: np.ndarray, segment_ids: np.ndarray, loss_weights: np.ndarray) -> np.ndarray:
    """Language-model labels of packed rows: the next token of the same segment.

    labels[r, t] = tokens[r, t + 1] where token t + 1 is in the same segment as
    token t and has loss weight > 0; IGNORE_INDEX (-100) elsewhere: at the last
    token of every segment, on padding and at t = L - 1. Inputs stay the
    tokens themselves, so a row of L tokens gives L inputs and L labels (as
    torchtitan's text loaders shift inputs and labels within each document).

    Args:
      tokens: int (R, L). segment_ids: int (R, L), 0 = padding.
      loss_weights: float (R, L).

    Returns:
      int64 (R, L).
    """
    labels = np.full(tokens.shape, IGNORE_INDEX, dtype=np.int64)
    same = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0) & (loss_weights[:, 1:] > 0)
    labels[:, :-1] = np.where(same, tokens[:, 1:], IGNORE_INDEX)
    return labels


class FeederLoader:
    """Batches of the Feeder's global stream as torch tensors, for rank r of R.

    Each step's B rows are split between ranks as the Feeder splits them between
    hosts (rank r owns rows [r*B/R, (r+1)*B/R)); a rank's rows are served in
    microbatches of ``local_batch_size`` rows (gradient accumulation: B / (R *
    local_batch_size) microbatches per step, in row order).

    Args (keyword-only):
      global_batch_size: B, rows per step over all ranks. Must be the same in a
        resumed run (it is part of the stream).
      sequence_length: L, tokens per row (the model's sequence length).
      rank, world_size: r and R (the data-parallel rank and degree). Default:
        ``torch.distributed``'s rank and world size when it is initialised, else
        0 and 1. R must divide B.
      local_batch_size: rows per microbatch (default B / R); must divide B / R.
      positions: add ``"positions"`` (the position of each token in its packed
        segment) to the input dict, as torchtitan's text loaders do.
      on_rows: called with a dict for each microbatch served, before it is
        returned: ``step`` (int), ``microbatch`` (int), ``rank`` (int) and the
        Feeder's ``cache_index``, ``task_index``, ``epoch`` (numpy, one per row):
        the provenance of what the trainer consumed.
      **feeder_args: the Feeder's own (``cache`` or ``mixture``, ``caches_root``,
        ``split``, ``seed``, ``num_epochs``, ``start_step``, ``feature``,
        ``num_threads``, ``prefetch``); see ``seqcache.feeders.Feeder``.

    Iteration yields ``(input_dict, labels)``:

      input_dict["input"]      int64 (b, L): tokens (b = local_batch_size).
      input_dict["positions"]  int64 (b, L): position in the segment (if ``positions``).
      labels                   int64 (b, L): ``next_token_labels``; -100 = no loss.

    Iteration ends at the end of a finite run (``num_epochs``); forever otherwise.

    State (``state_dict``/``load_state_dict``, the ``torch.distributed.checkpoint``
    ``Stateful`` protocol): ``{STATE_KEY: Feeder.state() as JSON text,
    MICROBATCH_KEY: int, "world_size": R, "local_batch_size": b}``. The same on
    every rank: save it once, load it on any world size that divides B (unless
    it was saved between two microbatches of a step, which only the same world
    size and local batch size can continue).

    Raises:
      ValueError: a world size that does not divide B, a local batch size that
        does not divide B / R, or the Feeder's own argument errors.
      seqcache.format.CacheError: a cache cannot be opened.
    """

    def __init__(
        self,
        *,
        global_batch_size: int,
        sequence_length: int,
        rank: int | None = None,
        world_size: int | None = None,
        local_batch_size: int | None = None,
        positions: bool = True,
        on_rows: Callable[[dict], None] | None = None,
        **feeder_args: Any,
    ):
        rank, world_size = dist_rank_and_world_size(rank, world_size)
        self.rank, self.world_size = rank, world_size
        self._feeder = Feeder(global_batch_size=global_batch_size, sequence_length=sequence_length,
                              host_index=rank, host_count=world_size, **feeder_args)
        try:
            rows = self._feeder.rows_per_host
            self.local_batch_size = rows if local_batch_size is None else int(local_batch_size)
            if self.local_batch_size < 1 or rows % self.local_batch_size:
                raise ValueError(
                    f"local_batch_size={local_batch_size} does not divide the {rows} rows per rank "
                    f"(global_batch_size={global_batch_size} over world_size={world_size}); use a divisor of {rows}"
                )
        except BaseException:
            self._feeder.close()
            raise
        self.microbatches_per_step = rows // self.local_batch_size
        self.positions = positions
        self.on_rows = on_rows
        self._microbatch = 0

    # --- the stream --------------------------------------------------------------

    @property
    def feeder(self) -> Feeder:
        """The underlying Feeder (its ``step`` is the step being served)."""
        return self._feeder

    @property
    def step(self) -> int:
        """The step whose rows are served next (or are being served)."""
        return self._feeder.step

    @property
    def global_batch_size(self) -> int:
        return self._feeder.global_batch_size

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        feeder = self._feeder
        feature = feeder.feature
        while feeder.num_steps is None or feeder.step < feeder.num_steps:
            step = feeder.step
            batch = feeder.get_batch(step)
            while self._microbatch < self.microbatches_per_step:
                m = self._microbatch
                rows = slice(m * self.local_batch_size, (m + 1) * self.local_batch_size)
                item = self._convert(batch, feature, rows)
                if self.on_rows is not None:
                    self.on_rows({"step": step, "microbatch": m, "rank": self.rank,
                                  "cache_index": batch["cache_index"][rows].copy(),
                                  "task_index": batch["task_index"][rows].copy(),
                                  "epoch": batch["epoch"][rows].copy()})
                # The state moves before the item is handed over: a state_dict()
                # taken after the consumer has it names the next microbatch.
                self._microbatch = m + 1
                if self._microbatch == self.microbatches_per_step:
                    self._microbatch = 0
                    feeder.step = step + 1
                yield item
                if feeder.step != step:
                    break

    def _convert(self, batch: Mapping[str, np.ndarray], feature: str, rows: slice):
        tokens = batch[feature][rows]
        labels = next_token_labels(tokens, batch[f"{feature}_segment_ids"][rows],
                                   batch[f"{feature}_loss_weights"][rows])
        input_dict = {"input": torch.from_numpy(tokens.astype(np.int64))}
        if self.positions:
            input_dict["positions"] = torch.from_numpy(batch[f"{feature}_positions"][rows].astype(np.int64))
        return input_dict, torch.from_numpy(labels)

    # --- state -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``{STATE_KEY: JSON text of Feeder.state(), MICROBATCH_KEY: int,
        "world_size": R, "local_batch_size": b}``: the same on every rank (the
        global position of the step being served, the microbatches of it
        already served, and the slicing they were served with)."""
        return {STATE_KEY: json.dumps(self._feeder.state(), sort_keys=True), MICROBATCH_KEY: self._microbatch,
                "world_size": self.world_size, "local_batch_size": self.local_batch_size}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Moves to a saved position, on this loader's rank and world size.

        An empty dict is accepted and changes nothing (torchtitan loads one when
        a checkpoint has no data state).

        Raises:
          FeederStateError (a ValueError): not a state of this loader; a state
            of another stream (other caches, seed, global batch size, sequence
            length, ...: the message names both values); a state saved
            between two microbatches of a step on another world size or local
            batch size; or a ``microbatches_served`` outside [0, B / (R * b))
            of the slicing it was saved with.
        """
        if not state_dict:
            return
        where = "dataloader state"
        if STATE_KEY not in state_dict:
            raise FeederStateError(
                f"{where}: no {STATE_KEY!r} (keys: {sorted(state_dict)[:8]}); it was not saved by "
                "seqcache.feeders.torch.FeederLoader"
            )
        text = state_dict[STATE_KEY]
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text)
        if not isinstance(text, (str, bytes)):
            raise FeederStateError(f"{where}: {STATE_KEY} is a {type(text).__name__}, expected JSON text")
        state = bounded_json.loads(text, path=where, error=FeederStateError, what="feeder state")
        microbatch = bounded_json.integer(state_dict.get(MICROBATCH_KEY, 0), MICROBATCH_KEY, path=where,
                                          error=FeederStateError, hi=2**31)
        if microbatch:
            self._check_mid_step(state_dict, microbatch)
        self._feeder.set_state(state)
        self._microbatch = microbatch

    def _check_mid_step(self, state_dict: Mapping[str, Any], microbatch: int) -> None:
        """A state saved between two microbatches of a step names its rows by
        microbatch of one rank's slice: only the same slicing continues it, and
        the microbatch must be one of a step's B / (R * b) under that slicing."""
        saved = (state_dict.get("world_size"), state_dict.get("local_batch_size"))
        r, b = saved
        if (isinstance(r, int) and isinstance(b, int) and not isinstance(r, bool) and not isinstance(b, bool)
                and r >= 1 and b >= 1 and self.global_batch_size % (r * b) == 0):
            per_step = self.global_batch_size // (r * b)
            if microbatch >= per_step:
                raise FeederStateError(
                    f"dataloader state: {MICROBATCH_KEY} = {microbatch}, expected an integer in [0, {per_step}) "
                    f"(global_batch_size={self.global_batch_size} over world_size={r} in microbatches of "
                    f"local_batch_size={b}: {per_step} per step); the state was edited or is not this loader's"
                )
        if saved != (self.world_size, self.local_batch_size):
            raise FeederStateError(
                f"dataloader state: saved after microbatch {microbatch} of a step, with world_size={saved[0]} "
                f"and local_batch_size={saved[1]}; this loader has world_size={self.world_size} and "
                f"local_batch_size={self.local_batch_size}: restore it with the slicing it was saved with, or "
                "save at step boundaries (after the optimizer step), which restore on any world size"
            )

    # --- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Stops the Feeder's reader threads. Idempotent."""
        self._feeder.close()

    def __enter__(self) -> "FeederLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"FeederLoader(rank {self.rank}/{self.world_size}, local_batch_size={self.local_batch_size}, "
                f"microbatch {self._microbatch}/{self.microbatches_per_step}, {self._feeder!r})")


class FeederDataset(torch.utils.data.IterableDataset):
    """A ``FeederLoader`` as a ``Stateful`` ``IterableDataset``, for torchdata's
    ``StatefulDataLoader`` (or torch's ``DataLoader``)::

        from torchdata.stateful_dataloader import StatefulDataLoader
        loader = StatefulDataLoader(FeederDataset(cache=..., global_batch_size=256,
                                                  sequence_length=512), batch_size=None)
        state = loader.state_dict()     # the Feeder's JSON under "dataset_state"

    Each item is already a microbatch: pass ``batch_size=None``. Use
    ``num_workers=0``: the Feeder reads on its own threads (``num_threads``,
    ``prefetch``). Worker processes are refused: several would each read the
    whole stream, and with one the loader keeps the state in its worker
    snapshot (not under ``"dataset_state"``), a state that only a loader with
    the same number of workers loads.

    Args: those of ``FeederLoader``.

    Raises:
      RuntimeError: iterated inside a loader worker process (``num_workers``
        of 1 or more).
    """

    def __init__(self, **loader_args: Any):
        self.loader = FeederLoader(**loader_args)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is not None:
            raise RuntimeError(
                f"FeederDataset: iterated in a loader worker process (num_workers={info.num_workers}); use "
                "num_workers=0: the Feeder reads on its own threads (num_threads=, prefetch=), and the loader's "
                "state_dict() then holds the Feeder's state under 'dataset_state'"
            )
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loader.load_state_dict(state_dict)

    def close(self) -> None:
        self.loader.close()


def torchtitan_global_batch_size(configured: int, *, local_batch_size: int, dp_world_size: int,
                                  snapshot_every_n_steps: int | None = None) -> int:
    """The global batch B of a ``TorchtitanDataLoader``: ``configured``, checked
    against what torchtitan passes the loader.

    torchtitan builds its loader with the data-parallel degree R, the rows per
    microbatch b and ``snapshot_every_n_steps`` = ``checkpoint.interval`` x its
    gradient accumulation B_t / (R * b) (x pipeline microbatches), but not its
    ``training.global_batch_size`` B_t itself. B must be given, and equal B_t:
    the loader serves B / (R * b) microbatches per step, torchtitan takes
    B_t / (R * b) per optimizer step. When torchtitan checkpoints every
    ``snapshot_every_n_steps`` microbatches and that is not a whole number of
    the loader's steps, B differs from B_t.

    Returns:
      B (int).

    Raises:
      ValueError: B not given (< 1), or a checkpoint interval that is not a
        whole number of the loader's steps.
    """
    b, r = int(local_batch_size), int(dp_world_size)
    if configured < 1:
        raise ValueError(
            f"dataloader.global_batch_size = {configured}: set it to training.global_batch_size (the loader "
            "cannot read torchtitan's training config, and local_batch_size x dp degree would be another global "
            "batch whenever torchtitan accumulates gradients, and change with the dp degree)")
    per_step = configured // (r * b) if b >= 1 and r >= 1 and configured % (r * b) == 0 else 0
    if per_step and snapshot_every_n_steps and snapshot_every_n_steps % per_step:
        raise ValueError(
            f"dataloader.global_batch_size = {configured} is {per_step} microbatches of {b} rows per step on "
            f"{r} rank(s), but torchtitan checkpoints every {snapshot_every_n_steps} microbatches "
            "(checkpoint.interval x its gradient accumulation): set dataloader.global_batch_size to "
            "training.global_batch_size")
    return configured


def _torchtitan_source(config: Any) -> dict:
    """``{"cache": folder}`` or ``{"mixture": {folder: rate}}`` of a
    ``TorchtitanDataLoader.Config``.

    Raises:
      ValueError: neither or both given.
    """
    if bool(config.cache) == bool(config.mixture):
        raise ValueError("TorchtitanDataLoader.Config: give exactly one of cache= (a task cache folder) "
                         "or mixture= ({cache folder: rate})")
    return {"cache": config.cache} if config.cache else {"mixture": dict(config.mixture)}


def _torchtitan_loader_class():
    """``TorchtitanDataLoader``: a ``FeederLoader`` that is a torchtitan
    ``BaseDataLoader`` (imports torchtitan)."""
    from torchtitan.components.dataloader import BaseDataLoader  # optional: torchtitan

    class TorchtitanDataLoader(FeederLoader, BaseDataLoader):
        """The Feeder's stream as torchtitan's data loader.

        ``Trainer.Config(dataloader=TorchtitanDataLoader.Config(cache=..., global_batch_size=B,
        seed=0), training=TrainingConfig(global_batch_size=B, local_batch_size=b, seq_len=L), ...)``.
        torchtitan builds it with its data-parallel rank and degree R, ``seq_len``
        (the sequence length L) and ``local_batch_size`` (rows per microbatch);
        each step serves this rank's B / R rows in B / (R * b) microbatches, which
        is torchtitan's gradient accumulation when ``training.global_batch_size``
        is B. DCP saves ``state_dict()`` under "dataloader" once (it is the same
        on every rank), so a checkpoint resumes on any R that divides B.

        Config fields: ``cache`` (a task cache folder) or ``mixture`` ({cache
        folder: rate}); ``global_batch_size`` (B, required: the same value as
        ``training.global_batch_size``, which the loader cannot read; see
        ``torchtitan_global_batch_size``); ``seed``; ``num_epochs`` (0 = forever);
        ``feature``; ``num_threads`` (0 = the Feeder's default);
        ``positions``; ``rows_log`` (a file: one JSON line per microbatch served:
        step, microbatch, rank, cache_index, task_index, epoch).

        Raises:
          ValueError: no cache or mixture, or both; no global batch; a global
            batch that R * b does not divide, or that torchtitan's checkpoint
            interval shows to differ from its own; the Feeder's own errors.
        """

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            cache: str = ""
            """A task cache folder (CACHE_DIR/<task>/<split>)."""
            mixture: dict[str, float] = field(default_factory=dict)
            """Instead of cache: {cache folder: rate}."""
            global_batch_size: int = -1
            """B: rows per step over all data-parallel ranks; required, equal to training.global_batch_size."""
            seed: int = 0
            """The Feeder's seed (selects the per-epoch orders)."""
            num_epochs: int = 0
            """Read every example this many times, then stop (0: forever)."""
            feature: str = "targets"
            """The token feature of the cache."""
            num_threads: int = 0
            """Feeder reader threads (0: its default)."""
            positions: bool = True
            """Give the model per-segment positions (RoPE), as torchtitan's text loaders do."""
            rows_log: str = ""
            """A file to append one JSON line to per microbatch served (provenance); empty: none."""

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, seq_len: int,
                     local_batch_size: int, tokenizer: Any = None, snapshot_every_n_steps: int | None = None,
                     **unused: Any):
            where = _torchtitan_source(config)
            b = torchtitan_global_batch_size(config.global_batch_size, local_batch_size=local_batch_size,
                                             dp_world_size=dp_world_size,
                                             snapshot_every_n_steps=snapshot_every_n_steps)
            self.rows_log = config.rows_log or None
            FeederLoader.__init__(
                self, global_batch_size=b, sequence_length=seq_len, rank=dp_rank, world_size=dp_world_size,
                local_batch_size=local_batch_size, positions=config.positions,
                on_rows=self._log_rows if self.rows_log else None, seed=config.seed,
                num_epochs=config.num_epochs or None, feature=config.feature,
                num_threads=config.num_threads or None, **where,
            )

        def _log_rows(self, rows: dict) -> None:
            line = {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in rows.items()}
            with open(self.rows_log, "a") as f:
                f.write(json.dumps(line) + "\n")

    TorchtitanDataLoader.__module__ = __name__
    TorchtitanDataLoader.__qualname__ = "TorchtitanDataLoader"
    return TorchtitanDataLoader


_LAZY: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name == "TorchtitanDataLoader":
        if name not in _LAZY:
            _LAZY[name] = _torchtitan_loader_class()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["FeederDataset", "FeederLoader", "IGNORE_INDEX", "TorchtitanDataLoader", "dist_rank_and_world_size",
           "next_token_labels", "torchtitan_global_batch_size"]
