"""The global stream: global position -> (task, ordinal, epoch, cache index).

This is the index arithmetic of the feeder, without reading or threads; the index
vocabulary is defined at the top of ``seqcache.feeders.feeder``. For a global
position p:

1. mixing (``seqcache.feeders.mixing``): task t and ordinal k, in O(log T);
2. epochs: epoch e = k // N_t, element k mod N_t;
3. order (``seqcache.feeders.permutation``): cache index
   i = perm_{seed,t,e}(k mod N_t), in O(1).

Finite runs (``num_epochs`` = E): task t provides E * N_t ordinals. A position whose
ordinal is k >= E * N_t (its task is exhausted) is a padding row. The stream ends
at P_end, the first position by which every task has provided all its E * N_t
ordinals: P_end = max_t min{P : c_t(P) = E * N_t}, and the run has
ceil(P_end / B) steps; rows at positions >= P_end are padding too. So every
example of every task is read exactly E times, and exactly once per epoch.
With one task, P_end = E * N and padding appears only in the last step.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
from typing import Mapping, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache import fs, layout
from seqcache.feeders import mixing
from seqcache.feeders.permutation import FeistelPermutation, epoch_permutation, permute_each
from seqcache.feeders.reader import CacheReader
from seqcache.feeders.schedule import Schedule
from seqcache.rates import Rate

_PERM_CACHE_SIZE = 256


@dataclasses.dataclass(frozen=True)
class Located:
    """Where a batch of global positions comes from; arrays of shape (n,).

    Attributes:
      position: int64, the global positions p.
      task: int32, the task index t (mixture order).
      ordinal: int64, k: how many earlier positions went to the same task.
      epoch: int64, e = k // N_t.
      cache_index: int64, i = perm_{seed,t,e}(k mod N_t); -1 on padding rows.
      valid: bool, False on padding rows (exhausted task in a finite run).
    """

    position: np.ndarray
    task: np.ndarray
    ordinal: np.ndarray
    epoch: np.ndarray
    cache_index: np.ndarray
    valid: np.ndarray


class IndexStream:
    """Random access to the global stream of a mixture of task caches.

    Args:
      readers: one opened ``CacheReader`` per task, in mixture order.
      weights: positive integer weights, one per task (``mixing.integer_weights``).
      seed: the feeder seed, in [0, 2^64).
      num_epochs: None (repeat forever) or E >= 1.

    Everything is O(log T) per position plus O(1) per (task, epoch) for the round
    keys, which are cached (a bounded LRU).
    """

    def __init__(self, *, readers: Sequence[CacheReader], weights: Sequence[int] | None = None, seed: int,
                 num_epochs: int | None, stages: Sequence[tuple[int, Sequence[int]]] | None = None):
        if (weights is None) == (stages is None):
            raise ValueError("give exactly one of weights= (constant rates) or stages= (a schedule)")
        self.readers = list(readers)
        self.sizes = [r.num_examples for r in readers]
        self.keys = [r.fingerprint for r in readers]
        self.mixer = Schedule(stages) if stages is not None else mixing.Mixer(weights)
        if self.mixer.num_tasks != len(self.readers):
            raise ValueError(f"{len(readers)} caches but {self.mixer.num_tasks} weights")
        self.seed = int(seed)
        self.num_epochs = num_epochs
        self._sizes = np.array(self.sizes, np.int64)  # (T,): N_t, indexed by task
        self._perms: collections.OrderedDict[tuple[int, int], FeistelPermutation] = collections.OrderedDict()
        self._lock = threading.Lock()
        if num_epochs is None:
            self.limits = None
            self.end_position = None
        else:
            self.limits = [num_epochs * n for n in self.sizes]
            self._limits = np.array(self.limits, np.int64)
            ends = [self.mixer.first_position_with_count(t, lim) for t, lim in enumerate(self.limits)]
            never = [self.readers[t].cache_dir for t, end in enumerate(ends) if end is None]
            if never:
                raise ValueError(
                    f"num_epochs={num_epochs}: the cache(s) {never} are not read in the last stage of the mixture "
                    "schedule and would never finish their epochs, so this finite run would never end; give them "
                    "a rate in the last stage or run with num_epochs=None"
                )
            self.end_position = max(ends)

    def num_steps(self, global_batch_size: int) -> int | None:
        """ceil(P_end / B) for a finite run, None when it repeats forever."""
        if self.end_position is None:
            return None
        return -(-self.end_position // global_batch_size)

    def permutation(self, task: int, epoch: int) -> FeistelPermutation:
        """perm_{seed, task, epoch}, a bijection of [0, N_task)."""
        key = (task, epoch)
        with self._lock:
            perm = self._perms.get(key)
            if perm is not None:
                self._perms.move_to_end(key)
                return perm
        perm = epoch_permutation(n=self.sizes[task], seed=self.seed, task_key=self.keys[task], epoch=epoch)
        with self._lock:
            self._perms[key] = perm
            while len(self._perms) > _PERM_CACHE_SIZE:
                self._perms.popitem(last=False)
        return perm

    def locate(self, positions) -> Located:
        """Locates global positions (int64 array (n,), each in [0, 2^62))."""
        p = np.asarray(positions, dtype=np.int64)
        task, ordinal = self.mixer.locate_many(p)
        n = p.size
        cache_index = np.full(n, -1, np.int64)
        if self.mixer.num_tasks == 1:
            size = self.sizes[0]
            epoch, elem = np.divmod(ordinal, size)
            valid = np.ones(n, bool) if self.limits is None else ordinal < self.limits[0]
        else:
            # All tasks at once: each position's own size and limit.
            epoch, elem = np.divmod(ordinal, self._sizes[task])
            valid = np.ones(n, bool) if self.limits is None else ordinal < self._limits[task]
        if not n:
            return Located(position=p, task=task, ordinal=ordinal, epoch=epoch, cache_index=cache_index, valid=valid)
        if self.mixer.num_tasks == 1 and (self.limits is None or valid.all()):
            e_lo, e_hi = int(epoch.min()), int(epoch.max())
            if e_lo == e_hi:  # the common step: one task, one epoch, no padding (no masking needed)
                cache_index = self.permutation(0, e_lo).permute(elem).astype(np.int64)
                return Located(position=p, task=task, ordinal=ordinal, epoch=epoch, cache_index=cache_index,
                               valid=valid)
        # The (task, epoch) permutations the batch draws from (usually one per
        # task), then one vectorised pass of them all (``permute_each``).
        perms: list[FeistelPermutation] = []
        tv, ev = task[valid], epoch[valid]
        which = np.zeros(tv.size, np.int64)  # per valid position: its index in perms
        tasks = np.unique(tv).tolist() if self.mixer.num_tasks > 1 else [0] * bool(tv.size)
        for t in tasks:
            in_t = np.flatnonzero(tv == t) if len(tasks) > 1 else slice(None)
            et = ev[in_t]
            e_lo, e_hi = int(et.min()), int(et.max())
            if e_lo == e_hi:
                which[in_t] = len(perms)
                perms.append(self.permutation(t, e_lo))
                continue
            which_t = np.empty(et.shape, np.int64)
            for ep in range(e_lo, e_hi + 1):
                m = et == ep
                if m.any():
                    which_t[m] = len(perms)
                    perms.append(self.permutation(t, ep))
            which[in_t] = which_t
        if perms:
            cache_index[valid] = permute_each(perms, which, elem[valid]).astype(np.int64)
        return Located(position=p, task=task, ordinal=ordinal, epoch=epoch, cache_index=cache_index, valid=valid)

    def locate_one(self, position: int) -> dict:
        """Python-integer version of ``locate`` for one position (any size)."""
        t, k = self.mixer.locate(int(position))
        size = self.sizes[t]
        e, elem = divmod(k, size)
        valid = self.limits is None or k < self.limits[t]
        ci = int(self.permutation(t, e).permute(np.array([elem]))[0]) if valid else -1
        return {"position": int(position), "task": t, "ordinal": k, "epoch": e, "element": elem,
                "cache_index": ci, "valid": valid}


# Stored features that accompany a token feature rather than being one.
PER_TOKEN_SUFFIXES = ("_segment_ids", "_positions")
# Stored features that are not token features: the per-token ones and an
# evaluation cache's source text (``<feature>_pretokenized``, uint8 UTF-8).
NOT_TOKEN_SUFFIXES = PER_TOKEN_SUFFIXES + (fmt.PRETOKENIZED_SUFFIX,)

# The converters of ``seqcache.feeders.converters`` and the features each reads.
CONVERTER_FEATURES = {"lm": ("targets",), "encdec": ("inputs", "targets"), "prefix_lm": ("inputs", "targets")}


def token_features(manifest) -> tuple[str, ...]:
    """The token features of a cache (its stored features less the per-token
    ``<feature>_segment_ids`` / ``_positions`` and the source text
    ``<feature>_pretokenized``), in manifest order."""
    return tuple(f.name for f in manifest.features if not f.name.endswith(NOT_TOKEN_SUFFIXES))


def describe_features(paths: Sequence[str], readers: Sequence[CacheReader]) -> str:
    """``task 'a' (PATH) has ['targets']; task 'b' (PATH) has ['inputs', 'targets']``:
    every cache's task and token features, for error messages."""
    return "; ".join(f"task {r.manifest.task!r} ({p}) has {list(token_features(r.manifest))}"
                     for p, r in zip(paths, readers))


