"""seqcache.tasks.metrics: the library-backed metrics against the libraries run
directly, the others on hand-made cases, run_metrics' errors, postprocess,
pretokenized_text, and Task's metric_fns / postprocess_fn checks."""

import functools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from seqcache import tasks
from seqcache.tasks import metrics

sacrebleu = pytest.importorskip("sacrebleu")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

PAIRS = [
    ("The cat sat on the mat .", "The cat sat on a mat ."),
    ("A man is riding a bicycle down the street . He waves .", "A man rides a bike down the road . He waves ."),
    ("Zwei Hunde spielen im Schnee .", "Zwei Hunde spielen im Schnee ."),
    ("Ein Mädchen liest ein Buch über Drachen .", "Das Mädchen liest ein Buch ."),
    ("It rained all day , so we stayed home .", "We stayed at home because it rained ."),
]


@pytest.fixture()
def predictions_file(tmp_path):
    """Targets and predictions as an evaluator writes them: JSON lines, read back."""
    path = tmp_path / "predictions.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for target, prediction in PAIRS:
            f.write(json.dumps({"target": target, "prediction": prediction}, ensure_ascii=False) + "\n")
    rows = [json.loads(line) for line in open(path, encoding="utf-8")]
    return [r["target"] for r in rows], [r["prediction"] for r in rows]


