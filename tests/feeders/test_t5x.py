"""seqcache.feeders.trainers.t5x without t5x: the clu iterator t5x's get_dataset_fn gets
is the converted feeder's stream, positioned at the latest checkpoint step."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
from clu.data.dataset_iterator import ArraySpec, DatasetIterator

from seqcache import format as fmt
from seqcache.feeders import ConvertedFeeder, FeederStateError
from seqcache.feeders.trainers import t5x
from seqcache.pipelines.writer import write_cache

ROW_KEYS = ("task_index", "cache_index", "epoch")


# Stand-ins for seqio's converter classes: seqcache matches them by name.
class EncDecFeatureConverter:
    pass


class DecoderFeatureConverter:
    pass


class MyEncDec(EncDecFeatureConverter):
    pass


def _tokens(i, n):
    return (np.arange(n, dtype=np.int32) * 7 + i) % 200 + 3


@pytest.fixture(scope="module")
def encdec_cache(tmp_path_factory):
    """An unpacked inputs/targets cache of 30 examples in 3 shards; example i has
    inputs of 3 + i % 5 tokens and targets of 2 + i % 3, starting with i + 1."""
    path = tmp_path_factory.mktemp("t5x") / "span"
    shards = [[], [], []]
    for i in range(30):
        inputs = np.concatenate([[i + 1], _tokens(i, 2 + i % 5)]).astype(np.int32)
        targets = np.concatenate([[i + 1], _tokens(i + 1000, 1 + i % 3)]).astype(np.int32)
        shards[i // 10].append(({"inputs": inputs, "targets": targets}, [(0, i, 0)]))
    write_cache(str(path), task="span", split="train",
                features=(fmt.FeatureSpec("inputs", "int32"), fmt.FeatureSpec("targets", "int32")),
                shards=shards, sources=[{"path": "corpus/span.txt"}],
                fingerprint_inputs={"task": "span", "n": 30})
    return str(path)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """An unpacked targets cache of 23 examples of 8 tokens."""
    path = tmp_path_factory.mktemp("t5x") / "lm"
    shards = [[], []]
    for i in range(23):
        shards[i % 2].append(({"targets": np.concatenate([[i + 1], _tokens(i, 7)]).astype(np.int32)}, [(0, i, 0)]))
    write_cache(str(path), task="lm", split="train", features=(fmt.FeatureSpec("targets", "int32"),),
                shards=shards, sources=[{"path": "corpus/lm.txt"}], fingerprint_inputs={"task": "lm", "n": 23})
    return str(path)


def cfg(name, lengths, *, batch_size=4, seed=3, split="train", module=None):
    """t5x's DatasetConfig, as the fields get_deterministic_dataset reads."""
    return types.SimpleNamespace(mixture_or_task_name=name, task_feature_lengths=lengths, split=split,
                                 batch_size=batch_size, shuffle=True, seed=seed, use_cached=False, pack=True,
                                 module=module)


ENCDEC = {"inputs": 8, "targets": 4}


def expected(cache, converter, lengths, step, *, batch_size=4, seed=3, host=0, hosts=1):
    with ConvertedFeeder(converter=converter, cache=cache, sequence_length=lengths, global_batch_size=batch_size,
                         seed=seed, host_index=host, host_count=hosts) as f:
        return f.get_batch(step)


def model_fields(batch):
    return {k: v for k, v in batch.items() if k not in ROW_KEYS}


def assert_same(a, b):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert a[k].dtype == b[k].dtype, k


