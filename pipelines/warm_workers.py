"""Worker processes of Beam's local engine started before the pipeline exists.

With ``--direct_running_mode=multi_processing`` Beam's local engine starts its
worker processes only when the pipeline runs, and each then spends about half
a second of CPU importing Beam, its SDK harness and seqcache before it can do
any work: on the build's critical path, after the driver's own start-up, in
which one of the machine's cores has nothing to do. ``start`` (the ``seqcache
build`` command calls it first thing) starts the workers at once instead:
each imports what a worker needs and waits, blocked on its standard input,
for the environment Beam gives a worker (its control and logging endpoints,
the pipeline options, its id). The local engine (``runner.local_engine``)
hands one warm process to each worker Beam asks for (``take``), through an
environment of its own (``WARM_ENVIRONMENT_URN``, whose payload is the usual
worker command: a worker that finds no warm process left starts cold, as
Beam's would).

On Linux the warm processes are forked from the command once it has imported
Beam (``start(count, fork=True)``, which ``seqcache build`` calls right
after that import): each begins with the modules already loaded, shared with
the command until written, instead of importing them again: about 0.5 s of
CPU less per worker, on a machine whose cores the command and its workers
share while they start (benchmarks/README.md). The fork happens before the
command has started a thread of its own or imported the modules a task
names; a child only runs the worker (``seqcache.pipelines.worker_main``) and
leaves by ``os._exit``, so none of the command's exit handlers runs in it.
Elsewhere, or when ``fork`` fails, each is a new interpreter (``python -m
seqcache.pipelines.worker_main --warm``) started at the command's start.

A warm process's standard error is a pipe that a thread copies to this
process's descriptor 2 wherever it points at the time (a build takes it away
from Beam, ``seqcache.commands.common.worker_stderr``), as a worker started
later would inherit it. Processes not handed out are told to exit (their
standard input closed) when the pipeline ends (``close``, also at exit): warm
processes serve one pipeline, the first of the command (a mixture's later
tasks start their workers cold). One whose driver dies reads end-of-file and
exits too; until it has work it ignores SIGINT, which Ctrl-C sends to the
whole process group, and leaves it to the command.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Sequence

# The environment URN of the local engine's workers when warm ones are waiting
# (its payload: the cold worker command, for a worker that finds none).
WARM_ENVIRONMENT_URN = "seqcache:environment:warm_subprocess:v1"
# The argument that makes ``seqcache.pipelines.worker_main`` wait for its environment.
WARM_FLAG = "--warm"

_LOGGER = logging.getLogger(__name__)
_lock = threading.Lock()
_waiting: list[subprocess.Popen] = []
_registered = False


def workers_asked(args: Sequence[str], cpu_count: int | None = None) -> int:
    """How many local worker processes the Beam pipeline options ``args`` ask
    for: ``--direct_num_workers`` (0 or absent: Beam's meaning, every CPU) with
    ``--direct_running_mode=multi_processing`` and no ``--runner`` other than
    the local engine; 0 otherwise, or when a value cannot be read (the build
    then reports it)."""
    from seqcache.pipelines import runner as runner_mod

    values = {}
    items = list(args)
    for i, a in enumerate(items):
        if not a.startswith("--"):
            continue
        name, eq, value = a.partition("=")
        if not eq:
            value = items[i + 1] if i + 1 < len(items) and not items[i + 1].startswith("--") else ""
        values[name] = value
    if values.get("--direct_running_mode") != "multi_processing":
        return 0
    runner = values.get("--runner")
    if runner is not None and runner_mod.RUNNER_ALIASES.get(runner.lower(), runner) != runner_mod.LOCAL_ENGINE:
        return 0
    count = values.get("--direct_num_workers", "1")
    if not count.isascii() or not count.isdigit():
        return 0
    count = int(count) or (cpu_count if cpu_count is not None else (os.cpu_count() or 1))
    return count if count > 1 else 0


def can_fork() -> bool:
    """Whether warm processes may be forked from this process (``start(...,
    fork=True)``): on Linux, where Beam's and gRPC's libraries, not yet
    started, survive a fork, in one of seqcache's own processes (the
    ``seqcache`` executable, ``seqcache.fs.own_process``) while it runs one
    thread. A program that runs the command itself (click's test runner, a
    notebook) may hold threads and descriptors a fork would copy in a state
    nobody can tell: its workers are new interpreters."""
    from seqcache import fs

    return (sys.platform.startswith("linux") and hasattr(os, "fork") and fs.is_own_process()
            and threading.active_count() == 1)


def start(count: int, *, fork: bool = False) -> None:
    """Starts ``count`` warm worker processes; nothing when ``count`` < 1.

    With ``fork`` (and ``can_fork()``), each is a fork of this process, which
    has imported Beam (``seqcache.fs.import_beam``) and started no thread of
    its own; a fork that fails leaves the rest to new interpreters. Otherwise
    each is ``python -m seqcache.pipelines.worker_main --warm``, with one numpy
    BLAS thread unless ``OPENBLAS_NUM_THREADS`` says otherwise, as
    ``runner.local_engine``'s workers."""
    if count < 1:
        return
    atexit.register(close)  # first: an interrupt while they start still has them told to exit, and waited for
    with _lock:
        forked: list = []
        if fork and can_fork():
            for p in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
                if p is not None:
                    p.flush()
            # Ctrl-C or SIGTERM while forking is held until every child is forked and
            # registered, then handled as it would have been: raised inside Python's
            # at-fork hooks (logging's, threading's) it would be lost, and could leave
            # their locks held. (A signal mask would not do: the kernel hands a
            # signal to any thread that does not block it, numpy's and Arrow's
            # included, and the interpreter then runs the handler in this thread.)
            held: list[int] = []
            previous = {sig: signal.signal(sig, lambda signum, _frame: held.append(signum)) for sig in _FORK_SIGNALS}
            try:
                while len(forked) < count:
                    try:
                        forked.append(_fork_worker(_waiting + forked, previous))
                    except OSError as e:
                        _LOGGER.info("no fork for a warm worker (%s): starting the rest as new processes", e)
                        break
                _copy_stderr(forked)  # threads only now: a child is forked from one thread
                _waiting.extend(forked)
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)
                for sig in dict.fromkeys(held):
                    _handle_held(sig, previous[sig])
        env = dict(os.environ)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        started = [subprocess.Popen([sys.executable, "-m", "seqcache.pipelines.worker_main", WARM_FLAG],
                                    stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
                   for _ in range(count - len(forked))]
        _copy_stderr(started)
        _waiting.extend(started)


_FORK_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _handle_held(signum: int, handler) -> None:
    """Handles a signal held while the workers were forked as ``handler`` (the
    command's) would have: a Python handler is called (Ctrl-C's raises
    KeyboardInterrupt), the default action is taken (the signal sent again),
    an ignored one is dropped."""
    if callable(handler):
        handler(signum, None)
    elif handler in (None, signal.SIG_DFL):
        os.kill(os.getpid(), signum)


def _copy_stderr(procs) -> None:
    """One thread per process copying its standard error to descriptor 2."""
    for proc in procs:
        threading.Thread(target=_copy_to_fd2, args=(proc.stderr,), name="warm-worker-stderr", daemon=True).start()


class ForkedWorker:
    """A forked warm process, with the part of ``subprocess.Popen``'s interface
    that the local engine and ``close`` use: ``pid``, ``stdin`` (the write end
    of its standard input), ``stderr`` (the read end of its standard error),
    ``poll``, ``wait``, ``kill`` and ``returncode``."""

    def __init__(self, pid: int, stdin, stderr):
        self.pid, self.stdin, self.stderr = pid, stdin, stderr
        self.args = [f"<forked worker {pid}>"]
        self.returncode: int | None = None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped already by someone else: its status is lost
                self.returncode = 0
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code, once it has exited.

        Raises:
          subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if timeout is None:
            return self._reap(0)
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _above_stdio(fd: int) -> int:
    """``fd`` moved to a descriptor above 2 when it is 0, 1 or 2 (a command
    started with its standard input closed gets pipes there)."""
    if fd > 2:
        return fd
    import fcntl

    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 3)
    os.close(fd)
    return moved


