"""Small helpers shared by the CLI commands (consoles, progress, cache lookup)."""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
import sys
import threading
from typing import Any, Mapping

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from seqcache import fs, lengths, process
from seqcache.cli import interrupts
from seqcache.pipelines import beam_text  # the standard library only: no Beam
from seqcache.tasks import Mixture, get_task_or_mixture, import_definitions, parse_on_error
from seqcache.tasks.near_duplicates import NearDuplicates, ParameterError


def stderr_console(file=None) -> Console:
    """A rich console on standard error (or on ``file``, a text stream); it
    never replaces emoji codes (``:smile:``), which a path may hold."""
    if file is not None:
        return Console(file=file, soft_wrap=True, emoji=False)
    return Console(stderr=True, soft_wrap=True, emoji=False)


def styled(style: str, head: str, tail: str = "") -> Text:
    """A line for a rich console: ``head`` in ``style`` (rich style words:
    ``"red"``, ``"bold"``), then ``tail``, both shown exactly as they are.

    What a user, a file or a manifest wrote (a path, a task name, an error
    message) goes into a printed line through here, or as a table cell printed
    with ``markup=False``: a rich markup string would read its ``[/]`` or
    ``[red]`` as tags (a ``MarkupError``, or text silently dropped), and
    ``rich.markup.escape`` drops the backslash of ``\\[``. A ``Text`` is
    neither parsed for markup nor for emoji codes.
    """
    return Text.assemble((head, style), tail)


@contextlib.contextmanager
def shard_progress(console: Console, label: str):
    """Progress bars of a build: work units done (those found done in the
    work folder named as reused) and shards written. Yields the callback of
    shards (``update(written, num_shards)``), whose ``units`` attribute is
    that of units (``units(reused, done, total)``)."""
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", style="bold", markup=False),  # a task or folder name: not markup
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[what]}", markup=False),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
        # sys.stderr stays as it is: a proxy onto the console would bypass ``worker_stderr``.
        redirect_stdout=False,
        redirect_stderr=False,
    ) as progress:
        unit_id = progress.add_task(f"reading {label}", total=None, what="work units", visible=False)
        task_id = progress.add_task(f"building {label}", total=None, what="shards")

        def update(done: int, total: int):
            progress.update(task_id, completed=done, total=total)

        def units(reused: int, done: int, total: int):
            what = f"work units ({reused} reused)" if reused else "work units"
            progress.update(unit_id, completed=done, total=total, what=what, visible=True)

        update.units = units
        yield update


# info, show and verify take Beam pipeline options (an object store's endpoint and credentials) as --flag=value.
BEAM_OPTIONS_CONTEXT = {"ignore_unknown_options": True, "allow_extra_args": True}

BEAM_OPTIONS_EPILOG = (
    "Any other --flag=value is a Beam pipeline option for the file system of a URL CACHE_DIR, for example "
    "--s3_endpoint_url=http://127.0.0.1:9000 --s3_access_key_id=... --s3_secret_access_key=... "
    "--s3_region_name=us-east-1; without them boto3's own settings apply (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
    "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, ~/.aws)."
)


def filesystem_options(args) -> list[str]:
    """Checks the free arguments of a cache-reading command (Beam pipeline
    options, ``--flag=value``) and hands them to Beam's FileSystems
    (``seqcache.fs.set_options``); imports Beam only when there are any.

    Raises:
      click.UsageError: an argument that is not ``--flag[=value]``, or a flag
        that no Beam option has (a typo would otherwise be ignored).
    """
    args = list(args)
    if not args:
        return args
    for a in args:
        if not a.startswith("--") or a == "--":
            raise click.UsageError(
                f"unexpected argument {a!r}: give one CACHE_DIR; Beam options take the --flag=value form"
            )
    options = process.import_beam().options.pipeline_options.PipelineOptions([])
    known = set(options.get_all_options(drop_default=False))
    unknown = [a for a in args if a[2:].partition("=")[0].replace("-", "_") not in known]
    if unknown:
        raise click.UsageError(
            f"no such option: {', '.join(unknown)} (options other than this command's own are Beam pipeline "
            "options, e.g. --s3_endpoint_url=...)"
        )
    fs.set_options(args)
    return args


