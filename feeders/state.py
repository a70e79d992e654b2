"""Feeder state: a small JSON object, and the checks run when it is restored.

Example (one task, position 4096 = step 16 of a global batch of 256)::

    {"kind": "seqcache.feeders.Feeder", "version": 1, "cache_format_version": 1,
     "mixture": [{"path": "/data/caches/wiki/train", "rate": 1.0, "weight": 1,
                  "task": "wiki", "split": "train", "num_examples": 36718,
                  "fingerprint": "9f2c..."}],
     "seed": 0, "global_batch_size": 256, "sequence_length": {"targets": 512},
     "feature": "targets", "num_epochs": null, "position": 4096}

``sequence_length`` is the feeder's, {feature: tokens per row}. States of
earlier releases hold an int there, the length of the state's feature: they are
read (``read_state``, ``load_state``) as that mapping, once, here.

``position`` is the global position of the next example to read (step * B): the
state does not depend on the number of hosts (G5). Nothing else is needed to resume
(G4): the stream is a pure function of the other fields and the caches.

A cache in a state is identified by its fingerprint (with its rate, its weight and
its place in the mixture order); ``path`` (absolute when saved) only says where the
cache was. A state restores onto the same caches found elsewhere (moved, copied,
or reached by another path string) when the fingerprints match, and is refused when
a cache was rebuilt (``stream_difference``).
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Any, Mapping, Sequence

from msgspec import Meta, Struct

from seqcache import bounded_json, fs
from seqcache import format as fmt
from seqcache.feeders import compat
from seqcache.feeders.compat import FeederStateError  # defined with the rules; this module's error
from seqcache.feeders.stream import CONVERTER_FEATURES

STATE_KIND = "seqcache.feeders.Feeder"
# Bump when the stream a state denotes changes: the mixing algorithm, the
# permutation (rounds, round function, key derivation), the end-of-run rule.
STATE_VERSION = 1
# A state whose mixture carries a schedule (rates that change at given steps) has
# this version and a "schedule" field, so that a release that does not know
# schedules refuses it instead of reading it as constant rates.
SCHEDULE_STATE_VERSION = 2

# The ranges a restored state's values must lie in (far above what a run uses,
# far below what overflows the feeder's int64 positions or its allocations).
MAX_GLOBAL_BATCH_SIZE = 2**24
MAX_POSITION = 2**62
MAX_EPOCHS = 2**32
MAX_SEED = 2**64
MAX_MIXTURE_ENTRIES = 2**16
MAX_SCHEDULE_STAGES = 2**16

_Count = Annotated[int, Meta(ge=0, lt=bounded_json.MAX_COUNT)]
_Rate = Annotated[float, Meta(ge=0, lt=bounded_json.MAX_COUNT)]
_Text = Annotated[str, Meta(max_length=4096)]
_Position = Annotated[int, Meta(ge=0, lt=MAX_POSITION)]
_Length = Annotated[int, Meta(ge=1, lt=bounded_json.MAX_SEQUENCE_LENGTH)]


class _Cache(Struct):
    """An entry of a state's ``mixture`` (``mixture_entries``)."""

    path: _Text
    rate: _Rate
    weight: _Count
    fingerprint: _Text
    num_examples: _Count
    task: _Text | None = None
    split: _Text | None = None


class _Stage(Struct):
    """A stage of a state's ``schedule`` (``stages_of``): one rate and weight per mixture entry."""

    step: _Position
    rates: list[_Rate]
    weights: list[_Count]


class _Converter(Struct, forbid_unknown_fields=True):
    """A ``ConvertedFeeder``'s state's ``converter`` field (``check_converter``)."""

    name: str
    sequence_length: dict[str, _Length]


