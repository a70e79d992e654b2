"""Feeders for a run, from its ``DataConfig`` (used by ``seqcache train``).

The training source is, in this order of precedence:

0. a mixture schedule (``seqcache train --mixture-schedule FILE``,
   ``load_mixture_schedule``): {step: {task or cache folder: rate}}, rates that
   change at the given steps (``seqcache.feeders.schedule``);
1. ``data.mixture``: {cache folder: rate}; relative folders are under ``cache_dir``;
2. ``data.task`` naming a cache folder (one with manifest.json);
3. ``data.task`` naming ``CACHE_DIR/<task>/<split>``;
4. ``data.task`` naming a registered task or mixture (``seqcache.tasks``), its
   caches under ``cache_dir``.

Evaluation reads the same source with ``data.eval_split`` and ``num_epochs=1``:
every example exactly once, the last batch padded with rows of zero loss weight
(for a schedule: its caches with equal rates).

The feature converter follows from the model and the cache's features
(``resolve_converter``); a model that cannot read a cache is refused with a
message naming both.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import types
from typing import Any, Callable, Mapping, Sequence

from seqcache import layout
from seqcache import format as fmt
from seqcache import lengths as lengths_lib
from seqcache.feeders import Feeder
from seqcache.feeders import schedule_file
from seqcache.feeders.converters import ConvertedFeeder
from seqcache.feeders.stream import check_same_features
from seqcache.tasks import registry
from seqcache.training import models
from seqcache.training.config import ConfigError, DataConfig, TrainConfig, converter_features


@dataclasses.dataclass(frozen=True, kw_only=True)
class Source:
    """Feeder arguments for one split (``cache=`` or ``mixture=``, with
    ``caches_root``/``split``), every cache folder read, and a label for messages."""

    kwargs: dict
    cache_dirs: tuple[str, ...]
    name: str


# The most bytes a mixture schedule file may have (``seqcache.feeders.schedule_file``).
MAX_SCHEDULE_BYTES = schedule_file.MAX_SCHEDULE_BYTES


def load_mixture_schedule(path: str) -> dict[int, dict[str, float]]:
    """Reads a mixture schedule, JSON or YAML (``.yaml``/``.yml``), {step: {task
    or cache folder: rate}}, e.g. ``{"0": {"wiki": 1}, "10000": {"wiki": 3, "code": 1}}``:
    steps are integers >= 0, the first 0; rates numbers >= 0 (0 or left out: not read).
    The file is read by ``seqcache.feeders.schedule_file.read_schedule_file``
    (bounded JSON, or YAML 1.2 without anchors, aliases, merge keys or tags).

    Raises:
      ConfigError: the file cannot be read or parsed, is out of bounds, uses
        YAML anchors, aliases, merge keys or tags, or a step or rate is bad; the
        message names the file, and the line and column where the parser knows them.
    """
    return schedule_file.read_schedule_file(path, error=ConfigError)


def _schedule_source(schedule: dict[int, dict[str, float]], data: DataConfig, split: str, *,
                     for_eval: bool) -> Source:
    """The feeder arguments of a mixture schedule; each name is a task under
    ``cache_dir`` or a cache folder (absolute or under ``cache_dir``; for
    another split, its sibling folder)."""
    paths: dict[str, str] = {}
    for stage in schedule.values():
        for name in stage:
            if name in paths:
                continue
            folder = name if os.path.isabs(name) or not data.cache_dir else os.path.join(data.cache_dir, name)
            if split != data.split:
                folder = os.path.join(os.path.dirname(os.path.normpath(folder)), split)
            tried = [folder] + ([os.path.join(data.cache_dir, name, split)] if data.cache_dir else [])
            found = next((p for p in tried if layout.is_cache(p)), None)
            if found is None:
                raise ConfigError(f"mixture schedule: {name!r} is neither a cache folder nor a task cache "
                                  f"(tried {', '.join(tried)})")
            paths[name] = found
    if for_eval:
        # A finite evaluation reads every example once whatever the rates.
        return Source(kwargs={"mixture": {p: 1.0 for p in paths.values()}}, cache_dirs=tuple(paths.values()),
                      name="mixture schedule")
    mixture = {step: {paths[n]: r for n, r in stage.items() if r > 0} for step, stage in schedule.items()}
    return Source(kwargs={"mixture": mixture}, cache_dirs=tuple(paths.values()),
                  name=f"mixture schedule ({len(schedule)} stages)")


def resolve_source(data: DataConfig, split: str, modules: tuple[str, ...] = (), *,
                   schedule: dict[int, dict[str, float]] | None = None, for_eval: bool = False) -> Source:
    """Where batches of ``split`` come from (see the module docstring).

    Args:
      schedule: a mixture schedule (``load_mixture_schedule``); replaces
        ``data.mixture`` and ``data.task``.
      for_eval: with a schedule, its caches of ``split`` at equal rates.

    Raises:
      ConfigError: nothing to train on, or a name that is neither a cache folder nor
        a registered task or mixture (the message says what was tried).
    """
    if schedule:
        return _schedule_source(schedule, data, split, for_eval=for_eval)
    if data.mixture:
        pairs = {path if os.path.isabs(path) or data.cache_dir is None else os.path.join(data.cache_dir, path): rate
                 for path, rate in data.mixture.items()}
        return Source(kwargs={"mixture": pairs}, cache_dirs=tuple(pairs), name="mixture")
    task = data.task
    if not task:
        raise ConfigError("no training data: give --task (a cache folder, task or mixture name) or data.mixture")
    found = registry.resolve_name(task, split=split, cache_dir=data.cache_dir, modules=modules)
    if found is not None and found.kind == "folder" and split != data.split:
        # A cache folder is one split; the sibling folder holds the other one.
        sibling = layout.sibling_split(task, split)
        if not layout.is_cache(sibling):
            raise ConfigError(f"{task} is the cache of one split; no cache for split {split!r} at {sibling}")
        return Source(kwargs={"cache": sibling}, cache_dirs=(sibling,), name=sibling)
    if found is not None and found.kind == "mixture":
        kwargs = {"mixture": found.mixture, "caches_root": data.cache_dir, "split": split}
        return Source(kwargs=kwargs, cache_dirs=found.cache_dirs, name=found.label)
    if found is not None:
        return Source(kwargs={"cache": found.cache_dirs[0]}, cache_dirs=found.cache_dirs, name=found.label)
    where = f" or {layout.cache_path(data.cache_dir, task, split)}" if data.cache_dir else ""
    raise ConfigError(
        f"--task {task!r}: not a cache folder{where}, nor a registered task or mixture"
        + ("" if data.cache_dir else " (give --cache-dir to look up names)"))


# Not token features: per-token ones and an evaluation cache's source text.
_PER_TOKEN_SUFFIXES = ("_segment_ids", "_positions", fmt.PRETOKENIZED_SUFFIX)


def token_features_of(source: Source) -> tuple[str, ...]:
    """The token features (not segment ids or positions) every cache of
    ``source`` has, in the first manifest's order.

    Raises:
      ConfigError: caches with different token features (the Feeder's message,
        ``seqcache.feeders.stream.check_same_features``).
    """
    manifests = [types.SimpleNamespace(manifest=fmt.read_manifest(path)) for path in source.cache_dirs]
    try:
        check_same_features(list(source.cache_dirs), manifests, converters_only=True)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return tuple(f.name for f in manifests[0].manifest.features if not f.name.endswith(_PER_TOKEN_SUFFIXES))


def resolve_converter(config: TrainConfig, source: Source, *, model_label: str | None = None) -> str:
    """The feature converter that feeds ``config.model`` from ``source``:
    ``data.converter`` if set (checked against the caches), else the one
    ``seqcache.training.models.converter_for`` picks from the features.

    Raises:
      ConfigError: the model cannot read the caches, or ``data.converter`` needs
        features they lack (names the cache, its features and the model's).
    """
    features = token_features_of(source)
    arch = config.model.architecture
    label = model_label or arch
    try:
        picked = models.converter_for(arch, features, cache=source.name, model=label)
    except models.ModelDataMismatch as e:
        raise ConfigError(str(e)) from None
    chosen = config.data.converter or picked
    needs = dict(models.architecture(arch).converters).get(chosen)
    if needs is not None and not set(needs) <= set(features):
        raise ConfigError(
            f"{source.name}: data.converter={chosen!r} reads features {list(needs)}, but the cache has "
            f"{list(features)} (model {label!r})")
    return chosen


def source_lengths(source: Source, given: Mapping[str, int | None] | int | None,
                   features: Sequence[str]) -> dict[str, int]:
    """The run's sequence lengths over ``source``'s caches, feature -> tokens
    (``seqcache.lengths.fit_lengths``): the given ones (None or a mapping's None:
    not given), else the caches' own; read before anything is compiled (also
    in a dry run), in the CLI's terms.

    Raises:
      seqcache.lengths.SequenceLengthError: a length longer than a cache's,
        or none given where a cache records none (the message names the cache
        and ``--sequence-length``).
      ConfigError: a malformed length (not an integer >= 1).
    """
    manifests = {path: fmt.read_manifest(path) for path in source.cache_dirs}
    try:
        return lengths_lib.fit_lengths(given, manifests, features, setting="--sequence-length ")
    except lengths_lib.SequenceLengthError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def vocab_size_of(source: Source, feature: str = "targets") -> int:
    """The vocabulary size of ``feature`` recorded in the caches' manifests.

    Raises:
      ConfigError: a manifest without it, or caches with different vocabularies.
    """
    seen = {}
    for path in source.cache_dirs:
        desc = fmt.read_manifest(path).vocabularies.get(feature)
        if desc is None or desc.vocab_size is None:
            raise ConfigError(
                f"{path}: the manifest records no vocabulary size for feature {feature!r}; "
                "set it with --set model.vocab_size=N")
        seen[path] = desc
    descs = list(seen.values())
    if any(d != descs[0] for d in descs[1:]):
        raise ConfigError(f"the caches use different vocabularies for {feature!r}: {seen}")
    return int(descs[0].vocab_size)


def model_vocab_size(source: Source, converter: str) -> int:
    """The vocabulary size a model needs for ``source``: that of ``targets``; an
    encdec or prefix_lm model also reads ``inputs`` with the same table.

    Raises:
      ConfigError: see ``vocab_size_of``; or ``inputs`` and ``targets`` with
        different vocabulary sizes (names both).
    """
    size = vocab_size_of(source, "targets")
    if converter != "lm":
        inputs = vocab_size_of(source, "inputs")
        if inputs != size:
            raise ConfigError(
                f"{source.name}: features 'inputs' and 'targets' have vocabularies of {inputs} and {size} ids; the "
                "models read both with one embedding table: build the cache with one vocabulary for both")
    return size


def num_examples_of(source: Source) -> int:
    """Examples in the source's caches (all tasks together)."""
    return sum(fmt.read_manifest(path).num_examples for path in source.cache_dirs)


