"""The ``seqcache`` executable (also ``python -m seqcache.cli``): its first statement installs the handling of SIGINT and
SIGTERM (``seqcache.cli.interrupts``), before the command line's modules are
imported (click, then a command's own: rich and the tasks, about 0.25 s of
CPU; Beam's 0.6 s more for ``build``), so that a signal at any moment ends
the command with one line and status 130 or 143 instead of killing it
without a word midway through an import (status -15)."""

from __future__ import annotations

import sys

from seqcache.cli import interrupts


def run() -> None:
    """Runs the command line (``seqcache.cli.main.run``) with SIGINT and SIGTERM
    handled from the start; an interrupt that no command reports itself (one
    while the command line's modules load or ``build`` starts its worker
    processes, which are then killed) is one line on standard error and exit
    status 130 or 143 (``interrupts.exit_status``). Once the command has
    ended, a signal ends the process at once (``interrupts.exit_at_once``);
    an interrupted one ends through ``interrupts.end_process``, with the
    status the command gave, or 130 or 143 and the line "interrupted"
    when it failed otherwise after the signal (``interrupts.status_after``).

    Raises:
      SystemExit: with the command's exit status (when no signal came).
    """
    status = 0
    interrupts.install()
    try:
        from seqcache.cli import main as cli  # after the handlers: a signal while the command line loads is handled

        cli.run()
    except KeyboardInterrupt:
        interrupts.kill_descendants()  # a worker process ``build`` was starting ahead when the signal came
        interrupts.say_interrupted()
        status = interrupts.exit_status()
    except SystemExit as e:
        if interrupts.received() is None:
            raise
        status = e.code
    finally:
        interrupts.exit_at_once()
    if interrupts.received() is None:
        sys.exit(status)
    interrupts.end_process(interrupts.status_after(status))  # not the interpreter's exit, which may end with SIGINT
