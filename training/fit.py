"""The fit: the settings of the train step that fit the device's memory and
run fastest, chosen before training (``seqcache train --fit auto``).

A setting is (``num_microbatches``, ``model.remat``, ``model.scan_layers``):
none of them changes the model's values, only memory and time (the losses
agree to float rounding, docs/training.md). The fit

1. lists candidates (``candidates``): the config's own setting first, then a
   ladder ordered by expected speed, (M, remat) = (1, none), (1, dots),
   (2, dots), (4, dots), (8, dots), (2, full), (4, full), (8, full): less
   recomputation and larger microbatches first. ``model.scan_layers`` stays
   the config's (see ``candidates``). A field the user set (``pinned``) is
   not varied; a microbatch count that does not split the batch over the
   mesh's batch shards is left out.
2. compiles them ahead of time (``Trainer.compile``: XLA's
   ``memory_analysis``), at most ``MAX_CANDIDATES``. Once one fits, it starts
   no compile expected to end past ``COMPILE_BUDGET_S`` seconds of compiling
   (at the pace of the longest compile so far: an unrolled ``1b`` compiles in
   about 85 s on one v5e, its own setting, then nothing more); while none
   fits, it goes on (a run with none that fits fails anyway). A candidate fits
   when its program needs at most ``MEMORY_FRACTION`` of the device's memory
   (``program_bytes``); a compile that runs out of memory does not fit. The
   config's own setting is compiled first; if it fits, the ladder is walked
   from the slow end towards the fast one, else from the fast end. A
   candidate that recomputes at least as much and splits the batch at least
   as finely as one that fits (``Setting.dominates``) is not compiled: it is
   expected no faster; one that recomputes at most as much and splits at
   most as finely as one that does not fit is not compiled either: it needs
   no less memory.
3. with one candidate that fits, takes it; with several, runs each for
   ``PROBE_STEPS`` timed steps (after one untimed) on a synthetic batch and
   takes the fastest. A timed probe, not XLA's cost analysis: the cost
   analysis counts FLOPs and bytes, but what decides on a TPU is how well the
   matrix unit is fed (microbatch and head sizes) and how the recomputation
   overlaps, which it does not see (on one v5e, ``large`` with 4 microbatches
   and remat=dots ran 16% faster than with 1 and remat=full, for more FLOPs;
   ``1b`` with remat=attention ran faster with 8 microbatches than with 4).
   Every candidate that fits is probed: the order of the ladder is a guess.
4. with none that fits, keeps the config's own setting (the run then fails
   as it would have, or XLA finds room the analysis did not).

The result (``FitResult.record``) goes into the run's config (``TrainConfig.fit``,
config.json) and its summary. On a device other than a TPU or GPU, the fit
chooses nothing and changes nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import statistics
import time
from typing import Any, Callable, Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils

from seqcache import bounded_json
from seqcache.training import config as config_lib
from seqcache.training import partitioning
from seqcache.training.report import CONFIG_FILE

log = logging.getLogger("seqcache.training")

# At most this many candidates are compiled.
MAX_CANDIDATES = 4
# Once a candidate fits, no compile is started that is expected (at the pace of
# the longest compile so far) to end past this many seconds of compiling.
COMPILE_BUDGET_S = 90.0
# A program fits when it needs at most this share of the device's memory.
MEMORY_FRACTION = 0.95
# Steps of each probe that are timed, after one that is not.
PROBE_STEPS = 3
# The settings the fit may change, as dotted config names.
FIT_FIELDS = ("num_microbatches", "model.remat", "model.scan_layers")
FIT_MODES = ("auto", "off")
# Platforms the fit runs on (``jax.Device.platform``).
ACCELERATOR_PLATFORMS = ("tpu", "gpu", "cuda", "rocm")
# The ladder after the config's own setting: (microbatches, remat), fastest expected first.
LADDER = ((1, "none"), (1, "dots"), (2, "dots"), (4, "dots"), (8, "dots"), (2, "full"), (4, "full"), (8, "full"))
# How much each remat policy recomputes (more: slower, less memory).
_REMAT_RANK = {"none": 0, "dots": 1, "attention": 2, "full": 3}


@dataclasses.dataclass(frozen=True, order=True)
class Setting:
    """One candidate: ``num_microbatches``, ``model.remat``, ``model.scan_layers``."""

    num_microbatches: int
    remat: str
    scan_layers: bool

    @classmethod
    def of(cls, config: config_lib.TrainConfig) -> "Setting":
        return cls(config.num_microbatches, config.model.remat, config.model.scan_layers)

    def apply(self, config: config_lib.TrainConfig) -> config_lib.TrainConfig:
        model = dataclasses.replace(config.model, remat=self.remat, scan_layers=self.scan_layers)
        return dataclasses.replace(config, num_microbatches=self.num_microbatches, model=model)

    def dominates(self, other: "Setting") -> bool:
        """True when ``other`` recomputes at least as much and splits the batch at
        least as finely (same layout): expected no faster than this one."""
        return (other.scan_layers == self.scan_layers and other.num_microbatches >= self.num_microbatches
                and _REMAT_RANK[other.remat] >= _REMAT_RANK[self.remat])

    def as_dict(self) -> dict:
        return {"num_microbatches": self.num_microbatches, "model.remat": self.remat,
                "model.scan_layers": self.scan_layers}


def candidates(config: config_lib.TrainConfig, *, pinned: Iterable[str] = (), batch_shards: int = 1) -> list[Setting]:
    """The settings the fit may compile, in order: the config's own, then
    ``LADDER``, without duplicates.

    ``model.scan_layers`` stays the config's: a checkpoint resumes only with
    the layout it was saved with, and on one v5e the scanned ``base`` ran
    slower than the unrolled one (27% against 35% MFU) while compiling faster,
    so it is a choice of compile time and layout, which the config makes.

    Args:
      pinned: names of ``FIT_FIELDS`` the user set (a flag, a config file or
        ``--set``): they keep the config's value.
      batch_shards: the mesh's batch shards (data x fsdp); a microbatch must
        hold a multiple of them times ``loss_chunks`` rows.
    """
    pinned = set(pinned)
    unknown = pinned - set(FIT_FIELDS)
    if unknown:
        raise ValueError(f"pinned fields must be among {FIT_FIELDS} (got {sorted(unknown)})")
    own = Setting.of(config)
    out = [own]
    for micro, remat in LADDER:
        setting = Setting(own.num_microbatches if "num_microbatches" in pinned else micro,
                          own.remat if "model.remat" in pinned else remat, own.scan_layers)
        b = config.global_batch_size
        rows = b // setting.num_microbatches
        if b % setting.num_microbatches or rows % (batch_shards * config.loss_chunks):
            continue
        if setting not in out:
            out.append(setting)
    return out


def program_bytes(memory: dict, platform: str) -> int | None:
    """Device bytes a compiled step needs, from ``Trainer.memory_analysis``:
    XLA's ``peak_memory_in_bytes`` where the platform reports it (a TPU or
    GPU), else (the CPU, whose peak leaves out the temporaries) arguments +
    outputs - aliased (donated) + temporaries + generated code. None when the
    analysis is empty."""
    if not memory:
        return None
    if memory.get("peak_memory_in_bytes") and platform != "cpu":
        return int(memory["peak_memory_in_bytes"])
    return int(memory.get("argument_size_in_bytes", 0) + memory.get("output_size_in_bytes", 0)
               - memory.get("alias_size_in_bytes", 0) + memory.get("temp_size_in_bytes", 0)
               + memory.get("generated_code_size_in_bytes", 0))


def is_out_of_memory(error: BaseException) -> bool:
    """True for XLA's out-of-memory errors (``RESOURCE_EXHAUSTED``, "out of memory")."""
    text = f"{type(error).__name__}: {error}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass
