"""A task with a source per split (seqio's ``split_to_filepattern``): the cache
of split S reads S's source only; a split the task lacks is refused before
anything is written; a task with one source reads it for every split.

(tests/tasks/test_splits.py is about splits of files: byte ranges, row groups.)"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from testsupport import byte_task, write_lines

from seqcache import tasks
from seqcache.cli.main import main
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.pipelines import build as build_mod

TRAIN = ["alpha", "beta", "gamma", "delta"]
VALIDATION = ["one", "two", "three"]


def _split_task(tmp_path, name="per_split"):
    train = write_lines(tmp_path / "train.txt", TRAIN)
    validation = write_lines(tmp_path / "validation.txt", VALIDATION)
    return byte_task(name, {"train": tasks.TextLineSource(str(train)),
                            "validation": tasks.TextLineSource(str(validation))}, eos=False)


def _texts(cache_dir) -> list[str]:
    with CacheReader(cache_dir) as r:
        vocab = tasks.ByteVocabulary()
        return sorted(vocab.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))


def test_each_split_is_built_from_its_own_source(tmp_path):
    task = _split_task(tmp_path)
    caches = str(tmp_path / "caches")
    train = build_task(task, cache_dir=caches, config=BuildConfig(split="train", num_shards=1))
    validation = build_task(task, cache_dir=caches, config=BuildConfig(split="validation", num_shards=1))
    assert train.cache_dir == os.path.join(caches, "per_split", "train")
    assert validation.cache_dir == os.path.join(caches, "per_split", "validation")
    assert _texts(train.cache_dir) == sorted(TRAIN)
    assert _texts(validation.cache_dir) == sorted(VALIDATION)
    assert train.manifest.fingerprint != validation.manifest.fingerprint
    # Each cache's fingerprint and source table name its own split's file only.
    for result, name in [(train, "train.txt"), (validation, "validation.txt")]:
        table = result.manifest.read_source_table(result.cache_dir)
        assert [os.path.basename(f["path"]) for f in table] == [name]
    # The same build again is reused, split by split.
    again = build_task(task, cache_dir=caches, config=BuildConfig(split="validation", num_shards=1))
    assert again.reused and again.manifest.fingerprint == validation.manifest.fingerprint


def test_a_split_fingerprint_covers_its_own_source_only(tmp_path):
    task = _split_task(tmp_path)
    (tmp_path / "other").mkdir()
    single = byte_task("per_split", tasks.TextLineSource(str(tmp_path / "train.txt")), eos=False)
    config = BuildConfig(split="train", num_shards=1)
    per_split = build_mod.task_fingerprint_inputs(task, config, 1)
    assert per_split == build_mod.task_fingerprint_inputs(single, config, 1)
    assert [os.path.basename(f["path"]) for f in per_split["task"]["source"]["files"]] == ["train.txt"]
    # Changing the validation file leaves the train split's fingerprint as it was.
    write_lines(tmp_path / "validation.txt", VALIDATION + ["four"])
    assert build_mod.task_fingerprint_inputs(task, config, 1) == per_split
    assert build_mod.task_fingerprint_inputs(task, BuildConfig(split="validation", num_shards=1), 1) != per_split


def test_a_split_the_task_lacks_is_refused_in_one_line_with_nothing_written(tmp_path):
    task = _split_task(tmp_path)
    caches = tmp_path / "caches"
    with pytest.raises(BuildError) as e:
        build_task(task, cache_dir=str(caches), config=BuildConfig(split="test", num_shards=1))
    assert str(e.value) == "task 'per_split' has no split 'test' (its splits: train, validation)"
    assert not caches.exists()


def test_a_task_with_one_source_reads_it_for_every_split(tmp_path):
    path = write_lines(tmp_path / "a.txt", TRAIN)
    task = byte_task("single", tasks.TextLineSource(str(path)), eos=False)
    assert task.splits is None and task.for_split("anything") is task
    assert task.source_for("validation") is task.source
    caches = str(tmp_path / "caches")
    built = build_task(task, cache_dir=caches, config=BuildConfig(split="whatever", num_shards=1))
    assert _texts(built.cache_dir) == sorted(TRAIN)


def test_bad_per_split_sources_are_refused(tmp_path):
    source = tasks.TextLineSource(str(tmp_path / "a.txt"))
    with pytest.raises(ValueError, match=r"task 'bad': source maps no split"):
        byte_task("bad", {})
    with pytest.raises(TypeError, match=r"task 'bad': the source of split 'validation' must be a Source \(got str\)"):
        byte_task("bad", {"train": source, "validation": "valid.txt"})
    with pytest.raises(ValueError, match=r"bad task 'bad': split name 'a/b'"):
        byte_task("bad", {"a/b": source})
    with pytest.raises(TypeError, match=r"task 'bad': source must be a Source or a mapping of split -> Source"):
        byte_task("bad", ["a.txt"])
    task = byte_task("two", {"train": source, "validation": source})
    assert task.splits == ("train", "validation")
    with pytest.raises(ValueError, match=r"task 'two' has a source per split \(train, validation\); read it "
                                         r"through task.for_split\(split\)"):
        task.source  # noqa: B018
    resolved = task.for_split("validation")
    assert resolved.source is source and resolved.split == "validation" and task.split is None
    assert "'train':" in repr(task) and "'validation':" in repr(task)


@pytest.mark.parametrize("cls", [tasks.TextLineSource, tasks.JsonLinesSource, tasks.ParquetSource])
def test_a_mapping_given_as_a_file_pattern_says_to_give_the_task_one(cls):
    with pytest.raises(TypeError) as e:
        cls({"train": "train.txt", "validation": "valid.txt"})
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{cls.__name__} takes a file pattern, not a mapping")
    assert "give the Task a mapping of split -> source instead" in message


def _register(tmp_path, module: str, definitions: str) -> None:
    (tmp_path / f"{module}.py").write_text("from seqcache import tasks\n" + definitions, encoding="utf-8")


def _task_code(name: str, splits: dict[str, str]) -> str:
    sources = ", ".join(f"{s!r}: tasks.TextLineSource({p!r})" for s, p in splits.items())
    return (f"tasks.TaskRegistry.add({name!r}, source={{{sources}}},\n"
            "    output_features={'targets': tasks.Feature(tasks.ByteVocabulary())},\n"
            "    preprocessors=[tasks.preprocessors.rekey({'targets': 'text'}), tasks.preprocessors.tokenize()])\n")


def test_cli_builds_lists_and_scans_a_mixture_per_split(tmp_path, monkeypatch):
    files = {name: str(write_lines(tmp_path / f"{name}.txt", lines)) for name, lines in
             [("a_train", TRAIN), ("a_val", VALIDATION), ("b_train", ["x", "y"]), ("b_val", ["z"])]}
    _register(tmp_path, "per_split_cli_tasks",
              _task_code("split_a", {"train": files["a_train"], "validation": files["a_val"]})
              + _task_code("split_b", {"train": files["b_train"], "validation": files["b_val"]})
              + _task_code("split_c", {"train": files["b_train"]})
              + "tasks.MixtureRegistry.add('split_ab', ['split_a', 'split_b'], default_rate=1.0)\n"
              + "tasks.MixtureRegistry.add('split_ac', ['split_a', 'split_c'], default_rate=1.0)\n")
    monkeypatch.chdir(tmp_path)
    caches = tmp_path / "caches"
    common = ["--module", "per_split_cli_tasks", "--cache-dir", str(caches), "--num-shards", "1"]
    out = CliRunner().invoke(main, ["build", "split_ab", "--split", "validation", "--json", *common])
    assert out.exit_code == 0, out.output
    assert _texts(caches / "split_a" / "validation") == sorted(VALIDATION)
    assert _texts(caches / "split_b" / "validation") == ["z"]
    assert sorted(os.listdir(caches)) == ["split_a", "split_b"]
    assert os.listdir(caches / "split_a") == ["validation"]
    # A mixture one of whose tasks lacks the split: refused in one line, before any task is built.
    refused = CliRunner().invoke(main, ["build", "split_ac", "--split", "test", *common])
    assert refused.exit_code == 1
    assert refused.output.strip() == "error: task 'split_a' has no split 'test' (its splits: train, validation)"
    refused = CliRunner().invoke(main, ["build", "split_ac", "--split", "validation", *common])
    assert refused.output.strip() == "error: task 'split_c' has no split 'validation' (its splits: train)"
    assert os.listdir(caches / "split_a") == ["validation"] and not (caches / "split_c").exists()
    listed = json.loads(CliRunner().invoke(main, ["tasks", "--module", "per_split_cli_tasks", "--json"]).stdout)
    row = next(t for t in listed["tasks"] if t["name"] == "split_a")
    assert row["splits"] == ["train", "validation"]
    assert row["source"] == f"train: text lines of {files['a_train']}; validation: text lines of {files['a_val']}"
    scanned = CliRunner().invoke(main, ["scan", "split_a", "--module", "per_split_cli_tasks", "--json"])
    assert [(r["split"], r["records"]) for r in json.loads(scanned.stdout)] == [("train", 4), ("validation", 3)]
    one = CliRunner().invoke(main, ["scan", "split_a", "--split", "validation", "--module", "per_split_cli_tasks",
                                    "--json"])
    assert [(r["split"], r["records"]) for r in json.loads(one.stdout)] == [("validation", 3)]
