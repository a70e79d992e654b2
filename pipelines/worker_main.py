"""A worker process of Beam's local engine (``--direct_running_mode=multi_processing``):
Beam's own ``sdk_worker_main``, with Beam imported as the build imports it
(``seqcache.process.import_beam``: without pandas). ``runner.local_engine`` starts
it instead of Beam's; the arguments and the environment are Beam's.
"""

import gc
import sys

from seqcache import process

process.import_beam()  # before Beam's modules below (already done by the package's import of runner.py)
from apache_beam.runners.worker import sdk_worker_main  # noqa: E402


def main(argv=None) -> None:
    """Runs Beam's worker, in a process of seqcache's own (``process.own_process``),
    until its runner closes the control channel; then the objects left are
    frozen (``gc.freeze``), so that the exit does not walk them (about 0.2 s)."""
    argv = list(sys.argv if argv is None else argv)
    process.own_process()
    process.tune_allocator()
    process.freeze_heap()  # what is imported by now lives as long as the worker
    try:
        sdk_worker_main.main(argv)
    finally:
        gc.freeze()


if __name__ == "__main__":
    main()
