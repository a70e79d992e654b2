"""A job that makes no progress, and the bound on waiting for it.

Beam's portable runners wait for their SDK workers without end: a Flink or
Spark job server whose worker died, or never started (an EXTERNAL worker
pool whose ``python`` lacks Beam), asks for its control connection again
and again (Beam's Java ``ExternalEnvironmentFactory``), and the job stays
RUNNING, and ``wait_until_finish`` without a duration never returns. So a
build on a runner that runs its job through a job service (Flink, Spark, a
job server named by ``--job_endpoint``: ``runner.watches_stalls``) watches
its job while it waits, and gives up after ``timeout_s`` seconds without
progress (``wait``):

- **Progress** is a **heartbeat** of one of the build's steps: a work unit
  started, a batch of records read, a shard's group spread or written
  (transforms.py calls ``Heartbeat.beat``). The job's state is not asked:
  a job whose workers never start stays RUNNING, and Beam's result gives
  its state only where its own wait keeps it.
- **Heartbeats** are files in a folder every worker writes and the driver
  reads, the build's working folder (``<cache>/_tmp/beats/``, build.py):
  one file a worker process (``<host>-<pid>``), rewritten with a count at
  most every ``every_s`` seconds, so that a step pays one small write a few
  seconds at most, and a worker on another machine reaches the driver as its
  shards do. The driver lists the folder (``progress_of``: each file's path,
  size and modification time) every ``poll_seconds(timeout_s)``; any
  difference from the last listing is progress. Times are compared on the
  driver's clock only, so the workers' clocks do not matter.

The bound: ``$SEQCACHE_STALL_TIMEOUT`` seconds (``DEFAULT_TIMEOUT_S``, 5
minutes, when unset; runner.py reads it). A phase in which no step of the
build runs for longer (a runner's own sort of a very large shuffle before
the first group reaches a step) needs a larger bound.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable, Hashable

from seqcache import fs

# Seconds without progress after which a watched job is given up, unless $SEQCACHE_STALL_TIMEOUT says otherwise.
DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_VARIABLE = "SEQCACHE_STALL_TIMEOUT"
# The heartbeats' folder in the build's working folder (``_tmp``).
BEATS_DIR = "beats"
# Seconds a cancelled job's runner gets to answer before the build goes on without it.
CANCEL_WAIT_S = 20.0

# Per heartbeat folder: (monotonic time of this process's last beat, beats so far).
_last_beat: dict[str, tuple[float, int]] = {}
_beat_lock = threading.Lock()


class Stalled(Exception):
    """The job made no progress for ``seconds`` (``wait``); ``finished`` is
    set once Beam's ``wait_until_finish``, still waiting, returns (``cancel``)."""

    def __init__(self, seconds: float, finished: threading.Event | None = None):
        super().__init__(f"no progress for {seconds:g} s")
        self.seconds, self.finished = seconds, finished


def poll_seconds(timeout_s: float) -> float:
    """How often the driver looks for progress: a tenth of the bound, between 0.5 and 5 s."""
    return max(0.5, min(5.0, timeout_s / 10))


class Heartbeat:
    """A step's sign of progress, for the driver's ``wait``: ``beat()``
    rewrites ``<folder>/<host>-<pid>`` (the count of this process's beats)
    when the last beat of this process into ``folder`` is ``every_s`` seconds
    old or more, else does nothing. Picklable (it travels with the steps);
    ``folder`` None: ``beat`` does nothing (a runner not watched). A beat that
    cannot be written (the folder removed once the build gave up) is passed
    over: it never fails a step."""

    def __init__(self, folder: str | None, *, every_s: float = 2.0):
        self.folder, self.every_s = folder, float(every_s)

    def beat(self) -> None:
        """One heartbeat of this process (see the class); never raises."""
        if self.folder is None:
            return
        now = time.monotonic()
        with _beat_lock:
            last, count = _last_beat.get(self.folder, (None, 0))
            if last is not None and now - last < self.every_s:
                return
            _last_beat[self.folder] = (now, count + 1)
        name = f"{socket.gethostname()}-{os.getpid()}"
        try:
            fs.write_bytes(fs.join(self.folder, name), str(count + 1).encode())
        except OSError:
            pass


def beat_interval(timeout_s: float) -> float:
    """Seconds between a worker process's heartbeats for a bound of
    ``timeout_s``: a sixth of it, between 1 and 10 s."""
    return max(1.0, min(10.0, timeout_s / 6))


def progress_of(folder: str) -> Hashable:
    """What the heartbeats in ``folder`` look like now: ``(path, bytes,
    modification time in ns)`` of each file; an empty tuple when there is
    none or the folder cannot be listed."""
    try:
        return tuple(fs.match(fs.join(folder, "*")))
    except OSError:
        return ()


def wait(result, *, timeout_s: float, progress: Callable[[], Hashable], clock: Callable[[], float] = time.monotonic,
         poll_s: float | None = None) -> None:
    """``result.wait_until_finish()`` (Beam's ``PipelineResult``), on a daemon
    thread, while this thread looks for progress every ``poll_s`` seconds
    (default ``poll_seconds(timeout_s)``): a change of ``progress()``
    (``progress_of`` the heartbeats' folder). ``timeout_s``, ``poll_s``:
    seconds. ``clock``: the seconds the bound is measured in (tests give a
    fake one).

    Raises:
      Stalled: it did not change for ``timeout_s`` seconds (the job is left
        as it is: ``cancel`` it).
      What ``wait_until_finish`` raised (a failed job, a lost job service),
      and a KeyboardInterrupt raised in this thread while it waits.
    """
    done, outcome = threading.Event(), {}

    def waiting():
        try:
            outcome["state"] = result.wait_until_finish()
        except BaseException as e:  # handed to the driver's thread, which raises it
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=waiting, name="seqcache-wait-job", daemon=True).start()
    every = poll_seconds(timeout_s) if poll_s is None else poll_s
    seen: Any = progress()
    since = clock()
    while not done.wait(every):
        now = progress()
        if now != seen:
            seen, since = now, clock()
        elif clock() - since >= timeout_s:
            raise Stalled(timeout_s, done)
    if "error" in outcome:
        raise outcome["error"]


def cancel(result, stalled: Stalled, wait_s: float = CANCEL_WAIT_S) -> None:
    """Cancels the job of ``result`` that ``stalled``, best effort, and waits
    at most ``wait_s`` seconds in all for the runner to answer and for Beam's
    ``wait_until_finish`` to see the job end (so that its threads end before
    the job server goes; a job service that never answers is left to the job
    server's end)."""
    def cancelling():
        try:
            result.cancel()
        except Exception:  # cancelling is best effort: the job server is stopped after
            pass

    deadline = time.monotonic() + wait_s
    thread = threading.Thread(target=cancelling, name="seqcache-cancel-job", daemon=True)
    thread.start()
    thread.join(wait_s)
    if stalled.finished is not None:
        stalled.finished.wait(max(0.0, deadline - time.monotonic()))