def steps_per_epoch(source: Source, global_batch_size: int) -> int | None:
    """ceil(examples / B) for one cache; None for a mixture (an epoch is per task)."""
    if len(source.cache_dirs) != 1:
        return None
    return math.ceil(num_examples_of(source) / global_batch_size)


def make_feeder(config: TrainConfig, source: Source, *, seed: int, num_epochs: int | None = None):
    """A feeder over ``source`` with the run's global batch size and sequence
    lengths: a ``Feeder`` of ``targets`` for the "lm" converter, else a
    ``ConvertedFeeder`` of ``config.converter``; both of ``config.sequence_length``."""
    common = dict(source.kwargs, global_batch_size=config.global_batch_size, seed=seed, num_epochs=num_epochs)
    given = config.sequence_length or {}
    lengths = {f: given[f] for f in converter_features(config.converter) if f in given}
    if config.converter == "lm":
        return Feeder(**common, sequence_length=lengths)
    return ConvertedFeeder(converter=config.converter, sequence_length=lengths, **common)


def feeder_readers(feeder) -> list:
    """The cache readers of a ``Feeder`` or of every feature feeder of a
    ``ConvertedFeeder`` (for the dry run's shard checks)."""
    inner = getattr(feeder, "feeders", None)
    if isinstance(inner, dict):
        return [r for f in inner.values() for r in f.readers]
    return list(feeder.readers)


def eval_feeder_factory(config: TrainConfig, source: Source, *, seed: int) -> Callable[[], Any]:
    """A function returning a fresh finite (one epoch) feeder over ``source``."""
    return functools.partial(make_feeder, config, source, seed=seed, num_epochs=1)
