"""The ``seqcache`` command line (click).

Each command lives in its own module under ``seqcache/commands``; this module only
assembles the group. Commands import heavy dependencies (Beam, JAX) lazily so that
``seqcache --help`` stays fast.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys

# numpy's OpenBLAS starts a thread per core when numpy is imported, and each of
# them spins for about 0.1 s of CPU before it sleeps; no command here multiplies
# matrices with numpy (JAX has its own). One BLAS thread, unless the user asks for
# more: numpy is first imported below, so this comes first. The local engine's
# worker processes inherit it (seqcache.pipelines.runner).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from seqcache import __version__  # noqa: E402

# (module under seqcache.commands, attribute): every command the CLI offers.
_COMMANDS = (
    ("build", "build"),
    ("scan", "scan"),
    ("inspect", "info"),
    ("inspect", "show"),
    ("inspect", "verify"),
    ("inspect", "tasks_cmd"),
    ("vocab", "vocab"),
    ("which", "which"),
    ("overlap", "overlap"),
    ("export", "export"),
    ("report", "report"),
    ("train", "train"),
)


class _Commands(click.Group):
    """The command group; an interrupt (Ctrl-C, or SIGTERM where a command turns
    it into one) that a command does not report itself, such as one during its
    start-up, exits with 130 and says so, instead of click's "Aborted!" and 1.
    A ``seqcache.format.CacheError`` or ``FeederStateError`` that a command does
    not report itself is one ``error:`` line on standard error and exit status 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as e:
            if not _is_damaged_input(e):
                raise
            # A damaged cache or feeder state that a command did not report
            # itself: one line, as the commands report them, never a traceback.
            from seqcache.commands import common

            common.print_error(e)
            sys.exit(1)
        except KeyboardInterrupt:
            from seqcache.commands import common  # standard error may have been taken from Beam's workers

            common.write_stderr("interrupted\n")
            sys.exit(130)


def _is_damaged_input(error: BaseException) -> bool:
    """Whether ``error`` is a ``seqcache.format.CacheError`` or a
    ``FeederStateError`` (the feeders package is not imported for this: no
    such error exists before it is)."""
    from seqcache import format as fmt

    compat = sys.modules.get("seqcache.feeders.compat")
    return isinstance(error, fmt.CacheError) or (compat is not None and isinstance(error, compat.FeederStateError))


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="seqcache")
def main():
    """Deterministic token caches and exactly-once feeders for LM training."""
    if not {"-h", "--help"} & set(sys.argv[1:]):  # a command's help is shown whatever the environment
        _check_environment()


def _check_environment() -> None:
    """Refuses, before any command runs, an environment variable of seqcache's
    that would fail it midway (``SEQCACHE_ENCODING_THREADS`` that is not a
    positive integer: ``seqcache.tasks.vocabularies.encoding_threads``).

    Raises:
      click.ClickException: one line naming the variable.
    """
    from seqcache.tasks.vocabularies import encoding_threads

    try:
        encoding_threads()
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _register():
    for module_name, attr in _COMMANDS:
        try:
            module = importlib.import_module(f"seqcache.commands.{module_name}")
        except ModuleNotFoundError as e:
            if e.name == f"seqcache.commands.{module_name}":
                continue  # an area that is not installed in this build
            raise
        main.add_command(getattr(module, attr))


_register()


def run():
    """The ``seqcache`` executable: runs the command line (``main``), then
    exits without the interpreter's cyclic garbage collections at exit.

    The objects left when a command ends (Beam's, protobuf's, the caches'
    tables: well over 100,000) are frozen (``gc.freeze``) as the command
    returns, so that finalisation does not walk them again and again: about
    0.2 s of every command that imports Beam. Every file a command writes is
    closed before it returns; atexit handlers still run. The process is
    seqcache's own (``seqcache.fs.own_process``)."""
    from seqcache import fs

    fs.own_process()
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    run()
