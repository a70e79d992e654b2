"""Small helpers shared by the CLI commands (consoles, progress, cache lookup)."""

from __future__ import annotations

import contextlib
import os

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


def stderr_console() -> Console:
    return Console(stderr=True, soft_wrap=True)


@contextlib.contextmanager
def shard_progress(console: Console, label: str):
    """A progress bar of shards written; yields the callback a build reports to."""
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("shards"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as progress:
        task_id = progress.add_task(f"building {label}", total=None)

        def update(done: int, total: int):
            progress.update(task_id, completed=done, total=total)

        yield update


def resolve_cache(path: str) -> str:
    """Accepts a cache folder (with manifest.json) and returns it; errors clearly."""
    if not os.path.isdir(path):
        raise click.UsageError(f"{path}: no such cache folder")
    return path


def plural(n: int, word: str) -> str:
    """``plural(1, "shard")`` -> "1 shard"; ``plural(3, "shard")`` -> "3 shards"."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM raises KeyboardInterrupt while the block runs, so that a terminated
    build cleans up like a Ctrl-C one (and Beam shuts its workers down)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _on_error_parser(base: tuple[str, ...]):
    def parse(ctx, param, values):
        from seqcache.tasks import parse_on_error

        try:
            return parse_on_error([*base, *values] or ["raise"])
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return parse


ON_ERROR_HELP = (
    "Bad source records: 'raise' (the default: fail naming the file and record), 'skip' (leave them out, "
    "counted and listed in the cache's quarantine file) or 'replace' (repair what can be repaired: bad UTF-8 "
    "and control characters -> U+FFFD, a CR inside a line -> newline, U+2581 -> space; skip the rest). "
    "KIND=ACTION sets one kind: invalid_utf8, carriage_return, control_characters, u2581, empty, whitespace, "
    "malformed, missing_field, bad_value; ACTION is raise, skip, replace or keep (accept as is). Repeatable, "
    "e.g. --on-error empty=skip --on-error control_characters=keep."
)


def on_error_option(help_text: str = ON_ERROR_HELP, *, base: tuple[str, ...] = ()):
    """The ``--on-error`` option: repeatable, parsed into an ``ErrorPolicy`` spec;
    ``base`` values come first, so the user's values override them."""
    return click.option("--on-error", "on_error", multiple=True, metavar="ACTION|KIND=ACTION",
                        callback=_on_error_parser(base), help=help_text)
