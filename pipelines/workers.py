"""The worker processes of Beam's local engine (``--direct_running_mode=multi_processing``).

Beam's local engine asks a worker pool for each of its workers (``StartWorker``
of Beam's ``BeamFnExternalWorkerPool`` service, the protocol of Beam's own
``worker_pool_main``); ``runner.local_engine`` serves it in the build's process
and hands each request to ``hand_out``. A worker is ``python -m
seqcache.pipelines.worker_main --wait``: it imports Beam (without pandas), its
SDK harness and the build's steps, then waits on its standard input for the
environment of Beam's SDK harness contract (one JSON line:
``CONTROL_API_SERVICE_DESCRIPTOR``, ``LOGGING_API_SERVICE_DESCRIPTOR``,
``PIPELINE_OPTIONS``, ``WORKER_ID``) and runs Beam's ``sdk_worker_main``.

The ``seqcache build`` executable starts its workers first thing
(``start_ahead``), so that each imports while the command does instead of
after it, when the pipeline runs: about 1 s of CPU per worker, on a core the
command leaves idle while it starts (benchmarks/README.md, "Worker
processes"). A request that finds no waiting process starts one then (the
only way in a program that calls ``build_task`` itself). A process started
ahead inherits the command's standard error before the build takes it away
from Beam (``seqcache.cli.commands.common.worker_stderr``): a thread copies its
standard error to descriptor 2 wherever that points at the time, as a process
started later would inherit it. Waiting processes are stopped when the
pipeline ends (``stop_waiting``; they serve one pipeline, the command's first)
or at exit; one whose command dies reads end-of-file and exits. Until it has work a
waiting process ignores SIGINT (from its start: it is blocked until
``worker_main`` ignores it), which Ctrl-C sends to the whole process group:
the command handles it. Once it has work it takes back the command's SIGINT
handling: interrupted with the others, or, when the command was started with
SIGINT ignored (``nohup``), still ignoring it.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Sequence

# The argument that makes ``seqcache.pipelines.worker_main`` wait for its environment.
WAIT_FLAG = "--wait"
# ``--runner`` values that mean Beam's local engine (runner.RUNNER_ALIASES maps them to it).
LOCAL_ENGINE_NAMES = ("direct", "directrunner", "fnapi", "fnapirunner", "local")
# Seconds the workers of a pipeline that has ended get to exit before they are killed.
EXIT_WAIT_S = 10.0

_lock = threading.Lock()
_waiting: list[subprocess.Popen] = []


def asked(args: Sequence[str], cpu_count: int | None = None) -> int:
    """How many worker processes of the local engine the ``seqcache build``
    arguments ``args`` ask for: ``--workers N``, or ``--direct_num_workers``
    (0 or absent: every CPU, as Beam reads it) with
    ``--direct_running_mode=multi_processing``, and no ``--runner`` other than
    the local engine; 0 otherwise, or for a value that cannot be read (the
    command then says what is wrong)."""
    values, items = {}, list(args)
    for i, a in enumerate(items):
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if not eq and i + 1 < len(items) and not items[i + 1].startswith("-"):
                value = items[i + 1]
            values[name] = value
    runner = values.get("--runner", "local").lower()
    if runner not in LOCAL_ENGINE_NAMES and runner.rsplit(".", 1)[-1] != "fnapirunner":
        return 0
    count = values.get("--workers") if "--workers" in values else None
    if count is None:
        if values.get("--direct_running_mode") != "multi_processing":
            return 0
        count = values.get("--direct_num_workers", "1")
    if not count.isascii() or not count.isdigit():
        return 0
    count = int(count) or (cpu_count or os.cpu_count() or 1)
    return count if count > 1 else 0


def start_ahead(args: Sequence[str]) -> int:
    """Starts the worker processes the ``seqcache build`` arguments ``args``
    ask for (``asked``), to wait for their pipeline; returns how many."""
    count = 0 if {"-h", "--help"} & set(args) else asked(args)
    if count:
        atexit.register(stop_waiting)
        with _lock:
            _waiting.extend(_start(relay_stderr=True) for _ in range(count))
    return count


def _start(*, relay_stderr: bool) -> subprocess.Popen:
    """One waiting worker process, with one numpy BLAS thread unless the
    environment says otherwise. It starts with SIGINT blocked (the calling
    thread's mask, which it inherits), until ``worker_main`` ignores it: a
    Ctrl-C while its interpreter starts is no traceback of its own; in this
    process it is only delayed until the process has started."""
    env = dict(os.environ)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
    try:
        proc = subprocess.Popen([sys.executable, "-m", "seqcache.pipelines.worker_main", WAIT_FLAG], env=env,
                                stdin=subprocess.PIPE, stderr=subprocess.PIPE if relay_stderr else None)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if relay_stderr:
        threading.Thread(target=_relay, args=(proc.stderr,), name="seqcache-worker-stderr", daemon=True).start()
    return proc


def _relay(stream) -> None:
    """Copies ``stream`` to descriptor 2 until it ends; what cannot be written is dropped."""
    with stream:
        for chunk in iter(lambda: stream.read1(1 << 16), b""):
            try:
                os.write(2, chunk)
            except OSError:
                pass


def hand_out(environment: Mapping[str, str]) -> subprocess.Popen:
    """Gives ``environment`` (the SDK harness's variables) to a waiting worker
    process, or to one started now when none is left; returns the process.

    Raises:
      OSError: no process could be started.
    """
    line = (json.dumps(dict(environment)) + "\n").encode()
    while True:
        with _lock:
            proc = _waiting.pop(0) if _waiting else _start(relay_stderr=False)
        try:
            proc.stdin.write(line)
            proc.stdin.close()
            return proc
        except OSError:  # it exited while waiting (killed): the next one, or a new one
            proc.kill()
            proc.wait()


def stop_waiting() -> None:
    """Stops the processes still waiting for work (started ahead, not handed out)."""
    with _lock:
        waiting = list(_waiting)
        _waiting.clear()
    for proc in waiting:
        proc.kill()
        proc.wait()
        proc.stdin.close()


def reap(processes: Sequence[subprocess.Popen], *, kill: bool = False) -> None:
    """Waits for worker ``processes`` whose pipeline has ended to exit (they
    leave when its control channel closes), killing those still running after
    ``EXIT_WAIT_S`` in all; with ``kill`` (the pipeline was interrupted or
    failed) kills them at once."""
    deadline = time.monotonic() + (0.0 if kill else EXIT_WAIT_S)
    for proc in processes:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
