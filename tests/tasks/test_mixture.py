"""Mixture rates (seqio semantics) and fingerprints."""

import json

import pytest

from seqcache.tasks import ByteVocabulary, Feature, FunctionSource, Mixture, Task, TaskRegistry, rate_num_examples


def _nothing():
    return []


def test_constant_rates_and_default():
    m = Mixture("mix", [("a", 1.0), ("b", 3)])
    assert m.task_names == ["a", "b"]
    assert m.get_rates() == {"a": 1.0, "b": 3.0}
    d = Mixture("mix2", ["a", "b", "c"], default_rate=2)
    assert d.get_rates() == {"a": 2.0, "b": 2.0, "c": 2.0}


def test_rate_num_examples_temperature_and_maximum():
    counts = {"big": 1_000_000, "mid": 10_000, "small": 100}
    m = Mixture("m", [(n, rate_num_examples()) for n in counts])
    assert m.get_rates(counts) == {"big": 1e6, "mid": 1e4, "small": 100.0}
    capped = Mixture("c", [(n, rate_num_examples(maximum=50_000)) for n in counts])
    assert capped.get_rates(counts) == {"big": 50_000.0, "mid": 1e4, "small": 100.0}
    hot = Mixture("t", [(n, rate_num_examples(temperature=2.0)) for n in counts])
    assert hot.get_rates(counts) == pytest.approx({"big": 1000.0, "mid": 100.0, "small": 10.0})
    scaled = rate_num_examples(maximum=300, temperature=2.0, scale=4.0)
    assert scaled(100) == pytest.approx(300 ** 0.5) and scaled(25) == pytest.approx(10.0)
    assert rate_num_examples()(0) == 0.0
    # Mixed constant and count-based rates.
    mixed = Mixture("x", [("big", rate_num_examples()), ("fixed", 5.0)])
    assert mixed.get_rates({"big": 7}) == {"big": 7.0, "fixed": 5.0}


def test_rate_errors():
    with pytest.raises(ValueError, match="total rate is 0.0"):
        Mixture("z", [("a", 0), ("b", 0.0)]).get_rates()
    with pytest.raises(ValueError, match="total rate is 0.0"):
        Mixture("z", [("a", rate_num_examples())]).get_rates({"a": 0})
    with pytest.raises(ValueError, match="rate of task 'a' must be >= 0"):
        Mixture("n", [("a", -1)])
    with pytest.raises(ValueError, match="rates must be >= 0"):
        Mixture("n", [("a", lambda n: -1.0)]).get_rates({"a": 3})
    with pytest.raises(ValueError, match="depends on its number of examples, which was not given"):
        Mixture("n", [("a", rate_num_examples())]).get_rates({})
    with pytest.raises(ValueError, match="has no rate"):
        Mixture("n", ["a"])
    with pytest.raises(ValueError, match="listed twice"):
        Mixture("n", [("a", 1), ("a", 2)])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rate_num_examples(temperature=0)


def test_fingerprint_and_task_objects():
    task = Task("inline", source=FunctionSource(_nothing, name="nothing"),
                output_features={"targets": Feature(ByteVocabulary())})
    m = Mixture("m", [(task, rate_num_examples(maximum=10)), ("other", 2.0)])
    fp = m.fingerprint()
    assert json.loads(json.dumps(fp)) == {
        "name": "m",
        "tasks": [["inline", {"rate_num_examples": {"maximum": 10, "temperature": 1.0, "scale": 1.0}}],
                  ["other", 2.0]]}
    assert Mixture("m", [(task, rate_num_examples(maximum=11)), ("other", 2.0)]).fingerprint() != fp
    TaskRegistry.reset()
    with pytest.raises(KeyError, match="no task named 'other'"):
        m.get_tasks()
    other = TaskRegistry.add("other", source=FunctionSource(_nothing, name="nothing"),
                             output_features={"targets": Feature(ByteVocabulary())})
    try:
        assert m.get_tasks() == [task, other]
    finally:
        TaskRegistry.reset()


def _task(name, *features):
    return Task(name, source=FunctionSource(_nothing, name="nothing"),
                output_features={f: Feature(ByteVocabulary()) for f in features})


def test_tasks_with_different_output_features_are_refused_naming_each():
    lm, mt = _task("wiki", "targets"), _task("wmt", "inputs", "targets")
    with pytest.raises(ValueError) as e:
        Mixture("mix", [(lm, 1), (mt, 1)])
    assert str(e.value) == (
        "mixture 'mix': its tasks have different output features, so a feeder would drop some tasks' features: "
        "task 'wiki' has ['targets']; task 'wmt' has ['inputs', 'targets']. Mix only tasks with the same output "
        "features (e.g. register a variant of each task with only the features they share, ['targets'])")
    # Registered names are checked at construction too, and in any order of features.
    TaskRegistry.reset()
    try:
        TaskRegistry.add(mt)
        with pytest.raises(ValueError, match="task 'wiki' has \\['targets'\\]; task 'wmt' has \\['inputs', 'targets'\\]"):
            Mixture("mix", [lm, "wmt"], default_rate=1)
        assert Mixture("mt", ["wmt", _task("iwslt", "targets", "inputs")], default_rate=1).task_names == ["wmt", "iwslt"]
        # A name registered after the mixture was built is checked when it is resolved.
        late = Mixture("late", [(lm, 1), ("later", 1)])
        TaskRegistry.add(_task("later", "inputs", "targets"))
        with pytest.raises(ValueError, match="task 'later' has \\['inputs', 'targets'\\]"):
            late.get_tasks()
    finally:
        TaskRegistry.reset()
    # Tasks that share no feature: no variant to suggest.
    with pytest.raises(ValueError, match=r"task 'b' has \['text'\]\. Mix only tasks with the same output features$"):
        Mixture("mix", [_task("a", "targets"), _task("b", "text")], default_rate=1)
