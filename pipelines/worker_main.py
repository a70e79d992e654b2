"""A worker process of Beam's local engine (``--direct_running_mode=multi_processing``):
Beam's own ``sdk_worker_main``, with Beam imported as the build imports it
(``seqcache.fs.import_beam``: without pandas, about 0.65 s of CPU less per
worker, before any work).

``runner.local_engine`` starts workers with ``python -m seqcache.pipelines.worker_main``
instead of ``python -m apache_beam.runners.worker.sdk_worker_main``; the
arguments and the environment are Beam's.
"""

import sys

from seqcache import fs


def main(argv=None) -> None:
    fs.import_beam()
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main(sys.argv if argv is None else argv)


if __name__ == "__main__":
    main()
