"""Evaluation metrics and their running (seqio's ``metric_fns``, t5's metrics).

A task's ``metric_fns`` are seqio's two kinds, told apart by parameter names
(``seqcache.tasks.task.metric_kind``): predict metrics ``fn(targets,
predictions) -> {name: value}`` and score metrics ``fn(targets, scores) ->
{name: value}``. ``run_metrics`` runs them once over a whole split;
``postprocess`` applies a task's ``postprocess_fn`` first.

The metrics here follow ``t5.evaluation.metrics`` in name, arguments, output
keys and scale (percentages on 0-100): ``bleu`` and ``chrf`` through sacrebleu
(Post, 2018, "A Call for Clarity in Reporting BLEU Scores"), ``rouge`` through
rouge-score (Lin, 2004), ``accuracy``, ``sequence_accuracy``, ``exact_match``
(SQuAD's normalised exact match, Rajpurkar et al., 2016), and the score
metrics ``mean_log_likelihood`` and ``perplexity``. sacrebleu and rouge-score
are imported inside the metrics that use them, so importing this module (or
``seqcache.tasks``) costs neither.

``check_postprocessed`` refuses, before any metric runs, a postprocessed
target or prediction that the task's metrics do not take (``postprocess_fn``
returned None, or a type one of this module's metrics does not take), naming
the postprocess_fn and the example.

``pretokenized_text`` reads the source's target text that an evaluation cache
keeps (``"targets_pretokenized"``, uint8 UTF-8 bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
import string
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from seqcache.codec import PRETOKENIZED_SUFFIX
from seqcache.tasks.task import function_names, metric_kind


class MetricError(ValueError):
    """A metric or a postprocess_fn failed; the one-line message names the task and the function."""


def metric_names(metric_fns: Sequence[Callable]) -> list[str]:
    """The names of ``metric_fns`` as the manifest and ``seqcache info`` show
    them: each function's ``__name__`` (a ``functools.partial``'s function's)."""
    return function_names(metric_fns)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _as_number(value) -> float | None:
    """``value`` as a float when it is a real number (a Python or numpy scalar,
    or a 0-d numeric array; NaN and infinities included, bools not), else None."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def run_metrics(task_name: str, metric_fns: Sequence[Callable], *, targets: list, predictions: list | None = None,
                scores: list[float] | None = None) -> dict[str, float]:
    """Runs each predict metric on ``(targets, predictions)`` and each score
    metric on ``(targets, scores)`` (by keyword), once each, in order.

    Args:
      task_name: the task, for messages.
      metric_fns: seqio metric functions (``Task.metric_fns``).
      targets: one (postprocessed) target per example.
      predictions: one (postprocessed) prediction per example; needed when
        there is a predict metric.
      scores: one score per example (the log-likelihood of its targets,
        nats); needed when there is a score metric.

    Returns:
      ``{key: float}``, every metric's keys together. A NaN or an infinity a
      metric returns is kept as it is (a number: the metric's own answer,
      e.g. a correlation of constant values), not an error.

    Raises:
      MetricError: one line naming the task and the metric: a function with
        neither signature; predictions or scores missing for it or of another
        length than the targets; the metric raised (its exception type and
        message follow); it returned something other than a mapping of
        string keys to real numbers; or a key another metric already gave.
    """
    out: dict[str, float] = {}
    given_by: dict[str, str] = {}
    for fn, name in zip(metric_fns, metric_names(metric_fns)):
        where = f"task {task_name!r}, metric {name!r}"
        kind = metric_kind(fn)
        if kind is None:
            raise MetricError(f"{where}: takes neither (targets, predictions) nor (targets, scores)")
        arg = "predictions" if kind == "predict" else "scores"
        values = predictions if kind == "predict" else scores
        if values is None:
            raise MetricError(f"{where}: a {kind} metric needs {arg}, and none were given")
        if len(values) != len(targets):
            raise MetricError(f"{where}: {len(values)} {arg} for {len(targets)} targets")
        try:
            result = fn(targets=targets, **{arg: values})
        except Exception as e:  # any failure of user code becomes one line naming it
            raise MetricError(f"{where} raised {type(e).__name__}: {_one_line(e)}") from e
        if not isinstance(result, Mapping):
            raise MetricError(f"{where} returned {_one_line(repr(result), 80)} ({type(result).__name__}); "
                              "expected a dict of metric name -> number")
        for key, value in result.items():
            number = _as_number(value)
            if not isinstance(key, str) or number is None:
                raise MetricError(f"{where} returned {key!r}: {_one_line(repr(value), 80)} "
                                  f"({type(value).__name__}); expected a string key and a real number")
            if key in out:
                raise MetricError(f"{where} returned {key!r}, which metric {given_by[key]!r} already gave")
            out[key], given_by[key] = number, name
    return out


def postprocess(task, outputs: list[str], examples: list[Mapping] | None, *, is_target: bool) -> list:
    """``task.postprocess_fn(output, example=example, is_target=is_target)``
    for each output (seqio's call), or the outputs unchanged when the task has
    none. ``task``: a seqcache ``Task`` (or any object with ``postprocess_fn``).

    Args:
      outputs: decoded texts, one per example.
      examples: the examples (feature -> value) they belong to, or None.
      is_target: whether the outputs are targets (True) or predictions.

    Returns:
      A list of the same length.

    Raises:
      MetricError: ``examples`` of another length; the function raised (one
        line naming the task, the function and the output's index).
    """
    fn = getattr(task, "postprocess_fn", None)
    outputs = list(outputs)
    name = getattr(task, "name", "?")
    if examples is not None and len(examples) != len(outputs):
        raise MetricError(f"task {name!r}: postprocess got {len(examples)} examples for {len(outputs)} outputs")
    if fn is None:
        return outputs
    fn_name = function_names([fn])[0]
    out = []
    for i, output in enumerate(outputs):
        try:
            out.append(fn(output, example=None if examples is None else examples[i], is_target=is_target))
        except Exception as e:
            which = "target" if is_target else "prediction"
            raise MetricError(f"task {name!r}, postprocess_fn {fn_name!r} raised {type(e).__name__} on {which} "
                              f"{i}: {_one_line(e)}") from e
    return out


def check_postprocessed(task, *, targets: Sequence, predictions: Sequence | None, examples: Sequence[str]) -> None:
    """Refuses a postprocessed target or prediction that the task's metrics do
    not take, before any metric runs: the first one, in the order given, that
    ``refusal`` finds fault with.

    Without this a ``postprocess_fn`` that returns None would be scored as
    if it meant something (``accuracy`` counts None == None as a hit) or
    would fail inside a metric, whose error then names the metric.

    Args:
      task: the task (``name``, ``metric_fns``, ``postprocess_fn``).
      targets: the postprocessed targets, one per example.
      predictions: the postprocessed predictions, one per example; None when
        no predict metric takes them (they are not checked then).
      examples: each example in words, for the message (the Evaluator gives
        ``"cache index 3 (/data/val.txt, line 4)"``).

    Raises:
      MetricError: one line naming the task, the postprocess_fn, what it
        returned (cut to 80 characters) and its type, the example, and what
        the metrics take.
    """
    metric_fns = tuple(getattr(task, "metric_fns", ()) or ())
    fn = getattr(task, "postprocess_fn", None)
    returned = f"postprocess_fn {function_names([fn])[0]!r} returned" if fn is not None else "the decoded text is"
    checks = [("target", targets, True)]
    if predictions is not None:
        checks.append(("prediction", predictions, False))
    for i, example in enumerate(examples):
        for which, values, is_target in checks:
            why = refusal(metric_fns, values[i], is_target=is_target)
            if why is not None:
                value = values[i]
                raise MetricError(f"task {getattr(task, 'name', '?')!r}: {returned} {_one_line(repr(value), 80)} "
                                  f"({type(value).__name__}) for the {which} of {example}, but {why}")


def refusal(metric_fns: Sequence[Callable], value, *, is_target: bool) -> str | None:
    """Why ``metric_fns`` do not take ``value`` as a postprocessed target
    (``is_target``) or prediction of an example, in words, or None when they do.

    None is refused whatever the metrics: seqio's and t5's metrics compare
    texts, labels or numbers, and none means anything by None. This module's
    metrics (also inside a ``functools.partial``) are held to what they take:
    ``bleu``, ``chrf`` and ``exact_match`` a string prediction and a string
    target or a non-empty list of strings (several references); ``rouge`` a
    string each; ``accuracy`` a label (a string or a number); ``sequence_accuracy``
    a string or a token sequence (a list, a tuple or a 1-D array);
    ``perplexity`` a target of text, token ids or a token count. Other
    metrics' types are their own and are not checked.
    """
    if value is None:
        return "no metric takes None (return text, a label or a number)"
    for fn, name in zip(metric_fns, metric_names(metric_fns)):
        while isinstance(fn, functools.partial):
            fn = fn.func
        takes = _TAKES.get(fn)
        kind = None if takes is None else takes[0 if is_target else 1]
        if kind is not None and not kind.accepts(value):
            return f"metric {name!r} takes {kind.words}"
    return None


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What a metric takes per example: ``words`` for messages, ``accepts`` the check."""

    words: str
    accepts: Callable[[Any], bool]


def _is_sequence(value) -> bool:
    return isinstance(value, (str, list, tuple)) or (isinstance(value, np.ndarray) and value.ndim == 1)


_TEXT = _Kind("a string", lambda v: isinstance(v, str))
_REFERENCES = _Kind("a string or a non-empty list of strings",
                    lambda v: isinstance(v, str) or (isinstance(v, (list, tuple)) and len(v) > 0
                                                     and all(isinstance(x, str) for x in v)))
_LABEL = _Kind("a label (a string or a number)", lambda v: isinstance(v, (str, bytes, numbers.Number, np.generic)))
_SEQUENCE = _Kind("a string or a token sequence (a list, a tuple or a 1-D array)", _is_sequence)
_UNITS = _Kind("text, token ids or a token count",
               lambda v: (isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))) or _is_sequence(v))


