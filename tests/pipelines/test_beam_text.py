"""beam_text.py: what the build reads from the text of an error Beam hands back,
held to the messages a real local engine gives, in this process and from a
worker process (where only the text crosses). The Flink and Spark texts are
held to real job servers by the slow tests of test_jvm_runners.py (a worker
killed in a bundle, a worker pool that does not listen)."""

import functools
import os
import pathlib

import apache_beam as beam
import pytest

from seqcache.pipelines import beam_text
from seqcache.pipelines import runner as runner_mod

BAD_INPUT = ("data.jsonl: record 3: a control character; accept such records with the source's "
             "on_error option (on_error={'control_characters': 'keep'})")


def _raised_by_a_step(element, fn, worker_process: bool) -> BaseException:
    """The error ``runner.run`` raises when a real pipeline on the local engine
    applies ``fn`` (a standard-library callable, which a worker process can
    import) to ``element``, in this process or in a worker process."""
    args = ["--direct_running_mode=multi_processing", "--direct_num_workers=1"] if worker_process else []
    options, runner = runner_mod.pipeline_options(args)
    pipeline = beam.Pipeline(runner=runner_mod.pipeline_runner(runner, options), options=options)
    _ = pipeline | beam.Create([element]) | "Tokenize" >> beam.Map(fn)
    with pytest.raises(BaseException) as info:
        runner_mod.run(pipeline, runner)
    return info.value


@pytest.mark.parametrize("worker_process", [False, True], ids=["in this process", "in a worker process"])
def test_a_steps_errors_are_read_from_what_the_local_engine_hands_back(worker_process):
    bad = _raised_by_a_step(BAD_INPUT, int, worker_process)  # ValueError: invalid literal for int() ...
    reading = beam_text.read(bad)
    assert reading.step_raised and reading.bad_input_advice and not reading.no_space
    assert reading.message == f"invalid literal for int() with base 10: {BAD_INPUT!r}"
    assert not (reading.worker_connection_ended or reading.workers_unreachable or reading.interrupted)
    if worker_process:  # only the text crossed: the ValueError itself is not among the causes
        assert not any(isinstance(e, ValueError) for e in beam_text.causes(bad))

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here: a write there is how the test fills a disk")
    full = _raised_by_a_step(b"x", functools.partial(pathlib.Path.write_bytes, pathlib.Path("/dev/full")),
                             worker_process)
    reading = beam_text.read(full)
    assert reading.step_raised and reading.no_space and not reading.bad_input_advice
    assert reading.message == "[Errno 28] No space left on device"
    if worker_process:
        assert not any(isinstance(e, OSError) for e in beam_text.causes(full))


# The failure texts of Beam 2.77.0's Flink job server as wait_until_finish
# raises them (the job's state and its error as one message).
FLINK_WORKER_GONE = ("Pipeline BeamApp-root-1206 failed in state FAILED: "
                     "org.apache.beam.vendor.grpc.v1p69p0.io.grpc.StatusRuntimeException: CANCELLED: client cancelled")
FLINK_NO_POOL = ("Pipeline BeamApp-root-1206 failed in state FAILED: java.net.ConnectException: "
                 "Connection refused: localhost/127.0.0.1:50000")


def test_a_java_runners_failures_are_told_from_a_steps():
    gone, no_pool = beam_text.read(RuntimeError(FLINK_WORKER_GONE)), beam_text.read(RuntimeError(FLINK_NO_POOL))
    assert gone.worker_connection_ended and not gone.workers_unreachable and not gone.step_raised
    assert no_pool.workers_unreachable and not no_pool.worker_connection_ended and not no_pool.step_raised
    # A step's own error that mentions a refused connection is the step's.
    step = beam_text.read(RuntimeError("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
                                       "ConnectionError: java.net.ConnectException: refused [while running 'Read']"))
    assert step.step_raised and not step.workers_unreachable


def test_an_unknown_runner_is_told_from_one_that_fails_to_load():
    from seqcache.pipelines import beam_internals

    with pytest.raises(ValueError) as unknown:
        beam_internals.create_runner("NoSuchRunner")
    assert beam_text.unknown_runner(unknown.value), str(unknown.value)
    assert not beam_text.unknown_runner(ImportError("No module named 'apache_beam.runners.dask'"))
    with pytest.raises(runner_mod.RunnerError, match=r"^runner 'NoSuchRunner' is unknown \(runners: "):
        runner_mod.check_runner_available("NoSuchRunner")


@pytest.mark.parametrize("flag, expected", [
    ("--direct_running_mode=bogus", "argument --direct_running_mode: invalid choice: 'bogus' (choose from "
                                    "'in_memory', 'multi_threading', 'multi_processing')"),
    ("--direct_num_workers=x", "argument --direct_num_workers: invalid int value: 'x'"),
])
def test_a_refused_option_value_is_read_from_what_beams_parser_writes(flag, expected):
    assert runner_mod.option_value_errors([flag]) == expected
    assert beam_text.option_error("usage: x [-h]\nx: error: " + expected + "\n") == expected
