"""``seqcache train --mixture-schedule FILE``: the schedule reaches the run's
feeder, its state records it, and a resumed run may append a stage but not
rewrite the past."""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.feeders import Feeder, FeederStateError
from seqcache.feeders import state as state_lib
from seqcache.pipelines.writer import write_cache
from seqcache.training import data as data_lib
from seqcache.training.config import ConfigError, DataConfig, TrainConfig

B, L = 8, 8


def _cache(root, task: str, n: int, first: int):
    shards = [[({"targets": np.arange(first + i, first + i + L, dtype=np.int32) % 250 + 3}, [(0, i, 0)])
               for i in range(s, n, 2)] for s in range(2)]
    write_cache(str(root / task / "train"), task=task, split="train", features=(fmt.FeatureSpec("targets", "int32"),),
                shards=shards, sources=[{"path": f"{task}.txt"}], fingerprint_inputs={"task": task, "n": n})


@pytest.fixture
def caches(tmp_path):
    root = tmp_path / "caches"
    _cache(root, "a", 40, 0)
    _cache(root, "b", 24, 1000)
    _cache(root, "c", 16, 2000)
    return root


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)


def _feeder(caches, schedule_file):
    data = DataConfig(cache_dir=str(caches))
    source = data_lib.resolve_source(data, "train", schedule=data_lib.load_mixture_schedule(schedule_file))
    cfg = TrainConfig(global_batch_size=B, sequence_length=L)
    return source, data_lib.make_feeder(cfg, source, seed=3)


def test_a_schedule_file_reaches_the_feeder_and_its_state(caches, tmp_path):
    sched = _write(tmp_path / "s.json", {"0": {"a": 1, "b": 1}, "5": {"a": 3, "b": 1}})
    source, f = _feeder(caches, sched)
    with f:
        a, b = str(caches / "a" / "train"), str(caches / "b" / "train")
        assert source.kwargs["mixture"] == {0: {a: 1.0, b: 1.0}, 5: {a: 3.0, b: 1.0}}
        assert [st["step"] for st in f.schedule] == [0, 5]
        tasks = f.stream.locate(np.arange(20 * B)).task
        before, after = tasks[: 5 * B], tasks[5 * B:]
        assert (before == 0).sum() == (before == 1).sum()  # 1:1 up to step 5
        assert abs((after == 0).sum() - 3 * (after == 1).sum()) <= 3  # 3:1 after
        state = f.state()
    assert state["version"] == state_lib.SCHEDULE_STATE_VERSION
    assert [(st["step"], st["rates"]) for st in state["schedule"]] == [(0, [1.0, 1.0]), (5, [3.0, 1.0])]


def test_a_yaml_schedule_names_tasks_or_cache_folders(caches, tmp_path):
    (tmp_path / "s.yaml").write_text("0:\n  a: 2\n  b/train: 1\n10:\n  b/train: 1\n")
    schedule = data_lib.load_mixture_schedule(str(tmp_path / "s.yaml"))
    assert schedule == {0: {"a": 2.0, "b/train": 1.0}, 10: {"b/train": 1.0}}
    source = data_lib.resolve_source(DataConfig(cache_dir=str(caches)), "train", schedule=schedule)
    assert source.cache_dirs == (str(caches / "a" / "train"), str(caches / "b" / "train"))


@pytest.mark.parametrize("content, message", [
    ({"5": {"a": 1}}, "starts at step 0"),
    ({"0": {"a": -1}}, "rate of 'a' at step 0 is -1"),
    ({"x": {"a": 1}}, "step 'x' is not an integer"),
    ({"0": {"zz": 1}}, "'zz' is neither a cache folder nor a task cache"),
])
def test_a_bad_schedule_file_is_a_config_error_naming_it(caches, tmp_path, content, message):
    path = _write(tmp_path / "bad.json", content)
    with pytest.raises(ConfigError, match=message):
        data_lib.resolve_source(DataConfig(cache_dir=str(caches)), "train",
                                schedule=data_lib.load_mixture_schedule(path))