def what_reads(features: Sequence[str], *, converters_only: bool = False) -> str:
    """The readers of caches with ``features`` that use every one of them, in
    words (``converters_only``: ``ConvertedFeeder``'s converters alone)."""
    fits = [c for c, needs in CONVERTER_FEATURES.items() if set(needs) == set(features)]
    if fits:
        readers = ["Feeder(feature='targets')"] if list(features) == ["targets"] and not converters_only else []
        readers.append("ConvertedFeeder(converter=" + " or ".join(repr(c) for c in fits) + ")")
        return " or ".join(readers)
    return "no converter; one Feeder per feature" if converters_only else "one Feeder(feature=...) per feature"


def check_same_features(paths: Sequence[str], readers: Sequence[CacheReader], *,
                        converters_only: bool = False) -> None:
    """Refuses a mixture whose caches have different token features: a feeder
    would drop some tasks' other features without a word (the ``inputs`` of a
    translation task mixed with an LM task). seqio's ``Mixture`` refuses it too.

    Raises:
      ValueError: one line naming every cache's task, folder and features, and
        the mixtures that would work with their readers (``converters_only``:
        ``ConvertedFeeder``'s converters alone).
    """
    feats = [token_features(r.manifest) for r in readers]
    if all(set(f) == set(feats[0]) for f in feats[1:]):
        return
    distinct: list[tuple[str, ...]] = []
    for f in feats:
        if all(set(f) != set(d) for d in distinct):
            distinct.append(f)
    shared = [f for f in feats[0] if all(f in other for other in feats[1:])]
    options = [f"tasks with {list(d)} only (read with {what_reads(d, converters_only=converters_only)})"
               for d in distinct]
    if shared:
        options.append(f"build every task with the features they share, {shared}")
    raise ValueError(
        "the mixture's caches have different features, so a feeder would drop some tasks' features: "
        f"{describe_features(paths, readers)}. Mix " + "; or ".join(options)
    )


