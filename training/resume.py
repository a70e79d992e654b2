"""Resuming a run: the checks that a checkpoint belongs to this run's data
stream and schedule, and moving the feeder to the checkpoint's position."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Mapping

import jax

from seqcache import bounded_json
from seqcache.feeders import compat
from seqcache.feeders import state as feeder_state
from seqcache.training import config as config_lib
from seqcache.training.checkpoints import CheckpointError

log = logging.getLogger("seqcache.training")


def check_feeder(feeder, global_batch_size: int) -> None:
    """Refuses a feeder whose state cannot be checkpointed or whose global batch
    size is not the config's (ValueError naming both)."""
    state = feeder.state()
    gbs = state.get("global_batch_size") if isinstance(state, Mapping) else None
    if gbs is None:
        raise ValueError(f"feeder state has no 'global_batch_size' (got {state!r}); it cannot be checkpointed")
    try:
        compat.check_global_batch(int(gbs), global_batch_size, restored_from="feeder has",
                                  current_from="the config has")
    except compat.FeederStateError as e:
        raise ValueError(f"{e}; build the feeder with the config's value") from None


def restore_feeder(feeder, restored):
    """The feeder to train on: the run's moved to the checkpoint's feeder state
    (``set_state``), or one rebuilt from it (``type(feeder).restore``).

    Raises:
      CheckpointError: another data stream (``check_same_stream``), or a state
        that does not restore to the checkpoint's step.
    """
    check_same_stream(restored.path, restored.feeder_state, feeder.state())
    set_state = getattr(feeder, "set_state", None)
    if callable(set_state):
        # The run's feeder already reads this run's caches, where they are now,
        # on this run's hosts: move it to the saved position (its own checks
        # compare the caches by fingerprint, not by path).
        set_state(restored.feeder_state)
        new = feeder
    else:
        host_index = getattr(feeder, "host_index", None)
        host_count = getattr(feeder, "host_count", None)
        host_index = jax.process_index() if host_index is None else host_index
        host_count = jax.process_count() if host_count is None else host_count
        new = type(feeder).restore(restored.feeder_state, host_index=host_index, host_count=host_count)
        feeder.close()
    position = getattr(new, "step", restored.step)
    if position != restored.step:
        new.close()
        raise CheckpointError(
            f"{restored.path}: the feeder state restores to global batch {position}, but the checkpoint "
            f"is at step {restored.step}; the checkpoint is inconsistent")
    return new


# Keys of a feeder state that say where the stream is, not which stream it is.
_POSITION_KEYS = ("position", "step")
_STREAM_HINT = (
    "; the checkpoint belongs to another data stream. Train with the checkpoint's data settings (the caches, "
    "data.mixture, data.seed, which is not --seed, the parameters' seed, and --sequence-length), or start a new "
    "run in another checkpoint directory."
)


