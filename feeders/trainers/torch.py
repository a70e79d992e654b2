"""PyTorch: a ``Stateful`` data loader over the Feeder's global stream.

``FeederLoader`` yields this rank's rows of each global batch as torch tensors in
torchtitan's ``(input_dict, labels)`` form, and its ``state_dict()`` is the
Feeder's JSON state (the global position), so a run resumes exactly on any
data-parallel world size that divides the global batch (G4, G5)::

    from seqcache.feeders.trainers.torch import FeederLoader

    loader = FeederLoader(cache="caches/wiki/train", global_batch_size=256, sequence_length=512)
    for input_dict, labels in loader:       # rank r of R: rows [r*256/R, (r+1)*256/R) of each step
        logits = model(input_dict["input"])  # int64 (256 // R, 512)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.save(loader.state_dict(), ...)     # or DCP, next to the model: {"dataloader": loader}

Three ways in, one stream:

- a plain loop over ``FeederLoader`` (above);
- torchdata's ``StatefulDataLoader(FeederDataset(...), batch_size=None,
  num_workers=W)``: the dataset is itself ``Stateful``. With W = 0 the loader's
  ``state_dict()`` carries the Feeder's JSON under ``"dataset_state"``; with
  W >= 1 worker w makes microbatches w, w + W, ... and the loader, which fetches
  from its workers in turn, yields the same items in the same order, and
  ``dataset_state_of`` finds the position in the workers' saved states, which
  ``FeederDataset.load_state_dict`` restores on any W and world size;
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
from typing import Annotated, Any, Callable, Iterator, Mapping

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data

from seqcache import bounded_json
from seqcache.feeders.feeder import Feeder
from seqcache.feeders.reader import ClosedOnExit
from seqcache.feeders.state import FeederStateError

IGNORE_INDEX = -100
"""The label of a token that has no loss (torch's ``cross_entropy`` default
``ignore_index``, torchtitan's ``IGNORE_INDEX``)."""

STATE_KEY = "seqcache_feeder_state"
"""Key of the Feeder's JSON state (a str) in ``state_dict()``."""

MICROBATCH_KEY = "microbatches_served"
"""Key of the number of microbatches of the current step already served (0 at a
step boundary, where every checkpoint of a training loop is taken)."""

_Steps = Annotated[int, msgspec.Meta(ge=0, lt=2**62)]
_Size = Annotated[int, msgspec.Meta(ge=1, lt=2**40)]


class _Served(msgspec.Struct):
    """What ``FeederLoader.load_state_dict`` reads of a state besides its JSON
    text (other keys are not read here)."""

    microbatch: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = msgspec.field(default=0, name=MICROBATCH_KEY)


class _Slicing(_Served, kw_only=True):
    """A saved worker state's slicing (``_position``); the bounds that depend on
    the global batch size are checked there."""

    world_size: _Size
    local_batch_size: _Size


class _Place(msgspec.Struct):
    """The fields of a Feeder state that place it in the stream (``_position``;
    other keys are not read here)."""

    global_batch_size: _Size
    position: _Steps


class _Worker(msgspec.Struct):
    """A worker's part of its saved state (``WORKER_KEY``); ``ahead`` is below
    ``num_workers``, checked after."""

    worker: Annotated[int, msgspec.Meta(ge=0, lt=2**16)]
    num_workers: Annotated[int, msgspec.Meta(ge=1, lt=2**16)]
    ahead: Annotated[int, msgspec.Meta(ge=0, lt=2**16)]


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


class FeederLoader(ClosedOnExit):
    """Batches of the Feeder's global stream as torch tensors, for rank r of R.

    Each step's B rows are split between ranks as the Feeder splits them between
    hosts (rank r owns rows [r*B/R, (r+1)*B/R)); a rank's rows are served in
    microbatches of ``local_batch_size`` rows (gradient accumulation: B / (R *
    local_batch_size) microbatches per step, in row order).

    Args (keyword-only):
      global_batch_size: B, rows per step over all ranks. Must be the same in a
        resumed run (it is part of the stream).
      sequence_length: L, tokens per row (the model's sequence length): an
        int or {feature: L}; default the caches' own (as ``Feeder``'s).
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
        sequence_length: Mapping[str, int] | int | None = None,
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
        while feeder.num_steps is None or feeder.step < feeder.num_steps:
            step = feeder.step
            batch = feeder.get_batch(step)
            while self._microbatch < self.microbatches_per_step:
                m = self._microbatch
                item = self._serve(batch, step, m)
                # The state moves before the item is handed over: a state_dict()
                # taken after the consumer has it names the next microbatch.
                self._microbatch = m + 1
                if self._microbatch == self.microbatches_per_step:
                    self._microbatch = 0
                    feeder.step = step + 1
                yield item
                if feeder.step != step:
                    break

    def _serve(self, batch: Mapping[str, np.ndarray], step: int, m: int):
        """Microbatch m of this rank's rows of ``step`` (``batch``: the Feeder's
        batch of that step), after calling ``on_rows`` with its provenance."""
        rows = slice(m * self.local_batch_size, (m + 1) * self.local_batch_size)
        item = self._convert(batch, self._feeder.feature, rows)
        if self.on_rows is not None:
            self.on_rows({"step": step, "microbatch": m, "rank": self.rank,
                          "cache_index": batch["cache_index"][rows].copy(),
                          "task_index": batch["task_index"][rows].copy(),
                          "epoch": batch["epoch"][rows].copy()})
        return item

    # Microbatch j of this rank's stream is microbatch j % M of step j // M (M =
    # microbatches_per_step); loader worker processes split the stream by j.

    @property
    def _item(self) -> int:
        """j of the microbatch served next."""
        return self._feeder.step * self.microbatches_per_step + self._microbatch

    def _seek(self, item: int) -> None:
        """Moves to microbatch j = ``item`` (the state follows)."""
        step, m = divmod(item, self.microbatches_per_step)
        self._feeder.step = step
        self._microbatch = m

    @property
    def _num_items(self) -> int | None:
        """Microbatches in this rank's stream: None (forever) or num_steps * M."""
        steps = self._feeder.num_steps
        return None if steps is None else steps * self.microbatches_per_step

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
                "seqcache.feeders.trainers.torch.FeederLoader"
            )
        text = state_dict[STATE_KEY]
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text)
        if not isinstance(text, (str, bytes)):
            raise FeederStateError(f"{where}: {STATE_KEY} is a {type(text).__name__}, expected JSON text")
        state = bounded_json.loads(text, path=where, error=FeederStateError, what="feeder state")
        microbatch = bounded_json.convert(dict(state_dict), _Served, path=where, error=FeederStateError).microbatch
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

    def __repr__(self) -> str:
        return (f"FeederLoader(rank {self.rank}/{self.world_size}, local_batch_size={self.local_batch_size}, "
                f"microbatch {self._microbatch}/{self.microbatches_per_step}, {self._feeder!r})")