def _fork_worker(siblings: Sequence, handlers: dict) -> ForkedWorker:
    """Forks one warm process (SIGINT and SIGTERM held by the caller;
    ``handlers``, the command's own, are the child's again, but for SIGINT,
    which it ignores until it has work): its standard input and error are new
    pipes; the ends of its siblings' pipes that this process holds are closed
    in it.

    Raises:
      OSError: no pipe or no fork.
    """
    fds = []
    try:
        for _ in range(2):
            for fd in os.pipe():
                fds.append(_above_stdio(fd))
        pid = os.fork()
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    stdin_r, stdin_w, err_r, err_w = fds
    if pid == 0:  # the child: a worker, until os._exit
        code = 1
        try:
            global _lock
            _lock = threading.Lock()  # held by the parent's thread that forked
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # until it has work (worker_main)
            for sig, handler in handlers.items():
                if sig != signal.SIGINT:
                    signal.signal(sig, signal.SIG_DFL if handler is None else handler)
            for proc in siblings:
                proc.stdin.close()
                proc.stderr.close()
            os.close(stdin_w)
            os.close(err_r)
            os.dup2(stdin_r, 0)
            os.dup2(err_w, 2)
            os.close(stdin_r)
            os.close(err_w)
            _waiting.clear()
            from seqcache.pipelines import worker_main

            worker_main.main([sys.executable, WARM_FLAG])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            try:
                traceback.print_exc()
            except BaseException:
                pass
        finally:
            try:
                for p in (sys.stdout, sys.stderr):
                    if p is not None:
                        p.flush()
            finally:
                os._exit(code)
    os.close(stdin_r)
    os.close(err_w)
    return ForkedWorker(pid, os.fdopen(stdin_w, "wb"), os.fdopen(err_r, "rb"))


