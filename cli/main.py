"""The ``seqcache`` command line (click): the group of the commands in
``cli/commands``, each module imported only when its command runs (or shows
its help). The group itself imports click and little else: ``seqcache
--help`` and ``--version`` load neither the tasks, numpy, rich nor Beam.
"""

from __future__ import annotations

import runpy

if __name__ == "__main__":
    # ``python -m seqcache.cli.main``, like ``python -m seqcache.cli`` (cli/__main__.py), is the
    # executable, whose first statement handles SIGINT and SIGTERM: before the imports below.
    runpy.run_module("seqcache.cli", run_name="__main__")

import ast  # noqa: E402
import gc  # noqa: E402
import importlib  # noqa: E402
import importlib.resources  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

# numpy's OpenBLAS starts a thread per core when numpy is imported, and each of
# them spins for about 0.1 s of CPU before it sleeps; no command here multiplies
# matrices with numpy (JAX has its own). One BLAS thread, unless the user asks for
# more: numpy is first imported by a command's module, so this comes first. The
# local engine's worker processes inherit it (seqcache.pipelines.runner).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import click  # noqa: E402

from seqcache import __version__, process  # noqa: E402
from seqcache.cli import interrupts  # noqa: E402
from seqcache.pipelines import workers  # noqa: E402

# Every command: name -> (module under seqcache.cli.commands, attribute).
_COMMANDS = {"build": ("build", "build"), "clean": ("clean", "clean"), "eval": ("evaluate", "eval_cmd"),
             "export": ("export", "export"),
             "infer": ("evaluate", "infer"), "info": ("inspect", "info"),
             "overlap": ("overlap", "overlap"), "report": ("report", "report"), "scan": ("scan", "scan"),
             "show": ("inspect", "show"), "tasks": ("inspect", "tasks_cmd"), "train": ("train", "train"),
             "verify": ("inspect", "verify"), "vocab": ("vocab", "vocab"), "which": ("which", "which")}


def _help(name: str) -> str:
    """A command's help (its function's docstring), read from its module's source without importing it."""
    module, attr = _COMMANDS[name]
    source = importlib.resources.files("seqcache.cli.commands").joinpath(f"{module}.py").read_text(encoding="utf-8")
    return ast.literal_eval(re.search(rf'^def {attr}\(.*?(""".*?""")', source, re.S | re.M).group(1))


class _Commands(click.Group):
    """The command group; a command's module is imported when the command runs
    or shows its help. An interrupt (Ctrl-C, or SIGTERM: ``seqcache.cli.interrupts``)
    that a command does not report itself, such as one during its start-up,
    exits with 130 (143 after SIGTERM) and says so in one line, "interrupted"
    ("interrupted by SIGTERM"), instead of click's "Aborted!" and 1.
    Values longer than a few hundred characters are cut in the messages of
    click's usage errors, as in every ``error:`` line (``common.cut_values``).
    A ``seqcache.format.CacheError`` or ``FeederStateError`` that a command does
    not report itself is one ``error:`` line on standard error and exit status 1,
    and so is a ``--module`` that raised while it was imported
    (``seqcache.tasks.registry.DefinitionsError``; with ``-v``/``--verbose``
    its traceback first)."""

    def list_commands(self, ctx):
        return sorted({*_COMMANDS, *self.commands})

    def get_command(self, ctx, name):
        if name not in self.commands and name in _COMMANDS:
            module, attr = _COMMANDS[name]
            self.add_command(getattr(importlib.import_module(f"seqcache.cli.commands.{module}"), attr), name)
        return self.commands.get(name)

    def format_commands(self, ctx, formatter):  # the commands' summaries, without importing them
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(n, self.commands[n].get_short_help_str(limit) if n in self.commands
                 else click.utils.make_default_short_help(_help(n), limit)) for n in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.ClickException as e:
            _cut_values(e)
            raise
        except KeyboardInterrupt:
            _exit_interrupted()

    def invoke(self, ctx):
        args = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # the command's name and arguments
        try:
            return super().invoke(ctx)
        except click.ClickException as e:  # a usage error: click prints it
            _cut_values(e)
            raise
        except Exception as e:
            definitions = _is_definitions_error(e)
            if not (definitions or _is_damaged_input(e)):
                raise
            if definitions and {"-v", "--verbose"} & set(args):  # a --module that raised while it was imported
                traceback.print_exception(e.__cause__ or e, file=sys.stderr)
            _common().print_error(e)
            sys.exit(1)
        except KeyboardInterrupt:
            _exit_interrupted()


def _common():
    """``seqcache.cli.commands.common``, for an error line."""
    from seqcache.cli.commands import common  # rich and the tasks: only for an error line, not for `seqcache --help`

    return common


def _cut_values(error: click.ClickException) -> None:
    """Cuts the long values in the message click will print (``common.cut_values``)."""
    error.message = _common().cut_values(error.message)


def _exit_interrupted():
    """One line, "interrupted" or "interrupted by SIGTERM", and exit status 130 or 143."""
    interrupts.say_interrupted()  # to the real standard error, which may have been taken from Beam's workers
    sys.exit(interrupts.exit_status())


def _is_damaged_input(error: BaseException) -> bool:
    """Whether ``error`` is a ``CacheError`` or a ``FeederStateError`` (either
    module is imported once such an error can be raised)."""
    codec, compat = sys.modules.get("seqcache.codec"), sys.modules.get("seqcache.feeders.compat")
    return (codec is not None and isinstance(error, codec.CacheError)) or \
        (compat is not None and isinstance(error, compat.FeederStateError))


def _is_definitions_error(error: BaseException) -> bool:
    """Whether ``error`` is a ``DefinitionsError``: a ``--module`` that raised
    while it was imported (``seqcache.tasks.registry``, imported by then)."""
    registry = sys.modules.get("seqcache.tasks.registry")
    return registry is not None and isinstance(error, registry.DefinitionsError)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="seqcache")
def main():
    """Deterministic token caches and exactly-once feeders for LM training."""
    if not {"-h", "--help"} & set(sys.argv[1:]):  # a command's help is shown whatever the environment
        _check_environment()


def _check_environment() -> None:
    """Refuses, before any command runs, a ``SEQCACHE_ENCODING_THREADS`` that is
    not a positive integer (a click.ClickException naming it), which would fail a command midway."""
    from seqcache.tasks.vocabularies import encoding_threads  # the tasks: not for `seqcache --help` or `--version`

    try:
        encoding_threads()
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def run():
    """The command line, as the ``seqcache`` executable runs it once it handles
    SIGINT and SIGTERM (``seqcache.cli.executable``): ``main``, in a process of
    seqcache's own (``seqcache.process.own_process``), then freezes the objects
    left (``gc.freeze``: often over 100,000 of Beam's and protobuf's) so that
    finalisation does not walk them again and again, about 0.2 s of every
    command that imports Beam.
    ``seqcache build``'s local worker processes start first, to import while
    the command does (``seqcache.pipelines.workers.start_ahead``)."""
    process.own_process()
    if sys.argv[1:2] == ["build"]:
        workers.start_ahead(sys.argv[2:])
    try:
        main()
    finally:
        gc.freeze()