def feature_layout(reader: CacheReader, feature: str) -> dict:
    """Which stored features of a cache give the tokens and segment ids of
    ``feature``: ``{"tokens": name, "segment_ids": name or None}``.

    Raises:
      ValueError: the cache has no such feature, or it is another feature's
        ``_segment_ids`` or ``_positions`` (a ``_pretokenized`` text is read
        as its bytes).
    """
    names = [f.name for f in reader.features]
    if feature not in names or feature.endswith(PER_TOKEN_SUFFIXES):
        what = (f"feature {feature!r} holds another feature's segment ids or positions" if feature in names
                else f"the cache has no feature {feature!r}")
        raise ValueError(f"{reader.cache_dir}: {what} (its token features: "
                         f"{', '.join(token_features(reader.manifest))}); choose one of them (feature= in Python, "
                         "--feature on the command line)")
    layout = {"tokens": feature, "segment_ids": None}
    if f"{feature}_segment_ids" in names:
        layout["segment_ids"] = f"{feature}_segment_ids"
    return layout


def check_step(step: int, *, global_batch_size: int, num_steps: int | None, num_epochs: int | None,
               allow_end: bool = False) -> None:
    """Refuses a step no batch of the stream has: negative, at global position
    2^62 or beyond, or (a finite run of ``num_steps`` steps) past its end
    (``allow_end``: the end itself is allowed, as the position after the last
    batch).

    Raises:
      ValueError: naming the step and the run's steps.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0 (got {step})")
    if (step + 1) * global_batch_size > mixing.MAX_POSITION:
        raise ValueError(f"step {step} is beyond the largest supported global position 2^62")
    if num_steps is not None:
        limit = num_steps if allow_end else num_steps - 1
        if step > limit:
            raise ValueError(
                f"step {step} is past the end of this finite run: {num_epochs} epoch(s) take "
                f"{num_steps} steps (0..{num_steps - 1})"
            )


def _resolve_mixture(cache, mixture, caches_root, split) -> tuple[list[tuple[str, Rate]], str | None]:
    """[(cache path, rate or rate callable)], and the mixture's name when it has one."""
    if cache is not None:
        return [(os.fspath(cache), 1.0)], None
    if _is_task_mixture(mixture):
        paths, counts = _task_mixture_caches(mixture, caches_root, split)
        names = list(paths)
        rates = mixture.get_rates(counts)
        # seqio semantics: a task with rate 0 is part of the mixture but never read.
        return [(paths[n], float(rates[n])) for n in names if rates[n] > 0], getattr(mixture, "name", None)
    items = list(mixture.items()) if isinstance(mixture, Mapping) else list(mixture)
    if not items:
        raise ValueError("mixture= is empty: give {cache_path: rate, ...}")
    out = []
    for item in items:
        try:
            path, rate = item
        except (TypeError, ValueError):
            raise ValueError(f"mixture entries are (cache path, rate) pairs (got {item!r})") from None
        out.append((os.fspath(path), rate))
    counts = collections.Counter(p for p, _ in out)
    dup = sorted(p for p, n in counts.items() if n > 1)
    if dup:
        shown = ", ".join(repr(p) for p in dup[:5]) + (f" and {len(dup) - 5:,} more" if len(dup) > 5 else "")
        raise ValueError(f"mixture lists cache(s) {shown} more than once")
    return out, None