def test_resume_accepts_an_appended_stage_and_refuses_a_rewritten_past(caches, tmp_path):
    first = _write(tmp_path / "first.json", {"0": {"a": 1, "b": 1}, "4": {"a": 3, "b": 1}})
    _, f = _feeder(caches, first)
    with f:
        f.step = 9
        saved = json.loads(json.dumps(f.state()))  # what a checkpoint holds
        expected = [f.get_batch(s) for s in range(9, 16)]
    # A new stage (and a new task) after the saved step: the stream continues.
    appended = _write(tmp_path / "appended.json", {"0": {"a": 1, "b": 1}, "4": {"a": 3, "b": 1},
                                                   "12": {"a": 1, "b": 1, "c": 2}})
    _, g = _feeder(caches, appended)
    with g:
        assert state_lib.stream_difference(saved, g.state()) is None  # what the trainer checks
        g.set_state(saved)
        assert g.step == 9
        for s, want in zip(range(9, 12), expected):  # the same batches up to the new stage
            got = g.get_batch(s)
            assert all(np.array_equal(got[k], want[k]) for k in want)
        assert 2 in g.get_batch(14)["task_index"]  # the new task is read after step 12
        assert [st["step"] for st in g.state()["schedule"]] == [0, 4, 12]
    # The stage at step 4 changed, before the saved step 9: refused, naming the step.
    rewritten = _write(tmp_path / "rewritten.json", {"0": {"a": 1, "b": 1}, "4": {"a": 1, "b": 3}})
    _, h = _feeder(caches, rewritten)
    with h:
        assert "rewrites the past at step 4" in state_lib.stream_difference(saved, h.state())
        with pytest.raises(FeederStateError, match="the mixture schedule rewrites the past at step 4"):
            h.set_state(saved)