WORKER_KEY = "loader_worker"
"""Key, in the state of a ``FeederDataset`` inside loader worker w of W, of
``{"worker": w, "num_workers": W, "ahead": k}``: the state's position is one
past the last microbatch this worker made (the dataset's start before it made
one), and the worker's next microbatch is k further on."""

PLAIN_LOADER_ERROR = (
    "FeederDataset: iterated in a worker process of a loader that keeps no state (torch.utils.data.DataLoader, "
    "num_workers={num_workers}): the position would stay where the dataset was built and a resume would repeat "
    "data; use torchdata's StatefulDataLoader (a drop-in DataLoader whose state_dict() resumes on any number of "
    "workers and ranks), or num_workers=0"
)


class _WorkerPart:
    """The microbatches that loader worker w of W makes: j0 + w, j0 + w + W,
    j0 + w + 2W, ... of this rank's stream (j0: where the dataset started).

    A loader that fetches from its workers in turn (0, 1, ..., W-1, 0, ...: the
    in-order round-robin of torch's and torchdata's loaders) therefore yields
    j0, j0 + 1, j0 + 2, ...: the stream of ``num_workers=0``.

    ``loader`` is this worker's own FeederLoader; its position is one past the
    last microbatch made here (j0 before the first), and ``ahead`` says how far
    past it the next one is (w at the start, W - 1 after each).
    """

    def __init__(self, loader: FeederLoader, *, worker: int, num_workers: int):
        self.loader, self.worker, self.num_workers = loader, worker, num_workers
        self.ahead = worker
        self._batch: tuple[int, Mapping[str, np.ndarray]] | None = None  # (step, batch) last read

    def __iter__(self):
        lo = self.loader
        end = lo._num_items
        while end is None or lo._item + self.ahead < end:
            j = lo._item + self.ahead
            step, m = divmod(j, lo.microbatches_per_step)
            if self._batch is None or self._batch[0] != step:  # with gradient accumulation W workers share steps
                self._batch = (step, lo.feeder.get_batch(step))
            item = lo._serve(self._batch[1], step, m)
            lo._seek(j + 1)  # the state moves before the item is handed over, as in FeederLoader
            self.ahead = self.num_workers - 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {**self.loader.state_dict(),
                WORKER_KEY: {"worker": self.worker, "num_workers": self.num_workers, "ahead": self.ahead}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continues a state this worker saved (torchdata restores each worker's
        own state into a loader of as many workers).

        Raises:
          FeederStateError: not a worker's state, or another worker's.
        """
        where = "dataloader worker state"
        saved = state_dict.get(WORKER_KEY)
        if not isinstance(saved, Mapping):
            raise FeederStateError(
                f"{where}: no {WORKER_KEY!r} (keys: {sorted(state_dict)[:8]}); a state of the whole loader is "
                "loaded into the FeederDataset before the loader is built (dataset.load_state_dict(state))")
        saved = bounded_json.convert(dict(saved), _Worker, path=where, error=FeederStateError, prefix=WORKER_KEY)
        worker, count = saved.worker, saved.num_workers
        if (worker, count) != (self.worker, self.num_workers):
            raise FeederStateError(
                f"{where}: saved by worker {worker} of {count}, loaded into worker {self.worker} of "
                f"{self.num_workers}; load the loader's state into the FeederDataset instead "
                "(dataset.load_state_dict(state)), which resumes on any number of workers")
        if saved.ahead >= count:
            raise FeederStateError(f"{where}: {WORKER_KEY}.ahead = {saved.ahead}, expected an integer in [0, {count})")
        self.loader.load_state_dict({k: v for k, v in state_dict.items() if k != WORKER_KEY})
        self.ahead = saved.ahead


def dataset_state_of(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The position (a ``FeederLoader`` state) in any saved state of a loader
    over ``FeederDataset``, whatever its number of workers.

    ``state_dict`` is one of: a ``FeederLoader`` or ``FeederDataset`` state
    (returned as it is, less a worker's ``WORKER_KEY``); a ``StatefulDataLoader``
    state with ``num_workers=0`` (its ``"dataset_state"``); one with W >= 1
    workers: torchdata keeps each worker's dataset state as of the last
    microbatch the loader yielded from it, so the furthest of them is where the
    loader was at its last snapshot, to which the microbatches yielded since
    (``"_steps_since_snapshot"``, 0 with the default
    ``snapshot_every_n_steps=1``) are added. Anything else is returned as it
    is, for ``FeederLoader.load_state_dict`` to refuse.

    Raises:
      FeederStateError: a worker snapshot without a FeederDataset state, or
        worker states of different slicings.
    """
    if not isinstance(state_dict, Mapping) or not state_dict:
        return state_dict
    if STATE_KEY in state_dict:
        return {k: v for k, v in state_dict.items() if k != WORKER_KEY}
    if "dataset_state" in state_dict and isinstance(state_dict["dataset_state"], Mapping):
        return dataset_state_of(state_dict["dataset_state"])
    snapshot = state_dict.get("_snapshot")
    if isinstance(snapshot, Mapping) and isinstance(snapshot.get("_worker_snapshots"), Mapping):
        return _furthest_worker_state(snapshot["_worker_snapshots"], state_dict.get("_steps_since_snapshot", 0))
    return state_dict


def _position(state: Mapping[str, Any], where: str) -> tuple[dict, int, int]:
    """(Feeder state, j, M) of a FeederLoader state: j = step * M + microbatch
    under the slicing it was saved with, M = B / (R * b) microbatches per step.

    Raises:
      FeederStateError: malformed JSON or fields, or a slicing that does not divide B.
    """
    text = state.get(STATE_KEY)
    if not isinstance(text, (str, bytes, bytearray)):
        raise FeederStateError(f"{where}: {STATE_KEY} is a {type(text).__name__}, expected JSON text")
    feeder = bounded_json.loads(bytes(text) if isinstance(text, bytearray) else text, path=where,
                                error=FeederStateError, what="feeder state")
    place = bounded_json.convert(feeder, _Place, path=where, error=FeederStateError, prefix=STATE_KEY)
    slicing = bounded_json.convert(dict(state), _Slicing, path=where, error=FeederStateError)
    g, p = place.global_batch_size, place.position
    r, b, m = slicing.world_size, slicing.local_batch_size, slicing.microbatch
    if g % (r * b) or p % g:  # also refuses a world_size or local_batch_size above g
        raise FeederStateError(f"{where}: position {p}, world_size={r} and local_batch_size={b} do not slice "
                               f"global_batch_size={g} into whole steps and microbatches")
    per_step = g // (r * b)
    if m >= per_step:
        raise FeederStateError(f"{where}: {MICROBATCH_KEY} = {m}, expected an integer in [0, {per_step})")
    return feeder, p // g * per_step + m, per_step


def _furthest_worker_state(workers: Mapping[str, Any], since: Any) -> dict[str, Any]:
    """The position of a StatefulDataLoader with workers: the furthest of its
    workers' states, ``since`` microbatches further on (see ``dataset_state_of``)."""
    where = "dataloader state"
    since = bounded_json.convert(since, _Steps, path=where, error=FeederStateError, prefix="_steps_since_snapshot")
    best = None
    for key in sorted(workers):
        state = workers[key].get("dataset_state") if isinstance(workers[key], Mapping) else None
        if not isinstance(state, Mapping) or STATE_KEY not in state:
            raise FeederStateError(f"{where}: worker snapshot {key!r} holds no FeederDataset state; it was not "
                                   "saved by a StatefulDataLoader over seqcache.feeders.trainers.torch.FeederDataset")
        feeder, j, per_step = _position(state, f"{where}, worker snapshot {key!r}")
        slicing = (state["world_size"], state["local_batch_size"])
        if best is not None and slicing != best[3]:
            raise FeederStateError(f"{where}: worker snapshots of two slicings, (world_size, local_batch_size) = "
                                   f"{best[3]} and {slicing}; the state was edited or is not one loader's")
        if best is None or j > best[1]:
            best = (state, j, feeder, slicing, per_step)
    if best is None:
        raise FeederStateError(f"{where}: no worker snapshots")
    state, j, feeder, _, per_step = best
    out = {k: v for k, v in state.items() if k != WORKER_KEY}
    if since:
        step, m = divmod(j + since, per_step)
        feeder = {**feeder, "position": step * feeder["global_batch_size"]}
        out.update({STATE_KEY: json.dumps(feeder, sort_keys=True), MICROBATCH_KEY: m})
    return out


class FeederDataset(torch.utils.data.IterableDataset):
    """A ``FeederLoader`` as a ``Stateful`` ``IterableDataset``, for torchdata's
    ``StatefulDataLoader``, with or without worker processes::

        from torchdata.stateful_dataloader import StatefulDataLoader
        dataset = FeederDataset(cache=..., global_batch_size=256, sequence_length=512)
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
        state = loader.state_dict()
        ...                             # a later run, any number of workers and ranks:
        dataset = FeederDataset(cache=..., global_batch_size=256, sequence_length=512)
        dataset.load_state_dict(state)  # before the loader is built
        loader = StatefulDataLoader(dataset, batch_size=None, num_workers=1)

    Each item is already a microbatch: pass ``batch_size=None``.

    ``num_workers=0``: the dataset's ``FeederLoader`` serves the items (the
    Feeder reads on its own threads: ``num_threads``, ``prefetch``), and the
    loader's state holds its state under ``"dataset_state"``.

    ``num_workers=W >= 1``: worker w opens the caches itself and makes
    microbatches j0 + w, j0 + w + W, ... of this rank's stream (j0: the
    dataset's position when the loader starts its workers; ``_WorkerPart``),
    reading with ``prefetch=0`` (torchdata's ``prefetch_factor`` is the read
    ahead). The loader fetches from its workers in turn and yields in that order
    (``in_order=True``, the default), so the items are those of
    ``num_workers=0``, in the same order. torchdata saves each worker's state
    (``WORKER_KEY``); ``dataset_state_of`` finds the position in them.
    ``on_rows`` is called in the worker process.

    Resuming: ``dataset.load_state_dict(state)`` takes any saved loader state
    (0 or W workers, any rank: ``dataset_state_of``) and a loader built after it
    continues there, with any number of workers, on any world size that divides
    B (a state saved between two microbatches of a step: the same slicing
    only). ``loader.load_state_dict(state)`` works too, but torchdata accepts
    only a state of as many workers.

    A loader with workers starts them from the dataset's position at each
    ``iter(loader)``: use one iterator per run, and restore from
    ``loader.state_dict()`` to continue elsewhere. The dataset's own
    ``state_dict()`` in the main process does not follow the workers.

    Args: those of ``FeederLoader`` (``rank`` and ``world_size`` are resolved
    here, in the main process, and handed to the workers).

    Raises:
      RuntimeError: iterated in a worker process of a loader that keeps no
        state (torch's ``DataLoader`` with ``num_workers`` >= 1,
        ``PLAIN_LOADER_ERROR``): its position cannot be saved. torchdata's
        ``StatefulDataLoader`` is told apart by asking each worker's dataset
        for its state before the first item.
      FeederStateError: from ``load_state_dict``, as ``FeederLoader``'s.
    """

    def __init__(self, **loader_args: Any):
        self.loader: FeederLoader | None = FeederLoader(**loader_args)
        # A worker process has no torch.distributed: it gets the rank and world size resolved here.
        self._loader_args = {**loader_args, "rank": self.loader.rank, "world_size": self.loader.world_size}
        self._start: Mapping[str, Any] | None = None  # the position, in a copy unpickled without its loader
        self._part: _WorkerPart | None = None  # in a loader worker process: this worker's microbatches
        self._asked = False  # in a worker: whether the loader asked for state (torchdata's does, at the start)

    def __getstate__(self) -> dict[str, Any]:
        # spawn and forkserver workers get the arguments and the position, not the open Feeder
        return {"loader_args": self._loader_args, "start": self._main_loader().state_dict()}

    def __setstate__(self, state: Mapping[str, Any]) -> None:
        self.loader, self._loader_args, self._start = None, state["loader_args"], state["start"]
        self._part, self._asked = None, False

    def _main_loader(self) -> FeederLoader:
        """The loader of the main process (built from the arguments and the
        position in a copy unpickled without it)."""
        if self.loader is None:
            self.loader = FeederLoader(**self._loader_args)
            self.loader.load_state_dict(self._start or {})
        return self.loader

    def _worker_part(self, info: Any) -> _WorkerPart:
        if self._part is None:
            # The loader inherited from a forked parent is not used: its reader threads did not come along.
            start = self.loader.state_dict() if self.loader is not None else (self._start or {})
            loader = FeederLoader(**{**self._loader_args, "prefetch": 0})
            loader.load_state_dict(start)
            self._part = _WorkerPart(loader, worker=info.id, num_workers=info.num_workers)
        return self._part

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if info is None:
            return iter(self._main_loader())
        return self._worker_items(info)

    def _worker_items(self, info: Any):
        # A generator: torchdata creates the iterator first, then asks for the state, then fetches.
        if not self._asked:
            raise RuntimeError(PLAIN_LOADER_ERROR.format(num_workers=info.num_workers))
        yield from self._worker_part(info)

    def state_dict(self) -> dict[str, Any]:
        """The ``FeederLoader`` state; in worker w of W, this worker's, with
        ``WORKER_KEY``."""
        info = torch.utils.data.get_worker_info()
        if info is None:
            return self._main_loader().state_dict()
        self._asked = True
        return self._worker_part(info).state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """In the main process: moves to the position of any saved state of a
        loader over this dataset (``dataset_state_of``). In a worker process:
        continues that worker's own state (torchdata's restore, same number of
        workers). An empty dict changes nothing.

        Raises:
          FeederStateError (a ValueError): as ``FeederLoader.load_state_dict``
            and ``dataset_state_of``; in a worker, a state of another worker.
        """
        info = torch.utils.data.get_worker_info()
        if info is None:
            self._main_loader().load_state_dict(dataset_state_of(state_dict))
            return
        self._asked = True
        if state_dict:
            self._worker_part(info).load_state_dict(state_dict)

    def close(self) -> None:
        """Closes the main process's loader (a worker's goes with its process). Idempotent."""
        if self.loader is not None:
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


__all__ = ["FeederDataset", "FeederLoader", "IGNORE_INDEX", "TorchtitanDataLoader", "dataset_state_of",
           "dist_rank_and_world_size", "next_token_labels", "torchtitan_global_batch_size"]
