"""Checkpoints: model, optimizer state, step and feeder state saved together.

One Orbax ``CheckpointManager`` step folder per saved step::

    CHECKPOINT_DIR/
        config.json            the resolved TrainConfig (written by the trainer)
        metrics.jsonl          one JSON line per step (written by the trainer)
        <step>/state/          params, opt_state, step (Orbax StandardSave)
        <step>/feeder/         the feeder's JSON state (Orbax JsonSave)

``<step>`` is the number of optimizer updates applied; the feeder state saved with
it is positioned at global batch ``<step>``, the first batch not yet trained on.

Orbax writes a step into a temporary folder and renames it into place once
every item is committed, so an interrupted save never becomes the latest
checkpoint. Restore refuses a checkpoint without feeder state, or with another
global batch size: the data stream could not resume exactly.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import orbax.checkpoint as ocp

from seqcache.feeders import checkpoint as feeder_checkpoint
from seqcache.feeders import compat
from seqcache.feeders import state as feeder_state_lib
from seqcache.feeders.reader import ClosedOnExit

STATE_ITEM = "state"
FEEDER_ITEM = feeder_checkpoint.ITEM_NAME  # "feeder"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be restored into this run (the message says why and what to do)."""


@dataclasses.dataclass(kw_only=True)
class Restored:
    """A restored checkpoint.

    Attributes:
      step: number of optimizer updates applied.
      state: ``{"params", "opt_state", "step"}`` with the shardings asked for.
      feeder_state: the feeder's JSON state, positioned at global batch ``step``.
      path: the step folder.
    """

    step: int
    state: dict
    feeder_state: dict
    path: str


def saved_feeder_state(path: str, step: int, global_batch_size: int) -> dict:
    """The feeder state saved in the checkpoint step folder ``path`` (step
    ``step``), read by seqcache's bounded reader (``load_checkpoint_state``,
    not Orbax's JsonRestore: Python's json has no bounds and keeps a key
    given twice silently), with its global batch size checked against
    ``global_batch_size``.

    Raises:
      CheckpointError: a state that cannot be read (``checkpoint step 40:
        DIR/40/feeder/metadata: ...``), without an integer
        ``global_batch_size``, or of another global batch size (naming both
        and the fix); one line.
    """
    try:
        feeder_state = feeder_state_lib.load_checkpoint_state(path, step=step, any_feeder=True)
    except feeder_state_lib.FeederStateError as e:
        raise CheckpointError(str(e)) from None
    saved = feeder_state.get("global_batch_size") if isinstance(feeder_state, dict) else None
    if isinstance(saved, bool) or not isinstance(saved, int):
        keys = sorted(feeder_state) if isinstance(feeder_state, dict) else type(feeder_state).__name__
        raise CheckpointError(f"checkpoint step {step}: {os.path.join(path, feeder_state_lib.STATE_IN_STEP)}: the "
                              f"feeder state has no integer 'global_batch_size' (got keys {keys})")
    try:
        compat.check_global_batch(saved, int(global_batch_size), restored_from="checkpoint was saved with",
                                  current_from="the current config has")
    except compat.FeederStateError as e:
        raise CheckpointError(
            f"{path}: {e}. Use --batch-size {saved}, or start a new run in another checkpoint directory."
        ) from None
    return feeder_state


class Checkpointer(ClosedOnExit):
    """Saves and restores training state with an Orbax CheckpointManager in
    ``directory`` (created if missing), keeping the last ``max_to_keep`` steps;
    ``async_save`` writes in a background thread (``wait()`` blocks until done)."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=async_save)
        handlers = {STATE_ITEM: ocp.StandardCheckpointHandler(), FEEDER_ITEM: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def all_steps(self) -> list[int]:
        """Steps with a complete (committed) checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The most recent complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, *, state: Mapping[str, Any], feeder_state: Mapping[str, Any]) -> bool:
        """Saves ``state`` (a pytree of jax.Arrays) and ``feeder_state`` (a JSON
        dict) as step ``step``. Returns False if the step already exists.

        Raises:
          CheckpointError: ``feeder_state`` is not a dict with ``global_batch_size``.
        """
        if not isinstance(feeder_state, Mapping) or "global_batch_size" not in feeder_state:
            raise CheckpointError(
                f"feeder state to save with step {step} must be a dict with 'global_batch_size' "
                f"(got {feeder_state!r})")
        if step in self._manager.all_steps():
            return False
        # The state of the step just trained, captured before the feeder fetched the next batch.
        args = {STATE_ITEM: ocp.args.StandardSave(dict(state)), FEEDER_ITEM: ocp.args.JsonSave(dict(feeder_state))}
        return self._manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int | None, *, abstract_state: Any, global_batch_size: int) -> Restored:
        """Restores step ``step`` (None: the latest) into ``abstract_state``, the
        ``state`` tree as ShapeDtypeStructs with this run's shardings (another
        mesh than at save time is fine).

        Raises:
          CheckpointError: no checkpoint; the step has no feeder state; a feeder
            state that cannot be read or checked (``load_checkpoint_state``:
            ``checkpoint step 40: DIR/40/feeder/metadata: ...``, one line); a
            different global batch size (the message names both values).
        """
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointError(f"{self.directory}: no complete checkpoint to restore")
        path = self.step_path(step)
        if step not in self._manager.all_steps():
            raise CheckpointError(f"{path}: no complete checkpoint for step {step} (have {self.all_steps()})")
        items = set(self._manager.item_metadata(step).keys())  # a JSON item's metadata is None: names only
        if FEEDER_ITEM not in items:
            raise CheckpointError(
                f"{path}: checkpoint has no feeder state (item {FEEDER_ITEM!r}; found {sorted(items)}), so "
                "the data stream cannot be resumed exactly. Train from scratch with an empty checkpoint "
                "directory, or restore this checkpoint's parameters yourself.")
        feeder_state = saved_feeder_state(path, step, global_batch_size)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)})
        )
        return Restored(step=step, state=restored[STATE_ITEM], feeder_state=feeder_state, path=path)

    def reached_preemption(self, step: int) -> bool:
        """True when JAX's preemption service says every host should save now (multi-host runs)."""
        return bool(self._manager.reached_preemption(step))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

