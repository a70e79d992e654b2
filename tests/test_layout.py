"""seqcache.layout: CACHE_DIR/<task>/<split> and what a cache is; and one
resolution of a name to cache folders (seqcache.tasks.registry), shared by
`seqcache train` and `seqcache which`."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from seqcache import layout, tasks
from seqcache.tasks import registry
from seqcache.cli.main import main


@pytest.fixture
def registered():
    tasks.TaskRegistry.reset()
    tasks.MixtureRegistry.reset()
    for name in ("lay_a", "lay_b"):
        tasks.TaskRegistry.add(name, source=tasks.FunctionSource(_rows, name=name),
                               output_features={"targets": tasks.Feature(tasks.ByteVocabulary())})
    tasks.MixtureRegistry.add("lay_mix", [("lay_a", 1.0), ("lay_b", 2.0)])
    yield
    tasks.TaskRegistry.reset()
    tasks.MixtureRegistry.reset()


def _rows():
    return [{"text": "a"}]


def _fake_cache(path) -> str:
    os.makedirs(path, exist_ok=True)
    open(os.path.join(path, layout.MANIFEST_NAME), "w").write("{}")
    return str(path)


def test_paths_and_what_a_cache_is(tmp_path):
    assert layout.cache_path(str(tmp_path), "wiki", "train") == os.path.join(str(tmp_path), "wiki", "train")
    folder = _fake_cache(tmp_path / "wiki" / "train")
    assert layout.is_cache(folder) and not layout.is_cache(str(tmp_path / "wiki"))
    assert not layout.is_cache(str(tmp_path / "nothing")) and not layout.is_cache("gs://bucket/wiki/train")
    assert layout.sibling_split(folder + "/", "validation") == os.path.join(str(tmp_path), "wiki", "validation")


def test_resolve_name_in_order(tmp_path, registered):
    root = str(tmp_path)
    folder = _fake_cache(tmp_path / "other" / "x")
    assert registry.resolve_name(folder, split="train") == registry.Resolved("folder", (folder,), folder)
    assert registry.resolve_name("lay_a", split="train") is None  # names need a cache_dir
    under = _fake_cache(tmp_path / "built" / "train")
    assert registry.resolve_name("built", split="train", cache_dir=root) == registry.Resolved(
        "cache", (under,), "built/train")
    # A registered task: its cache under the root, built or not.
    assert registry.resolve_name("lay_a", split="dev", cache_dir=root) == registry.Resolved(
        "task", (os.path.join(root, "lay_a", "dev"),), "lay_a/dev")
    mix = registry.resolve_name("lay_mix", split="train", cache_dir=root)
    assert mix.kind == "mixture" and mix.mixture is tasks.get_task_or_mixture("lay_mix")
    assert mix.cache_dirs == (os.path.join(root, "lay_a", "train"), os.path.join(root, "lay_b", "train"))
    assert registry.resolve_name("lay_nope", split="train", cache_dir=root) is None
    assert "lay_nope" in registry.not_registered("lay_nope")


def test_train_and_which_resolve_a_name_alike(tmp_path, registered):
    from seqcache.training.config import DataConfig
    from seqcache.training.data import resolve_source

    root = str(tmp_path)
    folder = _fake_cache(tmp_path / "lay_a" / "train")
    _fake_cache(tmp_path / "lay_a" / "dev")
    by_folder = resolve_source(DataConfig(task=folder), "train")
    assert by_folder.kwargs == {"cache": folder} and by_folder.name == folder
    sibling = resolve_source(DataConfig(task=folder), "dev")  # the other split of a cache folder
    assert sibling.kwargs == {"cache": os.path.join(root, "lay_a", "dev")}
    by_name = resolve_source(DataConfig(task="lay_a", cache_dir=root), "train")
    assert by_name.kwargs == {"cache": folder} and by_name.name == "lay_a/train"
    mix = resolve_source(DataConfig(task="lay_mix", cache_dir=root), "train")
    assert mix.kwargs["mixture"] is tasks.get_task_or_mixture("lay_mix") and mix.kwargs["caches_root"] == root
    assert mix.cache_dirs == (folder, os.path.join(root, "lay_b", "train"))
    # which names the same folder for the same name (the fake manifest is then refused when read).
    out = CliRunner().invoke(main, ["which", "lay_a", "--cache-dir", root, "--step", "0", "--row", "0",
                                    "--batch-size", "1"])
    assert out.exit_code != 0 and folder in out.output, out.output
    missing = CliRunner().invoke(main, ["which", "lay_nope", "--cache-dir", root, "--step", "0", "--row", "0",
                                        "--batch-size", "1"])
    assert missing.exit_code == 2 and f"no cache at {os.path.join(root, 'lay_nope', 'train')}" in missing.output


def test_a_task_folder_given_for_a_cache_names_its_splits(tmp_path):
    from seqcache import format as fmt
    from seqcache.pipelines.writer import write_cache
    import numpy as np

    cache = tmp_path / "t" / "validation"
    write_cache(str(cache), task="t", split="validation", features=(fmt.FeatureSpec("targets", "int32"),),
                shards=[[({"targets": np.arange(3, 8, dtype=np.int32)}, [(0, 0, 0)])]],
                sources=[{"path": "synthetic"}], fingerprint_inputs={"t": 1})
    out = CliRunner().invoke(main, ["info", str(tmp_path / "t")])
    assert out.exit_code == 1 and "this is a task folder" in out.output and "validation" in out.output, out.output
    # An empty folder is still "incomplete or not a cache".
    (tmp_path / "empty").mkdir()
    out = CliRunner().invoke(main, ["info", str(tmp_path / "empty")])
    assert out.exit_code == 1 and "not a cache folder" in out.output, out.output
