"""Saving feeder state with Orbax, next to model state.

The state is a small JSON object (``Feeder.state()``), saved as an Orbax JSON item,
conventionally named "feeder"::

    import orbax.checkpoint as ocp
    from seqcache.feeders import feeder_save_args, feeder_restore_args, restore_feeder

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                            feeder=feeder_save_args(feeder)))
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
    # The feeder state read from the step folder by seqcache's bounded reader
    # (not Orbax's JsonRestore, which reads it with Python's json):
    feeder = restore_feeder(os.path.join(ckpt_dir, str(step)), host_index=jax.process_index(),
                            host_count=jax.process_count())

Every host saves the same state, so Orbax's primary-host write is enough. Orbax
is imported only when these helpers are called.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from seqcache.feeders.converters import ConvertedFeeder
from seqcache.feeders.feeder import Feeder
from seqcache.feeders.state import CHECKPOINT_ITEM, FeederStateError, load_state

ITEM_NAME = CHECKPOINT_ITEM  # "feeder"


def feeder_save_args(feeder: Feeder):
    """``ocp.args.JsonSave(feeder.state())``: the feeder's item in a Composite save.

    Save it after the step's batch was consumed, so that the saved position is the
    next batch to read.
    """
    import orbax.checkpoint as ocp  # optional: orbax

    return ocp.args.JsonSave(feeder.state())


def feeder_restore_args():
    """``ocp.args.JsonRestore()``: the feeder's item in a Composite restore.
    Orbax reads the item with Python's ``json`` (a key given twice is kept
    silently, nothing is bounded): for a checkpoint you did not write, give
    ``restore_feeder`` the step folder instead."""
    import orbax.checkpoint as ocp  # optional: orbax

    return ocp.args.JsonRestore()


def restore_feeder(restored: Mapping[str, Any] | str | os.PathLike, *, host_index: int | None = None,
                   host_count: int | None = None, **kwargs):
    """``Feeder.restore(state, host_index=, host_count=, **kwargs)``, or
    ``ConvertedFeeder.restore(...)`` for a state with a "converter" field.
    ``restored`` is the state: a checkpoint step folder (its
    ``feeder/metadata``) or a state file, read by ``load_state`` (bounded,
    no key twice: the safe way), or the dict Orbax's ``JsonRestore`` gave.
    ``kwargs`` (threads, the caches' current locations, the expectations) are
    those of that ``restore``.

    Raises:
      FeederStateError (a ValueError): no feeder state in the checkpoint, a
        file that cannot be read or is out of bounds (naming the checkpoint
        step and the file), or a state that does not match the caches or the
        expectations.
    """
    if restored is None:
        raise FeederStateError(
            f"the checkpoint has no feeder state (item {ITEM_NAME!r}); it was saved without feeder_save_args()"
        )
    state = load_state(restored) if isinstance(restored, (str, os.PathLike)) else dict(restored)
    restore = ConvertedFeeder.restore if "converter" in state else Feeder.restore
    return restore(state, host_index=host_index, host_count=host_count, **kwargs)
