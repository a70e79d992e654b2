"""``python -m seqcache``: the ``seqcache`` command."""

from seqcache.cli import run

run()
