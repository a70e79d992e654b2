"""The ``seqcache`` command line (click).

Each command lives in its own module under ``seqcache/commands``; this module only
assembles the group and imports a command's module only when that command runs,
so that ``seqcache --help`` stays fast.
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

from seqcache import __version__, fs  # noqa: E402
from seqcache import format as fmt  # noqa: E402
from seqcache.commands import common  # noqa: E402
from seqcache.tasks.vocabularies import encoding_threads  # noqa: E402

# Every command: name -> (module under seqcache.commands, attribute, the first
# sentence of its help, which ``seqcache --help`` lists without importing it).
_COMMANDS = {
    "build": ("build", "build", "Build the deterministic cache of NAME (a registered task or mixture), or of an "
              "ad-hoc task given by --source/--vocabulary/--name."),
    "export": ("export", "export", "Write the Feeder's global stream, steps S..S+STEPS-1, as files another trainer "
               "reads in that order (S = 0, or the step of a saved feeder state)."),
    "info": ("inspect", "info", "Summarise the cache at CACHE_DIR (a folder with manifest.json: a local path, or a "
             "gs:// or s3:// URL)."),
    "overlap": ("overlap", "overlap", "Find the examples of CACHE_OR_MIXTURE that share an n-gram of normalised words "
                "with an item of BENCHMARK_SPEC, and when a run reads them first."),
    "report": ("report", "report", "Write a self-contained HTML report of a cache: example lengths against the "
               "sequence length, packing efficiency, tokens and examples per source file, skipped and repaired "
               "records, shard sizes; for a mixture or a saved feeder state, each task's share of the first steps "
               "and the epoch it reaches; with --overlap FILE, a result of `seqcache overlap`: the benchmark items "
               "found in the caches and the step at which the run first reads each."),
    "scan": ("scan", "scan", "Count every kind of bad input in the sources of NAME (a registered task or mixture) "
             "or of an ad-hoc --source, without building anything."),
    "show": ("inspect", "show", "Decode examples of the cache at CACHE_DIR (a local path, or a gs:// or s3:// URL), "
             "with their provenance."),
    "tasks": ("inspect", "tasks_cmd", "List registered tasks and mixtures."),
    "train": ("train", "train", "Train a decoder-only or a T5 encoder-decoder model on a cache with the "
              "exactly-once feeder (the model reads the cache through the feature converter that fits its "
              "features: lm, prefix_lm or encdec)."),
    "verify": ("inspect", "verify", "Check every shard of CACHE_DIR (a local path, or a gs:// or s3:// URL): "
               "counts, checksums, decodability."),
    "vocab": ("vocab", "vocab", "Train a vocabulary (SentencePiece, or a tokenizers BPE/Unigram tokenizer.json) or "
              "encode text with one."),
    "which": ("which", "which", "Show what row ROW of global batch STEP was: task, cache index, source file and "
              "record number of each segment, and the decoded text."),
}


class _Commands(click.Group):
    """The command group; a command's module is imported when the command runs
    or shows its help. An interrupt (Ctrl-C, or SIGTERM where a command turns
    it into one) that a command does not report itself, such as one during its
    start-up, exits with 130 and says so, instead of click's "Aborted!" and 1.
    A ``seqcache.format.CacheError`` or ``FeederStateError`` that a command does
    not report itself is one ``error:`` line on standard error and exit status 1."""

    def list_commands(self, ctx):
        return sorted({*_COMMANDS, *self.commands})

    def get_command(self, ctx, name):
        if name not in self.commands and name in _COMMANDS:
            module, attr, _ = _COMMANDS[name]
            self.add_command(getattr(importlib.import_module(f"seqcache.commands.{module}"), attr), name)
        return self.commands.get(name)

    def format_commands(self, ctx, formatter):
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        with formatter.section("Commands"):
            formatter.write_dl([(n, self.commands[n].get_short_help_str(limit) if n in self.commands
                                 else click.utils.make_default_short_help(_COMMANDS[n][2], limit)) for n in names])

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Exception as e:
            if not _is_damaged_input(e):
                raise
            common.print_error(e)
            sys.exit(1)
        except KeyboardInterrupt:
            common.write_stderr("interrupted\n")  # standard error may have been taken from Beam's workers
            sys.exit(130)


def _is_damaged_input(error: BaseException) -> bool:
    """Whether ``error`` is a ``CacheError`` or, once the feeders are imported, a ``FeederStateError``."""
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
    try:
        encoding_threads()
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def run():
    """The ``seqcache`` executable: runs the command line (``main``), then
    exits without the interpreter's cyclic garbage collections at exit.

    The objects left when a command ends (Beam's, protobuf's, the caches'
    tables: well over 100,000) are frozen (``gc.freeze``) as the command
    returns, so that finalisation does not walk them again and again: about
    0.2 s of every command that imports Beam. Every file a command writes is
    closed before it returns; atexit handlers still run. The process is
    seqcache's own (``seqcache.fs.own_process``)."""
    fs.own_process()
    try:
        main()
    finally:
        gc.freeze()


if __name__ == "__main__":
    run()
