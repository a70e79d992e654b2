"""A worker process of Beam's local engine (``--direct_running_mode=multi_processing``):
Beam's own ``sdk_worker_main`` (``beam_internals.run_sdk_worker``), with Beam
imported as the build imports it (``seqcache.process.import_beam``: without
pandas) and the build's steps imported before there is work. With ``--wait``
(``workers.WAIT_FLAG``, how ``seqcache.pipelines.workers`` starts it) it then
waits on its standard input for its environment, one JSON line, and exits
quietly if the input ends first.

While it waits it ignores SIGINT (Ctrl-C reaches the whole process group; its
command stops it; ``workers`` starts it with SIGINT blocked until then); once
it has work it takes back the SIGINT handling it was started with, the
command's: interrupted with the others, or, when the command was started with
SIGINT ignored (``nohup``, a shell script's background job), still ignoring
it, as the command does.
"""

import gc
import json
import os
import signal
import sys

# The SIGINT handling this process was started with: Python's own, or SIG_IGN
# where the command ignores SIGINT (exec keeps an ignored signal ignored); None
# (a handler set outside Python) is taken as Python's own.
INHERITED_SIGINT = signal.getsignal(signal.SIGINT)
if INHERITED_SIGINT is None:
    INHERITED_SIGINT = signal.default_int_handler
if __name__ == "__main__" and "--wait" in sys.argv[1:]:
    # Until it has work, a waiting process leaves Ctrl-C to its command (which then
    # stops it): no traceback from an import cut short. ``workers`` starts it with
    # SIGINT blocked, so that none comes before this; one pending is dropped here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])

from seqcache import process  # noqa: E402

process.import_beam()  # before Beam's modules (already done by the package's import of runner.py)
from seqcache.pipelines import beam_internals  # noqa: E402  (Beam's SDK harness)

import seqcache.pipelines.transforms  # noqa: E402,F401  what unpickling the build's steps imports
from seqcache.pipelines import workers  # noqa: E402


def main(argv=None) -> None:
    """Runs Beam's worker, in a process of seqcache's own (``process.own_process``),
    until its runner closes the control channel; then the objects left are
    frozen (``gc.freeze``), so that the exit does not walk them (about 0.2 s)."""
    argv = list(sys.argv if argv is None else argv)
    process.own_process()
    process.tune_allocator()
    process.freeze_heap()  # what is imported by now lives as long as the worker
    if workers.WAIT_FLAG in argv[1:]:
        line = sys.stdin.buffer.readline()
        if not line:
            return
        os.environ.update(json.loads(line))
        argv = argv[:1]
        signal.signal(signal.SIGINT, INHERITED_SIGINT)  # a worker now: as its command, interrupted or not
    try:
        beam_internals.run_sdk_worker(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
