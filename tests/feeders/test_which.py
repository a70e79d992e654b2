"""Provenance (G6): Feeder.which and `seqcache which` map (step, row) to source records."""

import json

import pytest
from click.testing import CliRunner

from seqcache.cli.main import main
from seqcache.feeders import Feeder


def _byte_vocab():
    tasks = pytest.importorskip("seqcache.tasks")
    return tasks.ByteVocabulary()


def test_which_matches_the_batch_row_and_names_the_source(tmp_path, fx):
    vocab = _byte_vocab()
    fx.write_fixture_cache(tmp_path / "c", n=23, num_shards=3, length=lambda i: 2 + i % 5,
                           vocabularies={"targets": vocab.to_json()})
    with Feeder(cache=str(tmp_path / "c"), global_batch_size=6, sequence_length=8, host_index=0, host_count=1,
                seed=4) as f:
        for step in (0, 3, 9):  # 9 is in epoch 2
            batch = f.get_batch(step)
            for row in (0, 5):
                d = f.which(step, row)
                i = int(batch["cache_index"][row])
                assert d["cache_index"] == i and d["epoch"] == int(batch["epoch"][row])
                assert d["position"] == step * 6 + row and not d["padding"]
                shard, offset = f.readers[0].locate([i])
                assert d["shard"] == f"data.array_record-{int(shard[0]):05d}-of-00003" and d["record"] == int(offset[0])
                (seg,) = d["segments"]
                assert seg["source"] == "corpus/fixture.txt" and seg["record_number"] == 1000 + i
                want = fx.example_tokens(i, 2 + i % 5)
                assert seg["token_ids"] == want.tolist()
                assert seg["text"] == vocab.decode(want.tolist())


def test_which_splits_packed_segments(tmp_path, fx):
    fx.write_packed_cache(tmp_path / "p", n=10, sequence_length=12)
    with Feeder(cache=str(tmp_path / "p"), global_batch_size=2, sequence_length=12, host_index=0, host_count=1) as f:
        d = f.which(2, 1)
        i = d["cache_index"]
        a = 3 + i % 4
        s1, s2 = d["segments"]
        assert (s1["source"], s1["record_number"], s1["token_offset"]) == ("corpus/a.txt", 2 * i, 0)
        assert (s2["source"], s2["record_number"], s2["token_offset"]) == ("corpus/b.txt", 2 * i + 1, 5)
        assert s1["token_ids"] == fx.example_tokens(i, a).tolist()
        assert s2["num_tokens"] == 12 - a - i % 3
        assert s1["text"] is None and "no vocabulary" in s1["vocabulary_error"]


def test_which_reports_padding_rows(make_cache):
    path = make_cache(n=5)
    with Feeder(cache=path, global_batch_size=4, sequence_length=2, host_index=0, host_count=1, num_epochs=1) as f:
        assert f.which(1, 0)["padding"] is False
        d = f.which(1, 1)
        assert d["padding"] is True and d["cache_index"] is None and d["segments"] == []
        with pytest.raises(ValueError, match=r"row must be in \[0, 4\)"):
            f.which(0, 4)