def test_importing_the_module_imports_no_trainer_or_framework():
    code = ("import sys, seqcache.feeders.trainers.t5x; "
            "print([m for m in ('t5x', 'gin', 'clu', 'seqio', 'tensorflow', 'jax') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("conv_cls, converter", [(MyEncDec, "encdec"), (DecoderFeatureConverter, "prefix_lm")])
def test_the_iterator_yields_the_converted_feeders_batches(encdec_cache, tmp_path, conv_cls, converter):
    it = t5x.get_deterministic_dataset(cfg(encdec_cache, ENCDEC), 0, 1, conv_cls, model_dir=str(tmp_path / "m"))
    assert isinstance(it, DatasetIterator)
    spec = it.element_spec
    for step in range(9):  # past the end of an epoch (30 examples, 4 a step)
        batch = next(it)
        assert_same(batch, model_fields(expected(encdec_cache, converter, ENCDEC, step)))
        assert set(spec) == set(batch)
        for k, v in batch.items():
            assert spec[k] == ArraySpec(dtype=v.dtype, shape=v.shape), k
    it.close()


def test_decoder_only_reads_targets_with_the_lm_converter(lm, tmp_path):
    it = t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}), 0, 1, DecoderFeatureConverter,
                                       model_dir=str(tmp_path))
    assert sorted(it.element_spec) == ["decoder_input_tokens", "decoder_loss_weights", "decoder_positions",
                                       "decoder_segment_ids", "decoder_target_tokens"]
    assert it.element_spec["decoder_loss_weights"] == ArraySpec(np.float32, (4, 8))
    for step in range(7):
        assert_same(next(it), model_fields(expected(lm, "lm", {"targets": 8}, step)))
    it.close()


def _checkpoints(model_dir, steps, *, extra=()):
    os.makedirs(model_dir, exist_ok=True)
    for s in steps:
        os.makedirs(os.path.join(model_dir, f"checkpoint_{s}"))
    for name in extra:
        os.makedirs(os.path.join(model_dir, name))
    (open(os.path.join(model_dir, "checkpoint_99"), "w")).close()  # a file, not a checkpoint


def test_it_starts_at_the_latest_checkpoint_step(lm, tmp_path):
    model_dir = str(tmp_path / "m")
    _checkpoints(model_dir, [0, 3, 7], extra=["checkpoint_12.orbax-checkpoint-tmp-1", "checkpoints_40"])
    assert t5x.latest_checkpoint_step(model_dir) == 7
    assert t5x.latest_checkpoint_step(str(tmp_path / "none")) is None
    c = cfg(lm, {"targets": 8})
    for kwargs, step in [({}, 7), ({"start_step": 2}, 5), ({"continue_from_last_checkpoint": False}, 0)]:
        it = t5x.get_deterministic_dataset(c, 0, 1, "lm", model_dir=model_dir, **kwargs)
        assert it.step == step
        assert_same(next(it), model_fields(expected(lm, "lm", {"targets": 8}, step)))
        it.close()
    with pytest.raises(ValueError, match="latest checkpoint step 7 is before start_step 8"):
        t5x.get_deterministic_dataset(c, 0, 1, "lm", model_dir=model_dir, start_step=8)
    with pytest.raises(ValueError, match="needs model_dir"):
        t5x.get_deterministic_dataset(c, 0, 1, "lm")


