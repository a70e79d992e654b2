"""The train loop: one compiled step per global batch, the next host batch
fetched while the device computes, metrics, checkpoints, evaluation and the
stop on SIGTERM or at the end of the stream.

Vocabulary as in ``seqcache.training.trainer``: step s trains on global batch s;
after it, ``done = s + 1`` updates are applied, and the feeder state saved with
checkpoint ``done`` is positioned at global batch ``done``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from seqcache.training.flops import RunFlops
from seqcache.training.preemption import StopFlag, stop_agreed
from seqcache.training.report import TrainResult

log = logging.getLogger("seqcache.training")


@dataclasses.dataclass
class LoopIO:
    """What the loop writes to and reads from besides the trainer."""

    checkpointer: Any
    writer: Any
    progress: Any
    stop: StopFlag
    eval_feeder_fn: Callable[[], Any] | None
    on_step: Callable[[dict], None] | None
    # A ``seqcache.training.evaluation.Evaluator`` run after each eval loss (its
    # files under ``eval_root``), or None.
    evaluator: Any = None
    eval_root: str | None = None


def _fetcher(feeder) -> Callable[[], tuple]:
    """``next(feeder)`` with the feeder state after it and the seconds it took."""
    iterator = iter(feeder)

    def fetch():
        t0 = time.perf_counter()
        host_batch = next(iterator)
        waited = time.perf_counter() - t0
        return host_batch, feeder.state(), waited

    return fetch


def run_loop(trainer, feeder, params, opt_state, compiled, start: int, end: int, io: LoopIO) -> TrainResult:
    """Trains steps ``start`` .. ``end - 1`` (fewer after SIGTERM or the end of
    the stream), saving and evaluating as ``_maybe_save`` and ``_maybe_evaluate`` say."""
    cfg = trainer.config
    run_flops = RunFlops.of(cfg, trainer.mesh)
    multi_host = jax.process_count() > 1
    fetch = _fetcher(feeder)
    records: list[dict] = []
    last_eval = None
    stopped = exhausted = False
    step = start
    pending = None
    if start < end:
        pending, exhausted = _try_fetch(fetch)
    last_time = time.perf_counter()
    while pending is not None and step < end:
        host_batch, feeder_state_after, data_wait = pending
        batch = trainer.global_batch(host_batch)
        trainer._check_train_batch(batch)
        step_arr = jax.device_put(np.int32(step), trainer.replicated)
        params, opt_state, metrics = compiled(params, opt_state, step_arr, batch)
        done = step + 1
        # Fetch the next host batch while the device computes this step. (With
        # several hosts the stop is agreed after the step: every host fetches, so
        # that all of them stop, and save, at the same step.)
        pending = None
        if done < end and not (io.stop.event.is_set() and not multi_host):
            pending, exhausted = _try_fetch(fetch)
        record, last_time = _step_record(cfg, run_flops, step, metrics, last_time, data_wait)
        records.append(record)
        _report_step(io, record, done)
        stopped = stop_agreed(io.stop, io.checkpointer, done, multi_host=multi_host)
        _maybe_save(cfg, io, done, end, stopped or exhausted, params, opt_state, step_arr, feeder_state_after)
        if io.eval_feeder_fn is not None and not stopped:
            last_eval = _maybe_evaluate(trainer, io, params, step, done, exhausted) or last_eval
        step = done
        if stopped:
            log.warning("SIGTERM: stopped after step %d with a checkpoint saved", step - 1)
            break
        if exhausted:
            log.warning("the feeder's stream ended after %d steps (config.steps=%d)", step, cfg.steps)
            break
    if io.checkpointer is not None:
        io.checkpointer.wait()
    return TrainResult(
        start_step=start, end_step=step, metrics=records, eval=last_eval, stopped_by_signal=stopped,
        data_exhausted=exhausted, compile_time_s=trainer.compile_time_s, memory_analysis=trainer.memory_analysis,
        params=params, opt_state=opt_state,
    )


def _try_fetch(fetch: Callable[[], tuple]):
    """(the next fetch, False), or (None, True) at the end of the stream."""
    try:
        return fetch(), False
    except StopIteration:
        return None, True


def _step_record(cfg, run_flops: RunFlops, step: int, metrics, last_time: float,
                 data_wait: float) -> tuple[dict, float]:
    """The metrics line of ``step`` (waits for the step's values) and the time it
    was taken; the FLOP fields from ``run_flops`` (``RunFlops.step_metrics``)."""
    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
    now = time.perf_counter()
    step_time = now - last_time
    record = {
        "step": step,
        **values,
        "tokens_per_s": cfg.tokens_per_step / step_time if step_time > 0 else float("inf"),
        "step_time_s": step_time,
        "data_wait_s": data_wait,
        **run_flops.step_metrics(step_time),
    }
    return record, now


def _report_step(io: LoopIO, record: dict, done: int) -> None:
    io.writer.write(record)
    io.progress.update(completed=done, loss=record["loss"], tokens_per_s=record["tokens_per_s"],
                       tflops_per_s_per_device=record["tflops_per_s_per_device"], mfu=record["mfu"])
    if io.on_step is not None:
        io.on_step(record)


def _maybe_save(cfg, io: LoopIO, done, end, ending, params, opt_state, step_arr, feeder_state_after) -> None:
    """Saves checkpoint ``done`` every ``checkpoint.every_steps``, at ``end`` and
    when the run ends early (``ending``: a stop or the end of the stream)."""
    if io.checkpointer is None:
        return
    if done % cfg.checkpoint.every_steps == 0 or done == end or ending:
        state = {"params": params, "opt_state": opt_state, "step": step_arr + 1}
        io.checkpointer.save(done, state=state, feeder_state=feeder_state_after)


def _maybe_evaluate(trainer, io: LoopIO, params, step: int, done: int, exhausted: bool) -> dict | None:
    """Evaluates after ``done`` updates every ``eval_every`` steps, after the
    run's last step and at the end of the stream; None when it is not time.
    With ``io.evaluator``, the eval line also has the task metrics of the
    model's decoded predictions (``EvalResult.flat``: ``eval_<task>/<metric>``)."""
    cfg = trainer.config
    if not ((cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps or exhausted):
        return None
    result = trainer.evaluate(params, io.eval_feeder_fn())
    if io.evaluator is not None:
        # Decoded predictions and the task's metrics, on every process (process 0 writes).
        model = nnx.merge(trainer.graphdef, params)
        result.update(io.evaluator.evaluate(model, step=done, out_root=io.eval_root).flat())
    io.writer.write({"step": step, **result})
    log.info("eval after step %d: %s", step, result)
    return result