def pretokenized_text(example: Mapping[str, Any], feature: str = "targets") -> str | None:
    """The source's text of ``feature`` that an evaluation cache keeps for an
    example (``example["<feature>_pretokenized"]``), or None when the example
    has none (a cache of a task without metrics, or a packed one).

    The stored value is a 1-D uint8 array of UTF-8 bytes (what ``CacheReader``
    returns); a wider integer array is taken as a padded feeder row (trailing
    zeros dropped, bytes cut by the row's end replaced by U+FFFD); ``str`` and
    ``bytes`` are accepted as they are.

    Raises:
      ValueError: values outside [0, 255], not 1-D, or (uint8) not UTF-8.
    """
    key = feature + PRETOKENIZED_SUFFIX
    value = example.get(key) if isinstance(example, Mapping) else None
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8")
    array = np.asarray(value)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"{key}: expected a 1-D array of UTF-8 bytes (got {array.dtype} of shape {array.shape})")
    if array.dtype == np.uint8:
        try:
            return array.tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{key}: not UTF-8 ({e})") from None
    if array.size and (int(array.min()) < 0 or int(array.max()) > 255):
        raise ValueError(f"{key}: values in [{int(array.min())}, {int(array.max())}] are not bytes")
    return array.astype(np.uint8).tobytes().rstrip(b"\0").decode("utf-8", errors="replace")


