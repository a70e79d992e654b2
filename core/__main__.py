"""``python -m seqcache``: the ``seqcache`` command."""

from seqcache.cli.executable import run

run()