# The most characters of one value (a path, a name, an argument) that an error
# line repeats; a longer one keeps its first VALUE_HEAD and last VALUE_TAIL
# characters and says how long it was (``cut_value``).
VALUE_LIMIT = 300
VALUE_HEAD, VALUE_TAIL = 200, 60
# The most characters of a whole error line once its values are cut (many short
# values, a list of thousands of paths): longer keeps its first MESSAGE_HEAD.
MESSAGE_LIMIT, MESSAGE_HEAD = 2000, 1600
# A run of more than VALUE_LIMIT characters without a space: a path or a name
# that a message was built with (its quotes and brackets are left outside the cut).
_LONG_RUN = re.compile(r"(?P<open>['\"(\[{<]*)(?P<value>[^\s\ue000\ue001]{%d,}?)(?P<close>['\")\]}>,;:]*)"
                       r"(?=[\s\ue000]|$)" % (VALUE_LIMIT + 1))


def cut_value(value: str, length: int | None = None) -> str:
    """``value`` as an error line shows it: as it is up to ``VALUE_LIMIT``
    characters; a longer one as its first ``VALUE_HEAD`` and last
    ``VALUE_TAIL`` characters around ``...``, then how long it was:
    ``/data/aaaa...aaaa.txt [120,000 characters]`` (``length``: the length to
    state, when ``value`` is a form of a longer or shorter original)."""
    if len(value) <= VALUE_LIMIT:
        return value
    return f"{value[:VALUE_HEAD]}...{value[-VALUE_TAIL:]} [{len(value) if length is None else length:,} characters]"


def cut_values(message, values=None) -> str:
    """``message`` with each value in it longer than ``VALUE_LIMIT`` characters
    cut by ``cut_value``, so that a 120 KB ``--cache-dir`` makes an error line
    of a few hundred characters that still says which value it was and how
    long: every one of ``values`` (default: the command's arguments and the
    option values of click's current context) that the message holds, as it
    is or as ``repr`` writes it inside quotes (a value may hold spaces), then
    any other run of more than ``VALUE_LIMIT`` characters without a space (a
    path or a name the message was built from, such as a file beside the
    cache folder). Every ``error:`` line of the command line goes through
    here (``print_error``, ``fail``, ``error_line``'s text when printed, the
    training commands' ``fail_line``, and click's usage errors)."""
    text = str(message)
    if len(text) <= VALUE_LIMIT:
        return text
    given = _given_values() if values is None else values
    cuts: list[str] = []
    for value in sorted({v for v in given if isinstance(v, str) and len(v) > VALUE_LIMIT}, key=len, reverse=True):
        for form in dict.fromkeys((value, repr(value)[1:-1])):
            if form in text:  # a placeholder without spaces or long runs stands for the cut value until the end
                cuts.append(cut_value(form, len(value)))
                text = text.replace(form, f"\ue000{len(cuts) - 1}\ue001")
    text = _LONG_RUN.sub(lambda m: m["open"] + cut_value(m["value"]) + m["close"], text)
    text = re.sub("\ue000([0-9]+)\ue001", lambda m: cuts[int(m[1])], text)
    if len(text) > MESSAGE_LIMIT:  # many short values (a list of paths): the line's middle goes
        text = f"{text[:MESSAGE_HEAD]} ... {text[-VALUE_TAIL:]} [{len(text):,} characters in all]"
    return text


def _given_values() -> list:
    """The command line's arguments and the option and argument values of
    click's current context and its parents (what a user typed, with spaces
    if it had any)."""
    values = list(sys.argv[1:])
    ctx = click.get_current_context(silent=True)
    while ctx is not None:
        for value in [*ctx.params.values(), *ctx.args]:
            values.extend(value if isinstance(value, (list, tuple)) else [value])
        ctx = ctx.parent
    return values


def print_error(message, console: Console | None = None) -> None:
    """``error: MESSAGE`` on standard error, the message printed as is (no
    markup), with values longer than ``VALUE_LIMIT`` cut (``cut_values``)."""
    (console or stderr_console()).print(styled("red", "error:", f" {cut_values(message)}"), highlight=False)


def fail(message) -> None:
    """``error: MESSAGE`` on standard error, and exit status 1."""
    print_error(message)
    sys.exit(1)