def test_bleu_and_chrf_equal_sacrebleu_run_directly(predictions_file):
    targets, predictions = predictions_file
    direct = sacrebleu.corpus_bleu(predictions, [targets], smooth_method="exp", tokenize="intl",
                                   lowercase=False, use_effective_order=False)
    assert metrics.bleu(targets, predictions) == {"bleu": pytest.approx(direct.score, abs=1e-9)}
    assert 0 < direct.score < 100
    assert metrics.bleu(targets, predictions, tokenizer="13a")["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(predictions, [targets], tokenize="13a").score, abs=1e-9)
    chrf = sacrebleu.corpus_chrf(predictions, [targets]).score
    assert metrics.chrf(targets, predictions) == {"chrf": pytest.approx(chrf, abs=1e-9)}
    assert metrics.bleu(targets, targets)["bleu"] == pytest.approx(100.0)


def test_bleu_with_several_references_per_example(predictions_file):
    targets, predictions = predictions_file
    multi = [[t, p] for t, p in zip(targets, predictions)]  # the prediction is one of the references
    streams = [targets, predictions]
    assert metrics.bleu(multi, predictions)["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(predictions, streams, tokenize="intl").score, abs=1e-9)
    assert metrics.bleu(multi, predictions)["bleu"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="same number of references"):
        metrics.bleu([["a"], ["b", "c"]], ["a", "b"])


def test_rouge_equals_rouge_score_run_directly(predictions_file):
    targets, predictions = predictions_file
    keys = ["rouge1", "rouge2", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(keys)
    sums = dict.fromkeys(keys, 0.0)
    for t, p in zip(targets, predictions):
        s = scorer.score(t.replace(" . ", " .\n"), p.replace(" . ", " .\n"))
        for k in keys:
            sums[k] += s[k].fmeasure
    want = {k: 100 * v / len(targets) for k, v in sums.items()}
    got = metrics.rouge(targets, predictions)
    assert list(got) == keys
    assert got == pytest.approx(want, abs=1e-9)
    # rougeLsum splits at " . " (t5's rule): two sentences in swapped order match whole.
    two = (["alpha beta gamma . delta epsilon zeta"], ["delta epsilon zeta . alpha beta gamma"])
    assert metrics.rouge(*two, score_keys=["rougeL", "rougeLsum"]) == {"rougeL": 50.0, "rougeLsum": 100.0}


def test_exact_match_normalises_like_squad():
    assert metrics.exact_match(["The Cat!", "a dog"], ["cat", "dog ."]) == {"exact_match": 100.0}
    assert metrics.exact_match(["Paris", ["Rome", "the Eternal City"]], ["paris", "eternal  city"]) == \
        {"exact_match": 100.0}
    assert metrics.exact_match(["Paris", "Rome"], ["London", "rome"]) == {"exact_match": 50.0}
    assert metrics.exact_match(["cats"], ["cat"]) == {"exact_match": 0.0}


def test_accuracy_and_sequence_accuracy():
    assert metrics.accuracy([1, 2, 3, 4], [1, 0, 3, 0]) == {"accuracy": 50.0}
    assert metrics.accuracy(["yes", "no", "no"], ["yes", "no", "yes"])["accuracy"] == pytest.approx(200 / 3)
    assert metrics.sequence_accuracy(["a b", "c"], ["a b", "c "]) == {"sequence_accuracy": 50.0}
    tokens = [np.array([1, 2, 3]), np.array([4, 5])]
    assert metrics.sequence_accuracy(tokens, [np.array([1, 2, 3]), np.array([4, 5, 6])]) == \
        {"sequence_accuracy": 50.0}
    assert metrics.sequence_accuracy([[1, 2]], [[1, 2]]) == {"sequence_accuracy": 100.0}
    with pytest.raises(ValueError, match="no examples"):
        metrics.accuracy([], [])


def test_score_metrics():
    scores = [-2.0, -4.0]
    assert metrics.mean_log_likelihood(["x", "y"], scores) == {"mean_log_likelihood": -3.0}
    # Tokens: 6 in all, -6 nats: perplexity e.
    assert metrics.perplexity([[5, 6], [7, 8, 9, 1]], scores) == {"perplexity": pytest.approx(math.e)}
    assert metrics.perplexity([2, 4], scores) == {"perplexity": pytest.approx(math.e)}
    # Text counts words: 3 words, -6 nats: e^2.
    assert metrics.perplexity(["one two", "three"], scores) == {"perplexity": pytest.approx(math.e ** 2)}
    assert metrics.perplexity(["a"], [-1e6]) == {"perplexity": math.inf}
    with pytest.raises(ValueError, match="no tokens or words"):
        metrics.perplexity([""], [-1.0])


def _raises(targets, predictions):
    raise RuntimeError("bad\ninput")


def _text(targets, predictions):
    return {"x": "high"}


def _nan(targets, scores):
    return {"nan_metric": float("nan")}


def test_run_metrics_runs_each_kind_on_its_inputs():
    out = metrics.run_metrics("t", [metrics.accuracy, metrics.mean_log_likelihood, _nan],
                              targets=["a", "b"], predictions=["a", "c"], scores=[-1.0, -3.0])
    assert out["accuracy"] == 50.0 and out["mean_log_likelihood"] == -2.0
    assert math.isnan(out["nan_metric"])  # a NaN is a number: kept, not an error
    assert list(out) == ["accuracy", "mean_log_likelihood", "nan_metric"]
    rouge_l = functools.partial(metrics.rouge, score_keys=["rougeL"])
    assert metrics.run_metrics("t", [rouge_l], targets=["a b"], predictions=["a b"]) == {"rougeL": 100.0}
    assert metrics.metric_names([metrics.bleu, rouge_l, _nan]) == ["bleu", "rouge", "_nan"]


@pytest.mark.parametrize("fns, kwargs, message", [
    ([_raises], {"predictions": ["a"]}, "task 'wmt', metric '_raises' raised RuntimeError: bad input"),
    ([_text], {"predictions": ["a"]}, "task 'wmt', metric '_text' returned 'x': 'high' (str); expected"),
    ([lambda targets, predictions: [1.0]], {"predictions": ["a"]}, "task 'wmt', metric '<lambda>' returned [1.0]"),
    ([lambda targets, predictions: {"b": True}], {"predictions": ["a"]},
     "task 'wmt', metric '<lambda>' returned 'b': True (bool)"),
    ([metrics.mean_log_likelihood], {"predictions": ["a"]},
     "task 'wmt', metric 'mean_log_likelihood': a score metric needs scores, and none were given"),
    ([metrics.bleu], {"predictions": ["a", "b"]}, "task 'wmt', metric 'bleu': 2 predictions for 1 targets"),
    ([metrics.accuracy, metrics.sequence_accuracy, functools.partial(metrics.accuracy)], {"predictions": ["a"]},
     "task 'wmt', metric 'accuracy' returned 'accuracy', which metric 'accuracy' already gave"),
    ([len], {"predictions": ["a"]}, "task 'wmt', metric 'len': takes neither"),
])
def test_run_metrics_errors_are_one_line_naming_task_and_metric(fns, kwargs, message):
    with pytest.raises(metrics.MetricError) as e:
        metrics.run_metrics("wmt", fns, targets=["a"], **kwargs)
    assert "\n" not in str(e.value) and str(e.value).startswith(message)
    assert isinstance(e.value, ValueError)


def _source(tmp_path):
    if not (tmp_path / "a.txt").exists():
        (tmp_path / "a.txt").write_text("x\n")
    return tasks.TextLineSource(str(tmp_path / "a.txt"))


def _task(tmp_path, **kw):
    return tasks.Task("eval_task", source=_source(tmp_path),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())}, **kw)


def test_task_sorts_metrics_by_signature_and_refuses_bad_ones(tmp_path):
    t = _task(tmp_path, metric_fns=[metrics.bleu, metrics.perplexity, functools.partial(metrics.rouge)],
              postprocess_fn=str.strip)
    assert t.predict_metric_fns == (metrics.bleu, t.metric_fns[2]) and t.score_metric_fns == (metrics.perplexity,)
    assert t.evaluation() == {"metrics": ["bleu", "perplexity", "rouge"], "postprocess_fn": "strip",
                              "pretokenized": ["targets_pretokenized"]}
    assert _task(tmp_path).evaluation() is None and _task(tmp_path).metric_fns == ()
    assert _task(tmp_path, metric_fns=[metrics.bleu], packing="lm").pretokenized_features == ()
    for bad, message in [
        ([42], "task 'eval_task': metric_fns holds 42, which is not callable"),
        ([lambda x, y: {}], "task 'eval_task': metric '<lambda>' must take"),
        ([lambda targets, predictions, scores: {}], "must take"),
        (metrics.bleu, "metric_fns must be a sequence"),
    ]:
        with pytest.raises(TypeError, match=message):
            _task(tmp_path, metric_fns=bad)
    with pytest.raises(TypeError, match="task 'eval_task': postprocess_fn must be callable"):
        _task(tmp_path, postprocess_fn="lower")


def test_the_fingerprint_changes_with_the_metrics_only_for_tasks_with_metrics(tmp_path):
    plain = _task(tmp_path).fingerprint(seed=0, sequence_length=None)
    assert "evaluation" not in plain
    with_bleu = _task(tmp_path, metric_fns=[metrics.bleu]).fingerprint(seed=0, sequence_length=None)
    with_chrf = _task(tmp_path, metric_fns=[metrics.chrf]).fingerprint(seed=0, sequence_length=None)
    assert with_bleu["evaluation"]["metrics"] == ["bleu"] and with_bleu != with_chrf
    assert {k: v for k, v in with_bleu.items() if k != "evaluation"} == plain


def test_a_mixture_s_tasks_keep_their_metrics(tmp_path):
    a = _task(tmp_path, metric_fns=[metrics.bleu], postprocess_fn=str.strip)
    mixture = tasks.Mixture("mix", [(a, 1.0)])
    (got,) = mixture.get_tasks()
    assert got.metric_fns == (metrics.bleu,) and got.postprocess_fn is str.strip


def _upper(output, example=None, is_target=False):
    return (output.upper(), example["id"] if example else None, is_target)


def test_postprocess(tmp_path):
    assert metrics.postprocess(_task(tmp_path), ["a", "b"], None, is_target=True) == ["a", "b"]
    t = _task(tmp_path, postprocess_fn=_upper, metric_fns=[metrics.bleu])
    assert metrics.postprocess(t, ["a", "b"], [{"id": 1}, {"id": 2}], is_target=False) == \
        [("A", 1, False), ("B", 2, False)]
    assert metrics.postprocess(t, ["a"], None, is_target=True) == [("A", None, True)]
    with pytest.raises(metrics.MetricError, match="task 'eval_task', postprocess_fn '_upper' raised KeyError on "
                                                  "prediction 1"):
        metrics.postprocess(t, ["a", "b"], [{"id": 1}, {"x": 2}], is_target=False)
    with pytest.raises(metrics.MetricError, match="2 examples for 1 outputs"):
        metrics.postprocess(t, ["a"], [{}, {}], is_target=True)


def _none(output, example=None, is_target=False):
    return None


def _label(output, example=None, is_target=False):
    return {"yes": 1, "no": 0}.get(output.strip(), -1)


def test_refusal_names_what_the_metrics_take():
    # None, whatever the metrics: accuracy would count None == None as a hit.
    assert metrics.accuracy([None, None], [None, None]) == {"accuracy": 100.0}
    for fns in ([metrics.accuracy], [metrics.sequence_accuracy], [_raises], []):
        assert metrics.refusal(fns, None, is_target=False) == "no metric takes None (return text, a label or a number)"
    assert metrics.refusal([metrics.bleu], 3, is_target=False) == "metric 'bleu' takes a string"
    assert metrics.refusal([functools.partial(metrics.bleu, tokenizer="13a")], ["a"], is_target=False) == \
        "metric 'bleu' takes a string"
    assert metrics.refusal([metrics.bleu], ["a", "b"], is_target=True) is None  # two references
    assert metrics.refusal([metrics.exact_match], [], is_target=True) == \
        "metric 'exact_match' takes a string or a non-empty list of strings"
    assert metrics.refusal([metrics.accuracy], 1, is_target=True) is None
    assert metrics.refusal([metrics.accuracy], np.int64(1), is_target=False) is None
    assert metrics.refusal([metrics.accuracy], [1, 2], is_target=False) == \
        "metric 'accuracy' takes a label (a string or a number)"
    assert metrics.refusal([metrics.sequence_accuracy], np.array([1, 2]), is_target=False) is None
    assert metrics.refusal([metrics.sequence_accuracy], np.zeros((2, 2)), is_target=False).startswith(
        "metric 'sequence_accuracy' takes a string or a token sequence")
    assert metrics.refusal([metrics.perplexity], 7, is_target=True) is None
    assert metrics.refusal([metrics.perplexity], 7.5, is_target=True) == \
        "metric 'perplexity' takes text, token ids or a token count"
    assert metrics.refusal([metrics.mean_log_likelihood], {"any": "thing"}, is_target=True) is None
    # Another library's metric: its types are its own, only None is refused.
    assert metrics.refusal([_text], {"answer": 1}, is_target=False) is None


def test_check_postprocessed_names_the_postprocess_fn_and_the_example(tmp_path):
    t = _task(tmp_path, postprocess_fn=_none, metric_fns=[metrics.accuracy, metrics.sequence_accuracy])
    where = ["cache index 0 (/data/val.txt, line 1)", "cache index 1 (/data/val.txt, line 2)"]
    with pytest.raises(metrics.MetricError) as e:
        metrics.check_postprocessed(t, targets=["a", "b"], predictions=[None, None], examples=where)
    assert str(e.value) == ("task 'eval_task': postprocess_fn '_none' returned None (NoneType) for the prediction of "
                            "cache index 0 (/data/val.txt, line 1), but no metric takes None (return text, a "
                            "label or a number)")
    # The first example at fault, the target before the prediction.
    with pytest.raises(metrics.MetricError, match=r"for the target of cache index 1 \(/data/val.txt, line 2\)"):
        metrics.check_postprocessed(t, targets=["a", None], predictions=["a", None], examples=where)
    t = _task(tmp_path, postprocess_fn=_label, metric_fns=[metrics.bleu])
    with pytest.raises(metrics.MetricError, match="postprocess_fn '_label' returned 1 \\(int\\) for the target of "
                                                  "cache index 0 .*, but metric 'bleu' takes a string or a non-empty"):
        metrics.check_postprocessed(t, targets=[1, 0], predictions=["yes", "no"], examples=where)
    t = _task(tmp_path, postprocess_fn=_label, metric_fns=[metrics.accuracy])
    metrics.check_postprocessed(t, targets=[1, 0], predictions=[1, -1], examples=where)  # labels: taken
    # Score metrics take no predictions: those are not checked.
    t = _task(tmp_path, postprocess_fn=_none, metric_fns=[metrics.perplexity])
    metrics.check_postprocessed(t, targets=["a b", "c"], predictions=None, examples=where)


def test_pretokenized_text():
    text = "Zwei Hunde spielen im Schnee. ☃"
    stored = np.frombuffer(text.encode("utf-8"), np.uint8)
    assert metrics.pretokenized_text({"targets_pretokenized": stored}) == text
    padded = np.zeros(64, np.int32)
    padded[:stored.size] = stored
    assert metrics.pretokenized_text({"targets_pretokenized": padded}) == text
    assert metrics.pretokenized_text({"inputs_pretokenized": b"hi"}, "inputs") == "hi"
    assert metrics.pretokenized_text({"targets": np.array([1, 2])}) is None
    with pytest.raises(ValueError, match="not UTF-8"):
        metrics.pretokenized_text({"targets_pretokenized": np.array([0xFF], np.uint8)})
    with pytest.raises(ValueError, match="are not bytes"):
        metrics.pretokenized_text({"targets_pretokenized": np.array([300])})


def test_importing_the_feeders_and_tasks_imports_no_metric_library():
    code = ("import sys, seqcache.feeders, seqcache.tasks, seqcache.tasks.metrics; "
            "print(sorted(m for m in ('sacrebleu', 'rouge_score', 'nltk') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