def _is_task_mixture(mixture) -> bool:
    """Whether ``mixture=`` is a ``seqcache.tasks.Mixture`` (named tasks)."""
    return hasattr(mixture, "get_rates") and hasattr(mixture, "task_names")


def _task_mixture_caches(mixture, caches_root, split) -> tuple[dict[str, str], dict[str, int]]:
    """({task: cache folder}, {task: example count}) of a ``seqcache.tasks.Mixture``:
    tasks resolve to ``caches_root/<task>/<split>`` (manifests read, no shard opened)."""
    if caches_root is None:
        raise ValueError(
            f"mixture {getattr(mixture, 'name', mixture)!r} names tasks; give caches_root= (the folder holding "
            "<task>/<split> caches) to find them"
        )
    root = fs.require_local(os.fspath(caches_root), "the feeder (CacheReader)")
    paths = {n: layout.cache_path(root, n, split) for n in mixture.task_names}
    counts = {n: fmt.read_manifest(p).num_examples for n, p in paths.items()}
    return paths, counts


def _task_mixture_schedule(mixture, caches_root, split) -> dict[int, dict[str, float]] | None:
    """The schedule {step: {cache folder: rate > 0}} of a ``seqcache.tasks.Mixture``
    made with ``schedule=``, else None."""
    if not getattr(mixture, "schedule", None):
        return None
    paths, counts = _task_mixture_caches(mixture, caches_root, split)
    return {step: {paths[n]: r for n, r in rates.items() if r > 0}
            for step, rates in mixture.get_schedule(counts).items()}


def is_schedule(mixture) -> bool:
    """Whether ``mixture=`` is a schedule ``{step: {cache path: rate}}`` (int keys)."""
    return (isinstance(mixture, Mapping) and bool(mixture)
            and all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in mixture))


def _resolve_schedule(schedule) -> tuple[list[str], list[tuple[int, dict[str, Rate]]]]:
    """(cache paths in mixture order: first appearance, stage by stage; [(step, {path: rate})])."""
    stages = sorted((int(step), rates) for step, rates in schedule.items())
    if stages[0][0] != 0:
        raise ValueError(f"a mixture schedule starts at step 0 (its first stage is at step {stages[0][0]})")
    paths: list[str] = []
    seen: set[str] = set()
    out = []
    for step, rates in stages:
        if not isinstance(rates, Mapping):
            try:
                rates = dict(rates)
            except (TypeError, ValueError):
                raise ValueError(f"schedule stage at step {step}: expected {{cache path: rate}} (got {rates!r})") from None
        if not rates:
            raise ValueError(f"schedule stage at step {step} has no caches")
        stage = {os.fspath(path): rate for path, rate in rates.items()}
        for p in stage:
            if p not in seen:
                seen.add(p)
                paths.append(p)
        out.append((step, stage))
    return paths, out