class FitResult:
    """What the fit chose.

    Attributes:
      config: the run's config with the chosen setting and ``fit`` (the record).
      trainer: the chosen candidate's Trainer, its step already compiled (None
        when the fit compiled nothing or kept no trainer).
      record: JSON dict: ``mode``, ``device``, ``memory_limit_bytes``,
        ``budget_bytes``, ``chosen`` (the setting, or None), ``by`` (how:
        "probe", "the only candidate that fits", "none fits: the config's own"
        or why nothing was chosen), ``candidates`` (per compiled candidate: the
        setting, ``program_bytes``, ``fits``, ``compile_time_s``, and
        ``probe_step_time_s`` where probed), ``compile_time_s`` and
        ``probe_time_s`` (totals, seconds).
    """

    config: config_lib.TrainConfig
    trainer: Any
    record: dict


def skipped(config: config_lib.TrainConfig, why: str, mode: str = "auto") -> FitResult:
    """The config unchanged, its ``fit`` None; the record says ``why``."""
    return FitResult(config=dataclasses.replace(config, fit=None), trainer=None,
                     record={"mode": mode, "chosen": None, "by": why})


def fit(config: config_lib.TrainConfig, *, pinned: Iterable[str] = (), platform: str, device_kind: str,
        memory_limit: int | None, make_trainer: Callable[[config_lib.TrainConfig], Any],
        probe: Callable[[Any], float] | None = None, clock: Callable[[], float] = time.perf_counter,
        max_candidates: int = MAX_CANDIDATES, compile_budget_s: float = COMPILE_BUDGET_S) -> FitResult:
    """Chooses the setting (module docstring) for ``config`` on a device of
    ``platform`` ("tpu", "gpu", "cpu", ...) with ``memory_limit`` bytes.

    Args:
      make_trainer: builds a ``Trainer`` for a candidate's config (whose
        ``compile()`` fills ``memory_analysis`` and ``compile_time_s``, and
        whose ``mesh`` gives the batch shards).
      probe: seconds per step of a compiled candidate's Trainer (default
        ``time_probe``); tests give a fake one.
      clock: for the compile budget.

    Returns:
      FitResult. On a platform that is not a TPU or GPU, or without a memory
      limit, ``skipped``: nothing compiled, the config unchanged.
    """
    if platform not in ACCELERATOR_PLATFORMS:
        return skipped(config, f"no TPU or GPU ({platform}): nothing chosen")
    if not memory_limit:
        return skipped(config, f"{device_kind} reports no memory limit: nothing chosen")
    probe = probe or time_probe
    budget = int(memory_limit * MEMORY_FRACTION)
    first = make_trainer(config)
    shards = partitioning.data_parallel_size(first.mesh)
    todo = candidates(config, pinned=pinned, batch_shards=shards)
    tried: list[dict] = []
    fitting: dict[Setting, Any] = {}
    too_big: list[Setting] = []
    spent = longest = 0.0
    while todo and len(tried) < max_candidates and (not fitting or spent + longest <= compile_budget_s):
        setting = todo.pop(0)
        if any(kept.dominates(setting) for kept in fitting) or any(setting.dominates(big) for big in too_big):
            continue  # expected slower than one that fits, or needing more memory than one that does not
        row, trainer, seconds = _compile_one(setting, config, first, make_trainer, budget, clock)
        # Process 0's compile time on every process: whether to compile another
        # must be decided alike on every host (each compiles and probes the same).
        (seconds,) = _from_process_0([seconds])
        spent, longest = spent + seconds, max(longest, seconds)
        tried.append(row)
        log.info("fit: %s", _describe(row))
        if row["fits"]:
            fitting[setting] = trainer
        else:
            too_big.append(setting)
        if first is not None:
            # After the config's own setting: from it towards the faster settings when
            # it fits (each that does not fit rules out the larger ones), else towards
            # the smaller ones (each that fits rules out the slower ones).
            todo = todo[::-1] if row["fits"] else todo
            first = None
    record = {"mode": "auto", "device": device_kind, "memory_limit_bytes": int(memory_limit),
              "budget_bytes": budget, "max_candidates": max_candidates, "candidates": tried,
              "compile_time_s": round(spent, 3), "probe_time_s": 0.0}
    own = Setting.of(config)
    if not fitting:
        chosen, by, trainer = own, "none fits: the config's own", None
    elif len(fitting) == 1:
        (chosen, trainer), = fitting.items()
        by = "the only candidate that fits"
    else:
        chosen, trainer = _probe_all(fitting, tried, probe, record, clock)
        by = "probe"
    record.update(chosen=chosen.as_dict(), by=by)
    out = dataclasses.replace(chosen.apply(config), fit=record)
    if trainer is not None:
        trainer.config = out  # the same step; the record rides along
    return FitResult(config=out, trainer=trainer, record=record)