class _State(Struct):
    """The fields of a state after its kind and versions (other keys are not read here).
    The seed's upper bound, ``MAX_SEED``, is ``check_tree``'s (msgspec's bounds fit in int64)."""

    mixture: Annotated[list[_Cache], Meta(min_length=1, max_length=MAX_MIXTURE_ENTRIES)]
    seed: Annotated[int, Meta(ge=0)]
    global_batch_size: Annotated[int, Meta(ge=1, lt=MAX_GLOBAL_BATCH_SIZE)]
    # {feature: L}; an int L in a state of an earlier release (``read_state``).
    sequence_length: dict[str, _Length] | _Length
    feature: _Text
    num_epochs: Annotated[int, Meta(ge=1, lt=MAX_EPOCHS)] | None
    position: _Position
    schedule: Annotated[list[_Stage], Meta(min_length=1, max_length=MAX_SCHEDULE_STAGES)] | None = None


def check_state(state: Mapping[str, Any], *, path: str = "feeder state") -> None:
    """Validates the structure, version and every value of a state dict: the
    nesting and numbers of the whole object (``seqcache.bounded_json.check_tree``),
    then each field's type and range (``bounded_json.convert`` to ``_State``),
    then what ties fields together.

    Args:
      state: the decoded state.
      path: where it came from (a file), for messages.

    Raises:
      FeederStateError: one line naming ``path`` and the field: not a feeder
        state, another state or cache format version, a missing field, a value
        of the wrong type or out of range (``feeder state: mixture[0].rate:
        expected `float` >= 0.0 (got -1)``), a schedule that does not fit the
        mixture, a sequence length that is not one feature's, or a position
        that is not a multiple of the global batch.
    """
    if not isinstance(state, Mapping):
        raise FeederStateError(f"{path}: a feeder state is a JSON object (got {type(state).__name__})")
    bounded_json.check_tree(dict(state), path=path, error=FeederStateError, what="feeder state")
    if state.get("kind") != STATE_KIND:
        raise FeederStateError(f"{path}: not a feeder state: kind is {_short(state.get('kind'))}, "
                               f"expected {STATE_KIND!r}")
    version = state.get("version")
    if isinstance(version, bool) or version not in (STATE_VERSION, SCHEDULE_STATE_VERSION) or (
            version == SCHEDULE_STATE_VERSION and state.get("schedule") is None):
        raise FeederStateError(
            f"{path}: feeder state version is {_short(version)}, this seqcache reads version {STATE_VERSION} "
            f"(and {SCHEDULE_STATE_VERSION} with a mixture schedule): "
            "the state was written by another seqcache release; restore it with that release"
        )
    cache_version = state.get("cache_format_version")
    if isinstance(cache_version, bool) or cache_version != fmt.RECORD_FORMAT_VERSION:
        raise FeederStateError(
            f"{path}: feeder state was saved for cache format version {_short(cache_version)}, "
            f"this seqcache reads version {fmt.RECORD_FORMAT_VERSION}"
        )
    checked = bounded_json.convert(dict(state), _State, path=path, error=FeederStateError)
    if isinstance(checked.sequence_length, dict) and len(checked.sequence_length) != 1:
        raise FeederStateError(f"{path}: sequence_length = {_short(checked.sequence_length)}, expected "
                               f"{{{checked.feature!r}: L}}, the length of the state's feature")
    b = checked.global_batch_size
    for i, entry in enumerate(checked.mixture):
        if "\x00" in entry.path:  # no file system takes it: one line here, not "embedded null byte" later
            raise FeederStateError(f"{path}: mixture[{i}].path = {_short(entry.path)} holds a NUL character")
        if entry.rate == 0 and checked.schedule is None:
            raise FeederStateError(f"{path}: mixture[{i}].rate = 0 (cache {_short(entry.path)}), expected a number "
                                   "> 0: a task read at rate 0 is left out of the mixture")
    _check_schedule(checked.schedule or [], len(checked.mixture), b, path)
    if checked.position % b:
        raise FeederStateError(f"{path}: feeder state has position={checked.position!r}: expected a non-negative "
                               f"multiple of global_batch_size={b}")


_short = bounded_json.short


def read_state(state: Mapping[str, Any], *, path: str = "feeder state") -> dict:
    """A feeder state after ``check_state``, as this release writes it: a copy
    whose ``sequence_length`` is the mapping {feature: tokens}. A state of an
    earlier release holds an int L there, the length of its ``feature``: it
    is read as {feature: L}, here and nowhere else. What every restore reads.

    Raises:
      FeederStateError: what ``check_state`` refuses.
    """
    check_state(state, path=path)
    out = dict(state)
    if not isinstance(out["sequence_length"], Mapping):
        out["sequence_length"] = {out["feature"]: int(out["sequence_length"])}
    return out