@dataclasses.dataclass
class OpenedMixture:
    """The caches of a mixture, opened: paths, readers, float rates and integer
    weights, in mixture order. For a schedule, ``stages`` is [{"step", "rates",
    "weights"}] (0 where a cache is not read in that stage) and ``rates`` /
    ``weights`` are the first stage's."""

    paths: list[str]
    readers: list[CacheReader]
    rates: list[float]
    weights: list[int]
    name: str | None
    stages: list[dict] | None = None

    def stream(self, *, seed: int, num_epochs: int | None, global_batch_size: int) -> "IndexStream":
        """The ``IndexStream`` of these caches (a schedule's steps become positions with B)."""
        if self.stages is None:
            return IndexStream(readers=self.readers, weights=self.weights, seed=seed, num_epochs=num_epochs)
        return IndexStream(readers=self.readers, seed=seed, num_epochs=num_epochs,
                           stages=[(st["step"] * global_batch_size, st["weights"]) for st in self.stages])

    def close(self) -> None:
        for r in self.readers:
            r.close()


def open_mixture(*, cache=None, mixture=None, caches_root=None, split: str = "train") -> OpenedMixture:
    """Resolves ``cache=`` or ``mixture=`` (see ``Feeder``) and opens every cache.

    Rate callables are evaluated with the cache's example count; rates become
    integer weights with ``mixing.integer_weights``.

    Raises:
      ValueError: both or neither of cache/mixture, bad pairs or rates, a cache listed twice.
      seqcache.format.CacheError: a cache is missing, incomplete or inconsistent.
    """
    if (cache is None) == (mixture is None):
        raise ValueError("give exactly one of cache= (one task cache folder) or mixture=")
    if caches_root is not None and not _is_task_mixture(mixture):
        raise ValueError("caches_root= is only used with mixture=<seqcache.tasks.Mixture>")
    if is_schedule(mixture):
        return _open_schedule(mixture)
    if _is_task_mixture(mixture):
        schedule = _task_mixture_schedule(mixture, caches_root, split)
        if schedule is not None:
            return _open_schedule(schedule, name=getattr(mixture, "name", None))
    entries, name = _resolve_mixture(cache, mixture, caches_root, split)
    with _readers([path for path, _ in entries]) as readers:
        rates = [_rate_value(path, rate, reader) for (path, rate), reader in zip(entries, readers)]
        for (path, _), rate in zip(entries, rates):
            if rate == 0:
                raise ValueError(f"mixture rate of {path} is 0 (expected a finite number > 0); remove the task "
                                 "instead of giving it rate 0")
        weights = mixing.integer_weights(rates)
    return OpenedMixture(paths=[p for p, _ in entries], readers=readers, rates=rates, weights=weights, name=name)


@contextlib.contextmanager
def _readers(paths: Sequence[str]):
    """A reader of each cache, all closed when the block (or opening one) fails;
    O(1) in the number of shards: each shard is checked at its first read."""
    readers: list[CacheReader] = []
    try:
        for path in paths:
            readers.append(CacheReader(path, open_shards=False))
        yield readers
    except BaseException:
        for r in readers:
            r.close()
        raise


def _rate_value(path: str, rate: Rate, reader: CacheReader) -> float:
    value = rate(reader.num_examples) if callable(rate) else rate
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"mixture rate of {path} must be a number (got {value!r})")
    if not np.isfinite(value) or value < 0:
        raise ValueError(f"mixture rate of {path} is {float(value)!r}, expected a finite number > 0 (0 in a "
                         "schedule stage: not read in that stage)")
    return float(value)


def _open_schedule(schedule, *, name: str | None = None) -> OpenedMixture:
    """``open_mixture`` for a schedule ``{step: {cache path: rate}}``: every cache
    named in any stage, in order of first appearance; per stage, its rates (rate
    callables evaluated with the cache's example count; 0 for caches the stage does
    not name) and integer weights (``mixing.integer_weights`` of its positive rates)."""
    paths, stages = _resolve_schedule(schedule)
    with _readers(paths) as readers:
        by_path = dict(zip(paths, readers))
        out = []
        for step, stage in stages:
            rates = [0.0] * len(paths)
            for path, rate in stage.items():
                value = _rate_value(path, rate, by_path[path])
                if value != 0:
                    rates[paths.index(path)] = value
            positive = [t for t, r in enumerate(rates) if r != 0]
            if not positive:
                raise ValueError(f"schedule stage at step {step}: every rate is 0")
            try:
                ws = mixing.integer_weights([rates[t] for t in positive])
            except ValueError as e:
                raise ValueError(f"schedule stage at step {step}: {e}") from None
            weights = [0] * len(paths)
            for t, w in zip(positive, ws):
                weights[t] = w
            out.append({"step": step, "rates": rates, "weights": weights})
    return OpenedMixture(paths=paths, readers=readers, rates=list(out[0]["rates"]), weights=list(out[0]["weights"]),
                         name=name, stages=out)
