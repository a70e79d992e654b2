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

import jax
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
        feeder_state = self.feeder_state(step, global_batch_size)
        self.check_arrays(step, abstract_state)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract_state)})
            )
        except Exception as e:  # noqa: BLE001 (the arrays' names and shapes were checked: this is reading them)
            raise damaged(path, "cannot read its arrays", e) from None
        return Restored(step=step, state=restored[STATE_ITEM], feeder_state=feeder_state, path=path)

    def feeder_state(self, step: int, global_batch_size: int) -> dict:
        """The feeder state saved with complete checkpoint ``step``, read by
        seqcache's bounded reader (``load_checkpoint_state``; not Orbax's
        JsonRestore: Python's json has no bounds and keeps a key given twice
        silently), its global batch size checked against ``global_batch_size``.
        What ``restore`` reads first; ``seqcache train --dry-run`` reads only this.

        Raises:
          CheckpointError: the step has no feeder state; a state that cannot be
            read (``checkpoint step 40: DIR/40/feeder/metadata: ...``) or has
            no integer ``global_batch_size``; another global batch size (naming
            both and the fix); one line.
        """
        path = self.step_path(step)
        # The step's items from its folder, not Orbax's metadata (which reads every array's too).
        items = {n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n))} if os.path.isdir(path) else set()
        if FEEDER_ITEM not in items:
            raise CheckpointError(
                f"{path}: checkpoint has no feeder state (item {FEEDER_ITEM!r}; found {sorted(items)}), so "
                "the data stream cannot be resumed exactly. Train from scratch with an empty checkpoint "
                "directory, or restore this checkpoint's parameters yourself.")
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

    def check_arrays(self, step: int, abstract_state: Any) -> None:
        """Refuses checkpoint ``step`` unless its state holds the arrays of
        ``abstract_state`` (the same tree of ``ShapeDtypeStruct``, the same
        shapes), read from Orbax's metadata before anything is restored: a
        checkpoint of another model or optimizer, with or without the run's
        config.json, is one line, not Orbax's tree dump.

        Raises:
          CheckpointError: naming how many arrays are missing, extra or of
            another shape, and the first of each.
        """
        path = self.step_path(step)
        try:
            metadata = self._manager.item_metadata(step)
            saved = _shapes(metadata[STATE_ITEM]) if STATE_ITEM in metadata.keys() else {}
        except Exception as e:  # noqa: BLE001 (Orbax and TensorStore raise many kinds for a damaged step)
            raise damaged(path, "cannot read its arrays' metadata", e) from None
        if not saved:
            raise damaged(path, f"its {STATE_ITEM!r} item holds no arrays")
        wanted = _shapes(abstract_state)
        order = lambda k: (not k.startswith("params/"), k)  # noqa: E731 (the parameters named first)
        missing = sorted(set(wanted) - set(saved), key=order)
        extra = sorted(set(saved) - set(wanted), key=order)
        reshaped = sorted((k for k in set(wanted) & set(saved) if wanted[k] != saved[k]), key=order)
        if not (missing or extra or reshaped):
            return
        parts = []
        if missing:
            parts.append(f"{len(missing)} of this run's arrays are not in it (first: {missing[0]})")
        if extra:
            parts.append(f"{len(extra)} of its arrays are not this run's (first: {extra[0]})")
        if reshaped:
            k = reshaped[0]
            parts.append(f"{len(reshaped)} have another shape (first: {k}, saved {saved[k]}, this run {wanted[k]})")
        raise CheckpointError(f"{self.step_path(step)}: the checkpoint does not hold this run's model and optimizer: "
                              f"{'; '.join(parts)}. Resume with the model and optimizer settings it was saved "
                              "with, or start a new run in another checkpoint directory.")

    def reached_preemption(self, step: int) -> bool:
        """True when JAX's preemption service says every host should save now (multi-host runs)."""
        return bool(self._manager.reached_preemption(step))

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _shapes(tree: Any) -> dict[str, tuple]:
    """{"params/blocks/0/attn/wq": shape} of a tree of arrays, array
    metadata or ShapeDtypeStructs (dict keys, indices and attribute names
    alike, so an optax state and Orbax's metadata of it compare)."""
    def name(key) -> str:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                return str(getattr(key, attr))
        return str(key)

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): tuple(getattr(leaf, "shape", ())) for path, leaf in leaves}


def damaged(path: str, what: str, error: BaseException | None = None) -> CheckpointError:
    """The one line for a checkpoint step that cannot be read (a damaged or
    partly deleted step folder): what failed, the error's first line."""
    cause = ""
    if error is not None:
        first = (str(error).strip().splitlines() or [""])[0]
        cause = f" ({type(error).__name__}: {first[:300]}{'...' if len(first) > 300 else ''})"
    return CheckpointError(f"{path}: {what}{cause}; the step folder is damaged or partly deleted: move it away "
                           "to resume from the step before, or start a new run in another checkpoint directory")