def check_converter(state: Mapping[str, Any], *, path: str = "feeder state") -> tuple[str, dict[str, int]]:
    """The converter of a ``ConvertedFeeder``'s state (a checked state with a
    ``"converter"`` field ``{"name": ..., "sequence_length": {feature: L}}``),
    after checking its fields: the name one of ``ConvertedFeeder``'s
    converters, a length for exactly the features it reads, each an integer in
    [1, 2^24), and the state's own ``feature`` and ``sequence_length`` those of
    its targets.

    Returns:
      (name, {feature: length}) with the converter's features in its order.

    Raises:
      FeederStateError: one line naming ``path`` and the field, with the value
        shortened (``seqcache.bounded_json.short``).
    """
    converter = bounded_json.convert(state.get("converter"), _Converter, path=path, error=FeederStateError,
                                     prefix="converter")
    name, lengths = converter.name, converter.sequence_length
    if name not in CONVERTER_FEATURES:
        raise FeederStateError(f"{path}: converter.name = {_short(name)}, expected one of "
                               f"{tuple(CONVERTER_FEATURES)}")
    names = CONVERTER_FEATURES[name]
    if sorted(lengths) != sorted(names):
        raise FeederStateError(f"{path}: converter.sequence_length has features {_short(sorted(lengths))}, "
                               f"converter {name!r} reads {list(names)}")
    out = {n: lengths[n] for n in names}
    own = state.get("sequence_length")  # {feature: L}, or the int of an earlier release
    if state.get("feature") != "targets" or own not in (out["targets"], {"targets": out["targets"]}):
        raise FeederStateError(
            f"{path}: feature = {_short(state.get('feature'))} and sequence_length = "
            f"{_short(state.get('sequence_length'))} disagree with converter {name!r} "
            f"(expected 'targets' and {{'targets': {out['targets']}}}, its targets' length)")
    return name, out


def refuse_converter_state(state: Mapping[str, Any], *, path: str = "feeder state") -> None:
    """Refuses a ``ConvertedFeeder``'s state (one with a ``"converter"``
    field) where a plain ``Feeder`` would restore it: that feeder would read the
    targets only, without the converter's other features and fields.

    Raises:
      FeederStateError: naming the converter and ``ConvertedFeeder.restore``.
    """
    if "converter" not in state:
        return
    converter = state["converter"]
    name = converter.get("name") if isinstance(converter, Mapping) else converter
    raise FeederStateError(
        f"{path}: the state was saved by ConvertedFeeder(converter={_short(name)}); a Feeder would read its "
        "targets only: restore it with ConvertedFeeder.restore(state, ...) or restore_feeder(state, ...)"
    )


def _check_schedule(schedule: list[_Stage], n: int, b: int, path: str) -> None:
    """Refuses a schedule whose stages do not give one rate and weight to each
    of the ``n`` mixture entries, give weight 0 to all, do not start at step 0
    and increase, or start past global position 2^62 (global batch ``b``)."""
    for j, stage in enumerate(schedule):
        for key in ("rates", "weights"):
            if len(getattr(stage, key)) != n:
                raise FeederStateError(f"{path}: schedule[{j}].{key} = {_short(getattr(stage, key))}, expected a "
                                       f"list of one per mixture entry ({n})")
        if not any(stage.weights):
            raise FeederStateError(f"{path}: schedule[{j}].weights are all 0, expected one > 0")
        if stage.step * b >= MAX_POSITION:
            raise FeederStateError(f"{path}: schedule[{j}].step = {stage.step} starts at global position "
                                   f"{stage.step} * {b} (global_batch_size), beyond 2^62")
    steps = [stage.step for stage in schedule]
    if steps and (steps[0] != 0 or any(y <= x for x, y in zip(steps, steps[1:]))):
        raise FeederStateError(f"{path}: feeder state schedule steps must start at 0 and increase "
                               f"(got {_short(steps)})")


