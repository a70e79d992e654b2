"""Vocabularies: byte layout, SentencePiece training determinism, sentinels, pickling."""

import hashlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

from seqcache.tasks import sources as S
from seqcache.tasks import vocabularies as V
from seqcache import tasks


def _blns_lines(corpora):
    lines = corpora.blns.read_text(encoding="utf-8").split("\n")
    return [l for l in lines if l and not l.startswith("#")]


def test_byte_layout_and_round_trip(corpora):
    v = V.ByteVocabulary()
    assert (v.vocab_size, v.pad_id, v.eos_id, v.unk_id) == (259, 0, 1, 2)
    assert v.encode("Ab") == [ord("A") + 3, ord("b") + 3]
    assert v.encode("é") == [0xC3 + 3, 0xA9 + 3]
    lines = _blns_lines(corpora)
    assert len(lines) > 500
    arrays = v.encode_batch(lines)
    for line, ids in zip(lines, arrays):
        assert ids.dtype == np.int32
        assert ids.tolist() == v.encode(line)
        assert v.decode(ids) == line
    # pad and eos decode to nothing; a cut UTF-8 sequence becomes U+FFFD.
    assert v.decode([0, *v.encode("hi"), 1, 0]) == "hi"
    assert v.decode(v.encode("é")[:1]) == "\ufffd"


def test_byte_extra_ids():
    v = V.ByteVocabulary(extra_ids=100)
    assert v.vocab_size == 359
    assert v.sentinel_id(0) == 358 and v.sentinel_id(99) == 259
    assert v.decode([v.sentinel_id(0), *v.encode("x")]) == "x"
    with pytest.raises(ValueError, match="sentinel index 100 is out of range"):
        v.sentinel_id(100)
    assert v.fingerprint() == {"kind": "byte", "sha256": None, "extra_ids": 100}
    assert tasks.vocabulary_from_json(v.to_json(), "/nonexistent") == v
    assert v.model_bytes() is None


@pytest.fixture(scope="module")
def botchan_sample(corpora):
    src = S.TextLineSource(str(corpora.botchan))
    return tasks.sample_for_vocabulary(src, max_records=3000, seed=7)