def _nonempty(targets, values, what: str = "predictions") -> None:
    if len(targets) != len(values):
        raise ValueError(f"{len(values)} {what} for {len(targets)} targets")
    if not len(targets):
        raise ValueError("no examples")


def _reference_streams(targets: Sequence) -> list[list[str]]:
    """sacrebleu's references: one stream per reference. ``targets`` holds a
    string per example, or a list of strings per example (every example the
    same number)."""
    if targets and isinstance(targets[0], (list, tuple)):
        counts = {len(t) for t in targets}
        if len(counts) != 1:
            raise ValueError(f"every example needs the same number of references (got {sorted(counts)})")
        return [list(stream) for stream in zip(*targets)]
    return [list(targets)]


def bleu(targets, predictions, tokenizer: str = "intl") -> dict[str, float]:
    """Corpus BLEU (Papineni et al., 2002) by ``sacrebleu.corpus_bleu``, with
    t5's settings: exponential smoothing, no lowercasing, no effective order,
    sacrebleu tokenizer ``tokenizer`` (t5's default ``"intl"``).

    Args:
      targets: a reference string per example, or a list of references per
        example (the same number for every example).
      predictions: a string per example.

    Returns:
      ``{"bleu": score}``, 0-100.
    """
    import sacrebleu  # optional: sacrebleu (imported here: importing the metrics costs nothing)

    _nonempty(targets, predictions)
    result = sacrebleu.corpus_bleu(list(predictions), _reference_streams(targets), smooth_method="exp",
                                   force=False, lowercase=False, tokenize=tokenizer, use_effective_order=False)
    return {"bleu": float(result.score)}