def plural(n: int, word: str) -> str:
    """``plural(1, "shard")`` -> "1 shard"; ``plural(3, "shard")`` -> "3 shards"."""
    return f"{n:,} {word}" + ("" if n == 1 else "s")


# The most rows a table of `seqcache info`, `show` or `report` shows, and the
# most items a list in one of its cells names; the rest is one "… and K more"
# (`--json` gives every one). What a manifest holds is bounded by its reader,
# not by what a terminal or a page can show: a hand-edited one once made
# `info` print 100,000 rows in 28 s.
MAX_ROWS = 100


class CutTable(Table):
    """A rich ``Table`` whose text cells (and title) are cut as error lines
    cut values (``cut_value``: at most ``VALUE_LIMIT`` characters, then the
    full length), so that a manifest's 10 MB task name prints one row, not
    thousands of wrapped lines."""

    def __init__(self, *columns, title=None, **kwargs):
        if isinstance(title, (str, Text)):
            title = Text(cut_value(str(title)), style=title.style if isinstance(title, Text) else "")
        super().__init__(*columns, title=title, **kwargs)

    def add_row(self, *cells, **kwargs) -> None:
        super().add_row(*(cut_value(c) if isinstance(c, str) else c for c in cells), **kwargs)


def head(items, limit: int = MAX_ROWS) -> tuple[list, str | None]:
    """(the first ``limit`` of ``items``, ``"… and K more"`` or None when
    there are no more)."""
    items = items if isinstance(items, (list, tuple)) else list(items)
    if len(items) <= limit:
        return list(items), None
    return list(items[:limit]), f"… and {len(items) - limit:,} more"


def joined(items, limit: int = MAX_ROWS) -> str:
    """``", ".join`` of the first ``limit`` of ``items`` (strings), then "… and K more"."""
    shown, more = head(items, limit)
    return ", ".join(shown + ([more] if more else []))


def _stderr_is_fd2() -> bool:
    """Whether ``sys.stderr`` writes to file descriptor 2 (not under click's test runner)."""
    try:
        return sys.stderr.fileno() == 2
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return False


def stdout_for_output_only() -> None:
    """For the rest of the process, file descriptor 1 is the standard error,
    and ``sys.stdout`` (what ``click.echo`` and ``print`` write to) alone
    writes to the real standard output, through a copy of its descriptor.

    Libraries print to descriptor 1 from C and C++, beyond ``sys.stdout``:
    Gloo, the CPU collectives of a multi-process JAX run, prints ``[Gloo] Rank
    0 is connected to 1 peer ranks. ...`` whenever it connects a group of
    devices, which happens during the run, not only at
    ``jax.distributed.initialize``. A command whose standard output is its
    result (``seqcache eval``'s one JSON line) calls this before JAX starts, so
    that those messages go to the standard error; child processes inherit
    descriptor 1 as it is then. Nothing is changed when ``sys.stdout`` is not
    descriptor 1 (click's test runner) or the descriptors cannot be copied.
    """
    try:
        if sys.stdout.fileno() != 1:
            return
        sys.stdout.flush()
        saved = os.dup(1)
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return
    try:
        os.dup2(2, 1)
    except OSError:
        os.close(saved)
        return
    old = sys.stdout
    sys.stdout = open(saved, "w", encoding=old.encoding, errors=old.errors, buffering=1)


def _drain(read_fd: int, write_fd: int) -> None:
    """Copies ``read_fd`` to ``write_fd`` until end of file, dropping the bytes once a write fails."""
    broken = False
    try:
        while chunk := os.read(read_fd, 65536):
            while chunk and not broken:
                try:
                    chunk = chunk[os.write(write_fd, chunk):]
                except OSError:
                    broken = True
    finally:
        os.close(read_fd)
        os.close(write_fd)


