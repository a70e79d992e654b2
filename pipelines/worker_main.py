"""A worker process of Beam's local engine (``--direct_running_mode=multi_processing``):
Beam's own ``sdk_worker_main``, with Beam imported as the build imports it
(``seqcache.fs.import_beam`` in one of seqcache's own processes: without
pandas and pymongo, with its object-store clients deferred), so that each
worker starts sooner.

``runner.local_engine`` starts workers with ``python -m seqcache.pipelines.worker_main``
instead of ``python -m apache_beam.runners.worker.sdk_worker_main``; the
arguments and the environment are Beam's. With ``--warm`` (``warm_workers``)
the process is started before the pipeline exists, or forked from the command
on Linux, where ``warm_workers`` calls ``main`` in the child, Beam imported
already: it also imports what the
build's steps need, then waits on its standard input for the environment
Beam gives a worker, and exits quietly if the input ends first; until then it
ignores SIGINT (Ctrl-C reaches the whole process group, and the command, which
handles it, closes that input).
"""

import gc
import os
import signal
import sys

if "--warm" in sys.argv[1:]:
    # Until it has work, a warm process leaves Ctrl-C to its command (which then
    # closes its standard input): no traceback from an import cut short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

from seqcache import fs  # noqa: E402


def main(argv=None) -> None:
    """Runs Beam's worker until its runner closes the control channel; then the
    objects left are frozen (``gc.freeze``), so that the process exits without
    walking them in its cyclic garbage collections (about 0.2 s that the
    runner waits for at the end of a build). The process is seqcache's own
    (``seqcache.fs.own_process``)."""
    argv = list(sys.argv if argv is None else argv)
    warm = "--warm" in argv[1:]  # warm_workers.WARM_FLAG (imported below, after Beam)
    fs.own_process()
    fs.tune_allocator()
    fs.import_beam()
    from apache_beam.runners.worker import sdk_worker_main

    from seqcache.pipelines import warm_workers

    if warm:
        # What unpickling the build's steps imports anyway, before there is work.
        import sentencepiece  # noqa: F401
        import seqcache.pipelines.transforms  # noqa: F401
        import seqcache.tasks  # noqa: F401

    fs.freeze_heap()  # what is imported by now lives as long as the worker
    if warm:
        env = warm_workers.wait_for_environment()
        if env is None:
            return
        os.environ.clear()
        os.environ.update(env)
        argv = [argv[0]]
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a worker now, as a cold one
    try:
        sdk_worker_main.main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
