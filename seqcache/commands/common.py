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
