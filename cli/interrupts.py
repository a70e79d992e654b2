"""How seqcache's commands stop on SIGINT (Ctrl-C) and SIGTERM (``kill``,
``timeout``, a job scheduler).

Either signal raises ``KeyboardInterrupt`` in the main thread, so that what a
command has begun unwinds as after Ctrl-C (a build removes its unfinished
folder, which never holds a manifest); the command then says so in one line
on standard error that starts with ``describe()`` ("interrupted", or
"interrupted by SIGTERM") and exits with ``exit_status()``, 128 + the number
of the first signal: 130 after SIGINT, 143 after SIGTERM, as a shell reports a
process a signal ended; also when something else failed once the signal
had come (Ctrl-C reaches a runner's job server and workers too, and the runner
may report their loss first): ``status_after``. After the first signal the shutdown gets
``INTERRUPT_GRACE_S`` seconds; then this process's descendants (a build's
worker processes) are killed, ``on_deadline`` says what the user needs to
know, and the process exits with that status anyway.

The ``seqcache`` executable installs the handlers with its first statement
(``install``, from ``seqcache.cli.executable``), before click, rich or Beam are
imported, so that from then on no signal kills it without a word (status -15;
only the interpreter's own start-up, before any seqcache code runs, is left to
Python's defaults); a build installs them again around its pipeline (``handled``),
with what its deadline should say; once the command has ended
(``exit_at_once``) a signal ends the process at once. A signal the process was
started with ignored stays ignored: SIGINT under ``nohup`` or in a shell
script's background job, in the command and in its worker processes
(``seqcache.pipelines.worker_main``).

The standard library only: this is imported before anything heavy.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading

# Seconds an interrupted command may take to stop its runner and clean up before
# it stops its worker processes and exits anyway.
INTERRUPT_GRACE_S = 20.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)

# The first SIGINT or SIGTERM a handler of this module received (None before),
# and whether its grace period has started. Python runs the handlers in the main
# thread, one at a time: no lock (a signal during a handler would wait on it).
_received: int | None = None
_deadline_started = False


def received() -> int | None:
    """The first SIGINT or SIGTERM this process received (``signal.Signals``), or None."""
    return _received


def exit_status() -> int:
    """The exit status of a command interrupted by ``received()``: 128 + the
    signal's number (130 after SIGINT, 143 after SIGTERM; 130 for a
    ``KeyboardInterrupt`` that no signal raised)."""
    return 128 + int(_received or signal.SIGINT)


def describe() -> str:
    """How the command's last line starts: ``"interrupted"`` (Ctrl-C, or a
    ``KeyboardInterrupt`` that no signal raised) or ``"interrupted by SIGTERM"``."""
    if _received in (None, signal.SIGINT):
        return "interrupted"
    return f"interrupted by {signal.Signals(_received).name}"


# The real standard error while a build has taken descriptor 2 away from Beam's
# workers (``seqcache.cli.commands.common.worker_stderr``, which sets it; and after,
# when the build ended with an exit or an interrupt); None otherwise.
real_stderr_fd: int | None = None


def write_stderr(text: str) -> None:
    """Writes ``text`` to the real standard error at once, from any thread (to
    ``real_stderr_fd`` when a build has taken descriptor 2 away); errors writing
    (a closed pipe, a write the signal cut into) are ignored: these are a
    command's last words."""
    try:
        if real_stderr_fd is None:
            sys.stderr.write(text)
            sys.stderr.flush()
            return
        data = text.encode(sys.stderr.encoding or "utf-8", "backslashreplace")
        while data:
            data = data[os.write(real_stderr_fd, data):]
    except (OSError, ValueError, RuntimeError):
        pass


def say_interrupted() -> None:
    """Writes ``describe()`` as one line to the real standard error (``write_stderr``)."""
    write_stderr(f"{describe()}\n")


def status_after(code):
    """The exit status of a command that ended with ``code`` (as ``SystemExit``
    carries it) once ``received()`` is set: ``code`` when the command finished
    (0 or None) or said it was interrupted (``exit_status()``); any other, a
    failure that came after the signal (Ctrl-C reaches a runner's job server
    and workers too, whose loss the runner may report first), becomes
    ``exit_status()``, after ``say_interrupted`` (and a message ``code``
    carries, as ``end_process`` would write it): an interrupted command exits
    130 or 143 whatever else broke."""
    if code is None or (isinstance(code, int) and code in (0, exit_status())):
        return code
    if not isinstance(code, int):
        write_stderr(f"{code}\n")
    say_interrupted()
    return exit_status()