def _compile_one(setting: Setting, config, first, make_trainer, budget: int, clock):
    """(row, trainer or None, seconds): one candidate compiled and held against
    ``budget`` (its size as ``program_bytes`` reads it on the trainer's own
    devices)."""
    row: dict[str, Any] = setting.as_dict()
    start = clock()
    trainer = first if setting == Setting.of(config) and first is not None else make_trainer(setting.apply(config))
    try:
        trainer.compile()
    except Exception as e:  # noqa: BLE001 (only running out of memory is a verdict)
        if not is_out_of_memory(e):
            raise
        row.update(fits=False, program_bytes=None, error=str(e).strip().splitlines()[0][:200])
        return row, None, clock() - start
    seconds = clock() - start
    need = program_bytes(trainer.memory_analysis, str(trainer.mesh.devices.flat[0].platform))
    fits = need is not None and need <= budget
    row.update(fits=fits, program_bytes=need, compile_time_s=round(float(trainer.compile_time_s), 3))
    return row, (trainer if fits else None), seconds


def _probe_all(fitting: dict, tried: list[dict], probe, record: dict, clock):
    """(fastest setting, its trainer): each fitting candidate probed in turn;
    the others' trainers released."""
    times = {}
    start = clock()
    for setting, trainer in fitting.items():
        times[setting] = float(probe(trainer))
        for row in tried:
            if row["num_microbatches"] == setting.num_microbatches and row["model.remat"] == setting.remat:
                row["probe_step_time_s"] = round(times[setting], 6)
    record["probe_time_s"] = round(clock() - start, 3)
    keys = sorted(times)
    times = dict(zip(keys, _from_process_0([times[k] for k in keys])))
    chosen = min(times, key=lambda s: (times[s], s))
    trainer = fitting[chosen]
    fitting.clear()
    gc.collect()
    return chosen, trainer


