"""TensorBoard event files next to metrics.jsonl: the same values, read back from
the files (TFRecord framing and tensorboardX's Event protobuf, no TensorFlow);
on by default, off with --no-tensorboard; a resumed run adds a file."""

import json

import numpy as np
import pytest

from seqcache.training.metrics import read_metrics, read_tensorboard, tensorboard_tag
from testsupport import train_shakespeare_lm

L = 64


@pytest.fixture(scope="module")
def cache(tmp_path_factory, shakespeare_lm_cache):
    return shakespeare_lm_cache(tmp_path_factory, num_lines=300, sequence_length=L)


def _train(cache, ckpt, *extra):
    result = train_shakespeare_lm(cache, ckpt, *extra, sequence_length=L)
    assert result.exit_code == 0, result.output
    return result


def _expected(metrics):
    """tag -> [(step, value as float32)], what the event files must hold (a null
    value, ``mfu`` on CPU, is not written)."""
    want = {}
    for record in metrics:
        for name, value in record.items():
            if name != "step" and value is not None:
                want.setdefault(tensorboard_tag(name), []).append((record["step"], float(np.float32(value))))
    return want


def test_event_files_hold_the_metrics(cache, tmp_path):
    ckpt = tmp_path / "run"
    first = _train(cache, ckpt, "--steps", "4", "--eval-split", "train", "--set", "eval_every=2 checkpoint.every_steps=2")
    assert "tensorboard dir" in first.output  # named up front, with the other derived quantities
    metrics = read_metrics(str(ckpt / "metrics.jsonl"))
    assert [m["step"] for m in metrics if "loss" in m] == [0, 1, 2, 3]
    assert [m["step"] for m in metrics if "eval_loss" in m] == [1, 3]
    events = list((ckpt / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    got = read_tensorboard(str(ckpt / "tensorboard"))
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s", "eval/loss",
                "eval/accuracy", "eval/tokens", "train/model_flops_per_token", "train/tflops_per_s_per_device"):
        assert tag in got, sorted(got)
    assert "train/mfu" not in got  # null on CPU (the peak is unknown)
    assert got == _expected(metrics)
    assert got["train/learning_rate"][0][1] < got["train/learning_rate"][-1][1]  # warm-up: the schedule is there
    assert json.loads((ckpt / "config.json").read_text())["tensorboard"] is True

    # Resumed: a second event file (purging from step 4 on), every value once over both files.
    _train(cache, ckpt, "--steps", "6", "--set", "checkpoint.every_steps=2")
    assert len(list((ckpt / "tensorboard").glob("events.out.tfevents.*"))) == 2
    metrics = read_metrics(str(ckpt / "metrics.jsonl"))
    assert [m["step"] for m in metrics if "loss" in m] == list(range(6))
    assert read_tensorboard(str(ckpt / "tensorboard")) == _expected(metrics)


def test_no_tensorboard(cache, tmp_path):
    ckpt = tmp_path / "run"
    _train(cache, ckpt, "--steps", "1", "--no-tensorboard")
    assert (ckpt / "metrics.jsonl").is_file() and not (ckpt / "tensorboard").exists()
    assert json.loads((ckpt / "config.json").read_text())["tensorboard"] is False


def test_a_run_resumed_within_the_same_second_keeps_the_earlier_event_file(tmp_path, monkeypatch):
    """tensorboardX names an event file by the second it opened it: two writers
    in one second (a run preempted and resumed at once) must still write two
    files, read back in the order they were written."""
    import time

    from seqcache.training.metrics import TensorBoardWriter

    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.25)  # the same second for both
    first = TensorBoardWriter(str(tmp_path))
    for step in range(3):
        first.write({"step": step, "loss": 3.0 - step})
    first.close()
    resumed = TensorBoardWriter(str(tmp_path), start_step=2)
    resumed.write({"step": 2, "loss": 0.5})
    resumed.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 2
    assert read_tensorboard(str(tmp_path))["train/loss"] == [(0, 3.0), (1, 2.0), (2, 1.0), (2, 0.5)]
