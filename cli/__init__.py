"""seqcache.cli: the application on top of the areas: the ``seqcache``
executable and its command line.

  seqcache.cli.executable  the entry point (``seqcache``, ``python -m seqcache.cli``):
                           SIGINT and SIGTERM handled from its first statement
  seqcache.cli.interrupts  that handling
  seqcache.cli.main        the click group (``main``) and ``run``
  seqcache.cli.commands    one module per command, imported when it runs
  seqcache.cli.verify      ``seqcache verify``'s checks of a cache
  seqcache.cli.report      ``seqcache report``'s numbers, ``report_html`` its page
  seqcache.cli.url_reader  a cache reader for caches at a URL (``seqcache show``)

This file imports nothing: the executable imports ``interrupts`` before any
other module of the command line (docs/architecture.md).
"""