def _from_process_0(values: list[float]) -> list[float]:
    """Process 0's ``values`` (seconds) on every process: several hosts must
    decide alike (a collective: every process calls it at the same point)."""
    if jax.process_count() == 1:
        return [float(v) for v in values]
    agreed = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64))
    return [float(v) for v in np.asarray(agreed)]


def synthetic_batch(trainer) -> dict:
    """A host batch of the trainer's fields (``batch_fields``): one segment a
    row, positions 0..L-1, token id 1, loss weight 1 (the step's time does
    not depend on the values)."""
    rows = trainer.config.global_batch_size // jax.process_count()
    out = {}
    for key, (length, dtype) in trainer.batch_fields.items():
        if key.endswith("positions"):
            value = np.broadcast_to(np.arange(length), (rows, length))
        elif key.endswith("causal_attention"):
            value = np.zeros((rows, length))
        else:  # tokens, segment ids, loss weights
            value = np.ones((rows, length))
        out[key] = np.asarray(value, dtype=np.dtype(dtype))
    return out


def time_probe(trainer, steps: int = PROBE_STEPS) -> float:
    """Median seconds of ``steps`` train steps of ``trainer``'s compiled step
    (after one untimed), from a fresh initialisation on a synthetic batch;
    the state is dropped after."""
    compiled = trainer.compile()
    params, opt_state = trainer.init_state()
    batch = trainer.global_batch(synthetic_batch(trainer))
    times = []
    for i in range(steps + 1):
        step = jax.device_put(np.int32(i), trainer.replicated)
        start = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, step, batch)
        jax.block_until_ready(metrics)
        if i:
            times.append(time.perf_counter() - start)
    del params, opt_state, batch
    gc.collect()
    return statistics.median(times)


