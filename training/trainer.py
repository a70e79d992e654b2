"""The training loop: sharded initialisation, an ahead-of-time compiled train
step, checkpoints with feeder state, SIGTERM handling, metrics and evaluation.

Vocabulary (shared with the feeder):
  step s        the s-th optimizer update (0-based); it trains on global batch s.
  checkpoint k  state after k updates; its feeder state is positioned at global
                batch k, the first one not yet trained on.
  global batch  B rows over all hosts; each host feeds its B / host_count rows,
                which ``jax.make_array_from_process_local_data`` assembles into
                one (B, L) ``jax.Array`` sharded over ('data', 'fsdp').

The feeder is used through a small duck-typed interface (``seqcache.feeders.Feeder``
provides it): ``iter(feeder)`` yields host-local batches (dicts of (B / host_count,
L) numpy arrays named as in ``seqcache.training.step.BATCH_KEYS``) from the current
position; ``feeder.state()`` returns a JSON dict with ``global_batch_size`` and the
position; on resume, ``feeder.set_state(state)`` moves the run's feeder to a saved
state (when the feeder has it: it keeps the run's cache locations and hosts), or else
``type(feeder).restore(state, host_index=..., host_count=...)`` rebuilds the same
stream from a state; ``feeder.step`` is the current position; ``feeder.close()``
releases it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from seqcache.training import config as config_lib
from seqcache.training import distributed
from seqcache.training.models import common as model_lib
from seqcache.training import optimizer as optimizer_lib
from seqcache.training import partitioning
from seqcache.training import step as step_lib
from seqcache.training.checkpoints import Checkpointer, CheckpointError
from seqcache.training.metrics import TENSORBOARD_DIR, MetricsWriter, ProgressBar

log = logging.getLogger("seqcache.training")

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


@dataclasses.dataclass(kw_only=True)
class TrainResult:
    """What ``Trainer.fit`` did.

    Attributes:
      start_step: the step training (re)started at (0, or a restored checkpoint's).
      end_step: number of updates applied when ``fit`` returned.
      metrics: one dict per step trained in this call (as in the metrics file).
      eval: the last evaluation's metrics, or None.
      stopped_by_signal: SIGTERM (or a multi-host preemption notice) stopped the run
        after saving a checkpoint.
      data_exhausted: the feeder's stream ended before ``config.steps``.
      compile_time_s: seconds to lower and compile the train step.
      memory_analysis: ``compiled.memory_analysis()`` as a dict of byte counts (may
        be empty on backends that do not report it).
      params, opt_state: the final state (sharded jax.Arrays).
    """

    start_step: int
    end_step: int
    metrics: list[dict]
    eval: dict | None
    stopped_by_signal: bool
    data_exhausted: bool
    compile_time_s: float
    memory_analysis: dict
    params: Any
    opt_state: Any

    @property
    def losses(self) -> list[float]:
        return [m["loss"] for m in self.metrics]


def params_digest(params) -> str:
    """sha256 (hex) of every parameter's path, dtype, shape and bytes, in path
    order: two runs with the same digest have bit-identical parameters, whatever
    their shardings or how many hosts hold them."""
    h = hashlib.sha256()
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            # Sharded over several hosts: every host gathers the whole array (every
            # host must call this function).
            from jax.experimental import multihost_utils

            value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        else:
            value = np.asarray(jax.device_get(leaf))
        h.update(jax.tree_util.keystr(path).encode())
        h.update(f"{value.dtype}{value.shape}".encode())
        h.update(value.tobytes())
    return h.hexdigest()


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> "0..2, 5..6"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}..{v}" if v != start else str(v))
            start = None
    return ", ".join(out) or "none"


def memory_analysis_dict(compiled) -> dict:
    """``compiled.memory_analysis()`` as ``{field: bytes}`` (empty if unavailable)."""
    try:
        stats = compiled.memory_analysis()
    except Exception as e:  # some backends do not implement it
        log.info("memory analysis unavailable: %s", e)
        return {}
    if stats is None:
        return {}
    out = {}
    for name in dir(stats):
        if name.endswith("_in_bytes"):
            value = getattr(stats, name)
            if isinstance(value, (int, np.integer)):
                out[name] = int(value)
    return out


# The memory_analysis fields logged after compiling, with their labels.
_MEMORY_FIELDS = (
    ("argument_size_in_bytes", "arguments"),
    ("output_size_in_bytes", "outputs"),
    ("alias_size_in_bytes", "aliased"),
    ("temp_size_in_bytes", "temporaries"),
    ("generated_code_size_in_bytes", "code"),
    ("peak_memory_in_bytes", "peak"),
)


def format_memory_analysis(memory: Mapping[str, int]) -> str:
    """One line for the log: the device memory of a compiled program in MB
    (10^6 bytes), e.g. "arguments 7.5 MB, outputs 7.4 MB, temporaries 1,396.9 MB,
    peak 7.5 MB". Fields that are absent or zero (aliased bytes, code size) are
    left out, except arguments and outputs; an empty dict gives "unavailable"."""
    parts = []
    for key, label in _MEMORY_FIELDS:
        value = memory.get(key)
        if value is None or (value == 0 and label not in ("arguments", "outputs")):
            continue
        parts.append(f"{label} {value / 1e6:,.1f} MB")
    return ", ".join(parts) if parts else "unavailable"


class _StopFlag:
    """Set by SIGTERM; installed only in the main thread for the duration of ``fit``."""

    def __init__(self):
        self.event = threading.Event()
        self._previous = None
        self._installed = False

    def install(self):
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def _handle(self, signum, frame):
        self.event.set()

    def uninstall(self):
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False


class Trainer:
    """Builds the mesh, shardings, optimizer and compiled steps for one config.

    Args:
      config: the run; ``config.model.vocab_size`` must be set.
      devices: devices for the mesh; default ``jax.devices()``.

    Raises:
      ConfigError: an invalid config, or a global batch that cannot be split over
        the hosts, the microbatches and the batch shards.
      PartitioningError: the mesh does not fit the devices, or a rule cannot be
        applied to a parameter (the message names the parameter, its shape and
        the mesh axis).
    """

    def __init__(self, config: config_lib.TrainConfig, *, devices=None):
        config.validate()
        self.config = config
        self.mesh = partitioning.make_mesh(dataclasses.asdict(config.mesh), devices)
        self.rules = partitioning.get_rules(config.rules)
        self.batch_sharding = partitioning.batch_sharding(self.mesh)
        self.converter = config.converter
        # Field name -> (length, dtype) of the batches the model reads.
        self.batch_fields = step_lib.batch_fields(self.converter, config.lengths)
        self._check_batch_divisibility()

        abstract = model_lib.abstract_model(config.model)
        self.graphdef, self.abstract_params = model_lib.split_params(abstract)
        self.logical_axes = model_lib.logical_axes(abstract)
        self.param_specs = partitioning.param_specs(self.abstract_params, self.logical_axes, self.rules, self.mesh)
        self.param_shardings = partitioning.named_shardings(self.param_specs, self.mesh)
        self.replicated = partitioning.replicated(self.mesh)

        self.optimizer, self.schedule = optimizer_lib.make_optimizer(config.optimizer, config.steps)
        self.abstract_opt_state = jax.eval_shape(self.optimizer.init, self.abstract_params)
        # Optimizer moments mirror the parameters' shardings (ZeRO-3 under 'fsdp');
        # scalars such as the update count are replicated.
        self.opt_shardings = optax.tree_map_params(
            self.optimizer,
            lambda _, sharding: sharding,
            self.abstract_opt_state,
            self.param_shardings,
            transform_non_params=lambda _: self.replicated,
            is_leaf=lambda x: isinstance(x, NamedSharding),
        )
        self.num_params = model_lib.count_params(self.abstract_params)
        self._compiled = None
        self._opt_init_fn = None
        self._eval_step = None
        self.compile_time_s = 0.0
        self.memory_analysis: dict = {}

    # -- sizes -------------------------------------------------------------------

    def _check_batch_divisibility(self):
        cfg = self.config
        hosts = jax.process_count()
        if cfg.global_batch_size % hosts:
            raise config_lib.ConfigError(
                f"global_batch_size={cfg.global_batch_size} is not divisible by the {hosts} hosts"
            )
        if hosts > 1:
            self._check_host_rows()
        shards = partitioning.data_parallel_size(self.mesh)
        micro = cfg.global_batch_size // cfg.num_microbatches
        if micro % shards:
            raise config_lib.ConfigError(
                f"microbatch size {micro} (global_batch_size={cfg.global_batch_size} / num_microbatches="
                f"{cfg.num_microbatches}) is not divisible by the {shards} batch shards of the mesh "
                f"(data={self.mesh.shape['data']} x fsdp={self.mesh.shape['fsdp']})"
            )

    def _check_host_rows(self):
        """With several hosts, host h feeds rows [h * B / H, (h + 1) * B / H) of
        each global batch (the feeder's slicing): the batch shards on h's devices
        must be exactly those rows, or ``make_array_from_process_local_data``
        would place them elsewhere (or need rows h does not have)."""
        cfg = self.config
        hosts, h = jax.process_count(), jax.process_index()
        b, per_host = cfg.global_batch_size, cfg.global_batch_size // jax.process_count()
        shape = (b, cfg.sequence_length)
        rows = set()
        for index in self.batch_sharding.addressable_devices_indices_map(shape).values():
            rows.update(range(*index[0].indices(b)))
        expected = set(range(h * per_host, (h + 1) * per_host))
        if rows != expected:
            raise config_lib.ConfigError(
                f"mesh {dict(self.mesh.shape)} on {hosts} hosts: the devices of host {h} hold batch rows "
                f"{_ranges(sorted(rows))}, but the host feeds rows {h * per_host}..{(h + 1) * per_host - 1} of each "
                f"global batch of {b}; the batch axes (data x fsdp) must split the batch by host: make "
                f"data x fsdp a multiple of the {hosts} hosts and keep 'model' within a host "
                f"(model <= {jax.local_device_count()} devices per host)"
            )

    def describe(self) -> dict:
        """Derived quantities of the run, printed before training starts."""
        cfg = self.config
        return {
            "parameters": self.num_params,
            "tokens_per_step": cfg.tokens_per_step,
            "global_batch_size": cfg.global_batch_size,
            "sequence_length": cfg.sequence_length,
            **({"inputs_sequence_length": cfg.inputs_sequence_length} if self.converter != "lm" else {}),
            "architecture": cfg.model.architecture,
            "converter": self.converter,
            "microbatches": cfg.num_microbatches,
            "microbatch_size": cfg.global_batch_size // cfg.num_microbatches,
            "host_batch_size": cfg.global_batch_size // jax.process_count(),
            "hosts": jax.process_count(),
            "devices": int(self.mesh.size),
            "mesh": dict(self.mesh.shape),
            "rules": cfg.rules,
            "steps": cfg.steps,
            "total_tokens": cfg.tokens_per_step * cfg.steps,
            "compute_dtype": cfg.model.dtype,
        }

    # -- state -------------------------------------------------------------------

    def init_state(self) -> tuple[Any, Any]:
        """(params, opt_state) initialised from ``config.seed``, each array created
        directly with its sharding (see ``model.init_params``). The values do not
        depend on the mesh (JAX's partitionable threefry RNG)."""
        cfg = self.config


        def sharding_of(names, shape):
            spec = partitioning.logical_to_spec(names, shape, self.rules, self.mesh)
            return NamedSharding(self.mesh, spec)

        params = model_lib.init_params(cfg.model, cfg.seed, sharding_of)
        if self._opt_init_fn is None:
            self._opt_init_fn = jax.jit(
                self.optimizer.init, in_shardings=(self.param_shardings,), out_shardings=self.opt_shardings
            )
        return params, self._opt_init_fn(params)

    def abstract_state(self) -> dict:
        """The checkpointed state as ShapeDtypeStructs with this run's shardings."""

        def sds(x, sharding):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        return {
            "params": jax.tree.map(sds, self.abstract_params, self.param_shardings),
            "opt_state": jax.tree.map(sds, self.abstract_opt_state, self.opt_shardings),
            "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=self.replicated),
        }

    # -- compiled steps ------------------------------------------------------------

    def compile(self):
        """Lowers and compiles the train step ahead of time (once); logs the compile
        time and the compiled memory analysis. Returns the compiled step
        ``(params, opt_state, step, batch) -> (params, opt_state, metrics)``;
        params and opt_state are donated."""
        if self._compiled is not None:
            return self._compiled
        cfg = self.config
        train_step = step_lib.make_train_step(
            self.graphdef,
            self.optimizer,
            self.schedule,
            seed=cfg.seed,
            num_microbatches=cfg.num_microbatches,
            mesh=self.mesh,
        )
        batch_shardings = {k: self.batch_sharding for k in self.batch_fields}
        jitted = jax.jit(
            train_step,
            in_shardings=(self.param_shardings, self.opt_shardings, self.replicated, batch_shardings),
            out_shardings=(self.param_shardings, self.opt_shardings, self.replicated),
            donate_argnums=(0, 1),
        )
        abstract = self.abstract_state()
        batch = step_lib.abstract_batch(cfg.global_batch_size, self.batch_fields, self.batch_sharding)
        start = time.perf_counter()
        with partitioning.activation_rules(self.mesh, self.rules):
            lowered = jitted.lower(abstract["params"], abstract["opt_state"], abstract["step"], batch)
        compiled = lowered.compile()
        self.compile_time_s = time.perf_counter() - start
        self.memory_analysis = memory_analysis_dict(compiled)
        log.info("compiled train step in %.2f s; memory: %s", self.compile_time_s,
                 format_memory_analysis(self.memory_analysis))
        self._compiled = compiled
        return compiled

    def _eval_fn(self):
        if self._eval_step is None:
            eval_step = step_lib.make_eval_step(self.graphdef)
            jitted = jax.jit(
                eval_step,
                in_shardings=(self.param_shardings, {k: self.batch_sharding for k in self.batch_fields}),
                out_shardings=self.replicated,
            )

            def run(params, batch):
                with partitioning.activation_rules(self.mesh, self.rules):
                    return jitted(params, batch)

            self._eval_step = run
        return self._eval_step

    # -- batches -------------------------------------------------------------------

    def global_batch(self, host_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Host-local batch (B / host_count, L) -> global (B, L) jax.Arrays sharded
        over ('data', 'fsdp'), for the fields the model reads
        (``step.batch_fields`` of the run's converter); other fields are left out.

        Raises:
          ValueError: a feature is missing or has the wrong number of rows or columns
            (the message names it and the expected shape).
        """
        out = {}
        for key, (_, dtype) in self.batch_fields.items():
            if key not in host_batch:
                raise ValueError(
                    f"feeder batch has no feature {key!r} (has {sorted(host_batch)}); the model "
                    f"{self.config.model.architecture!r} reads the fields of converter {self.converter!r}"
                )
            array = np.asarray(host_batch[key], dtype=dtype)
            if array.ndim != 2:
                raise ValueError(f"feeder batch feature {key!r} has shape {array.shape}; expected (rows, length)")
            rows = array.shape[0] * jax.process_count()
            out[key] = jax.make_array_from_process_local_data(
                self.batch_sharding, array, global_shape=(rows, array.shape[1])
            )
        return out

    def _check_train_batch(self, batch: Mapping[str, jax.Array]):
        cfg = self.config
        for key, (length, _) in self.batch_fields.items():
            expected = (cfg.global_batch_size, length)
            shape = tuple(batch[key].shape)
            if shape != expected:
                what = "sequence_length" if self.converter == "lm" else f"length of {key!r}"
                raise ValueError(
                    f"feeder gives global batches of shape {shape}, the config expects (global_batch_size, "
                    f"{what}) = {expected}"
                )

    # -- evaluation ------------------------------------------------------------------

    def evaluate(self, params, feeder) -> dict:
        """Loss and token accuracy over a finite feeder, every example once.

        The feeder must end (``num_epochs=1``); its last batch may be padded with
        rows of zero loss weight, which count for nothing. Sums are accumulated in
        float64 on the host.

        Returns:
          ``{"eval_loss": nats per weighted token, "eval_accuracy": weighted token
          accuracy, "eval_tokens": sum of loss weights, "eval_batches": int}``.
        """
        run = self._eval_fn()
        loss_sum = correct_sum = weight_sum = 0.0
        batches = 0
        try:
            for host_batch in feeder:
                sums = jax.device_get(run(params, self.global_batch(host_batch)))
                loss_sum += float(sums["loss_sum"])
                correct_sum += float(sums["correct_sum"])
                weight_sum += float(sums["weight_sum"])
                batches += 1
        finally:
            feeder.close()
        denom = weight_sum if weight_sum > 0 else 1.0
        return {
            "eval_loss": loss_sum / denom,
            "eval_accuracy": correct_sum / denom,
            "eval_tokens": weight_sum,
            "eval_batches": batches,
        }

    # -- the loop ----------------------------------------------------------------------

    def fit(
        self,
        feeder,
        *,
        eval_feeder_fn: Callable[[], Any] | None = None,
        stop_at: int | None = None,
        on_step: Callable[[dict], None] | None = None,
    ) -> TrainResult:
        """Trains up to ``config.steps``, resuming from the latest checkpoint in
        ``config.checkpoint.directory`` when there is one.

        Takes ownership of ``feeder`` (it is closed, or replaced by the restored
        feeder, and that one is closed at the end).

        Args:
          feeder: the training stream (see the module docstring for the interface).
          eval_feeder_fn: returns a fresh finite feeder over the eval split; called
            for each evaluation (every ``config.eval_every`` steps and at the end).
          stop_at: stop once this many updates are applied (a checkpoint is saved
            there), as a preemption would; the learning rate schedule still spans
            ``config.steps``. None = ``config.steps``.
          on_step: called with each step's metrics record after it is written.

        Raises:
          CheckpointError: the latest checkpoint has no feeder state or another
            global batch size, or its feeder state does not restore to its step.
          ValueError: the feeder's global batch size or batch shape differs from
            the config.
        """
        cfg = self.config
        is_chief = jax.process_index() == 0
        ckpt_dir = cfg.checkpoint.directory
        metrics_path = cfg.metrics_file or (os.path.join(ckpt_dir, METRICS_FILE) if ckpt_dir else None)
        checkpointer = None
        metrics_writer = None
        progress = None
        stop = _StopFlag()
        try:
            self._check_feeder(feeder)
            if ckpt_dir:
                checkpointer = Checkpointer(
                    ckpt_dir, max_to_keep=cfg.checkpoint.max_to_keep, async_save=cfg.checkpoint.async_save
                )

            start = 0
            if checkpointer is not None and checkpointer.latest_step() is not None:
                restored = checkpointer.restore(
                    None, abstract_state=self.abstract_state(), global_batch_size=cfg.global_batch_size
                )
                params, opt_state = restored.state["params"], restored.state["opt_state"]
                start = restored.step
                feeder = self._restore_feeder(feeder, restored)
                log.info("restored %s (step %d)", restored.path, start)
                _warn_schedule_changes(os.path.join(ckpt_dir, CONFIG_FILE), cfg, start)
            else:
                params, opt_state = self.init_state()

            if ckpt_dir and is_chief:
                # Written once the checkpoint (if any) is known to fit this config.
                _write_json_atomic(os.path.join(ckpt_dir, CONFIG_FILE), config_lib.to_dict(cfg))
            compiled = self.compile()
            # Only process 0 writes metrics: every process computes the same global values.
            tensorboard_dir = tensorboard_dir_for(cfg, metrics_path)
            metrics_writer = MetricsWriter(metrics_path if is_chief else None,
                                           tensorboard_dir=tensorboard_dir if is_chief else None, start_step=start)
            progress = ProgressBar(total=cfg.steps, start=start, enabled=cfg.progress and is_chief)
            stop.install()
            end = cfg.steps if stop_at is None else min(int(stop_at), cfg.steps)
            return self._loop(
                feeder, params, opt_state, compiled, start, end, checkpointer, metrics_writer, progress, stop,
                eval_feeder_fn, on_step,
            )
        finally:
            stop.uninstall()
            if progress is not None:
                progress.close()
            if metrics_writer is not None:
                metrics_writer.close()
            if checkpointer is not None:
                checkpointer.close()
            feeder.close()

    def _check_feeder(self, feeder):
        state = feeder.state()
        gbs = state.get("global_batch_size") if isinstance(state, Mapping) else None
        if gbs is None:
            raise ValueError(f"feeder state has no 'global_batch_size' (got {state!r}); it cannot be checkpointed")
        if int(gbs) != self.config.global_batch_size:
            raise ValueError(
                f"feeder has global batch size {gbs}, the config has global_batch_size="
                f"{self.config.global_batch_size}; build the feeder with the config's value"
            )

    def _restore_feeder(self, feeder, restored):
        _check_same_stream(restored.path, restored.feeder_state, feeder.state())
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
                f"is at step {restored.step}; the checkpoint is inconsistent"
            )
        return new

    def _loop(
        self, feeder, params, opt_state, compiled, start, end, checkpointer, writer, progress, stop, eval_feeder_fn,
        on_step,
    ):
        cfg = self.config
        tokens = cfg.tokens_per_step
        multi_host = jax.process_count() > 1
        iterator = iter(feeder)

        def fetch():
            t0 = time.perf_counter()
            host_batch = next(iterator)
            waited = time.perf_counter() - t0
            return host_batch, feeder.state(), waited

        records: list[dict] = []
        last_eval = None
        stopped = exhausted = False
        step = start
        pending = None
        if start < end:
            try:
                pending = fetch()
            except StopIteration:
                exhausted = True
        last_time = time.perf_counter()
        while pending is not None and step < end:
            host_batch, feeder_state_after, data_wait = pending
            batch = self.global_batch(host_batch)
            self._check_train_batch(batch)
            step_arr = jax.device_put(np.int32(step), self.replicated)
            params, opt_state, metrics = compiled(params, opt_state, step_arr, batch)
            done = step + 1
            # Fetch the next host batch while the device computes this step.
            pending = None
            if done < end and not (stop.event.is_set() and not multi_host):
                # (With several hosts the stop is agreed after the step: every host
                # fetches, so that all of them stop, and save, at the same step.)
                try:
                    pending = fetch()
                except StopIteration:
                    exhausted = True
            values = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            step_time = now - last_time
            last_time = now
            record = {
                "step": step,
                **values,
                "tokens_per_s": tokens / step_time if step_time > 0 else float("inf"),
                "step_time_s": step_time,
                "data_wait_s": data_wait,
            }
            records.append(record)
            writer.write(record)
            progress.update(completed=done, loss=values["loss"], tokens_per_s=record["tokens_per_s"])
            if on_step is not None:
                on_step(record)

            if multi_host:
                # Hosts must stop at the same step: a SIGTERM may reach some hosts
                # a step later than others, or not at all. They agree on the
                # local flags (one all-gather of an integer per host) after every
                # step, so every host saves the same step; JAX's preemption
                # service (through Orbax) is asked too, for notices it receives.
                stopped = distributed.any_process(stop.event.is_set())
                if not stopped and checkpointer is not None:
                    stopped = checkpointer.reached_preemption(done)
            else:
                stopped = stop.event.is_set()
            if checkpointer is not None and (
                done % cfg.checkpoint.every_steps == 0 or done == end or stopped or exhausted
            ):
                state = {"params": params, "opt_state": opt_state, "step": step_arr + 1}
                checkpointer.save(done, state=state, feeder_state=feeder_state_after)
            if eval_feeder_fn is not None and not stopped:
                if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps or exhausted:
                    last_eval = self.evaluate(params, eval_feeder_fn())
                    writer.write({"step": step, **last_eval})
                    log.info("eval after step %d: %s", step, last_eval)
            step = done
            if stopped:
                log.warning("SIGTERM: stopped after step %d with a checkpoint saved", step - 1)
                break
            if exhausted:
                log.warning("the feeder's stream ended after %d steps (config.steps=%d)", step, cfg.steps)
                break
        if checkpointer is not None:
            checkpointer.wait()
        return TrainResult(
            start_step=start,
            end_step=step,
            metrics=records,
            eval=last_eval,
            stopped_by_signal=stopped,
            data_exhausted=exhausted,
            compile_time_s=self.compile_time_s,
            memory_analysis=self.memory_analysis,
            params=params,
            opt_state=opt_state,
        )


# Keys of a feeder state that say where the stream is, not which stream it is.
_POSITION_KEYS = ("position", "step")
_STREAM_HINT = (
    "; the checkpoint belongs to another data stream. Train with the checkpoint's data settings, or start a new "
    "run in another checkpoint directory."
)


def _check_same_stream(path: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """Refuses to resume when the run's feeder reads another stream than the
    checkpoint's (rebuilt caches, another mixture, seed, sequence length, ...):
    the saved position would denote other examples.

    States of ``seqcache.feeders.Feeder`` are compared with
    ``seqcache.feeders.state.stream_difference``: caches by fingerprint, rate and
    mixture order, not by path, so a run may reach the same caches by another path
    (absolute or relative, moved or copied). Other feeders' states are compared
    key by key, positions excepted.

    Raises:
      CheckpointError: naming the first difference and both values.
    """
    from seqcache.feeders import state as feeder_state

    if saved.get("converter") != current.get("converter"):
        # ConvertedFeeder states: the converter and its lengths (None for a plain feeder).
        raise CheckpointError(
            f"{path}: the checkpoint's feeder fed the model through converter {saved.get('converter')!r}, this "
            f"run's feeder through {current.get('converter')!r}{_STREAM_HINT}"
        )
    if saved.get("kind") == feeder_state.STATE_KIND and current.get("kind") == feeder_state.STATE_KIND:
        try:
            feeder_state.check_state(saved)
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
                f"{key}={current.get(key)!r}{_STREAM_HINT}"
            )


# Config fields that change the learning-rate schedule or the optimizer of a run
# (``steps`` is the schedule's length unless optimizer.decay_steps is set).
SCHEDULE_FIELDS = ("steps",) + tuple(f"optimizer.{f.name}" for f in dataclasses.fields(config_lib.OptimizerConfig))


def schedule_changes(saved: Mapping[str, Any], config: config_lib.TrainConfig) -> list[tuple[str, Any, Any]]:
    """The schedule and optimizer fields (``SCHEDULE_FIELDS``) whose value in
    ``config`` differs from a saved config dict (a run's config.json).

    Returns:
      [(dotted field name, saved value, new value)], in ``SCHEDULE_FIELDS`` order;
      fields missing from ``saved`` are not compared.
    """
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


def _warn_schedule_changes(config_path: str, config: config_lib.TrainConfig, step: int) -> None:
    """Logs a WARNING when a resumed run's schedule or optimizer differs from the
    config the run was saved with. Extending a run (more steps) is legitimate, so
    this does not refuse; it makes the change visible."""
    try:
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
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


def _write_json_atomic(path: str, obj: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def tensorboard_dir_for(config: config_lib.TrainConfig, metrics_path: str | None) -> str | None:
    """Where a run writes its TensorBoard event files: the folder ``tensorboard``
    next to its metrics file, or None (``config.tensorboard`` off, or no metrics file)."""
    if not config.tensorboard or not metrics_path:
        return None
    return os.path.join(os.path.dirname(metrics_path), TENSORBOARD_DIR)


def train(config: config_lib.TrainConfig, feeder, *, eval_feeder_fn=None, devices=None) -> TrainResult:
    """``Trainer(config, devices=devices).fit(feeder, eval_feeder_fn=eval_feeder_fn)``."""
    return Trainer(config, devices=devices).fit(feeder, eval_feeder_fn=eval_feeder_fn)