def test_hosts_read_their_rows_of_each_global_batch(encdec_cache, tmp_path):
    model_dir = str(tmp_path / "m")
    _checkpoints(model_dir, [2])
    its = [t5x.get_deterministic_dataset(cfg(encdec_cache, ENCDEC, batch_size=6), h, 2, MyEncDec,
                                         model_dir=model_dir) for h in range(2)]
    assert its[0].element_spec["encoder_input_tokens"] == ArraySpec(np.int32, (3, 8))
    for step in range(2, 8):
        parts = [next(it) for it in its]
        whole = model_fields(expected(encdec_cache, "encdec", ENCDEC, step, batch_size=6))
        assert_same({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, whole)
    for it in its:
        it.close()


# Runs in a fresh interpreter: H hosts' iterators at the latest checkpoint of a
# model folder; prints the cache index of every row of `steps` global batches.
RESUME_CHILD = r"""
import json, sys, types
from seqcache.feeders.trainers import t5x
req = json.load(sys.stdin)
c = types.SimpleNamespace(mixture_or_task_name=req["cache"], task_feature_lengths={"targets": 8}, split="train",
                          batch_size=req["batch"], seed=3, module=None)
rows = [[] for _ in range(req["steps"])]
for h in range(req["hosts"]):
    it = t5x.get_deterministic_dataset(c, h, req["hosts"], "lm", model_dir=req["model_dir"],
                                       record_path=req["record"])
    for s in range(req["steps"]):
        next(it)
    it.close()
for line in open(req["record"]):
    r = json.loads(line)
    rows[r["step"] - req["first"]] += r["cache_index"]
json.dump(rows, sys.stdout)
"""


def test_a_resume_on_another_host_count_continues_the_stream_in_a_fresh_process(lm, tmp_path):
    # One host runs steps 0..5 and "checkpoints" at step 3; two hosts in a fresh
    # process resume from the model folder and read rows of steps 3..5 again.
    record1 = str(tmp_path / "one.jsonl")
    it = t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}), 0, 1, "lm", model_dir=str(tmp_path / "m"),
                                       record_path=record1)
    for _ in range(6):
        next(it)
    it.close()
    one = [json.loads(line) for line in open(record1)]
    assert [r["step"] for r in one] == list(range(6))
    with ConvertedFeeder(converter="lm", cache=lm, sequence_length={"targets": 8}, global_batch_size=4, seed=3,
                         host_index=0, host_count=1) as f:
        assert [r["cache_index"] for r in one] == [f.get_batch(s)["cache_index"].tolist() for s in range(6)]
    model_dir = str(tmp_path / "m")
    _checkpoints(model_dir, [0, 3])
    req = {"cache": lm, "batch": 4, "hosts": 2, "model_dir": model_dir, "steps": 3, "first": 3,
           "record": str(tmp_path / "two.jsonl")}
    out = subprocess.run([sys.executable, "-c", RESUME_CHILD], input=json.dumps(req), capture_output=True,
                         text=True, check=True)
    assert json.loads(out.stdout) == [r["cache_index"] for r in one[3:]]
    two = [json.loads(line) for line in open(req["record"])]
    assert sorted((r["shard_id"], r["num_shards"], len(r["cache_index"])) for r in two) == \
        [(0, 2, 2)] * 3 + [(1, 2, 2)] * 3


def test_save_writes_the_feeder_state_and_restore_checks_it_in_a_fresh_iterator(lm, tmp_path):
    c = cfg(lm, {"targets": 8})
    it = t5x.get_deterministic_dataset(c, 0, 1, "lm", model_dir=str(tmp_path / "a"))
    for _ in range(3):
        next(it)
    path = tmp_path / "train_ds-000-of-001"
    it.save(path)
    it.close()
    saved = json.loads(path.read_text())
    assert saved["format"] == t5x.STATE_FORMAT and saved["state"]["position"] == 12
    # The saved state is the feeder's: a ConvertedFeeder restored from it goes on at step 3.
    with ConvertedFeeder(converter="lm", cache=lm, sequence_length={"targets": 8}, global_batch_size=4, seed=3,
                         host_index=0, host_count=1) as f:
        f.set_state(saved["state"])
        assert f.step == 3
        assert_same(model_fields(next(f)), model_fields(expected(lm, "lm", {"targets": 8}, 3)))
    # A fresh iterator (at the model folder's step 5) checks the state and keeps its position.
    model_dir = str(tmp_path / "b")
    _checkpoints(model_dir, [5])
    fresh = t5x.get_deterministic_dataset(c, 0, 1, "lm", model_dir=model_dir)
    fresh.restore(path)
    assert fresh.step == 5
    assert_same(next(fresh), model_fields(expected(lm, "lm", {"targets": 8}, 5)))
    fresh.reset()
    assert fresh.step == 0
    fresh.close()
    other = t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}, seed=4), 0, 1, "lm", model_dir=model_dir)
    with pytest.raises((FeederStateError, ValueError), match="seed"):
        other.restore(path)
    other.close()
    bad = tmp_path / "bad"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match=f"{bad}: not a seqcache t5x dataset state"):
        t5x.get_deterministic_dataset(c, 0, 1, "lm", model_dir=model_dir).restore(bad)