@contextlib.contextmanager
def worker_stderr(*, verbose: bool):
    """Takes file descriptor 2 away from Beam for the length of a build; yields
    a text stream on the real standard error for the command's own messages.

    Beam's local engine writes outside of ``logging``'s reach: its SDK worker
    subprocesses inherit descriptor 2 and log to it before they read the
    pipeline options, and a worker ``print``-s a failed bundle's traceback to
    ``sys.stderr``; if that write fails (``2>&1 | head`` exited) the worker
    never answers and the runner waits forever. So descriptor 2 itself is
    redirected: to ``os.devnull`` (``verbose=False``; seqcache's own warnings
    still reach the yielded stream) or to a pipe that a thread copies to the
    real standard error and keeps draining once its reader is gone
    (``verbose=True``).

    Descriptor 2 is restored when the block ends normally or with an
    unexpected error (so its traceback is shown); after ``SystemExit`` or
    ``KeyboardInterrupt`` it stays redirected, as only Beam's teardown still
    writes, and the command's last words go through ``write_stderr``. When
    ``sys.stderr`` is not descriptor 2 (click's test runner) nothing is
    redirected and ``sys.stderr`` is yielded.
    """
    if not _stderr_is_fd2():
        yield sys.stderr
        return
    sys.stderr.flush()
    saved = os.dup(2)
    interrupts.real_stderr_fd = saved
    stream = open(os.dup(saved), "w", encoding=sys.stderr.encoding, errors=sys.stderr.errors or "backslashreplace",
                  buffering=1)
    handler = _redirect_fd2(saved, stream, verbose=verbose)
    restore = True
    try:
        yield stream
    except (SystemExit, KeyboardInterrupt):
        restore = False
        raise
    finally:
        if handler is not None:
            logging.getLogger("seqcache").removeHandler(handler)
        try:
            stream.flush()
        except OSError:
            pass
        if restore:
            sys.stderr.flush()
            os.dup2(saved, 2)
            interrupts.real_stderr_fd = None
            os.close(saved)
        # else ``saved`` stays open for ``write_stderr`` until the process exits.
        try:
            stream.close()
        except OSError:
            pass


def _redirect_fd2(saved: int, stream, *, verbose: bool) -> logging.Handler | None:
    """Points descriptor 2 as ``worker_stderr`` says; returns the log handler to remove afterwards, or None."""
    if verbose:
        read_fd, write_fd = os.pipe()
        threading.Thread(target=_drain, args=(read_fd, os.dup(saved)), name="seqcache-stderr-relay", daemon=True).start()
        os.dup2(write_fd, 2)
        os.close(write_fd)
        return None
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.getLogger("seqcache").addHandler(handler)
    return handler


# The command's last words, to the real standard error (the descriptor
# ``worker_stderr`` saved, if it took descriptor 2 away), from any thread.
write_stderr = interrupts.write_stderr


MODULES_OPTION = click.option("--module", "modules", multiple=True,
                              help="Python module that registers tasks and mixtures (repeatable).")


def schedule_option(help_text: str = "A JSON or YAML file {step: {PATH: rate}}: rates that change at given steps; PATH is "
                    "relative to CACHE_OR_MIXTURE."):
    return click.option("--mixture-schedule", "schedule", type=click.Path(exists=True, dir_okay=False), help=help_text)


def caches_options(*schedule):
    """``--mixture-rate``, ``schedule`` (a ``schedule_option``, or none), ``--cache-dir``, ``--split`` and
    ``--module``: with CACHE_OR_MIXTURE, they name a run's caches (``which.resolve``)."""
    options = [click.option("--mixture-rate", "mixture_rates", multiple=True, metavar="PATH=RATE", help="A cache of "
                            "the mixture and its rate (repeatable); PATH is relative to CACHE_OR_MIXTURE."), *schedule,
               click.option("--cache-dir", help="Root of <task>/<split> caches, when CACHE_OR_MIXTURE is a task or "
                            "mixture name."), click.option("--split", default="train", show_default=True), MODULES_OPTION]
    return lambda f: functools.reduce(lambda g, option: option(g), reversed(options), f)


def given_once(ctx: click.Context, param: click.Parameter, values):
    """A ``multiple=True`` option's callback for an option that takes one value:
    the value (None when absent); given twice, a usage error (click would keep the
    last one without a word)."""
    if len(values) > 1:
        raise click.BadParameter(f"given {len(values)} times ({', '.join(values)}); give it once "
                                 "(a glob or a task module covers several files)", ctx=ctx, param=param)
    return values[0] if values else None


def adhoc_options_given(ctx: click.Context, names) -> list[str]:
    """The options among ``names`` (parameter names) given on the command line,
    as the user spells them (``--on-error``)."""
    out = []
    for name in names:
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            param = next(p for p in ctx.command.params if p.name == name)
            out.append(max(param.opts, key=len))
    return out


