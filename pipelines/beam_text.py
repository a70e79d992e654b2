"""What seqcache reads from the text of an error Beam hands back: the one place
that classifies an error by its words.

A step's error reaches the build as Beam hands it back: raised again in this
process on the local engine, but from a worker process (multi_processing,
Prism's and Dask's workers) only as text inside a ``RuntimeError`` (the
worker's traceback, `` [while running 'STEP']``), and from a Java runner's job
service (Flink, Spark) only as the job's failure message. Where the error
itself is still there, its type decides (``causes``, ``isinstance``); where
only its text is, ``read`` reads it, against apache-beam 2.77.0 (constraints.txt)
and Flink's and Spark's job servers of that release. tests/pipelines/
test_beam_text.py holds each reading to the message a real local engine gives;
the Flink and Spark texts are held to real job servers by the slow tests of
tests/pipelines/test_jvm_runners.py (a killed worker, a pool that does not
listen).

The standard library only: the command line reads errors with it before Beam
is imported.
"""

from __future__ import annotations

import dataclasses
import errno
import re
from typing import Iterator

# The first line of a Python traceback, which a worker's error carries as text.
TRACEBACK = "Traceback (most recent call last):"
# What Beam's local engines add after a step's error: `` [while running 'STEP']``.
WHILE_RUNNING = "[while running"
# "ValueError: ", "seqcache.pipelines.build.BuildError: ": the name of an exception
# class at the start of a line of a traceback or of a wrapped message.
_EXCEPTION_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception): ")


def causes(error: BaseException | None, *, context: bool = True) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from (``__cause__``, and with
    ``context`` ``__context__``), each once."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or (error.__context__ if context else None)


@dataclasses.dataclass(frozen=True)
class Reading:
    """What an error Beam handed back says (``read``).

    Attributes:
      message: the message the step raised, without what Beam wraps around it
        (``RuntimeError: ValueError: ...``, `` [while running 'STEP']``, a
        worker's traceback): what ``build`` and ``overlap`` print after ``error:``.
      step_raised: one of the build's own steps raised it (bad input, a full
        disk), not the runner: a ``ValueError`` or ``KeyboardInterrupt``, or a
        message that carries a step's name or a worker's traceback.
      interrupted: a ``KeyboardInterrupt`` raised inside a step (Ctrl-C reaches
        the engine's threads and workers too).
      no_space: the disk was full (``ENOSPC``), here or in a worker.
      bad_input_advice: the message gives the source's ``on_error=`` advice
        (a ``BadInputError`` a worker raised, whose type did not cross).
      worker_connection_ended: a Java runner's job failed as the gRPC connection
        of an SDK worker ended ("StatusRuntimeException: CANCELLED: client
        cancelled", or UNAVAILABLE: Flink, when a worker dies in a bundle).
      workers_unreachable: a Java runner's job failed as it could not connect to
        its SDK workers ("java.net.ConnectException: ... Connection refused":
        an EXTERNAL environment whose pool does not listen).
    """

    message: str
    step_raised: bool
    interrupted: bool
    no_space: bool
    bad_input_advice: bool
    worker_connection_ended: bool
    workers_unreachable: bool


def read(error: BaseException) -> Reading:
    """What ``error`` (raised by ``pipeline.run`` or ``wait_until_finish``, or
    anything it was raised from) says, by its type where it is there and by its
    text where only the text crossed (module docstring)."""
    text = str(error)
    direct = list(causes(error, context=False))
    step_raised = isinstance(error, (KeyboardInterrupt, ValueError)) or any(
        WHILE_RUNNING in str(e) or TRACEBACK in str(e) for e in direct)
    message = _step_message(text)
    return Reading(
        message=message,
        step_raised=step_raised,
        interrupted=any(isinstance(e, KeyboardInterrupt) for e in direct) or "KeyboardInterrupt" in text,
        no_space=any((isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)
                     for e in causes(error)),
        bad_input_advice="on_error=" in message,
        worker_connection_ended=("StatusRuntimeException" in text and ("CANCELLED" in text or "UNAVAILABLE" in text)
                                 and not step_raised),
        workers_unreachable="java.net.ConnectException" in text and not step_raised,
    )


def _step_message(text: str) -> str:
    """``Reading.message`` of an error whose text is ``text``."""
    if TRACEBACK in text:
        text = _last_exception_line(text) or text
    while (m := _EXCEPTION_PREFIX.match(text)) is not None:
        text = text[m.end():]
    return text.split(f" {WHILE_RUNNING} ")[0].strip()


def _last_exception_line(traceback_text: str) -> str | None:
    """The ``Name: message`` line (the first unindented one) of the last traceback in ``traceback_text``."""
    tail = traceback_text.rsplit(TRACEBACK, 1)[1]
    for line in tail.splitlines():
        if line and not line.startswith(" "):
            return line
    return None


def unknown_runner(error: BaseException) -> bool:
    """Whether ``error`` (raised by Beam's ``create_runner``) says Beam knows no
    runner of that name: Beam raises a plain ``ValueError`` for it ("Unexpected
    pipeline runner: ..."), told apart from a known runner that fails to load
    only by its words."""
    return "Unexpected pipeline runner" in str(error)


def option_error(stderr: str) -> str:
    """The message of a pipeline option whose value Beam's options parser
    (argparse) refused, from what it wrote to standard error before exiting:
    its last ``PROG: error: MESSAGE`` line's MESSAGE ("argument
    --direct_running_mode: invalid choice: 'x' (choose from ...)")."""
    lines = [line for line in stderr.splitlines() if ": error: " in line]
    return lines[-1].split(": error: ", 1)[1] if lines else stderr.strip() or "invalid option value"