def check_same_stream(path: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuses to resume when the run's feeder reads another stream than the
    checkpoint's (rebuilt caches, another mixture, seed, sequence length, ...).
    ``Feeder`` states are compared by ``seqcache.feeders.state.stream_difference``
    (caches by fingerprint, not path: moved or copied caches still resume);
    other feeders' states key by key, positions excepted.

    Raises:
      CheckpointError: naming the first difference and both values.
    """
    if saved.get("converter") != current.get("converter"):
        # ConvertedFeeder states: the converter and its lengths (None for a plain feeder).
        raise CheckpointError(
            f"{path}: the checkpoint's feeder fed the model through converter {saved.get('converter')!r}, this "
            f"run's feeder through {current.get('converter')!r}{_STREAM_HINT}")
    if saved.get("kind") == feeder_state.STATE_KIND and current.get("kind") == feeder_state.STATE_KIND:
        try:
            saved = feeder_state.read_state(saved)  # a state of an earlier release: its int length as {feature: L}
            current = feeder_state.read_state(current, path="this run's feeder state")
        except feeder_state.FeederStateError as e:
            raise CheckpointError(f"{path}: {e}") from None
        diff = feeder_state.stream_difference(saved, current)
        if diff:
            raise CheckpointError(f"{path}: {diff}{_STREAM_HINT}")
        return
    for key in sorted(set(saved) | set(current)):
        if key in _POSITION_KEYS:
            continue
        if saved.get(key) != current.get(key):
            raise CheckpointError(
                f"{path}: the checkpoint's feeder state has {key}={saved.get(key)!r}, but this run's feeder has "
                f"{key}={current.get(key)!r}{_STREAM_HINT}")


# Model settings that change the checkpoint's parameter tree (not its values),
# with the value a config.json written before the setting existed means.
STRUCTURE_FIELDS = (("scan_layers", False),)
# Model fields that set the parameters' shapes (head_dim and num_decoder_layers
# compared resolved: None means d_model // num_heads and num_layers).
SHAPE_FIELDS = ("architecture", "vocab_size", "d_model", "num_layers", "num_decoder_layers", "num_heads", "head_dim",
                "mlp_dim", "mlp_activation", "tie_embeddings", "share_embeddings")
# The shapes ``base`` had before its heads became 6 of 128, named in the refusal.
_EARLIER_BASE = {"d_model": 768, "num_layers": 12, "num_heads": 12, "head_dim": 64, "mlp_dim": 2048}
# The presets that scanned their layers before they were measured faster unrolled.
_EARLIER_SCANNED = ("large", "1b")


def _shape_values(model: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SHAPE_FIELDS`` of a config.json's ``model`` dict, resolved, with
    ``ModelConfig``'s defaults for fields it lacks."""
    defaults = config_lib.to_dict(config_lib.ModelConfig())
    values = {name: model.get(name, defaults[name]) for name in SHAPE_FIELDS}
    d, heads = values["d_model"], values["num_heads"]
    if values["head_dim"] is None and isinstance(d, int) and isinstance(heads, int) and heads > 0:
        values["head_dim"] = d // heads
    if values["num_decoder_layers"] is None:
        values["num_decoder_layers"] = values["num_layers"]
    return values


def check_structure(config_path: str, config: config_lib.TrainConfig, checkpoint: str) -> None:
    """Refuses, before Orbax is asked, a checkpoint whose parameter or optimizer
    tree does not fit this run, read from the run's saved config.json (without
    one, nothing is compared): another setting of ``STRUCTURE_FIELDS`` (the
    layout), another shape (``SHAPE_FIELDS``, e.g. a preset whose heads
    changed) or another optimizer (``optimizer.name``; Adafactor's
    ``factored`` too).

    Raises:
      CheckpointError: one line naming the setting, both values and the fix.
    """
    try:
        saved = bounded_json.read_file(config_path, error=ValueError, max_bytes=1 << 20, what="config file")
    except ValueError:
        return
    model = saved.get("model") if isinstance(saved, Mapping) else None
    if not isinstance(model, Mapping):
        return
    for name, default in STRUCTURE_FIELDS:
        old, new = model.get(name, default), getattr(config.model, name)
        if old != new:
            raise CheckpointError(
                f"{checkpoint}: the checkpoint was saved with model.{name}={json.dumps(old)} and this run has "
                f"model.{name}={json.dumps(new)}, which lays the parameters out otherwise (stacked layers or one "
                f"per layer){_earlier_scanned_preset(model, old)}; resume with --set model.{name}={json.dumps(old)}")
    _check_shapes(model, config, checkpoint)
    _check_optimizer(saved.get("optimizer"), config, checkpoint)


def _earlier_scanned_preset(model: Mapping[str, Any], scanned: Any) -> str:
    """A parenthesis naming the preset, when a scanned checkpoint has the shapes of
    a preset that scanned its layers before it was measured faster unrolled; else ""."""
    if scanned is not True:
        return ""
    saved = _shape_values(model)
    for preset in _EARLIER_SCANNED:
        shapes = _shape_values(config_lib.to_dict(config_lib.MODEL_PRESETS[preset]))
        if all(saved[k] == shapes[k] for k in SHAPE_FIELDS if k != "vocab_size"):
            return f" (the preset '{preset}' no longer scans its layers: unrolled, it runs faster)"
    return ""


def _check_shapes(model: Mapping[str, Any], config: config_lib.TrainConfig, checkpoint: str) -> None:
    old, new = _shape_values(model), _shape_values(config_lib.to_dict(config.model))
    changed = [name for name in SHAPE_FIELDS if old[name] != new[name]]
    if not changed:
        return
    listed = ", ".join(f"model.{name} {json.dumps(old[name])} -> {json.dumps(new[name])}" for name in changed)
    fix = " ".join(f"model.{name}={json.dumps(old[name])}" for name in changed)
    earlier_base = all(old[k] == v for k, v in _EARLIER_BASE.items()) and new["num_heads"] != old["num_heads"]
    hint = (" (the preset 'base' has 6 heads of 128, no longer 12 of 64)" if earlier_base else "")
    raise CheckpointError(
        f"{checkpoint}: the checkpoint's parameters have other shapes than this run's model (saved -> now: "
        f"{listed}){hint}; resume with --set '{fix}' or start a new run in another checkpoint directory")


def _check_optimizer(saved: Any, config: config_lib.TrainConfig, checkpoint: str) -> None:
    """Another optimizer keeps another state (AdamW's two moments, Adafactor's
    factored second moments): refused, naming both."""
    saved = saved if isinstance(saved, Mapping) else {}
    old, new = saved.get("name", "adamw"), config.optimizer.name
    if old != new:
        raise CheckpointError(
            f"{checkpoint}: the checkpoint was saved with optimizer.name={json.dumps(old)} and this run has "
            f"optimizer.name={json.dumps(new)}, whose state differs; resume with --set optimizer.name={old} or "
            "start a new run in another checkpoint directory")
    if new == "adafactor" and saved.get("factored", True) != config.optimizer.factored:
        raise CheckpointError(
            f"{checkpoint}: the checkpoint's Adafactor state was saved with optimizer.factored="
            f"{json.dumps(saved.get('factored', True))} and this run has optimizer.factored="
            f"{json.dumps(config.optimizer.factored)}, whose second moments have other shapes; resume with --set "
            f"optimizer.factored={json.dumps(saved.get('factored', True))}")


# Config fields that change the learning-rate schedule or the optimizer of a run
# (``steps`` is the schedule's length unless optimizer.decay_steps is set).
SCHEDULE_FIELDS = ("steps",) + tuple(f"optimizer.{f.name}" for f in dataclasses.fields(config_lib.OptimizerConfig))


def schedule_changes(saved: Mapping[str, Any], config: config_lib.TrainConfig) -> list[tuple[str, Any, Any]]:
    """[(dotted field name, saved value, new value)] of the ``SCHEDULE_FIELDS``
    whose value in ``config`` differs from a saved config.json dict (fields it
    lacks are not compared)."""
    current = config_lib.to_dict(config)
    out = []
    for name in SCHEDULE_FIELDS:
        old, new, present = saved, current, True
        for part in name.split("."):
            present = present and isinstance(old, Mapping) and part in old
            old = old.get(part) if isinstance(old, Mapping) else None
            new = new.get(part) if isinstance(new, Mapping) else None
        if present and old != new:
            out.append((name, old, new))
    return out


def warn_schedule_changes(config_path: str, config: config_lib.TrainConfig, step: int) -> None:
    """Logs a WARNING when a resumed run's schedule or optimizer differs from the
    saved config (extending a run is legitimate, so it does not refuse)."""
    try:
        saved = bounded_json.read_file(config_path, error=ValueError, max_bytes=1 << 20, what="config file")
    except ValueError as e:
        log.info("no saved config to compare the schedule with (%s): %s", config_path, e)
        return
    changes = schedule_changes(saved, config)
    if not changes:
        return
    listed = ", ".join(f"{name} {json.dumps(old)} -> {json.dumps(new)}" for name, old, new in changes)
    log.warning(
        "resuming at step %d with another learning-rate schedule or optimizer than the run's %s: %s (saved -> "
        "now). From step %d on, the learning rate and updates follow the new values; resume with the saved "
        "values to keep the original schedule.",
        step, config_path, listed, step,
    )