def import_modules(modules) -> None:
    """Imports the ``--module`` modules (they register tasks and mixtures); click.UsageError if one fails."""
    for m in modules:
        try:
            import_definitions(m)
        except (ImportError, FileNotFoundError) as e:
            raise click.UsageError(f"--module {m}: cannot import it: {e}") from None


def registered_tasks(name: str) -> list:
    """The tasks of registered task or mixture ``name``; click.UsageError when there is none."""
    try:
        obj = get_task_or_mixture(name)
    except KeyError as e:
        raise click.UsageError(e.args[0] if e.args else str(e)) from None
    return list(obj.get_tasks()) if isinstance(obj, Mixture) else [obj]


def _on_error_parser(base: tuple[str, ...]):
    def parse(ctx, param, values):
        try:
            spec = parse_on_error(list(values))  # None: every kind's default
            if not base:
                return spec
            merged = dict(parse_on_error(list(base)))  # the user's values override the command's own
            merged.update({"default": spec} if isinstance(spec, str) else spec or {})
            return merged
        except ValueError as e:
            raise click.BadParameter(str(e)) from None

    return parse


ON_ERROR_HELP = (
    "Bad source records. By default empty and whitespace-only records are skipped (counted, and listed in the "
    "cache's quarantine file), control characters and U+2581 are kept (counted), and invalid UTF-8, a CR inside "
    "a line, malformed JSON, missing fields and wrong values fail naming the file and record. One action for "
    "every kind: 'raise' (strict), 'skip' or 'replace' (repair what can be repaired: bad UTF-8 and control "
    "characters -> U+FFFD, a CR inside a line -> newline, U+2581 -> space; skip the rest). KIND=ACTION sets one "
    "kind: invalid_utf8, carriage_return, control_characters, u2581, empty, whitespace, malformed, "
    "missing_field, bad_value, duplicate, near_duplicate; ACTION is raise, skip, replace or keep (accept as is). "
    "duplicate=skip is exact deduplication (the first copy of each identical record is kept, the others "
    "skipped): records compare by what the task reads, the selected field(s) of a JSON line, the selected "
    "columns of a Parquet or TSV row, a whole text line or file; duplicate is keep unless named. "
    "near_duplicate=skip removes near copies (MinHash LSH over word 5-grams, one kept per cluster; "
    "parameters: --near-duplicates); keep unless named. Repeatable, e.g. "
    "--on-error control_characters=raise --on-error empty=keep."
)


def on_error_option(help_text: str = ON_ERROR_HELP, *, base: tuple[str, ...] = ()):
    """The repeatable ``--on-error`` option, parsed into an ``ErrorPolicy`` spec that overrides ``base``."""
    return click.option("--on-error", "on_error", multiple=True, metavar="ACTION|KIND=ACTION",
                        callback=_on_error_parser(base), help=help_text)


class _ByteSize(click.ParamType):
    """A size in bytes: ``500000``, ``64MiB``, ``1.5GB``, ``10TB`` (k/M/G/T are
    powers of 1000, Ki/Mi/Gi/Ti of 1024; a trailing B is optional)."""

    name = "size"
    _UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
              "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?[bB]?\s*", str(value))
        if not m:
            self.fail(f"{value!r} is not a size in bytes (e.g. 500000, 64MiB, 1GB)", param, ctx)
        n = int(float(m.group(1)) * self._UNITS[(m.group(2) or "").lower()])
        if n < 1:
            self.fail(f"{value!r}: a size must be at least 1 byte", param, ctx)
        return n


BYTE_SIZE = _ByteSize()

# What a bare N of ``--sequence-length`` means, the same words in every command's help and in docs/cli.md.
SEQUENCE_LENGTH_HELP = ("Tokens per row: N, the length of every feature the command reads, or FEATURE=N, e.g. "
                        "inputs=512,targets=114 (FEATURE=N over a bare N); repeatable.")


def _sequence_length(ctx: click.Context, param: click.Parameter, values) -> dict[str, int] | None:
    """``--sequence-length``'s values as {feature: tokens}, a bare N under
    ``seqcache.lengths.ALL_FEATURES`` (``lengths.parse_sequence_length``); None
    when not given. click.BadParameter for a value that is not N or FEATURE=N."""
    try:
        return lengths.parse_sequence_length(values) or None
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None


