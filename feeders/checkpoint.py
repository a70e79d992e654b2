"""Saving feeder state with Orbax, next to model state.

The state is a small JSON object (``Feeder.state()``), saved as an Orbax JSON item,
conventionally named "feeder"::

    import orbax.checkpoint as ocp
    from seqcache.feeders import feeder_save_args, feeder_restore_args, restore_feeder

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(train_state),
                                            feeder=feeder_save_args(feeder)))
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                          feeder=feeder_restore_args()))
    feeder = restore_feeder(restored["feeder"], host_index=jax.process_index(),
                            host_count=jax.process_count())

Every host saves the same state, so Orbax's primary-host write is enough. Orbax
is imported only when these helpers are called.
"""

from __future__ import annotations

from typing import Any, Mapping

from seqcache.feeders.converters import ConvertedFeeder
from seqcache.feeders.feeder import Feeder
from seqcache.feeders.state import FeederStateError

ITEM_NAME = "feeder"


def feeder_save_args(feeder: Feeder):
    """``ocp.args.JsonSave(feeder.state())``: the feeder's item in a Composite save.

    Save it after the step's batch was consumed, so that the saved position is the
    next batch to read.
    """
    import orbax.checkpoint as ocp  # optional: orbax

    return ocp.args.JsonSave(feeder.state())


def feeder_restore_args():
    """``ocp.args.JsonRestore()``: the feeder's item in a Composite restore."""
    import orbax.checkpoint as ocp  # optional: orbax

    return ocp.args.JsonRestore()


def restore_feeder(restored_json: Mapping[str, Any], *, host_index: int | None = None,
                   host_count: int | None = None, **kwargs):
    """``Feeder.restore(restored_json, host_index=, host_count=, **kwargs)``, or
    ``ConvertedFeeder.restore(...)`` for a state with a "converter" field.
    ``kwargs`` (threads, the caches' current locations, the expectations) are
    those of that ``restore``.

    Raises:
      FeederStateError (a ValueError): no feeder state in the checkpoint, or a state
        that does not match the caches or the expectations.
    """
    if restored_json is None:
        raise FeederStateError(
            f"the checkpoint has no feeder state (item {ITEM_NAME!r}); it was saved without feeder_save_args()"
        )
    state = dict(restored_json)
    restore = ConvertedFeeder.restore if "converter" in state else Feeder.restore
    return restore(state, host_index=host_index, host_count=host_count, **kwargs)