# A checkpoint's feeder state: the Orbax item "feeder" of a step folder (an
# Orbax CheckpointManager step, as ``seqcache train`` saves), a JSON file that
# Orbax's JsonCheckpointHandler names "metadata".
CHECKPOINT_ITEM = "feeder"
STATE_IN_STEP = os.path.join(CHECKPOINT_ITEM, "metadata")
# The most bytes a feeder state file may have (a mixture of 2^16 caches and a
# schedule of thousands of stages take a few MB).
MAX_STATE_BYTES = 16 << 20


def load_state(path: str | os.PathLike) -> dict:
    """Reads and checks a feeder state: a JSON file (``Feeder.state()`` as
    written, e.g., by ``json.dump``), or a checkpoint step folder holding one
    (``STATE_IN_STEP``, ``load_checkpoint_state``). The file is read by
    ``seqcache.bounded_json`` (at most ``MAX_STATE_BYTES``, its depth, values,
    keys and numbers bounded, no key twice, a byte order mark at its first
    byte dropped), then checked field by field (``check_state``).

    Returns:
      the state as ``read_state`` gives it (its sequence length a mapping).

    Raises:
      FeederStateError: one line naming the file (and the checkpoint step):
        not readable, not UTF-8 or not JSON (with the line and column), out
        of bounds, a key twice, a bad field.
    """
    path = os.fspath(path)
    if fs.isdir(path):
        return load_checkpoint_state(path)
    state = bounded_json.read_file(path, error=FeederStateError, max_bytes=MAX_STATE_BYTES, what="feeder state")
    return read_state(state, path=path)


def load_checkpoint_state(step_dir: str | os.PathLike, *, step: int | None = None, any_feeder: bool = False) -> Any:
    """The feeder state of a checkpoint step folder (``<step>/feeder/metadata``),
    read as ``load_state`` reads a file: what ``seqcache train`` resumes from,
    and the safe way to restore a feeder from an Orbax checkpoint (Orbax's
    ``JsonRestore`` reads the file with Python's ``json``: no bounds, and a
    key given twice is read silently).

    Args:
      step_dir: the step folder (a local path or a URL).
      step: its step, for messages (default: the folder's name).
      any_feeder: take the JSON state of any feeder (a trainer's checkpoints
        hold its feeder's, whatever the feeder): checked (and read as
        ``read_state`` reads it) only when its ``kind`` is ``STATE_KIND``.

    Raises:
      FeederStateError: ``checkpoint step {step}: {file}: ...`` in one line.
    """
    step_dir = os.fspath(step_dir)
    name = step if step is not None else os.path.basename(os.path.normpath(step_dir))
    path = fs.join(step_dir, STATE_IN_STEP)
    try:
        if not fs.exists(path):  # anything else there is refused by the reader
            item = fs.join(step_dir, CHECKPOINT_ITEM)
            why = (f"its {CHECKPOINT_ITEM!r} item has no state file" if fs.exists(item) else
                   f"the checkpoint was saved without its {CHECKPOINT_ITEM!r} item")
            raise FeederStateError(f"{path}: no feeder state here ({why})")
        state = bounded_json.read_file(path, error=FeederStateError, max_bytes=MAX_STATE_BYTES,
                                       what="feeder state")
        if not any_feeder or isinstance(state, Mapping) and state.get("kind") == STATE_KIND:
            state = read_state(state, path=path)
    except FeederStateError as e:
        raise FeederStateError(f"checkpoint step {name}: {e}") from None
    return state


def stages_of(state: Mapping[str, Any]) -> list[dict]:
    """The schedule a state denotes: [{"step", "rates", "weights"}], one rate and
    weight per mixture entry; a state with constant rates is one stage at step 0."""
    if state.get("schedule") is not None:
        return [dict(step=int(st["step"]), rates=[float(r) for r in st["rates"]], weights=[int(w) for w in st["weights"]])
                for st in state["schedule"]]
    return [{"step": 0, "rates": [float(e["rate"]) for e in state["mixture"]],
             "weights": [int(e["weight"]) for e in state["mixture"]]}]


