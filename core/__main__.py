"""``python -m seqcache``: the ``seqcache`` command."""

from seqcache.executable import run

run()
