"""Several JAX processes: one ``seqcache train`` process per host.

A *host* is one JAX process, index h = ``jax.process_index()`` of H =
``jax.process_count()``; host h feeds rows [h * B / H, (h + 1) * B / H) of every
global batch of B rows, and the devices of all hosts form the mesh. Settings
come from flags or the environment (``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); ``launch_local`` starts N processes
on this machine to try a multi-host run out.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Mapping, Sequence

import numpy as np

log = logging.getLogger("seqcache.training")

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class DistributedError(ValueError):
    """Inconsistent multi-process settings (the message names them and the fix)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """How this process joins a multi-process run: process 0's coordinator
    "HOST:PORT", the process count H, this process's id h in [0, H), or ``auto``
    (``jax.distributed.initialize`` detects them on SLURM, Open MPI, Cloud TPU or
    Kubernetes)."""

    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False

    @property
    def enabled(self) -> bool:
        """True when ``jax.distributed.initialize`` must be called."""
        return self.auto or any(v is not None for v in (self.coordinator_address, self.num_processes, self.process_id))

    def validate(self) -> None:
        """Raises DistributedError unless the settings can start a run."""
        if not self.enabled or self.auto:
            return
        missing = [name for name, value in (("--coordinator-address", self.coordinator_address),
                                            ("--num-processes", self.num_processes),
                                            ("--process-id", self.process_id)) if value is None]
        if missing:
            raise DistributedError(
                f"a multi-process run needs the coordinator address, the process count and the process id; "
                f"missing: {', '.join(missing)} (or {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); "
                "give --jax-distributed to let JAX detect them on SLURM, Open MPI, Cloud TPU or Kubernetes")
        if self.num_processes < 1:
            raise DistributedError(f"--num-processes must be >= 1 (got {self.num_processes})")
        if not 0 <= self.process_id < self.num_processes:
            raise DistributedError(
                f"--process-id must be in [0, {self.num_processes}) for --num-processes {self.num_processes} "
                f"(got {self.process_id})")
        host, sep, port = self.coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise DistributedError(
                f"--coordinator-address must look like HOST:PORT, e.g. 10.0.0.2:1234 (got {self.coordinator_address!r})"
            )


def settings_from(*, coordinator_address: str | None = None, num_processes: int | None = None,
                  process_id: int | None = None, auto: bool = False,
                  environ: Mapping[str, str] | None = None) -> Settings:
    """Flags first, then the environment variables ``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

    Raises:
      DistributedError: an environment variable that is not an integer.
    """
    environ = os.environ if environ is None else environ

    def env_int(name):
        text = environ.get(name)
        if text in (None, ""):
            return None
        try:
            return int(text)
        except ValueError:
            raise DistributedError(f"{name} must be an integer (got {text!r})") from None

    return Settings(
        coordinator_address=coordinator_address or environ.get(ENV_COORDINATOR) or None,
        num_processes=num_processes if num_processes is not None else env_int(ENV_NUM_PROCESSES),
        process_id=process_id if process_id is not None else env_int(ENV_PROCESS_ID),
        auto=auto,
    )


def initialize(settings: Settings) -> bool:
    """Joins the run with ``jax.distributed.initialize`` (call it before any JAX
    computation or device query); on CPU selects the gloo collectives unless
    ``jax_cpu_collectives_implementation`` is set. Returns False for a single
    process without settings.

    Raises:
      DistributedError: see ``Settings.validate``.
    """
    settings.validate()
    if not settings.enabled:
        return False
    import jax  # optional: jax (the launcher and the settings run without it)

    if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings.auto and settings.coordinator_address is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                                   num_processes=settings.num_processes, process_id=settings.process_id)
    log.info("process %d of %d (coordinator %s): %d local devices, %d in all", jax.process_index(),
             jax.process_count(), settings.coordinator_address or "auto", jax.local_device_count(),
             jax.device_count())
    return True


def any_process(flag: bool) -> bool:
    """True on every host when ``flag`` is true on at least one (an all-gather;
    every host must call it at the same point)."""
    import jax  # optional: jax
    from jax.experimental import multihost_utils  # optional: jax

    if jax.process_count() == 1:
        return bool(flag)

    flags = multihost_utils.process_allgather(np.array([int(bool(flag))], dtype=np.int32))
    return bool(np.asarray(flags).any())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_process_env(*, index: int, count: int, port: int, devices_per_process: int | None,
                      base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of process ``index`` of ``count`` on this machine, the
    coordinator on 127.0.0.1:``port``; with ``devices_per_process``, that many
    CPU devices (``--xla_force_host_platform_device_count``)."""
    env = dict(os.environ if base is None else base)
    env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    env[ENV_NUM_PROCESSES] = str(count)
    env[ENV_PROCESS_ID] = str(index)
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
        env["XLA_FLAGS"] = " ".join(flags)
        env["JAX_PLATFORMS"] = "cpu"
    return env


def launch_local(argv: Sequence[str], *, num_processes: int, devices_per_process: int | None = None,
                 port: int | None = None, grace_s: float = 120.0) -> int:
    """Runs ``argv`` as ``num_processes`` processes of one multi-process JAX run
    on this machine (coordinator on 127.0.0.1, a free port) and waits for them.

    SIGTERM and SIGINT received here are passed on to every process (each in
    its own session) as SIGTERM, so each saves its part of the checkpoint. When
    one process fails (a status other than 0 and 143), the others get SIGTERM;
    a process still running ``grace_s`` seconds after SIGTERM is killed.

    Returns:
      0 when every process exited with 0; else the first status that is not 0 or
      143 (a failure), else 143 (stopped by a signal after saving). A process
      ended by a signal counts as 128 + the signal number.
    """
    if num_processes < 1:
        raise DistributedError(f"--local-processes must be >= 1 (got {num_processes})")
    port = free_port() if port is None else port
    procs: list[subprocess.Popen] = []
    stop_requested = threading.Event()
    lock = threading.Lock()

    def terminate_all(reason: str):
        with lock:
            alive = [p for p in procs if p.poll() is None]
            for p in alive:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        print(f"seqcache train: {reason}: sent SIGTERM to {len(alive)} processes", file=sys.stderr, flush=True)

    def on_signal(signum, frame):
        stop_requested.set()
        terminate_all(f"received {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i in range(num_processes):
            env = local_process_env(index=i, count=num_processes, port=port, devices_per_process=devices_per_process)
            with lock:
                procs.append(subprocess.Popen(list(argv), env=env, start_new_session=True))
        print(f"seqcache train: started {num_processes} processes (coordinator 127.0.0.1:{port}), pids "
              f"{' '.join(str(p.pid) for p in procs)}", file=sys.stderr, flush=True)
        codes: dict[int, int] = {}
        failed = reaper = False
        while len(codes) < len(procs):
            for i, p in enumerate(procs):
                if i in codes:
                    continue
                try:
                    code = p.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                codes[i] = 128 - code if code < 0 else code
                if codes[i] not in (0, 143) and not failed:
                    failed = True
                    terminate_all(f"process {i} exited with status {codes[i]}")
            if (failed or stop_requested.is_set()) and not reaper:
                reaper = True
                _kill_after(procs, grace_s)
        statuses = [codes[i] for i in range(len(procs))]
        bad = [c for c in statuses if c not in (0, 143)]
        return bad[0] if bad else 143 if 143 in statuses else 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _kill_after(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """Kills the processes still running ``grace_s`` seconds from now (once)."""

    def run():
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()

    threading.Thread(target=run, daemon=True, name="seqcache-launch-reaper").start()
