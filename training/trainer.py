"""The trainer: mesh and shardings, sharded initialisation, an ahead-of-time
compiled train step, evaluation, and ``fit``, which restores or initialises the
state and runs the loop (``loop``, ``resume``, ``preemption``, ``report``, whose
public names are importable from here too).

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
import logging
import os
import time
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from seqcache.feeders import compat, jax_arrays
from seqcache.training import config as config_lib
from seqcache.training import optimizer as optimizer_lib
from seqcache.training import partitioning
from seqcache.training import step as step_lib
from seqcache.training.checkpoints import Checkpointer, CheckpointError, Restored  # noqa: F401 (raised by fit)
from seqcache.training.loop import LoopIO, run_loop
from seqcache.training.metrics import MetricsWriter, ProgressBar
from seqcache.training.models import common as model_lib
from seqcache.training.preemption import StopFlag
from seqcache.training.report import (  # noqa: F401 (the trainer's public names)
    CONFIG_FILE, METRICS_FILE, TrainResult, format_memory_analysis, memory_analysis_dict, metrics_path_for,
    params_digest, ranges, tensorboard_dir_for, write_json_atomic)
from seqcache.training.resume import (  # noqa: F401
    SCHEDULE_FIELDS, check_feeder, check_same_stream, check_structure, restore_feeder, schedule_changes,
    warn_schedule_changes)

log = logging.getLogger("seqcache.training")


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
        self.batch_fields = step_lib.batch_fields(self.converter, config.sequence_length)
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
        # scalars such as the update count, and Adafactor's factored moments
        # (a row and a column of a parameter's shape), are replicated.
        self.opt_shardings = optax.tree_map_params(
            self.optimizer,
            lambda leaf, sharding, param: sharding if tuple(leaf.shape) == tuple(param.shape) else self.replicated,
            self.abstract_opt_state, self.param_shardings, self.abstract_params,
            transform_non_params=lambda _: self.replicated, is_leaf=lambda x: isinstance(x, NamedSharding))
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
        try:
            compat.check_hosts(cfg.global_batch_size, jax.process_index(), hosts)
        except ValueError as e:
            raise config_lib.ConfigError(str(e)) from None
        if hosts > 1:
            self._check_host_rows()
        shards = partitioning.data_parallel_size(self.mesh)
        micro = cfg.global_batch_size // cfg.num_microbatches
        if micro % shards:
            raise config_lib.ConfigError(
                f"microbatch size {micro} (global_batch_size={cfg.global_batch_size} / num_microbatches="
                f"{cfg.num_microbatches}) is not divisible by the {shards} batch shards of the mesh "
                f"(data={self.mesh.shape['data']} x fsdp={self.mesh.shape['fsdp']})")
        if micro % (shards * cfg.loss_chunks):
            raise config_lib.ConfigError(
                f"microbatch size {micro} is not divisible by loss_chunks={cfg.loss_chunks} x the {shards} batch "
                f"shards of the mesh: each chunk of the loss takes the same rows from every batch shard")

    def _check_host_rows(self):
        """Host h feeds rows [h * B / H, (h + 1) * B / H) of each global batch: the
        batch shards on h's devices must be exactly those rows."""
        cfg = self.config
        hosts, h = jax.process_count(), jax.process_index()
        b, per_host = cfg.global_batch_size, cfg.global_batch_size // jax.process_count()
        shape = (b, cfg.sequence_length["targets"])
        rows = set()
        for index in self.batch_sharding.addressable_devices_indices_map(shape).values():
            rows.update(range(*index[0].indices(b)))
        expected = set(range(h * per_host, (h + 1) * per_host))
        if rows != expected:
            raise config_lib.ConfigError(
                f"mesh {dict(self.mesh.shape)} on {hosts} hosts: the devices of host {h} hold batch rows "
                f"{ranges(sorted(rows))}, but the host feeds rows {h * per_host}..{(h + 1) * per_host - 1} of each "
                f"global batch of {b}; the batch axes (data x fsdp) must split the batch by host: make "
                f"data x fsdp a multiple of the {hosts} hosts and keep 'model' within a host "
                f"(model <= {jax.local_device_count()} devices per host)")

    def describe(self) -> dict:
        """Derived quantities of the run, printed before training starts."""
        cfg = self.config
        return {
            "parameters": self.num_params,
            "tokens_per_step": cfg.tokens_per_step,
            "global_batch_size": cfg.global_batch_size,
            "sequence_length": cfg.sequence_length["targets"],
            **({"inputs_sequence_length": cfg.sequence_length["inputs"]} if self.converter != "lm" else {}),
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
        with its sharding (``init_params``; the values do not depend on the mesh)."""
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
        """The train step ``(params, opt_state, step, batch) -> (params, opt_state,
        metrics)`` compiled ahead of time (once; params and opt_state donated);
        logs the compile time and memory analysis."""
        if self._compiled is not None:
            return self._compiled
        cfg = self.config
        train_step = step_lib.make_train_step(self.graphdef, self.optimizer, self.schedule, seed=cfg.seed,
                                              num_microbatches=cfg.num_microbatches, mesh=self.mesh,
                                              loss_chunks=cfg.loss_chunks)
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
            eval_step = step_lib.make_eval_step(self.graphdef, loss_chunks=self.config.loss_chunks, mesh=self.mesh)
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
        over ('data', 'fsdp'), of the fields the model reads (``batch_fields``).

        Raises:
          ValueError: a feature is missing or not 2-D (the message names it).
        """
        out = {}
        for key, (_, dtype) in self.batch_fields.items():
            if key not in host_batch:
                raise ValueError(
                    f"feeder batch has no feature {key!r} (has {sorted(host_batch)}); the model "
                    f"{self.config.model.architecture!r} reads the fields of converter {self.converter!r}")
            array = np.asarray(host_batch[key], dtype=dtype)
            if array.ndim != 2:
                raise ValueError(f"feeder batch feature {key!r} has shape {array.shape}; expected (rows, length)")
            out[key] = array
        return jax_arrays.make_global_batch(out, self.batch_sharding)

    def _check_train_batch(self, batch: Mapping[str, jax.Array]):
        cfg = self.config
        for key, (length, _) in self.batch_fields.items():
            expected = (cfg.global_batch_size, length)
            shape = tuple(batch[key].shape)
            if shape != expected:
                what = "sequence_length" if self.converter == "lm" else f"length of {key!r}"
                raise ValueError(
                    f"feeder gives global batches of shape {shape}, the config expects (global_batch_size, "
                    f"{what}) = {expected}")

    # -- evaluation ------------------------------------------------------------------

    def evaluate(self, params, feeder) -> dict:
        """Loss and token accuracy over a finite feeder (``num_epochs=1``), every
        example once; padding rows weigh nothing; sums in float64 on the host.

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
        return {"eval_loss": loss_sum / denom, "eval_accuracy": correct_sum / denom, "eval_tokens": weight_sum,
                "eval_batches": batches}

    # -- the loop ----------------------------------------------------------------------

    def fit(
        self,
        feeder,
        *,
        eval_feeder_fn: Callable[[], Any] | None = None,
        stop_at: int | None = None,
        on_step: Callable[[dict], None] | None = None,
        evaluator=None,
    ) -> TrainResult:
        """Trains up to ``config.steps``, resuming from the latest checkpoint in
        ``config.checkpoint.directory`` when there is one. Takes ownership of
        ``feeder`` (the interface: see the module docstring) and closes it.

        Args:
          eval_feeder_fn: returns a fresh finite feeder over the eval split, for
            each evaluation (every ``config.eval_every`` steps and at the end).
          stop_at: stop (with a checkpoint) once this many updates are applied, as
            a preemption would; the schedule still spans ``config.steps``.
          on_step: called with each step's metrics record after it is written.
          evaluator: a ``seqcache.training.evaluation.Evaluator`` run at each
            evaluation after the eval loss: the model's decoded predictions and
            the task's metrics, its files under the checkpoint directory (or
            the metrics file's folder).

        Raises:
          CheckpointError: the latest checkpoint has no feeder state or another
            global batch size, or its feeder state does not restore to its step.
          ValueError: the feeder's global batch size or batch shape differs from
            the config.
        """
        cfg = self.config
        is_chief = jax.process_index() == 0
        ckpt_dir = cfg.checkpoint.directory
        metrics_path = metrics_path_for(cfg)
        checkpointer = metrics_writer = progress = None
        stop = StopFlag()
        try:
            check_feeder(feeder, cfg.global_batch_size)
            if ckpt_dir:
                checkpointer = Checkpointer(ckpt_dir, max_to_keep=cfg.checkpoint.max_to_keep,
                                            async_save=cfg.checkpoint.async_save)
            params, opt_state, start, feeder = self._start_state(checkpointer, feeder)
            if ckpt_dir and is_chief:
                # Written once the checkpoint (if any) is known to fit this config.
                write_json_atomic(os.path.join(ckpt_dir, CONFIG_FILE), config_lib.to_dict(cfg))
            compiled = self.compile()
            # Only process 0 writes metrics: every process computes the same global values.
            tensorboard_dir = tensorboard_dir_for(cfg, metrics_path)
            metrics_writer = MetricsWriter(metrics_path if is_chief else None,
                                           tensorboard_dir=tensorboard_dir if is_chief else None, start_step=start)
            progress = ProgressBar(total=cfg.steps, start=start, enabled=cfg.progress and is_chief)
            stop.install()
            end = cfg.steps if stop_at is None else min(int(stop_at), cfg.steps)
            eval_root = ckpt_dir or (os.path.dirname(metrics_path) if metrics_path else None)
            io = LoopIO(checkpointer=checkpointer, writer=metrics_writer, progress=progress, stop=stop,
                        eval_feeder_fn=eval_feeder_fn, on_step=on_step, evaluator=evaluator, eval_root=eval_root)
            return run_loop(self, feeder, params, opt_state, compiled, start, end, io)
        finally:
            stop.uninstall()
            if progress is not None:
                progress.close()
            if metrics_writer is not None:
                metrics_writer.close()
            if checkpointer is not None:
                checkpointer.close()
            feeder.close()

    def check_resumable(self, feeder=None) -> None:
        """Refuses what ``fit`` refuses before it restores the latest complete
        checkpoint in ``config.checkpoint.directory`` (Orbax's notion of it, as
        the run's): a layout, shapes or optimizer other than the config's
        (``resume.check_structure``), arrays of other names or shapes
        (``Checkpointer.check_arrays``) and, with ``feeder`` (the run's, opened,
        then moved to the saved position), a feeder state of another global
        batch size or data stream, or one that does not restore to the
        checkpoint's step (``Checkpointer.feeder_state``,
        ``resume.restore_feeder``). Nothing without a complete step. Logs the
        step it would resume from and, as a run does, a change of the
        learning-rate schedule. Reads config.json, Orbax's metadata and the
        feeder state, not the parameters; writes nothing (``seqcache train
        --dry-run``).

        Raises:
          CheckpointError: one line naming the setting, both values and the fix.
        """
        config, directory = self.config, self.config.checkpoint.directory
        if not directory or not os.path.isdir(directory):
            return
        with Checkpointer(directory, async_save=False) as checkpointer:
            step = checkpointer.latest_step()
            if step is None:
                return
            check_structure(os.path.join(directory, CONFIG_FILE), config, checkpointer.directory)
            saved = checkpointer.feeder_state(step, config.global_batch_size)  # in the order the restore checks
            checkpointer.check_arrays(step, self.abstract_state())
            if feeder is not None:
                moved = restore_feeder(feeder, Restored(step=step, state=None, feeder_state=saved,
                                                        path=checkpointer.step_path(step)))
                if moved is not feeder:
                    moved.close()
            log.info("the run would resume from %s (step %d)", checkpointer.step_path(step), step)
            warn_schedule_changes(os.path.join(directory, CONFIG_FILE), config, step)

    def _start_state(self, checkpointer, feeder):
        """(params, opt_state, start step, feeder): restored from the latest
        checkpoint (the feeder moved to its position), or initialised at step 0."""
        cfg = self.config
        if checkpointer is None or checkpointer.latest_step() is None:
            params, opt_state = self.init_state()
            return params, opt_state, 0, feeder
        check_structure(os.path.join(cfg.checkpoint.directory, CONFIG_FILE), cfg, checkpointer.directory)
        restored = checkpointer.restore(None, abstract_state=self.abstract_state(),
                                        global_batch_size=cfg.global_batch_size)
        feeder = restore_feeder(feeder, restored)
        log.info("restored %s (step %d)", restored.path, restored.step)
        warn_schedule_changes(os.path.join(cfg.checkpoint.directory, CONFIG_FILE), cfg, restored.step)
        return restored.state["params"], restored.state["opt_state"], restored.step, feeder


def train(config: config_lib.TrainConfig, feeder, *, eval_feeder_fn=None, devices=None) -> TrainResult:
    """``Trainer(config, devices=devices).fit(feeder, eval_feeder_fn=eval_feeder_fn)``."""
    return Trainer(config, devices=devices).fit(feeder, eval_feeder_fn=eval_feeder_fn)