def _handler(on_deadline, grace_s: float):
    """A handler of SIGINT and SIGTERM that raises ``KeyboardInterrupt``; the
    first signal also starts the grace period."""

    def handle(signum, frame):
        global _received, _deadline_started
        first, _deadline_started = not _deadline_started, True
        if _received is None:
            _received = signal.Signals(signum)
        if first:
            timer = threading.Timer(grace_s, _give_up, args=(on_deadline,))
            timer.daemon = True
            timer.start()
        raise KeyboardInterrupt(signal.Signals(signum).name)

    handle.seqcache_handler = True
    return handle


def _give_up(on_deadline) -> None:
    """The end of the grace period: kills this process's descendants, says what
    ``on_deadline`` says (default: ``say_interrupted``) and exits."""
    kill_descendants()
    try:
        (on_deadline or say_interrupted)()
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        os._exit(exit_status())


def _set(handler) -> dict:
    """Installs ``handler`` for SIGTERM, unless the process ignores it, and for
    SIGINT where it is Python's own (``default_int_handler``) or this module's;
    returns the handlers replaced, by signal."""
    previous = {}
    for signum in SIGNALS:
        current = signal.getsignal(signum)
        if current is signal.SIG_IGN:  # started ignored (nohup, a background job): it stays so
            continue
        if signum == signal.SIGINT and not (current is signal.default_int_handler
                                            or getattr(current, "seqcache_handler", False)):
            continue
        previous[signum] = signal.signal(signum, handler)
    return previous


def install(on_deadline=None, grace_s: float | None = None) -> None:
    """For the rest of the process, SIGINT and SIGTERM raise ``KeyboardInterrupt``
    (module docstring). Main thread only; elsewhere it does nothing."""
    if threading.current_thread() is threading.main_thread():
        _set(_handler(on_deadline, INTERRUPT_GRACE_S if grace_s is None else grace_s))


@contextlib.contextmanager
def handled(on_deadline=None, grace_s: float | None = None):
    """While the block runs, SIGINT and SIGTERM raise ``KeyboardInterrupt``, and
    the first one gives the shutdown ``grace_s`` seconds (default
    ``INTERRUPT_GRACE_S``), after which ``on_deadline()`` speaks and the process
    exits with ``exit_status()`` (module docstring); the handlers before are
    restored after it. Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = _set(_handler(on_deadline, INTERRUPT_GRACE_S if grace_s is None else grace_s))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def exit_at_once() -> None:
    """From now on (the command has ended and the process is exiting), a SIGINT
    or SIGTERM that ``install`` handles ends the process at once: its
    descendants killed, one line, ``exit_status()``. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum, frame):
        global _received
        again = _received is not None  # the command has said so already
        if not again:
            _received = signal.Signals(signum)
        kill_descendants()
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            sys.stdout.flush()
        if not again:
            say_interrupted()
        os._exit(exit_status())

    handle.seqcache_handler = True
    for signum in SIGNALS:
        if getattr(signal.getsignal(signum), "seqcache_handler", False):
            signal.signal(signum, handle)


def end_process(code) -> None:
    """Ends this interrupted process with exit status ``code`` (read as
    ``SystemExit`` reads it: None is 0, a string is written to standard error
    and gives 1), after the ``atexit`` functions (a build's waiting worker
    processes are stopped there) and with standard output and error flushed,
    but without the interpreter's own finalization: after a
    ``KeyboardInterrupt`` raised inside code that ``exec`` runs from a string
    (a dataclass's or named tuple's methods, made while a module imports),
    CPython ends the process by SIGINT (status -2) once it has finalized, even
    though the interrupt was handled. Does not return."""
    if code is None or isinstance(code, int):
        status = code or 0
    else:
        write_stderr(f"{code}\n")
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, RuntimeError, AttributeError):
                stream.flush()
        os._exit(status)


def kill_descendants() -> None:
    """Sends SIGKILL to every descendant of this process (psutil's process
    tree; children that end meanwhile are passed over)."""
    import psutil  # here, not at the top: only a signal's path needs it, and it imports socket and datetime
    try:
        descendants = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in descendants:
        with contextlib.suppress(psutil.Error):
            child.kill()