def test_the_train_command_passes_the_schedule_to_the_feeder(caches, tmp_path, monkeypatch):
    from seqcache.cli.commands.train import train

    sched = _write(tmp_path / "s.json", {"0": {"a": 1, "b": 1}, "6": {"a": 1, "c": 1}})
    made = []
    real = data_lib.make_feeder

    def spy(config, source, **kw):
        feeder = real(config, source, **kw)
        made.append(feeder)
        return feeder

    monkeypatch.setattr(data_lib, "make_feeder", spy)
    out = CliRunner().invoke(train, ["--cache-dir", str(caches), "--mixture-schedule", sched, "--batch-size", str(B),
                                     "--sequence-length", str(L), "--model", "tiny", "--set", "model.vocab_size=256",
                                     "--set", "model.d_model=16 model.num_layers=1 model.num_heads=2 model.mlp_dim=32",
                                     "--dry-run"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    assert "mixture schedule (2 stages)" in out.output
    (feeder,) = made
    assert isinstance(feeder, Feeder)
    assert [(st["step"], st["rates"]) for st in feeder.schedule] == [(0, [1.0, 1.0, 0.0]), (6, [1.0, 0.0, 1.0])]
    assert feeder.paths == [str(caches / t / "train") for t in ("a", "b", "c")]


@pytest.mark.slow
def test_train_resumes_with_an_appended_stage_and_refuses_a_rewritten_past(caches, tmp_path):
    from seqcache.cli.commands.train import train

    ckpt = tmp_path / "ckpt"

    def run(schedule, steps):
        path = _write(tmp_path / f"s{len(list(tmp_path.iterdir()))}.json", schedule)
        return CliRunner().invoke(train, [
            "--cache-dir", str(caches), "--mixture-schedule", path, "--batch-size", str(B), "--sequence-length",
            str(L), "--checkpoint-dir", str(ckpt), "--steps", str(steps), "--model", "tiny",
            "--set", "model.vocab_size=256 model.d_model=16 model.num_layers=1 model.num_heads=2 model.mlp_dim=32",
            "--set", "progress=false checkpoint.every_steps=2"], catch_exceptions=False)

    first = run({"0": {"a": 1, "b": 1}, "1": {"a": 3, "b": 1}}, 2)
    assert first.exit_code == 0, first.output
    appended = run({"0": {"a": 1, "b": 1}, "1": {"a": 3, "b": 1}, "3": {"a": 1, "c": 1}}, 4)
    assert appended.exit_code == 0, appended.output
    assert json.loads(appended.output.strip().splitlines()[-1])["start_step"] == 2
    # The checkpoint is at step 4: the stage at step 1 is the past.
    rewritten = run({"0": {"a": 1, "b": 1}, "1": {"a": 1, "b": 3}, "3": {"a": 1, "c": 1}}, 6)
    assert rewritten.exit_code == 1, rewritten.output
    assert "the mixture schedule rewrites the past at step 1" in rewritten.output and "Traceback" not in rewritten.output


def test_a_schedule_and_a_task_together_are_refused(tmp_path):
    from seqcache.cli.commands.train import train

    sched = _write(tmp_path / "s.json", {"0": {"a": 1}})
    out = CliRunner().invoke(train, ["--cache-dir", str(tmp_path), "--mixture-schedule", sched, "--task", "a",
                                     "--batch-size", "4", "--sequence-length", "8", "--dry-run"])
    assert out.exit_code == 2 and "--mixture-schedule replaces --task" in out.output, out.output


def _alias_bomb(path):
    """Ten lines, each a list of nine aliases of the line before: 9^10 values
    once expanded ("billion laughs") in 341 bytes."""
    lines = ["a: &a [x,x,x,x,x,x,x,x,x]"] + [f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]"
                                           for p, n in zip("abcdefghi", "bcdefghij")]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_yaml_alias_bomb_is_refused_before_it_expands(tmp_path):
    path = _alias_bomb(tmp_path / "s.yaml")
    assert os.path.getsize(path) == 341
    with pytest.raises(ConfigError) as e:
        data_lib.load_mixture_schedule(path)
    assert str(e.value) == (f"{path}: line 1, column 4: anchor &a: a mixture schedule may not use YAML anchors or "
                            "aliases (&name, *name, <<: *name); write each value out in full")


def test_the_train_command_refuses_a_yaml_alias_bomb_in_one_line(tmp_path):
    from seqcache.cli.main import main

    path = _alias_bomb(tmp_path / "s.yaml")
    out = CliRunner().invoke(main, ["train", "--mixture-schedule", path, "--cache-dir", str(tmp_path),
                                    "--batch-size", "4", "--sequence-length", "8", "--dry-run"])
    # Reported as the other schedule errors are: a usage error, exit status 2.
    assert out.exit_code == 2, out.output
    errors = [line for line in out.output.splitlines() if line.lower().startswith("error:")]
    assert errors == [f"Error: {path}: line 1, column 4: anchor &a: a mixture schedule may not use YAML anchors "
                      "or aliases (&name, *name, <<: *name); write each value out in full"], out.output
    assert "Traceback" not in out.output


@pytest.mark.parametrize("text, where", [
    ("base: &base {a: 1}\n0: {<<: *base, b: 1}\n", "line 1, column 7: anchor &base"),  # a merge key
    ("0: {a: 1}\n5: {a: *r}\n", "line 2, column 8: alias *r"),  # an alias of no anchor
    ("0: &s {a: 1}\n", "line 1, column 4: anchor &s"),  # an anchor no alias uses
    ("&k 0: {a: 1}\n", "line 1, column 1: anchor &k"),  # on a key
])
def test_yaml_anchors_and_aliases_are_refused_naming_the_line(tmp_path, text, where):
    path = tmp_path / "s.yml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {re.escape(where)}: a mixture schedule may not "
                       "use YAML anchors"):
        data_lib.load_mixture_schedule(str(path))


def test_a_schedule_file_larger_than_the_bound_is_refused(tmp_path):
    for name in ("s.json", "s.yaml"):
        path = tmp_path / name
        path.write_text('{"0": {"a": 1}}' + " " * data_lib.MAX_SCHEDULE_BYTES)
        with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: the mixture schedule is larger than the "
                           "16,777,216 bytes"):
            data_lib.load_mixture_schedule(str(path))
