"""An evaluation cache: a translation task with metrics keeps each example's
target line as ``targets_pretokenized`` (UTF-8 bytes), deterministically, and
the readers, converters and statistics treat it as no token feature."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.feeders import Feeder
from seqcache.feeders.converters import ConvertedFeeder
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines.build import BuildConfig, build_task
from seqcache.tasks import metrics
from seqcache.tasks import preprocessors as P

VOCAB = tasks.ByteVocabulary()
EN = [f"line {i}: a dog runs {'fast ' * (i % 4)}." for i in range(40)]
DE = [f"Zeile {i}: ein Hund läuft {'schnell ' * (i % 3)}— ☃" for i in range(40)]


def _files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "val.en").write_text("\n".join(EN) + "\n", encoding="utf-8")
    (folder / "val.de").write_text("\n".join(DE) + "\n", encoding="utf-8")
    return {"en": str(folder / "val.en"), "de": str(folder / "val.de")}


def _strip(output, example=None, is_target=False):
    return output.strip()


def _task(files, *, metric_fns=(metrics.bleu, metrics.chrf), packing=None):
    return tasks.Task(
        "wmt_tiny", source=tasks.ParallelTextSource(files),
        output_features={"inputs": tasks.Feature(VOCAB), "targets": tasks.Feature(VOCAB)},
        preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(), P.append_eos_after_trim()],
        packing=packing, postprocess_fn=_strip, metric_fns=metric_fns)


def _build(root, task, lengths=None):
    return build_task(task, cache_dir=str(root), config=BuildConfig(
        split="validation", num_shards=2, sequence_length=lengths or {"inputs": 64, "targets": 24})).cache_dir


def _digests(cache):
    m = fmt.read_manifest(cache)
    return [hashlib.sha256(open(os.path.join(cache, s.file), "rb").read()).hexdigest() for s in m.shards]


@pytest.fixture(scope="module")
def eval_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    return _build(root / "cache", _task(_files(root / "in")))


def test_the_cache_keeps_each_target_line_whole(eval_cache):
    m = fmt.read_manifest(eval_cache)
    assert [(f.name, f.dtype) for f in m.features] == [
        ("inputs", "uint16"), ("targets", "uint16"), ("targets_pretokenized", "uint8")]
    assert m.features[2].to_json() == {"name": "targets_pretokenized", "dtype": "uint8"}  # no vocabulary
    assert m.evaluation.to_json() == {"metrics": ["bleu", "chrf"], "postprocess_fn": "_strip",
                                   "pretokenized": ["targets_pretokenized"]}
    # Statistics and the source table count tokens of the token features only.
    assert sorted(m.statistics.tokens) == ["inputs", "targets"]
    assert sorted(m.read_source_table().tokens) == ["inputs", "targets"]
    with CacheReader(eval_cache) as r:
        idx = list(range(len(r)))
        seen = set()
        for ex, (seg,) in zip(r.read_examples(idx), r.read_sources(idx)):
            k = seg["record_number"]
            seen.add(k)
            assert ex["targets_pretokenized"].dtype == np.uint8
            # The whole line, though its tokens were trimmed to 24.
            assert metrics.pretokenized_text(ex) == DE[k]
            assert ex["targets"].tolist() == VOCAB.encode(DE[k])[:23] + [VOCAB.eos_id]
        assert seen == set(range(len(DE)))


def test_two_builds_write_the_same_bytes(eval_cache, tmp_path):
    again = _build(tmp_path / "cache", _task(_files(tmp_path / "in")))
    assert _digests(again) == _digests(eval_cache)


def test_without_metrics_or_packed_no_text_is_kept(eval_cache, tmp_path):
    files = _files(tmp_path / "in")
    plain = _build(tmp_path / "plain", _task(files, metric_fns=()))
    m = fmt.read_manifest(plain)
    assert [f.name for f in m.features] == ["inputs", "targets"]
    assert m.evaluation.to_json() == {"metrics": [], "postprocess_fn": "_strip", "pretokenized": []}
    assert m.fingerprint != fmt.read_manifest(eval_cache).fingerprint
    with CacheReader(plain) as a, CacheReader(eval_cache) as b:  # the same token features, example by example
        assert [{k: v.tolist() for k, v in ex.items()} for ex in a.read_examples(range(len(a)))] == \
            [{k: v.tolist() for k, v in ex.items() if k != "targets_pretokenized"}
             for ex in b.read_examples(range(len(b)))]
    packed = _build(tmp_path / "packed", _task(files, packing="first_fit"))
    m = fmt.read_manifest(packed)
    assert "targets_pretokenized" not in [f.name for f in m.features]
    assert m.evaluation.pretokenized == [] and m.evaluation.metrics == ["bleu", "chrf"]


def test_feeders_and_converters_read_the_cache_as_its_token_features(eval_cache):
    args = dict(cache=eval_cache, split="validation", global_batch_size=4, host_index=0, host_count=1,
                num_epochs=1)
    with ConvertedFeeder(converter="encdec", sequence_length={"inputs": 64, "targets": 24}, **args) as f:
        batch = f.get_batch(0)
    assert batch["encoder_input_tokens"].shape == (4, 64) and batch["decoder_target_tokens"].shape == (4, 24)
    with Feeder(feature="targets_pretokenized", sequence_length=128, **args) as f:
        rows = f.get_batch(0)
    with CacheReader(eval_cache) as r:
        first = r.read_examples(rows["cache_index"].tolist())
    assert [metrics.pretokenized_text({"targets_pretokenized": row}) for row in rows["targets_pretokenized"]] == \
        [metrics.pretokenized_text(ex) for ex in first]


def test_the_trainer_sees_the_token_features_and_mixes_with_a_plain_cache(eval_cache, tmp_path):
    pytest.importorskip("jax")
    from seqcache.training.data import Source, token_features_of

    plain = _build(tmp_path / "plain", _task(_files(tmp_path / "in"), metric_fns=()))
    both = Source(kwargs={"mixture": {eval_cache: 1.0, plain: 1.0}}, cache_dirs=(eval_cache, plain), name="mix")
    assert token_features_of(both) == ("inputs", "targets")
    with ConvertedFeeder(converter="encdec", sequence_length={"inputs": 64, "targets": 24}, mixture=both.kwargs[
            "mixture"], split="validation", global_batch_size=4, host_index=0, host_count=1, num_epochs=1) as f:
        assert sorted(set(f.get_batch(0)["task_index"].tolist()) | set(f.get_batch(1)["task_index"].tolist())) \
            == [0, 1]


def test_info_shows_the_metrics(eval_cache):
    run = [sys.executable, "-m", "seqcache.cli", "info", eval_cache]
    table = subprocess.run(run, capture_output=True, text=True, check=True, env={**os.environ, "COLUMNS": "200"})
    assert "bleu, chrf" in table.stdout and "_strip" in table.stdout and "targets_pretokenized" in table.stdout
    as_json = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True).stdout)
    assert as_json["evaluation"]["metrics"] == ["bleu", "chrf"]
    assert as_json["evaluation"]["postprocess_fn"] == "_strip"
    shown = json.loads(subprocess.run([sys.executable, "-m", "seqcache.cli", "show", eval_cache, "--json"],
                                      capture_output=True, text=True, check=True).stdout)
    shown = shown[0] if isinstance(shown, list) else shown
    text = shown["features"]["targets_pretokenized"]["text"]
    assert text in DE
    plain = subprocess.run([sys.executable, "-m", "seqcache.cli", "show", eval_cache], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})
    assert plain.returncode == 0 and not plain.stderr, plain.stderr
    assert "targets_pretokenized: " in plain.stdout and text in plain.stdout
    verified = subprocess.run([sys.executable, "-m", "seqcache.cli", "verify", eval_cache], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
