"""seqcache.feeders.trainers.t5x.seqio_task with the real seqio: the seqio Task of a
cache carries the postprocess_fn and metrics of the seqcache task, or of a seqio
Task registered under the cache's task name, and yields the cache's target
text as seqio's ``targets_pretokenized``. Skipped where seqio is not installed
(it is in the t5x venv of tests/trainers/t5x)."""

import numpy as np
import pytest

seqio = pytest.importorskip("seqio")

from seqcache import tasks  # noqa: E402
from seqcache.feeders.trainers import t5x  # noqa: E402
from seqcache.pipelines.build import BuildConfig, build_task  # noqa: E402
from seqcache.tasks import metrics  # noqa: E402
from seqcache.tasks import preprocessors as P  # noqa: E402

EN = [f"sentence number {i} about a small dog" for i in range(30)]
DE = [f"Satz Nummer {i} über einen kleinen Hund" for i in range(30)]


def _strip(output, example=None, is_target=False):
    return output.strip()


def _shout(output, example=None, is_target=False):
    return output.upper()


@pytest.fixture(scope="module")
def sp_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("seqio")
    vocab = tasks.train_sentencepiece(EN + DE, output_path=str(root / "sp.model"), vocab_size=295)
    (root / "val.en").write_text("\n".join(EN) + "\n", encoding="utf-8")
    (root / "val.de").write_text("\n".join(DE) + "\n", encoding="utf-8")
    task = tasks.Task(
        "wmt_sp", source=tasks.ParallelTextSource({"en": str(root / "val.en"), "de": str(root / "val.de")}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(), P.append_eos()],
        postprocess_fn=_strip, metric_fns=[metrics.bleu, metrics.perplexity])
    cache = build_task(task, cache_dir=str(root / "caches"),
                       config=BuildConfig(split="validation", num_shards=1)).cache_dir
    return task, cache


def test_the_seqio_task_carries_the_seqcache_task_s_metrics_and_target_text(sp_cache):
    task, cache = sp_cache
    made = t5x.seqio_task(cache, "seqcache_eval_given", task=task)
    try:
        assert made.postprocessor is _strip
        assert list(made.predict_metric_fns) == [metrics.bleu] and list(made.score_metric_fns) == [metrics.perplexity]
        assert seqio.get_mixture_or_task("seqcache_eval_given") is made
        assert t5x.seqio_task(cache, "seqcache_eval_given") is made  # registered once, then reused
        examples = list(made.get_dataset(None, split="validation", shuffle=False).as_numpy_iterator())
        assert sorted(ex["targets_pretokenized"].decode("utf-8") for ex in examples) == sorted(DE)
        vocab = made.output_features["targets"].vocabulary
        for ex in examples:
            ids = [int(i) for i in ex["targets"] if i != 1]
            assert vocab.decode(ids) == ex["targets_pretokenized"].decode("utf-8")
            assert ex["targets"].dtype == np.int32
    finally:
        seqio.TaskRegistry.remove("seqcache_eval_given")


def test_a_registered_seqio_task_of_the_same_name_lends_its_metrics(sp_cache):
    _, cache = sp_cache
    theirs = seqio.Task("wmt_sp", source=seqio.FunctionDataSource(lambda split, shuffle_files: None,
                                                                     splits=["validation"]),
                        output_features={}, postprocess_fn=_shout, metric_fns=[metrics.chrf])
    seqio.TaskRegistry.add_provider("wmt_sp", theirs)
    try:
        made = t5x.seqio_task(cache)
        assert made.name == "seqcache:wmt_sp:validation" and made is not theirs
        assert made.postprocessor is _shout and list(made.metric_fns) == [metrics.chrf]
        assert seqio.TaskRegistry.get("wmt_sp") is theirs  # left as it was
        assert sorted(made.output_features) == ["inputs", "targets"]
    finally:
        seqio.TaskRegistry.remove("wmt_sp")
        seqio.TaskRegistry.remove("seqcache:wmt_sp:validation")
        t5x._TASK_CACHES.pop("seqcache:wmt_sp:validation", None)
