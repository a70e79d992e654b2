"""Tasks for the evaluation tests, imported with ``--module``: a copy task
(targets = inputs: each line of a text file, byte vocabulary) with the metric
exact_match, registered as ``copy`` and ``copy_t5`` (two runs in one test
session), ``copy_bad_metric`` with a metric that raises, and
``copy_none_postprocess`` whose postprocess_fn returns None, with accuracy
and sequence_accuracy (which would count None == None as a hit).

``copy_task(name, pattern)`` builds the same task over other files (the
tests build the train and validation caches with it; ``packing=`` packs them)."""

from seqcache import tasks
from seqcache.tasks import metrics
from seqcache.tasks import preprocessors as P


def broken_metric(targets, predictions):
    """A metric that fails: the evaluation must stop with one line naming it."""
    raise ZeroDivisionError("no examples counted")


def no_text(output, example=None, is_target=False):
    """A postprocess_fn that returns None: the evaluation must refuse it in one line naming it."""
    return None


def copy_task(name, pattern, metric_fns=(metrics.exact_match,), packing=None, postprocess_fn=None):
    vocab = tasks.ByteVocabulary()
    return tasks.Task(
        name,
        source=tasks.TextLineSource(pattern),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[P.rekey({"inputs": "text", "targets": "text"}), P.tokenize(), P.append_eos_after_trim()],
        metric_fns=metric_fns,
        packing=packing,
        postprocess_fn=postprocess_fn,
    )


for _name, _fns in (("copy", (metrics.exact_match,)), ("copy_t5", (metrics.exact_match,)),
                    ("copy_bad_metric", (metrics.exact_match, broken_metric))):
    if _name not in tasks.TaskRegistry.names():
        tasks.TaskRegistry.add(copy_task(_name, "unused.txt", _fns))
NONE_METRICS = (metrics.accuracy, metrics.sequence_accuracy)
if "copy_none_postprocess" not in tasks.TaskRegistry.names():
    tasks.TaskRegistry.add(copy_task("copy_none_postprocess", "unused.txt", NONE_METRICS, postprocess_fn=no_text))


def translation_task(name, inputs_pattern, targets_pattern):
    """English -> German on line-aligned files (``parallel:``), byte vocabulary, BLEU and chrF."""
    vocab = tasks.ByteVocabulary()
    return tasks.Task(
        name,
        source=tasks.ParallelTextSource({"inputs": inputs_pattern, "targets": targets_pattern}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[P.tokenize(), P.append_eos_after_trim()],
        metric_fns=(metrics.bleu, metrics.chrf),
    )


if "ntrex_en_de" not in tasks.TaskRegistry.names():
    tasks.TaskRegistry.add(translation_task("ntrex_en_de", "unused.en", "unused.de"))
