"""Task: preprocess_batch output and errors, fingerprint sensitivity."""

import hashlib
import json

import numpy as np
import pytest

from seqcache.tasks import (
    ByteVocabulary,
    Feature,
    FunctionPreprocessor,
    JsonLinesSource,
    SourceRecord,
    Task,
    TextLineSource,
    append_eos,
    append_eos_after_trim,
    filter_empty,
    rekey,
    tokenize,
)
from seqcache.tasks.sources import RecordIssue


def _keys(records):
    return [hashlib.blake2b(r.raw, digest_size=16).digest() for r in records]


@pytest.fixture()
def shakespeare(corpora):
    return TextLineSource(str(corpora.shakespeare), on_error={"empty": "keep"})


def _lm_task(source, **kw):
    pre = kw.pop("preprocessors", [rekey({"targets": "text"}), tokenize(), filter_empty(), append_eos()])
    return Task("shakespeare_lm", source=source, output_features={"targets": Feature(ByteVocabulary())},
                preprocessors=pre, **kw)


def test_preprocess_batch_lm(shakespeare):
    records = []
    for r in shakespeare.read_all():
        records.append(r)
        if len(records) == 400:
            break
    task = _lm_task(shakespeare)
    out = task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    # Empty lines are dropped by filter_empty; indices point at the source records.
    assert [i for i, _ in out] == [i for i, r in enumerate(records) if r.data["text"]]
    i, ex = out[0]
    assert set(ex) == {"targets"}
    assert ex["targets"].dtype == np.int32 and ex["targets"].ndim == 1
    assert ex["targets"].tolist() == [b + 3 for b in records[i].raw] + [1]


def test_preprocess_batch_trim_counts(shakespeare):
    records = [SourceRecord(0, n, {"text": t}, t.encode()) for n, t in enumerate(["abcdef", "ab", ""])]
    task = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(), append_eos_after_trim()])
    out = task.preprocess_batch(records, _keys(records), seed=0, sequence_length={"targets": 4})
    assert [(i, ex["targets"].tolist(), ex["_truncated_tokens"]) for i, ex in out] == [
        (0, [100, 101, 102, 1], 3), (1, [100, 101, 1], 0), (2, [1], 0)]


def test_preprocess_batch_errors_name_the_record(shakespeare):
    task = _lm_task(shakespeare, preprocessors=[tokenize()])  # no rekey: "targets" never appears
    records = [SourceRecord(3, 17, {"text": "x"}, b"x")]
    with pytest.raises(ValueError, match=r"task .*, line at byte 17 of file 3: required feature 'targets' is missing"):
        task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    untokenized = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"})])
    with pytest.raises(ValueError, match=r"line at byte 17 of file 3: feature 'targets' is still text"):
        untokenized.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    with pytest.raises(ValueError, match="got 0 keys for 1 records"):
        task.preprocess_batch(records, [], seed=0, sequence_length=None)


def test_optional_feature_and_source_errors(shakespeare):
    task = Task("pairs", source=shakespeare,
                output_features={"inputs": Feature(ByteVocabulary(), required=False), "targets": Feature(ByteVocabulary())},
                preprocessors=[rekey({"targets": "text"}), tokenize()])
    records = [SourceRecord(0, 0, {"text": "hi"}, b"hi"),
               SourceRecord(0, 1, {}, b"\xff", RecordIssue("skipped", "invalid_utf8", "bad bytes")),
               SourceRecord(0, 2, {"text": "yo"}, b"yo", RecordIssue("replaced", "u2581", "was repaired"))]
    out = task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    assert [i for i, _ in out] == [0, 2]  # the skipped record gives no example, the repaired one does
    assert out[1][1]["targets"].tolist() == list(ByteVocabulary().encode("yo"))
    assert out[0][1]["inputs"].dtype == np.int32 and out[0][1]["inputs"].size == 0


def _add_noise(example, ctx):
    return {**example, "targets": np.append(example["targets"], ctx.rng(0).integers(3, 259, 4))}


def test_randomness_independent_of_batch_position(shakespeare):
    task = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(),
                                                FunctionPreprocessor(_add_noise, "noise")])
    records = [SourceRecord(0, n, {"text": f"line {n}"}, f"line {n}".encode()) for n in range(50)]
    keys = _keys(records)
    whole = dict(task.preprocess_batch(records, keys, seed=5, sequence_length=None))
    order = list(reversed(range(50)))
    part = task.preprocess_batch([records[i] for i in order[:10]], [keys[i] for i in order[:10]], seed=5,
                                 sequence_length=None)
    for j, ex in part:
        np.testing.assert_array_equal(ex["targets"], whole[order[j]]["targets"])
    other_seed = dict(task.preprocess_batch(records, keys, seed=6, sequence_length=None))
    assert any(not np.array_equal(other_seed[i]["targets"], whole[i]["targets"]) for i in range(50))