def test_cli_on_a_cache_folder(tmp_path, fx):
    vocab = _byte_vocab()
    fx.write_fixture_cache(tmp_path / "c", n=30, vocabularies={"targets": vocab.to_json()})
    path = str(tmp_path / "c")
    with Feeder(cache=path, global_batch_size=8, sequence_length=8, host_index=0, host_count=1, seed=2) as f:
        i = int(f.get_batch(5)["cache_index"][3])
    runner = CliRunner()
    res = runner.invoke(main, ["which", path, "--step", "5", "--row", "3", "--batch-size", "8", "--seed", "2", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["cache_index"] == i and d["segments"][0]["record_number"] == 1000 + i
    res = runner.invoke(main, ["which", path, "--step", "5", "--row", "3", "--batch-size", "8", "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert f"cache index  {i}:" in res.output and f"corpus/fixture.txt record {1000 + i}" in res.output
    assert vocab.decode(fx.example_tokens(i, 8).tolist()).split("\n")[0] in res.output
    res = runner.invoke(main, ["which", path, "--step", "5", "--row", "8", "--batch-size", "8"])
    assert res.exit_code != 0 and "outside the global batch of 8 rows" in res.output


def test_cli_on_a_mixture_and_on_a_saved_state(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "a" / "train", n=9, task="a")
    fx.write_fixture_cache(tmp_path / "b" / "train", n=7, task="b")
    mixture = {str(tmp_path / "a" / "train"): 3.0, str(tmp_path / "b" / "train"): 1.0}
    with Feeder(mixture=mixture, global_batch_size=4, sequence_length=4, host_index=0, host_count=1, seed=1) as f:
        batch = f.get_batch(7)
        state = f.state()
    (tmp_path / "state.json").write_text(json.dumps(state))
    runner = CliRunner()
    by_rates = runner.invoke(main, ["which", str(tmp_path), "--mixture-rate", "a/train=3", "--mixture-rate",
                                    "b/train=1", "--step", "7", "--row", "2", "--batch-size", "4", "--seed", "1",
                                    "--json"])
    by_state = runner.invoke(main, ["which", str(tmp_path / "state.json"), "--step", "7", "--row", "2", "--json"])
    for res in (by_rates, by_state):
        assert res.exit_code == 0, res.output
        d = json.loads(res.output)
        assert d["task_index"] == int(batch["task_index"][2]) and d["cache_index"] == int(batch["cache_index"][2])
        assert d["task"] == ("a", "b")[d["task_index"]]
    res = runner.invoke(main, ["which", str(tmp_path / "state.json"), "--step", "7", "--row", "2", "--seed", "9"])
    assert res.exit_code != 0 and "seed=1, but 9 was given" in res.output


def test_cli_names_a_missing_cache(tmp_path):
    res = CliRunner().invoke(main, ["which", str(tmp_path / "nope"), "--step", "0", "--row", "0", "--batch-size", "2"])
    assert res.exit_code != 0 and "--cache-dir" in res.output
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(main, ["which", str(tmp_path / "empty"), "--step", "0", "--row", "0", "--batch-size", "2"])
    assert res.exit_code == 1 and "incomplete" in res.output and str(tmp_path / "empty") in res.output


def test_cli_on_a_registered_mixture_name(tmp_path, fx):
    tasks = pytest.importorskip("seqcache.tasks")
    fx.write_fixture_cache(tmp_path / "which_a" / "validation", n=8, task="which_a", split="validation")
    fx.write_fixture_cache(tmp_path / "which_b" / "validation", n=4, task="which_b", split="validation")
    name = "feeders_test_which_mixture"
    tasks.MixtureRegistry.add(name, [("which_a", 2.0), ("which_b", 1.0)])
    try:
        res = CliRunner().invoke(main, ["which", name, "--cache-dir", str(tmp_path), "--split", "validation",
                                        "--step", "3", "--row", "1", "--batch-size", "3", "--json"])
    finally:
        tasks.MixtureRegistry.remove(name)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    mixture = {str(tmp_path / "which_a" / "validation"): 2.0, str(tmp_path / "which_b" / "validation"): 1.0}
    with Feeder(mixture=mixture, global_batch_size=3, sequence_length=2, host_index=0, host_count=1) as f:
        b = f.get_batch(3)
    assert (d["task_index"], d["cache_index"]) == (int(b["task_index"][1]), int(b["cache_index"][1]))


def test_cli_on_a_saved_state_refuses_a_rebuilt_cache(tmp_path, fx):
    path = str(tmp_path / "c")
    fx.write_fixture_cache(path, n=12)
    with Feeder(cache=path, global_batch_size=4, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    (tmp_path / "state.json").write_text(json.dumps(state))
    args = ["which", str(tmp_path / "state.json"), "--step", "0", "--row", "0", "--json"]
    assert CliRunner().invoke(main, args).exit_code == 0
    rebuilt = fx.write_fixture_cache(path, n=12, tag="seed 1")  # rebuilt in place, another order
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1
    old = state["mixture"][0]["fingerprint"]
    assert f"the cache at {path} was rebuilt (fingerprint {rebuilt.fingerprint}, the state was saved with " \
           f"fingerprint {old})" in res.output


def test_cli_on_a_task_cache_under_cache_dir(tmp_path, fx):
    # As `seqcache train --task NAME --cache-dir DIR` finds it: DIR/NAME/SPLIT.
    fx.write_fixture_cache(tmp_path / "caches" / "which_plain" / "validation", n=10, task="which_plain",
                           split="validation")
    path = str(tmp_path / "caches" / "which_plain" / "validation")
    with Feeder(cache=path, global_batch_size=4, sequence_length=4, host_index=0, host_count=1) as f:
        i = int(f.get_batch(2)["cache_index"][3])
    res = CliRunner().invoke(main, ["which", "which_plain", "--cache-dir", str(tmp_path / "caches"), "--split",
                                    "validation", "--step", "2", "--row", "3", "--batch-size", "4", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["cache"] == path and d["cache_index"] == i
    res = CliRunner().invoke(main, ["which", "which_nothing", "--cache-dir", str(tmp_path / "caches"), "--step", "0",
                                    "--row", "0", "--batch-size", "4"])
    assert res.exit_code == 2
    assert "no such file or folder: which_nothing" in res.output
    assert "no cache at " + str(tmp_path / "caches" / "which_nothing" / "train") in res.output


def test_cli_on_a_checkpoint_step_folder(tmp_path, fx):
    # `seqcache train` saves the feeder state of step 12 as runs/12/feeder/metadata.
    path = str(tmp_path / "c")
    fx.write_fixture_cache(path, n=30)
    with Feeder(cache=path, global_batch_size=4, sequence_length=4, host_index=0, host_count=1, seed=3) as f:
        f.step = 12
        state = f.state()
        i = int(f.get_batch(12)["cache_index"][1])
    for step in (8, 12):
        (tmp_path / "runs" / str(step) / "feeder").mkdir(parents=True)
        (tmp_path / "runs" / str(step) / "feeder" / "metadata").write_text(json.dumps(state))
    res = CliRunner().invoke(main, ["which", str(tmp_path / "runs" / "12"), "--step", "12", "--row", "1", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert (d["cache_index"], d["seed"], d["global_batch_size"]) == (i, 3, 4)
    res = CliRunner().invoke(main, ["which", str(tmp_path / "runs"), "--step", "12", "--row", "1"])
    assert res.exit_code == 2
    assert f"{tmp_path / 'runs'} is a checkpoint directory; give one of its step folders, e.g. " \
           f"{tmp_path / 'runs' / '12'} (steps with a feeder state: 8, 12)" in res.output


def test_cli_names_a_missing_path(tmp_path):
    missing = str(tmp_path / "runs" / "7")
    res = CliRunner().invoke(main, ["which", missing, "--step", "0", "--row", "0"])
    assert res.exit_code == 2 and f"no such file or folder: {missing}" in res.output
    res = CliRunner().invoke(main, ["which", missing, "--mixture-rate", "a=1", "--step", "0", "--row", "0"])
    assert res.exit_code == 2 and f"no such file or folder: {missing}" in res.output