def waiting() -> int:
    """Warm processes not handed out yet."""
    with _lock:
        return len(_waiting)


def take() -> subprocess.Popen | ForkedWorker | None:
    """A warm process still alive, removed from the waiting ones, or None."""
    with _lock:
        while _waiting:
            proc = _waiting.pop(0)
            if proc.poll() is None:
                return proc
    return None


def hand_over(proc: subprocess.Popen | ForkedWorker, env: dict) -> None:
    """Gives the warm process ``proc`` its environment (it then runs Beam's
    SDK harness with it).

    Raises:
      OSError: the process is gone (its standard input is closed).
    """
    proc.stdin.write(json.dumps(env).encode("utf-8") + b"\n")
    proc.stdin.close()


def close() -> None:
    """Tells the warm processes not handed out to exit, and waits for them (at
    most a few seconds each, then kills them)."""
    with _lock:
        procs, _waiting[:] = list(_waiting), []
    for proc in procs:
        try:
            proc.stdin.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _copy_to_fd2(pipe) -> None:
    """Copies ``pipe`` to descriptor 2 until its end; a write that fails (no
    reader) is dropped, and the pipe still drained, so the worker never blocks."""
    while True:
        try:
            data = pipe.read1(1 << 16)
        except (OSError, ValueError):
            return
        if not data:
            return
        try:
            os.write(2, data)
        except OSError:
            pass


def wait_for_environment() -> dict | None:
    """In a warm process: the environment its driver hands over (``hand_over``),
    read from standard input, or None when standard input ends first (the
    driver needs it no more, or is gone)."""
    with open(0, "rb", closefd=False) as stdin:  # descriptor 0, whatever sys.stdin is in a forked process
        line = stdin.readline()
    if not line.strip():
        return None
    return json.loads(line)


def register_environment() -> None:
    """Registers the local engine's worker handler for ``WARM_ENVIRONMENT_URN``
    (once): Beam's subprocess worker, which takes a warm process if one is
    waiting and starts its worker command otherwise."""
    global _registered
    if _registered:
        return
    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2_grpc, endpoints_pb2
    from apache_beam.runners.portability import local_job_service
    from apache_beam.runners.portability.fn_api_runner import worker_handlers
    from apache_beam.utils import thread_pool_executor
    from google.protobuf import json_format, text_format

    class WarmSdkWorker(local_job_service.SubprocessSdkWorker):
        def run(self):
            proc = take()
            if proc is None:
                _LOGGER.info("worker %s: no warm process left, starting one", self._worker_id)
                return super().run()
            _LOGGER.info("worker %s: warm process %d", self._worker_id, proc.pid)
            # As Beam's SubprocessSdkWorker.run, with a process that is already running.
            options = [("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)]
            logging_server = grpc.server(thread_pool_executor.shared_unbounded_instance(), options=options)
            logging_port = logging_server.add_insecure_port("[::]:0")
            logging_server.start()
            beam_fn_api_pb2_grpc.add_BeamFnLoggingServicer_to_server(
                local_job_service.BeamFnLoggingServicer(), logging_server)
            env = dict(
                os.environ,
                CONTROL_API_SERVICE_DESCRIPTOR=text_format.MessageToString(
                    endpoints_pb2.ApiServiceDescriptor(url=self._control_address)),
                LOGGING_API_SERVICE_DESCRIPTOR=text_format.MessageToString(
                    endpoints_pb2.ApiServiceDescriptor(url="localhost:%s" % logging_port)),
                PIPELINE_OPTIONS=json_format.MessageToJson(self._provision_info.provision_info.pipeline_options))
            if self._worker_id:
                env["WORKER_ID"] = self._worker_id
            try:
                hand_over(proc, env)
                proc.wait()
                if proc.returncode:
                    raise RuntimeError(f"Worker subprocess exited with return code {proc.returncode}")
            finally:
                if proc.poll() is None:
                    proc.kill()
                logging_server.stop(0)

    @worker_handlers.WorkerHandler.register_environment(WARM_ENVIRONMENT_URN, bytes)
    class WarmSubprocessSdkWorkerHandler(worker_handlers.SubprocessSdkWorkerHandler):
        def start_worker(self):
            self.worker = WarmSdkWorker(self._worker_command_line, self.control_address, self.provision_info,
                                        self.worker_id)
            self.worker_thread = threading.Thread(name="run_worker", target=self.worker.run)
            self.worker_thread.start()

    _registered = True