def chrf(targets, predictions) -> dict[str, float]:
    """Corpus chrF (Popović, 2015) by ``sacrebleu.corpus_chrf`` with its
    defaults (character 6-grams, beta 2, no word n-grams).

    Args: as ``bleu``'s.

    Returns:
      ``{"chrf": score}``, 0-100.
    """
    import sacrebleu  # optional: sacrebleu

    _nonempty(targets, predictions)
    return {"chrf": float(sacrebleu.corpus_chrf(list(predictions), _reference_streams(targets)).score)}


def _sentence_lines(summary: str) -> str:
    """t5's preparation for rougeLsum: a newline after each " . " sentence end."""
    return summary.replace(" . ", " .\n")


def rouge(targets, predictions, score_keys: Sequence[str] | None = None, tokenizer=None) -> dict[str, float]:
    """ROUGE F-measures (Lin, 2004) by rouge-score's ``RougeScorer``, as t5
    computes them: keys ``rouge1``, ``rouge2``, ``rougeLsum`` by default, no
    stemming, and for ``rougeLsum`` each " . " in a text ends a line (a
    sentence). One difference: the per-example F-measures are averaged
    (exactly), where t5 reports the median of a random bootstrap of that mean
    (``BootstrapAggregator``'s ``mid``), which is not deterministic.

    Args:
      targets, predictions: a string per example.
      score_keys: rouge-score's keys (``rouge1``, ``rouge2``, ``rougeL``,
        ``rougeLsum``, ...).
      tokenizer: a rouge-score tokenizer (an object with ``tokenize``), or None.

    Returns:
      ``{key: mean F-measure * 100}``.
    """
    from rouge_score import rouge_scorer  # optional: rouge-score

    _nonempty(targets, predictions)
    keys = list(score_keys or ("rouge1", "rouge2", "rougeLsum"))
    scorer = rouge_scorer.RougeScorer(keys, tokenizer=tokenizer)
    sums = dict.fromkeys(keys, 0.0)
    for target, prediction in zip(targets, predictions):
        scores = scorer.score(target=_sentence_lines(target), prediction=_sentence_lines(prediction))
        for key in keys:
            sums[key] += scores[key].fmeasure
    return {key: 100.0 * sums[key] / len(targets) for key in keys}


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def _normalize_answer(text: str) -> str:
    """SQuAD's answer normalisation: lowercase, no punctuation, no articles
    (a, an, the), whitespace collapsed."""
    text = _ARTICLES.sub(" ", str(text).lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(targets, predictions) -> dict[str, float]:
    """SQuAD's exact match (the ``em`` of t5's ``squad``): the share of
    predictions equal, after ``_normalize_answer``, to the target or to any of
    an example's targets. Unlike ``sequence_accuracy`` it forgives case,
    punctuation, articles and spacing.

    Args:
      targets: a string, or a list of acceptable strings, per example.
      predictions: a string per example.

    Returns:
      ``{"exact_match": percent}``, 0-100.
    """
    _nonempty(targets, predictions)
    hits = 0
    for target, prediction in zip(targets, predictions):
        answers = target if isinstance(target, (list, tuple)) else [target]
        hits += _normalize_answer(prediction) in {_normalize_answer(a) for a in answers}
    return {"exact_match": 100.0 * hits / len(targets)}


def accuracy(targets, predictions) -> dict[str, float]:
    """The share of labels predicted exactly (t5's ``accuracy``,
    scikit-learn's ``accuracy_score`` on labels: strings, ints, ...).

    Returns:
      ``{"accuracy": percent}``, 0-100.
    """
    _nonempty(targets, predictions)
    return {"accuracy": 100.0 * sum(bool(t == p) for t, p in zip(targets, predictions)) / len(targets)}


def sequence_accuracy(targets, predictions) -> dict[str, float]:
    """The share of examples whose prediction equals the target exactly, as a
    whole sequence (t5's ``sequence_accuracy``): strings, or token sequences
    (lists or arrays, equal in length and every element).

    Returns:
      ``{"sequence_accuracy": percent}``, 0-100.
    """
    _nonempty(targets, predictions)
    same = 0
    for t, p in zip(targets, predictions):
        same += (t == p) if isinstance(t, str) or isinstance(p, str) else bool(np.array_equal(t, p))
    return {"sequence_accuracy": 100.0 * same / len(targets)}


def mean_log_likelihood(targets, scores) -> dict[str, float]:
    """The mean over examples of each example's log-likelihood of its targets
    (natural log, nats; ``seqcache.training.decoding.score``'s values).

    Returns:
      ``{"mean_log_likelihood": mean}`` (<= 0 for probabilities).
    """
    _nonempty(targets, scores, "scores")
    return {"mean_log_likelihood": float(np.mean(np.asarray(scores, dtype=np.float64)))}


def _unit_count(target) -> int:
    """What a target counts in perplexity's units: an int is a count; a string
    counts its whitespace-separated words; a sequence (token ids) its length."""
    if isinstance(target, (int, np.integer)) and not isinstance(target, bool):
        return int(target)
    if isinstance(target, str):
        return len(target.split())
    return len(target)


def perplexity(targets, scores) -> dict[str, float]:
    """Corpus perplexity: ``exp(-sum(scores) / sum(units))``, the exponential
    of the mean negative log-likelihood per unit. A target's units are its
    tokens when it is a token sequence (or an int count), its
    whitespace-separated words when it is text (word-level perplexity, which
    compares models with different vocabularies).

    Args:
      targets: per example, token ids, a token count, or text.
      scores: per example, the log-likelihood of its targets (nats).

    Returns:
      ``{"perplexity": value}`` (>= 1 for probabilities).

    Raises:
      ValueError: the targets hold no units.
    """
    _nonempty(targets, scores, "scores")
    units = sum(_unit_count(t) for t in targets)
    if units <= 0:
        raise ValueError("the targets hold no tokens or words to divide by")
    exponent = -float(np.sum(np.asarray(scores, dtype=np.float64))) / units
    return {"perplexity": math.exp(exponent) if exponent < 709.0 else math.inf}


# What each metric of this module takes per example: (target, prediction); None: not checked
# beyond None (``refusal``), or not given (a score metric's predictions).
_TAKES: dict[Callable, tuple[_Kind | None, _Kind | None]] = {
    bleu: (_REFERENCES, _TEXT), chrf: (_REFERENCES, _TEXT), rouge: (_TEXT, _TEXT),
    exact_match: (_REFERENCES, _TEXT), accuracy: (_LABEL, _LABEL), sequence_accuracy: (_SEQUENCE, _SEQUENCE),
    mean_log_likelihood: (None, None), perplexity: (_UNITS, None),
}

__all__ = [
    "MetricError", "accuracy", "bleu", "check_postprocessed", "chrf", "exact_match", "mean_log_likelihood",
    "metric_names", "perplexity", "postprocess", "pretokenized_text", "refusal", "rouge", "run_metrics",
    "sequence_accuracy",
]