@pytest.fixture(scope="module")
def spm_model(botchan_sample, tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "botchan.model"
    tasks.train_sentencepiece(botchan_sample, output_path=str(path), vocab_size=800)
    return path


def test_sample_for_vocabulary_independent_of_file_order(tmp_path, corpora):
    lines = corpora.shakespeare.read_text().split("\n")[:4000]
    (tmp_path / "a.txt").write_text("\n".join(lines[:2500]) + "\n")
    (tmp_path / "b.txt").write_text("\n".join(lines[2500:]) + "\n")
    (tmp_path / "c.txt").write_text("\n".join(reversed(lines)) + "\n")
    skip_empty = {"empty": "skip"}
    split = tasks.sample_for_vocabulary(S.TextLineSource(str(tmp_path / "[ab].txt"), on_error=skip_empty), max_records=500,
                                    seed=3)
    reordered = tasks.sample_for_vocabulary(S.TextLineSource(str(tmp_path / "c.txt"), on_error=skip_empty), max_records=500,
                                        seed=3)
    assert len(split) == 500 and split == reordered
    other_seed = tasks.sample_for_vocabulary(S.TextLineSource(str(tmp_path / "c.txt"), on_error=skip_empty), max_records=500,
                                         seed=4)
    assert other_seed != split
    assert "" not in split
    # The kept records are exactly the 500 smallest keyed hashes of the distinct non-empty lines.
    key = (3).to_bytes(8, "little")
    h = lambda s: hashlib.blake2b(s.encode(), key=key, digest_size=8).digest()
    nonempty = [l for l in lines if l]
    expected = sorted(nonempty, key=lambda s: (h(s), s.encode()))[:500]
    assert split == expected


def test_train_sentencepiece_deterministic(botchan_sample, spm_model, corpora, tmp_path):
    # A second training, in a fresh process, gives the same bytes.
    again = tmp_path / "again.model"
    code = (
        "import sys; from seqcache.tasks import TextLineSource, sample_for_vocabulary, train_sentencepiece\n"
        "texts = sample_for_vocabulary(TextLineSource(sys.argv[1]), max_records=3000, seed=7)\n"
        "train_sentencepiece(texts, output_path=sys.argv[2], vocab_size=800)\n"
    )
    botchan = str(corpora.botchan)
    subprocess.run([sys.executable, "-c", code, botchan, str(again)], check=True, timeout=120)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == hashlib.sha256(spm_model.read_bytes()).hexdigest()
    # Different training text gives a different model.
    other = tasks.train_sentencepiece(botchan_sample[:1500], output_path=str(tmp_path / "o.model"), vocab_size=800)
    assert other.sha256 != hashlib.sha256(spm_model.read_bytes()).hexdigest()


def test_identity_normalization_is_lossless(botchan_sample, corpora, tmp_path):
    v = tasks.train_sentencepiece(botchan_sample[:2000], output_path=str(tmp_path / "id.model"), vocab_size=600,
                              model_type="bpe", normalization_rule_name="identity", remove_extra_whitespaces=False)
    texts = _blns_lines(corpora) + ["  two  spaces ", "tab\tand ｆｕｌｌ width"]
    for text, ids in zip(texts, v.encode_batch(texts)):
        assert v.decode(ids) == text


def test_sentencepiece_layout_and_round_trip(spm_model, botchan_sample):
    v = V.SentencePieceVocabulary(str(spm_model))
    assert (v.vocab_size, v.pad_id, v.eos_id, v.unk_id) == (800, 0, 1, 2)
    texts = botchan_sample[:200]
    arrays = v.encode_batch(texts)
    assert len(arrays) == 200 and all(a.dtype == np.int32 for a in arrays)
    for text, ids in zip(texts, arrays):
        assert ids.tolist() == v.encode(text)
        # nmt_nfkc collapses runs of spaces; botchan is otherwise plain ASCII.
        assert v.decode(ids) == " ".join(text.split())
    # Byte fallback: characters never seen in training stay encodable.
    snow = "雪 ☃ 🎉"
    ids = v.encode(snow)
    assert v.unk_id not in ids and v.decode(ids) == snow
    assert v.decode([0, *v.encode("hello"), 1, 0]) == "hello"


@pytest.mark.parametrize("repeat", [1, 40])  # short lines (lists of ints), long texts (int32 buffers)
def test_sentencepiece_encode_batch_flat_equals_one_text_at_a_time(spm_model, botchan_sample, repeat):
    v = V.SentencePieceVocabulary(str(spm_model))
    texts = [" ".join([t] * repeat) for t in botchan_sample[:60]] + ["", "雪 ☃"]
    long_path = sum(map(len, texts)) >= V.SENTENCEPIECE_BUFFER_CHARS * len(texts)
    assert long_path == (repeat > 1)
    flat, lengths = v.encode_batch_flat(texts)
    assert flat.dtype == np.int32 and lengths.dtype == np.int64 and lengths.shape == (len(texts),)
    assert lengths.tolist() == [len(v.encode(t)) for t in texts]
    assert flat.tolist() == [i for t in texts for i in v.encode(t)]


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="no CPU affinity here")
def test_encoding_threads_follow_the_cpus_this_process_may_use(spm_model, botchan_sample, monkeypatch):
    """A batch's SentencePiece threads are the CPUs of this process's affinity
    (a container's or taskset's CPU set), not the machine's; the ids do not
    depend on them."""
    import os

    monkeypatch.delenv(V.ENCODING_THREADS_ENV, raising=False)
    before = os.sched_getaffinity(0)
    assert V.encoding_threads() == len(before)
    v = V.SentencePieceVocabulary(str(spm_model))
    texts = botchan_sample[:200]
    want = v.encode_batch_flat(texts, num_threads=3)
    asked = []
    real = v._processor()
    monkeypatch.setattr(v, "_processor", lambda: _Recording(real, asked))
    try:
        os.sched_setaffinity(0, {min(before)})
        assert V.encoding_threads() == 1
        got = v.encode_batch_flat(texts)
    finally:
        os.sched_setaffinity(0, before)
    assert asked == [1]
    assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist()


@pytest.mark.parametrize("given, want", [("3", 3), (" 1 ", 1), ("0", None), ("two", None), ("-2", None),
                                         ("1.5", None), ("\u0663", None)])
def test_encoding_threads_from_the_environment(monkeypatch, given, want):
    monkeypatch.setenv(V.ENCODING_THREADS_ENV, given)
    if want is None:
        with pytest.raises(ValueError, match=f"{V.ENCODING_THREADS_ENV}=.*positive integer"):
            V.encoding_threads()
    else:
        assert V.encoding_threads() == want


class _Recording:
    """A SentencePiece processor that records the ``num_threads`` it is asked for."""

    def __init__(self, processor, asked):
        self._processor, self._asked = processor, asked

    def encode(self, texts, **kwargs):
        self._asked.append(kwargs.get("num_threads"))
        return self._processor.encode(texts, **kwargs)


def test_sentencepiece_extra_ids_and_json(spm_model, tmp_path):
    v = V.SentencePieceVocabulary(str(spm_model), extra_ids=5)
    assert v.vocab_size == 805
    assert [v.sentinel_id(i) for i in range(5)] == [804, 803, 802, 801, 800]
    assert v.id_to_piece(804) == "<extra_id_0>" and v.id_to_piece(800) == "<extra_id_4>"
    assert v.decode([804, *v.encode("a cat"), 800]) == "a cat"
    desc = v.to_json()
    assert desc["kind"] == "sentencepiece" and desc["extra_ids"] == 5 and desc["sha256"] == v.sha256
    (tmp_path / desc["file"]).write_bytes(v.model_bytes())
    back = tasks.vocabulary_from_json(desc, str(tmp_path))
    assert back == v and back.vocab_size == 805
    (tmp_path / desc["file"]).write_bytes(v.model_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="has sha256 .* but the cache expects"):
        tasks.vocabulary_from_json(desc, str(tmp_path))
    with pytest.raises(ValueError, match="bad model file name"):
        tasks.vocabulary_from_json({**desc, "file": "../x.model"}, str(tmp_path))