def mixture_argument(state: Mapping[str, Any]):
    """The ``mixture=`` argument that reopens a state's caches at its paths: the
    [(path, rate)] pairs, or for a schedule {step: {path: rate}}."""
    if state.get("schedule") is None:
        return mixture_pairs(state)
    paths = [str(e["path"]) for e in state["mixture"]]
    return {int(st["step"]): {p: float(r) for p, r in zip(paths, st["rates"]) if float(r) != 0}
            for st in state["schedule"]}


def schedule_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why ``current`` (a feeder's state, possibly with a longer schedule) cannot
    continue the stream ``saved`` was at; None when it can.

    ``current`` continues ``saved`` when (1) the state's caches are the first
    mixture entries of ``current``, in order, by fingerprint and example count
    (caches added after them are new tasks, whose ordinals start at 0), (2) every
    stage that started before the saved step (the past) is the same in both, at
    the same step with the same rates (0 for the new caches), and (3) the other
    stream fields are equal. Stages at or after the saved step may be added,
    changed or removed: no example has been read under them.
    """
    have, want = list(saved["mixture"]), list(current["mixture"])
    if len(want) < len(have):
        return (
            f"the state was saved with a mixture of {len(have)} cache(s) ({_paths(have)}), but this run reads "
            f"{len(want)} ({_paths(want)}); a schedule can add caches, not remove them"
        )
    diff = compat.fingerprint_difference(have, want[:len(have)])
    if diff:
        return diff
    for key in _STREAM_FIELDS:
        if key != "version" and saved.get(key) != current.get(key):
            return _scalar_difference(key, saved.get(key), current.get(key))
    step = int(saved["position"]) // int(saved["global_batch_size"])
    extra = len(want) - len(have)
    old = [(st["step"], st["rates"] + [0.0] * extra) for st in stages_of(saved) if st["step"] < step]
    new = [(st["step"], st["rates"]) for st in stages_of(current) if st["step"] < step]
    for j in range(max(len(old), len(new))):
        a = old[j] if j < len(old) else None
        b = new[j] if j < len(new) else None
        if a == b:
            continue
        at = min(x[0] for x in (a, b) if x is not None)
        return (
            f"the mixture schedule rewrites the past at step {at}: the state is at step {step}, and its schedule has "
            f"{_stage_words(a, want)} where this run has {_stage_words(b, want)}; only stages starting at or after "
            f"step {step} can be added or changed"
        )
    return None


def _stage_words(stage, entries) -> str:
    if stage is None:
        return "no stage"
    step, rates = stage
    parts = ", ".join(f"{e.get('path')}: {r!r}" for e, r in zip(entries, rates) if r)
    return f"a stage at step {step} with rates {{{parts}}}"


def location(path: str | os.PathLike) -> str:
    """The form of a cache path stored in a state: absolute for a local path (so
    that it does not depend on the working directory), unchanged for a URL
    (``scheme://...``)."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)


def mixture_entries(paths: Sequence[str], rates: Sequence[float], weights: Sequence[int], readers) -> list[dict]:
    """The ``mixture`` field of a state: one dict per cache, in mixture order, with
    its absolute path, rate, integer weight, task, split, example count and
    fingerprint (``readers``: opened ``CacheReader``s)."""
    return [
        {
            "path": location(path),
            "rate": rate,
            "weight": weight,
            "task": reader.manifest.task,
            "split": reader.manifest.split,
            "num_examples": reader.num_examples,
            "fingerprint": reader.fingerprint,
        }
        for path, rate, weight, reader in zip(paths, rates, weights, readers)
    ]


def mixture_pairs(state: Mapping[str, Any]) -> list[tuple[str, float]]:
    """[(cache path, rate)] in mixture order."""
    return [(str(e["path"]), float(e["rate"])) for e in state["mixture"]]


def compare(state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuses a state whose configuration differs from ``expected``.

    Args:
      state: a checked state.
      expected: a subset of {"seed", "global_batch_size", "sequence_length",
        "feature", "num_epochs"} (num_epochs None means forever). Caches and rates
        are compared by ``stream_difference``.

    Raises:
      FeederStateError: naming the field, the state's value and the expected one.
    """
    for key, want in expected.items():
        have = state[key]
        if have != want:
            raise FeederStateError(_scalar_difference(key, have, want) + RESTORE_HINT)


# What to do about a difference, appended to the messages of ``Feeder.set_state``/``restore``.
RESTORE_HINT = (
    "; a state restores only onto the caches (same fingerprints, found at any path) and the configuration that "
    "saved it, or start a new run from step 0"
)

# The fields besides the mixture that define the stream a state denotes.
_STREAM_FIELDS = ("version", "cache_format_version", "seed", "global_batch_size", "sequence_length", "feature",
                  "num_epochs")


def _scalar_difference(key: str, have: Any, want: Any) -> str:
    if key == "global_batch_size" and isinstance(have, int) and isinstance(want, int):
        return compat.global_batch_difference(have, want)
    if key == "sequence_length" and isinstance(have, Mapping) and isinstance(want, Mapping) and list(have) == list(want):
        feature = next(f for f in have if have[f] != want[f])  # {feature: tokens}: the length that differs
        return (f"feeder state has sequence_length={json.dumps(have[feature])}, but this run has "
                f"sequence_length={json.dumps(want[feature])} for feature {feature!r}")
    return f"feeder state has {key}={json.dumps(have)}, but this run has {key}={json.dumps(want)}"


def _paths(entries: Sequence[Mapping[str, Any]], shown: int = 5) -> str:
    """The paths of ``entries`` for a message: the first ``shown``, then how many more."""
    text = ", ".join(str(e.get("path")) for e in entries[:shown])
    return text + (f" and {len(entries) - shown:,} more" if len(entries) > shown else "")


def _rate_difference(i: int, saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why mixture entry ``i`` of two states (the same cache) is read at another
    rate, or None."""
    path = current.get("path")
    if float(saved.get("rate")) != float(current.get("rate")):
        return (
            f"the state was saved with rate {float(saved.get('rate'))!r} for the cache at {path} (mixture entry {i}), "
            f"but this run has rate {float(current.get('rate'))!r}; rates change which task every position reads"
        )
    if saved.get("weight") != current.get("weight"):
        return (
            f"the cache at {path}: the state's integer weight {saved.get('weight')} differs from "
            f"{current.get('weight')} computed from rate {saved.get('rate')}; the state was written by an "
            "incompatible seqcache"
        )
    return None


def stream_difference(saved: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """Why two feeder states denote different streams, ignoring their positions
    and where their caches are; None when they denote the same stream.

    Caches are compared by fingerprint, example count, rate and integer weight, in
    mixture order; the other compared fields are the versions, seed, global batch
    size, sequence length, feature and number of epochs. When either state has a
    mixture schedule, this is ``schedule_difference``: ``current`` may extend the
    saved schedule after the saved step.

    Args:
      saved: the state being restored.
      current: the state of the feeder it is restored into (``Feeder.state()``).

    Returns:
      One sentence naming the first difference and both values (a rebuilt cache
      reads "the cache at PATH was rebuilt (fingerprint A, the state was saved with
      fingerprint B)"), or None.
    """
    if saved.get("schedule") is not None or current.get("schedule") is not None:
        # A mixture schedule may be extended after the saved step (stages and
        # caches added): the current stream continues the saved one.
        return schedule_difference(saved, current)
    have, want = list(saved["mixture"]), list(current["mixture"])
    if len(have) != len(want):
        return (
            f"the state was saved with a mixture of {len(have)} cache(s) ({_paths(have)}), but this run reads "
            f"{len(want)} ({_paths(want)})"
        )
    diff = compat.fingerprint_difference(have, want)
    if diff:
        return diff
    for i, (a, b) in enumerate(zip(have, want)):
        diff = _rate_difference(i, a, b)
        if diff:
            return diff
    for key in _STREAM_FIELDS:
        if saved.get(key) != current.get(key):
            return _scalar_difference(key, saved.get(key), current.get(key))
    return None