def test_names_resolve_to_caches_under_a_root(lm, tmp_path):
    caches_root = tmp_path / "caches"
    (caches_root / "lm").mkdir(parents=True)
    os.symlink(lm, caches_root / "lm" / "train")
    assert t5x.feeder_source("lm", split="train", caches_root=str(caches_root)) == \
        {"cache": str(caches_root / "lm" / "train")}
    assert t5x.feeder_source(types.SimpleNamespace(name=lm), split="train", caches_root=None) == {"cache": lm}
    with pytest.raises(ValueError, match="'wiki' is not a seqcache cache"):
        t5x.feeder_source("wiki", split="train", caches_root=str(caches_root))


def test_bad_configurations_get_one_clear_line(lm, encdec_cache, tmp_path):
    m = str(tmp_path)
    with pytest.raises(ValueError, match="seed is None"):
        t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}, seed=None), 0, 1, "lm", model_dir=m)
    with pytest.raises(ValueError, match="batch_size 4 is not divisible by the number of data shards 3"):
        t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}), 0, 3, "lm", model_dir=m)
    with pytest.raises(ValueError, match="not one seqcache converts to"):
        t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}), 0, 1, int, model_dir=m)
    it = t5x.get_deterministic_dataset(cfg(lm, {"targets": 8}), 0, 1, DecoderFeatureConverter, model_dir=m,
                                       seed=9)
    assert_same(next(it), model_fields(expected(lm, "lm", {"targets": 8}, 0, seed=9)))
    it.close()


def test_converter_names_follow_seqio():
    assert t5x.converter_name(MyEncDec, {"inputs": 1, "targets": 1}) == "encdec"
    assert t5x.converter_name(DecoderFeatureConverter, {"targets": 1}) == "lm"
    assert t5x.converter_name(DecoderFeatureConverter, {"inputs": 1, "targets": 1}) == "prefix_lm"
    assert t5x.converter_name(type("PrefixLMFeatureConverter", (), {}), {}) == "prefix_lm"
    assert t5x.converter_name(type("LMFeatureConverter", (), {}), {}) == "lm"


def test_the_gin_files_are_installed_with_the_package():
    names = sorted(os.listdir(t5x.gin_dir()))
    assert names == ["seqcache_common.gin", "seqcache_decoder_only_tiny.gin", "seqcache_t5_1_1_tiny.gin"]
    text = open(os.path.join(t5x.gin_dir(), "seqcache_common.gin")).read()
    assert "train_script.train.get_dataset_fn = @seqcache_t5x.get_deterministic_dataset" in text


def test_the_stored_vocabulary_path_is_absolute_for_a_relative_cache(tmp_path, corpora, monkeypatch):
    """seqio compares the task's and the model's vocabularies by file name, and
    the task's cache path is absolute: a CACHE given relative to the working
    folder must name the same file."""
    from click.testing import CliRunner

    from seqcache.cli.main import main

    model = tmp_path / "spm.model"
    trained = CliRunner().invoke(main, ["vocab", "train", "--source", f"text:{corpora.botchan}",
                                        "--vocab-size", "400", "--max-records", "2000", "--output", str(model)])
    assert trained.exit_code == 0, trained.output
    built = CliRunner().invoke(main, ["build", "--source", f"text:{corpora.botchan}", "--vocabulary", str(model),
                                      "--name", "bot", "--cache-dir", str(tmp_path / "caches")])
    assert built.exit_code == 0, built.output
    monkeypatch.chdir(tmp_path)
    path, extra_ids = t5x._stored_model(os.path.join("caches", "bot", "train"), "targets")
    assert os.path.isabs(path) and os.path.isfile(path), path
    assert path.startswith(str(tmp_path / "caches" / "bot" / "train")) and extra_ids == 0