def _describe(row: dict) -> str:
    need = row.get("program_bytes")
    size = "out of memory" if need is None else f"{need / 1e9:.2f} GB"
    return (f"num_microbatches={row['num_microbatches']} remat={row['model.remat']} "
            f"scan_layers={str(row['model.scan_layers']).lower()}: {size}, {'fits' if row['fits'] else 'does not fit'}")


def pinned_fields(overrides: Iterable[str], config_file_dict: dict | None) -> set[str]:
    """The ``FIT_FIELDS`` a user set: keys of ``--set`` overrides (already
    split) and fields of a ``--config`` file's JSON object."""
    out = set()
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in FIT_FIELDS:
            out.add(key)
    if isinstance(config_file_dict, dict):
        if "num_microbatches" in config_file_dict:
            out.add("num_microbatches")
        model = config_file_dict.get("model")
        for name in ("remat", "scan_layers"):
            if isinstance(model, dict) and name in model:
                out.add(f"model.{name}")
    return out


def resumed(config: config_lib.TrainConfig, saved: Any, *, pinned: Iterable[str] = ()) -> FitResult | None:
    """The settings of a run being resumed: ``FIT_FIELDS`` not ``pinned`` taken
    from ``saved`` (the dict of the run's config.json), with its fit record, so
    that the resumed run trains as it did (no new fit). None when ``saved`` is
    not a config dict."""
    if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
        return None
    pinned = set(pinned)
    model = saved["model"]
    micro = saved.get("num_microbatches", 1)
    remat = model.get("remat", "none")
    scan = model.get("scan_layers", False)
    own = Setting.of(config)
    setting = Setting(own.num_microbatches if "num_microbatches" in pinned or not isinstance(micro, int) else micro,
                      own.remat if "model.remat" in pinned or remat not in _REMAT_RANK else remat,
                      own.scan_layers if "model.scan_layers" in pinned or not isinstance(scan, bool) else scan)
    earlier = saved.get("fit") if isinstance(saved.get("fit"), dict) else None
    record = {**(earlier or {"mode": "off"}), "resumed": True, "chosen": setting.as_dict()}
    if earlier is None:
        record["by"] = "resumed: the settings of the run's config.json"
    return FitResult(config=dataclasses.replace(setting.apply(config), fit=record if earlier else None),
                     trainer=None, record=record)


def for_run(config: config_lib.TrainConfig, mode: str | None, *, pinned: Iterable[str] = (),
            dry_run: bool = False, make_trainer: Callable[[config_lib.TrainConfig], Any]) -> FitResult:
    """What ``seqcache train --fit MODE`` trains with: the settings of the
    run's config.json when its checkpoint directory has one (``resumed``);
    else ``skipped`` for ``--fit off``, a dry run or a device that is not a
    TPU or GPU; else ``fit`` on JAX's first device (``mode`` None: auto).

    Raises:
      ConfigError, PartitioningError: from ``make_trainer``.
    """
    if config.checkpoint.directory:
        path = os.path.join(config.checkpoint.directory, CONFIG_FILE)
        try:
            saved = bounded_json.read_file(path, error=ValueError, max_bytes=1 << 20, what="config file")
        except ValueError:
            saved = None
        result = resumed(config, saved, pinned=pinned) if saved is not None else None
        if result is not None:
            return result
    if mode == "off" or dry_run:
        return skipped(config, "--fit off" if mode == "off" else "--dry-run", mode=mode or "auto")
    device = jax.devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 (a backend without memory statistics)
        limit = None
    return fit(config, pinned=pinned, platform=device.platform, device_kind=device.device_kind, memory_limit=limit,
               make_trainer=make_trainer)
