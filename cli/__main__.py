"""``python -m seqcache.cli`` (how ``seqcache train`` starts its processes): the
``seqcache`` executable, whose first statement handles SIGINT and SIGTERM."""

from seqcache.cli.executable import run

run()