def test_sentencepiece_pickles_by_bytes(spm_model, tmp_path):
    path = tmp_path / "moved.model"
    path.write_bytes(spm_model.read_bytes())
    v = V.SentencePieceVocabulary(str(path), extra_ids=2)
    blob = pickle.dumps(v)
    path.unlink()  # a worker elsewhere has no access to the file
    w = pickle.loads(blob)
    assert w.encode("the school") == V.SentencePieceVocabulary(str(spm_model)).encode("the school")
    assert w.fingerprint() == {"kind": "sentencepiece", "sha256": hashlib.sha256(spm_model.read_bytes()).hexdigest(),
                               "extra_ids": 2}


def test_sentencepiece_pickles_a_stored_model_by_reference(spm_model, tmp_path):
    """While a build's steps are pickled (``stored_models``), a model stored in
    the cache travels as its file's URL and sha256, loads from there, and is
    pickled again the same way; elsewhere the bytes travel."""
    data = spm_model.read_bytes()
    stored = tmp_path / "vocabulary-targets.model"
    stored.write_bytes(data)
    v = V.SentencePieceVocabulary(str(spm_model), extra_ids=2)
    with V.stored_models({str(stored): data}):
        blob = pickle.dumps(v)
    assert len(blob) < 2000 < len(data) and data not in blob
    assert len(pickle.dumps(v)) > len(data)  # outside the block: the bytes
    w = pickle.loads(blob)
    assert w.encode("the school") == v.encode("the school")
    assert w.fingerprint() == v.fingerprint()
    again = pickle.dumps(pickle.loads(blob))  # a worker's runner pickling its steps anew
    assert len(again) < 2000
    # Another process: nothing loaded yet, the file read and checked.
    code = ("import pickle, sys; w = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(w.encode('the school'))")
    (tmp_path / "blob").write_bytes(again)
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "blob")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(v.encode("the school"))
    stored.write_bytes(data[:-1] + b"x")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "blob")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "vocabulary-targets.model: the vocabulary model the build stored there has changed" \
        in out.stderr, out.stderr
    stored.unlink()
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "blob")], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "cannot read the vocabulary model the build stored at" in out.stderr, out.stderr


def test_sentencepiece_bad_model(tmp_path):
    bad = tmp_path / "corrupt.model"
    bad.write_bytes(b"this is not a protobuf" * 10)
    with pytest.raises(ValueError, match="corrupt.model is not a valid SentencePiece model"):
        V.SentencePieceVocabulary(str(bad)).encode("x")
    with pytest.raises(ValueError, match="cannot read SentencePiece model .*missing.model"):
        V.SentencePieceVocabulary(str(tmp_path / "missing.model")).encode("x")
    with pytest.raises(ValueError, match="exactly one of"):
        V.SentencePieceVocabulary()


def test_vocabulary_from_spec(spm_model):
    assert tasks.vocabulary_from_spec("byte", extra_ids=3) == V.ByteVocabulary(extra_ids=3)
    assert isinstance(tasks.vocabulary_from_spec(str(spm_model)), V.SentencePieceVocabulary)
    with pytest.raises(ValueError, match="expected 'byte' or the path"):
        tasks.vocabulary_from_spec("bytes")


def test_train_errors(tmp_path):
    with pytest.raises(ValueError, match="model_type"):
        tasks.train_sentencepiece(["a"], output_path=str(tmp_path / "x.model"), vocab_size=300, model_type="word")
    with pytest.raises(ValueError, match="SentencePiece training failed"):
        tasks.train_sentencepiece(["tiny text"] * 10, output_path=str(tmp_path / "x.model"), vocab_size=5000)


def test_training_when_every_line_is_too_long_names_the_count(tmp_path):
    texts = ["x" * 300 + f" {i}" for i in range(50)]
    with pytest.raises(ValueError, match=r"every one of the 50 training sentences is longer than max_sentence_length \(100 bytes\)"):
        tasks.train_sentencepiece(texts, output_path=str(tmp_path / "m.model"), vocab_size=300, max_sentence_length=100)


def test_a_vocabulary_sample_of_a_parallel_source_holds_both_sides(tmp_path):
    (tmp_path / "a.en").write_text("a cat\na dog\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eine Katze\nein Hund\n", encoding="utf-8")
    src = tasks.ParallelTextSource({"inputs": str(tmp_path / "a.en"), "targets": str(tmp_path / "a.de")})
    texts = tasks.sample_for_vocabulary(src, max_records=10, seed=0)
    assert sorted(texts) == ["a cat\neine Katze", "a dog\nein Hund"]
    # One named field still reads only that field.
    assert sorted(tasks.sample_for_vocabulary(src, max_records=10, seed=0, field="targets")) == ["ein Hund",
                                                                                                 "eine Katze"]
