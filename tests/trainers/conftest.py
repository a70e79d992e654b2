"""The real-trainer tests run in venvs of their own (``make test-trainers``,
tests/trainers/run.sh), never in the default suite: collected only when
SEQCACHE_TRAINER_WORK names the work folder that run.sh sets."""

import os

if not os.environ.get("SEQCACHE_TRAINER_WORK"):
    collect_ignore_glob = ["*"]