compilation_cache_option = click.option(
    "--compilation-cache", metavar="DIR|off",
    help="JAX's persistent compilation cache: a restarted or resumed run loads its compiled programs from DIR "
         "instead of compiling them again; off: none [default: $JAX_COMPILATION_CACHE_DIR, else "
         "~/.cache/seqcache/jax on a TPU or GPU, none on a CPU].")


def sequence_length_option(help_text: str = ""):
    """The ``--sequence-length`` option of every command that takes one
    (``build``, ``train``, ``export``): repeatable, parsed by one function
    (``seqcache.lengths.parse_sequence_length``) into {feature: tokens} or
    None, a bare N kept under ``"*"``, which the command expands to the
    features it reads (``seqcache.lengths.sequence_lengths``). ``help_text``
    follows ``SEQUENCE_LENGTH_HELP``. A decorator of a click command."""
    return click.option("--sequence-length", "sequence_length", multiple=True, metavar="N|FEATURE=N",
                        callback=_sequence_length, help=f"{SEQUENCE_LENGTH_HELP} {help_text}".strip())


def error_line(error: BaseException) -> str:
    """The message of the error a step raised, without what Beam wraps around
    it (``RuntimeError: ValueError: ...``, `` [while running 'STEP']``, a
    worker's traceback): what ``build`` and ``overlap`` print after ``error:``
    (``seqcache.pipelines.beam_text``, the one place that reads Beam's text).
    Printed with ``print_error``, its long values are cut (``cut_values``)."""
    return beam_text.read(error).message


WORKERS_HELP = ("Worker processes of Beam's local engine (--direct_num_workers=N "
                "--direct_running_mode=multi_processing); other runners: their own options.")


def with_workers(pipeline_args: list[str], workers: int) -> list[str]:
    """``pipeline_args`` with ``--workers N``'s Beam options (N > 1): the local
    engine's ``--direct_num_workers=N --direct_running_mode=multi_processing``.

    Raises:
      click.UsageError: N > 1 with ``--direct_num_workers`` or
        ``--direct_running_mode`` already given.
    """
    if workers <= 1:
        return list(pipeline_args)
    if any(a.startswith(("--direct_num_workers", "--direct_running_mode")) for a in pipeline_args):
        raise click.UsageError("give --workers N or Beam's --direct_num_workers/--direct_running_mode, not both")
    return [*pipeline_args, f"--direct_num_workers={workers}", "--direct_running_mode=multi_processing"]


def describe_bad_input(statistics: Mapping[str, Any]) -> list[str]:
    """One line per action of a manifest's ``statistics`` with records under it,
    for a build's summary and ``seqcache info``, e.g. ``"skipped 7,223 records
    (empty 7,223)"``, ``"kept 5 records unchanged (control_characters 5)"``.
    Manifests from before ``bad_input_records`` give the skipped and replaced
    totals."""
    by_kind = statistics.get("bad_input_records") or {}
    records = by_kind.get("records") or {}
    out = []
    for action, total_key, tail in (("skipped", "skipped_records", ""), ("replaced", "replaced_records", ""),
                                    ("kept", None, " unchanged")):
        kinds = by_kind.get(action) or {}
        total = int(records.get(action) or (statistics.get(total_key) if total_key else 0) or 0)
        if not total:
            continue
        detail = joined([f"{kind} {n:,}" for kind, n in kinds.items()])
        noun = "record" if total == 1 else "records"
        out.append(f"{action} {total:,} {noun}{tail}" + (f" ({detail})" if detail else ""))
    return out


def near_duplicates_option(ctx, param, value):
    """``--near-duplicates``'s value (``build``, ``scan``) as ``NearDuplicates``
    (None when not given; the values of an option given more than once are
    joined, a parameter in two of them refused); ``click.BadParameter`` with
    the parser's words."""
    if isinstance(value, tuple):
        value = ",".join(value) if value else None
    if value is None:
        return None
    try:
        return NearDuplicates.parse(value)
    except ParameterError as e:  # click names the option
        raise click.BadParameter(e.detail) from None
