"""seqcache overlap on caches of several text features and on packed caches:
each feature is scanned (``inputs``, ``targets``), a span-corrupted example as
its text put back together, and a packed row segment by segment, each
segment with its own source record."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from seqcache.cli.main import main
from seqcache.pipelines import overlap as ov
from seqcache.tasks import train_sentencepiece
from seqcache.tasks.contamination import normalize_words


@pytest.fixture(scope="module")
def ntrex(corpora):
    lines = (corpora.ntrex / "newstest2019-src.eng.txt").read_text(encoding="utf-8").splitlines()
    long = [i for i, line in enumerate(lines) if len(normalize_words(line)) >= 30]
    return {"spec": f"text:{corpora.ntrex / 'newstest2019-src.eng.txt'}", "lines": lines, "long": long}


def _build(tmp_path, *args):
    res = CliRunner().invoke(main, ["build", *args, "--cache-dir", str(tmp_path / "caches")])
    assert res.exit_code == 0, res.output


def _overlap(tmp_path, spec, cache, name="o.json"):
    res = CliRunner().invoke(main, ["overlap", spec, str(cache), "-o", str(tmp_path / name)])
    assert res.exit_code == 0, res.output
    return json.loads((tmp_path / name).read_text())


def _found(result):
    return {(it["item"], m["feature"], m["location"]) for it in result["items"] for m in it["matches"]}


def test_inputs_and_targets_of_a_packed_supervised_cache_are_both_scanned(tmp_path, ntrex):
    a, b = ntrex["long"][0], ntrex["long"][1]
    records = [{"q": f"question {i} about nothing much", "a": f"answer {i}"} for i in range(40)]
    records[7]["q"] += " " + ntrex["lines"][a]
    records[29]["a"] = ntrex["lines"][b].upper()
    path = tmp_path / "sup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    offsets = [len("".join(json.dumps(r) + "\n" for r in records[:k]).encode()) for k in (7, 29)]
    _build(tmp_path, "--source", f"jsonl:{path}#inputs=q,targets=a", "--name", "sup", "--pack", "first_fit",
           "--sequence-length", "inputs=512", "--sequence-length", "targets=512")
    result = _overlap(tmp_path, ntrex["spec"], tmp_path / "caches" / "sup" / "train")
    assert result["caches"][0]["features"] == ["inputs", "targets"]
    assert result["summary"]["scanned"]["examples"] < 40  # packed: several records per example
    assert _found(result) == {(a, "inputs", f"line 8 (byte {offsets[0]:,})"),
                              (b, "targets", f"line 30 (byte {offsets[1]:,})")}


@pytest.mark.parametrize("vocabulary", ["byte", "sentencepiece"])
def test_a_span_corrupted_example_is_scanned_as_its_text(tmp_path, ntrex, vocabulary):
    picks = ntrex["long"][:20]
    path = tmp_path / "docs.txt"
    path.write_text("".join(f"doc {k}: {ntrex['lines'][i]}\n" for k, i in enumerate(picks)), encoding="utf-8")
    args = []
    if vocabulary == "sentencepiece":  # each feature's model file has its own name in the cache
        model = tmp_path / "spm.model"
        train_sentencepiece(ntrex["lines"], output_path=str(model), vocab_size=1000)
        args = ["--vocabulary", str(model)]
    _build(tmp_path, "--source", f"text:{path}", "--name", "sc", "--objective", "span_corruption", "--extra-ids",
           "100", "--sequence-length", "inputs=1024", *args)
    result = _overlap(tmp_path, ntrex["spec"], tmp_path / "caches" / "sc" / "train")
    # 15% of the bytes are noise in spans of about 3: the inputs alone, or the
    # targets alone, hold no 13 words in a row; put back together they hold all.
    assert {it["item"] for it in result["items"]} == set(picks)
    assert {m["feature"] for it in result["items"] for m in it["matches"]} == {"inputs+targets"}
    for it in result["items"]:
        (m,) = it["matches"]
        assert normalize_words(m["span"]) == normalize_words(ntrex["lines"][it["item"]])


def test_merge_span_corruption_puts_the_noise_spans_back():
    # T5's example: "Thank you <X> me to your party <Y> week." / "<X> for inviting <Y> last <Z>"
    x, y, z = 102, 101, 100  # sentinels in [100, 110)
    assert ov.merge_span_corruption([1, 2, x, 5, 6, y, 8], [x, 3, 4, y, 7, z], 100, 110) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert ov.merge_span_corruption([1, 2, 3], [4, 5], 100, 110) is None


def test_a_packed_row_is_scanned_segment_by_segment_with_each_source(tmp_path, ntrex):
    picks = ntrex["long"][20:60]
    path = tmp_path / "docs.txt"
    text = [f"doc {k}: {ntrex['lines'][i]}" for k, i in enumerate(picks)]
    path.write_text("".join(t + "\n" for t in text), encoding="utf-8")
    _build(tmp_path, "--source", f"text:{path}", "--name", "lm", "--pack", "lm", "--sequence-length", "512")
    result = _overlap(tmp_path, ntrex["spec"], tmp_path / "caches" / "lm" / "train")
    assert len(result["items"]) >= len(picks) // 2  # those split across rows may lose every n-gram
    for it in result["items"]:
        for m in it["matches"]:
            k = picks.index(it["item"])
            # The segment's source is the document's own line, and the span is that line's text.
            assert m["location"].startswith(f"line {k + 1} ") and m["span"] in text[k]
            assert " ".join(normalize_words(m["span"])) in " ".join(normalize_words(ntrex["lines"][it["item"]]))
    assert any(m["segment"] > 1 for it in result["items"] for m in it["matches"])
    assert any(m["token_offset"] > 0 for it in result["items"] for m in it["matches"])


def test_decode_batch_gives_the_texts_of_decode(tmp_path, corpora):
    from seqcache import tasks

    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()[:2000]
    spm = tasks.train_sentencepiece(lines, output_path=str(tmp_path / "spm.model"), vocab_size=400)
    for vocab in (tasks.ByteVocabulary(extra_ids=2), spm):
        batch = [vocab.encode(line) + [vocab.eos_id, 0] for line in lines[:50]] + [[], [vocab.eos_id]]
        batch.append(vocab.encode("tail é 日本")[:-1])  # a cut UTF-8 sequence (bytes), or any ids (pieces)
        assert vocab.decode_batch(batch) == [vocab.decode(ids) for ids in batch]
        assert vocab.decode_batch([]) == []