def test_fingerprint_changes_with_every_input(corpora, shakespeare):
    base = _lm_task(shakespeare)
    fp = base.fingerprint(seed=1, sequence_length={"targets": 128})
    json.dumps(fp)  # JSON-able
    assert fp["name"] == "shakespeare_lm" and fp["seed"] == 1 and fp["packing"] is None
    assert fp["preprocessors"][0] == ["rekey", {"key_map": {"targets": "text"}}]
    assert fp == _lm_task(shakespeare).fingerprint(seed=1, sequence_length={"targets": 128})
    variants = [
        base.fingerprint(seed=2, sequence_length={"targets": 128}),
        base.fingerprint(seed=1, sequence_length={"targets": 256}),
        base.fingerprint(seed=1, sequence_length=None),
        _lm_task(shakespeare, packing="lm").fingerprint(seed=1, sequence_length={"targets": 128}),
        _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(copy_pretokenized=True)])
        .fingerprint(seed=1, sequence_length={"targets": 128}),
        Task("shakespeare_lm", source=shakespeare, output_features={"targets": Feature(ByteVocabulary(extra_ids=1))},
             preprocessors=base.preprocessors).fingerprint(seed=1, sequence_length={"targets": 128}),
        _lm_task(TextLineSource(str(corpora.wikitext / "wiki.test.raw.crlf")))
        .fingerprint(seed=1, sequence_length={"targets": 128}),
        _lm_task(JsonLinesSource(str(corpora.dolma / "*.jsonl.gz")))
        .fingerprint(seed=1, sequence_length={"targets": 128}),
    ]
    blobs = [json.dumps(v, sort_keys=True) for v in [fp, *variants]]
    assert len(set(blobs)) == len(blobs)


def test_task_validation(shakespeare):
    feats = {"targets": Feature(ByteVocabulary())}
    with pytest.raises(ValueError, match="bad task name"):
        Task("has space", source=shakespeare, output_features=feats)
    with pytest.raises(ValueError, match="packing must be one of"):
        Task("t", source=shakespeare, output_features=feats, packing="best_fit")
    with pytest.raises(ValueError, match="needs exactly one output feature"):
        Task("t", source=shakespeare, output_features={**feats, "inputs": Feature(ByteVocabulary())}, packing="lm")
    with pytest.raises(TypeError, match="wrap functions in FunctionPreprocessor"):
        Task("t", source=shakespeare, output_features=feats, preprocessors=[lambda ex: ex])
    with pytest.raises(ValueError, match="unsupported feature dtype"):
        Feature(ByteVocabulary(), dtype="int4")


def test_task_pickles_for_workers(corpora, tmp_path):
    import pickle

    from seqcache.tasks import sample_for_vocabulary, train_sentencepiece

    src = TextLineSource(str(corpora.botchan))
    model = tmp_path / "v.model"
    vocab = train_sentencepiece(sample_for_vocabulary(src, max_records=1500, seed=0), output_path=str(model),
                                vocab_size=500)
    task = Task("botchan", source=src, output_features={"targets": Feature(vocab)},
                preprocessors=[rekey({"targets": "text"}), tokenize(), filter_empty(), append_eos()], packing="lm")
    records = []
    for r in src.read_all():
        records.append(r)
        if len(records) == 200:
            break
    blob = pickle.dumps(task)
    model.unlink()  # workers do not see the driver's files
    clone = pickle.loads(blob)
    assert clone.fingerprint(seed=0, sequence_length=None) == task.fingerprint(seed=0, sequence_length=None)
    a = task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    b = clone.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)
    assert len(a) == len(b) > 100
    for (i, x), (j, y) in zip(a, b):
        assert i == j and x["targets"].tobytes() == y["targets"].tobytes()


class _Columns(FunctionPreprocessor):
    """A column step: ``step(batch)`` is what ``process_columns`` returns."""

    def __init__(self, name, step):
        super().__init__(lambda ex, ctx: ex, name)
        self.step = step

    def process_columns(self, batch, ctx):
        return self.step(batch)


def _floats(batch):
    values, offsets = batch.columns["targets"]
    batch.columns["targets"] = (values.astype(np.float64) + 0.9, offsets)
    return batch


def test_ids_too_large_for_int32_are_refused_not_wrapped(shakespeare):
    records = [SourceRecord(0, 9, {"text": [10, 2**32 + 70]}, b"a"), SourceRecord(0, 20, {"text": [10, 20]}, b"b")]
    for eos_step in (append_eos(), append_eos_after_trim()):
        task = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(), eos_step])
        with pytest.raises(ValueError, match=r"line at byte 9 of file 0: feature 'targets' has token id 4294967366, "
                                             r"outside its vocabulary \[0, 259\)"):
            task.preprocess_batch(records, _keys(records), seed=0, sequence_length={"targets": 8})
    skipping = _lm_task(JsonLinesSource(str(shakespeare.patterns[0]), on_error={"bad_value": "skip"}),
                        preprocessors=[rekey({"targets": "text"}), tokenize(), append_eos()])
    skipped = []
    out = skipping.preprocess_batch(records, _keys(records), seed=0, sequence_length=None, skipped=skipped)
    assert [(i, ex["targets"].tolist()) for i, ex in out] == [(1, [10, 20, 1])]
    assert [i for i, _ in skipped] == [0] and "token id 4294967366" in skipped[0][1]


def test_a_column_of_floats_is_refused_naming_the_record(shakespeare):
    records = [SourceRecord(0, 5, {"text": "ab"}, b"ab")]
    task = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(), _Columns("floats", _floats)])
    with pytest.raises(ValueError, match=r"line at byte 5 of file 0: feature 'targets' holds float64 values; "
                                         r"expected a 1-D sequence of integer token ids"):
        task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)


def test_process_columns_returning_no_batch_is_named(shakespeare):
    records = [SourceRecord(0, 5, {"text": "ab"}, b"ab")]
    task = _lm_task(shakespeare, preprocessors=[rekey({"targets": "text"}), tokenize(), _Columns("nothing", lambda batch: None)])
    with pytest.raises(ValueError, match=r"preprocessor 'nothing': process_columns returned NoneType, "
                                         r"expected an ExampleBatch"):
        task.preprocess_batch(records, _keys(records), seed=0, sequence_length=None)


def test_a_dtype_too_narrow_for_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"feature dtype uint8 cannot hold the ids of a vocabulary of 259"):
        Feature(ByteVocabulary(), dtype="uint8")
    assert Feature(ByteVocabulary(), dtype="uint16").dtype == "uint16"
