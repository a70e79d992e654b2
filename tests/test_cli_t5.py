"""T5 tasks from the command line: span corruption, prefix LM and translation
caches built by ``seqcache build --source ...`` without Python, ``show`` with
sentinels, and the errors for options that do not go together."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache import tasks
from seqcache.cli.main import main
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import BuildConfig, build_task
from seqcache.tasks import preprocessors as P

NUM_DOCS = 120
VOCAB = tasks.ByteVocabulary(extra_ids=100)


def _run(args, code=0):
    out = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert out.exit_code == code, out.output
    return out


def _hashes(cache_dir):
    m = fmt.read_manifest(cache_dir)
    return [hashlib.sha256(open(os.path.join(cache_dir, s.file), "rb").read()).hexdigest() for s in m.shards]


@pytest.fixture(scope="module")
def c4(tmp_path_factory, corpora):
    """The first NUM_DOCS C4 validation documents as one Parquet file."""
    folder = tmp_path_factory.mktemp("c4")
    texts = corpora.c4_texts(NUM_DOCS)
    pq.write_table(pa.table({"text": texts}), folder / "c4.parquet", row_group_size=40)
    return folder / "c4.parquet", texts.to_pylist()


def _span_args(path, cache, *extra):
    return ["build", "--source", f"parquet:{path}#text", "--objective", "span_corruption", "--vocabulary", "byte",
            "--extra-ids", "100", "--on-error", "control_characters=keep", "--name", "c4_span", "--num-shards", "2",
            "--cache-dir", cache, "--json", *extra]


@pytest.fixture(scope="module")
def span_caches(tmp_path_factory, c4):
    """Span-corruption caches built on the command line: unpacked with
    ``targets=114`` alone, first-fit packed with ``inputs=512`` alone."""
    path, _ = c4
    root = tmp_path_factory.mktemp("span")
    _run(_span_args(path, root / "plain", "--sequence-length", "targets=114"))
    _run(_span_args(path, root / "packed", "--sequence-length", "inputs=512", "--pack", "first_fit"))
    return str(root / "plain" / "c4_span" / "train"), str(root / "packed" / "c4_span" / "train")


def test_span_corruption_cache_from_the_command_line(span_caches, c4, tmp_path):
    plain, packed = span_caches
    path, texts = c4
    # One length given, the other derived: inputs 512 -> targets 114 (T5's
    # random_spans_helper); targets 114 -> inputs 508, the shortest inputs
    # length whose targets take 114 tokens.
    for cache, packing, lengths in ((plain, None, {"inputs": 508, "targets": 114}),
                                    (packed, "first_fit", {"inputs": 512, "targets": 114})):
        info = json.loads(_run(["info", cache, "--json"]).stdout)
        assert info["sequence_length"] == lengths
        assert info["packing"] == packing
        assert [f["name"] for f in info["features"] if not f["name"].endswith("segment_ids")] == ["inputs", "targets"]
        assert info["statistics"]["truncated_tokens"] == 0
        assert [p.split("(")[0] for p in info["preprocessors"]] == ["rekey", "tokenize", "span_corruption",
                                                                     "append_eos_after_trim"]
        assert 'span_corruption(noise_density=0.15, mean_noise_span_length=3.0' in info["preprocessors"][2]
    eff = json.loads(_run(["info", packed, "--json"]).stdout)["packing_efficiency"]
    eff_plain = json.loads(_run(["info", plain, "--json"]).stdout)["packing_efficiency"]
    assert eff["inputs"] > eff_plain["inputs"] and eff["targets"] > eff_plain["targets"]

    # The command line builds exactly the task docs/tasks.md defines in Python.
    task = tasks.Task(
        "c4_span",
        source=tasks.ParquetSource(str(path), column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(VOCAB), "targets": tasks.Feature(VOCAB)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
    )
    ref = build_task(task, cache_dir=str(tmp_path), config=BuildConfig(
        num_shards=2, sequence_length={"inputs": 508, "targets": 114})).cache_dir
    assert _hashes(ref) == _hashes(plain)

    # Every packed segment is a span-corrupted chunk of its own source document.
    source_bytes = [t.encode("utf-8") for t in texts]
    segments = 0
    with CacheReader(packed) as r:
        idx = list(range(len(r)))
        for ex, prov in zip(r.read_examples(idx), r.read_sources(idx)):
            seg_in, seg_tg = ex["inputs_segment_ids"], ex["targets_segment_ids"]
            assert int(seg_in.max()) == int(seg_tg.max()) == len(prov)
            for s, p in enumerate(prov, 1):
                inputs, targets = ex["inputs"][seg_in == s], ex["targets"][seg_tg == s]
                assert inputs[-1] == VOCAB.eos_id and targets[-1] == VOCAB.eos_id
                assert (inputs >= VOCAB.base_vocab_size).any()  # sentinels in the inputs
                rebuilt = tasks.resolve_sentinels(inputs, targets, VOCAB)
                assert (rebuilt - 3).astype(np.uint8).tobytes() in source_bytes[p["record_number"]]
                segments += 1
    assert segments == NUM_DOCS


def _substitute(inputs_text, targets_text):
    """The original text from the two shown texts: each ``<extra_id_i>`` of the
    inputs replaced by what follows it in the targets."""
    spans = dict(re.findall(r"<extra_id_(\d+)>((?:(?!<extra_id_).)*)", targets_text, flags=re.S))
    return re.sub(r"<extra_id_(\d+)>", lambda m: spans[m.group(1)], inputs_text)


def test_show_prints_sentinels_and_both_features(span_caches, c4):
    plain, packed = span_caches
    _, texts = c4
    shown = json.loads(_run(["show", plain, "--index", "0", "--count", "5", "--max-chars", "0", "--json"]).stdout)
    assert len(shown) == 5
    for item in shown:
        (inp,), (tgt,) = item["features"]["inputs"]["segments"], item["features"]["targets"]["segments"]
        assert "<extra_id_0>" in inp["text"] and tgt["text"].startswith("<extra_id_0>")
        n = len(re.findall(r"<extra_id_\d+>", inp["text"]))
        assert n >= 1 and f"<extra_id_{n - 1}>" in tgt["text"] and f"<extra_id_{n}>" not in inp["text"]
        # The shown texts put back together are a chunk of the source document.
        assert _substitute(inp["text"], tgt["text"]) in texts[inp["provenance"]["record_number"]]
    out = _run(["show", packed, "--index", "0"]).stdout
    assert re.search(r"^inputs: \d+ tokens, \d+ segment\(s\)$", out, flags=re.M)
    assert re.search(r"^targets: \d+ tokens, \d+ segment\(s\)$", out, flags=re.M)
    assert out.index("inputs:") < out.index("targets:") and "<extra_id_0>" in out


def test_which_shows_sentinels_and_refuses_a_feature_the_cache_lacks(span_caches, c4):
    plain, _ = span_caches
    _, texts = c4
    for feature in ("inputs", "targets"):
        d = json.loads(_run(["which", plain, "--step", "0", "--row", "1", "--batch-size", "4", "--feature", feature,
                             "--json"]).stdout)
        (seg,) = d["segments"]
        assert "<extra_id_0>" in seg["text"], seg
    bogus = _run(["which", plain, "--step", "0", "--row", "0", "--batch-size", "4", "--feature", "bogus"], code=1)
    assert "has no feature 'bogus' (its token features: inputs, targets)" in bogus.output


def test_decode_with_sentinels_keeps_sentencepiece_spaces(tmp_path, corpora):
    from seqcache.cli.commands.inspect import decode_with_sentinels

    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()[:2000]
    vocab = tasks.train_sentencepiece(lines, output_path=str(tmp_path / "spm.model"), vocab_size=400, extra_ids=10)
    ids = vocab.encode("Thank you for inviting me to your party last week.")
    words = vocab.encode("Thank you") + [vocab.sentinel_id(0)] + vocab.encode("me to your party") + \
        [vocab.sentinel_id(1)] + vocab.encode("week.") + [vocab.eos_id]
    assert decode_with_sentinels(vocab, words) == "Thank you<extra_id_0> me to your party<extra_id_1> week."
    assert decode_with_sentinels(vocab, ids) == vocab.decode(ids)
    byte = tasks.ByteVocabulary(extra_ids=3)
    assert decode_with_sentinels(byte, byte.encode("a ") + [byte.sentinel_id(2)] + byte.encode(" b")) == \
        "a <extra_id_2> b"


def _lines(path):
    with gzip.open(path, "rt", encoding="utf-8", newline="\n") as f:
        return f.read().split("\n")[:-1]


def test_translation_cache_from_parallel_text_on_the_command_line(tmp_path, corpora):
    d = corpora.multi30k
    en, de = _lines(d / "val.en.gz"), _lines(d / "val.de.gz")
    cache = tmp_path / "c"
    built = _run(["build", "--source", f"parallel:inputs={d / 'val.en.gz'},targets={d / 'val.de.gz'}", "--name",
                  "multi30k_en_de", "--sequence-length", "64", "--num-shards", "2", "--cache-dir", cache, "--json"])
    cut = sum(max(0, len(t.encode()) - 63) for t in en + de)
    assert cut > 0 and f"dropped {cut:,} tokens" in built.output
    assert "a longer --sequence-length keeps them" in built.output and "--pack keeps" not in built.output
    out = str(cache / "multi30k_en_de" / "train")
    info = json.loads(_run(["info", out, "--json"]).stdout)
    assert info["sequence_length"] == {"inputs": 64, "targets": 64}  # a bare N is both features' length
    byte = tasks.ByteVocabulary()
    seen = []
    with CacheReader(out) as r:
        idx = list(range(len(r)))
        for ex, (p,) in zip(r.read_examples(idx), r.read_sources(idx)):
            k = p["record_number"]
            seen.append(k)
            assert ex["inputs"].tolist() == byte.encode(en[k])[:63] + [byte.eos_id]
            assert ex["targets"].tolist() == byte.encode(de[k])[:63] + [byte.eos_id]
    assert sorted(seen) == list(range(len(en))) and len(en) == 1014

    # The same pairs as JSON lines with two named fields, first-fit packed (--pack alone).
    jl = tmp_path / "pairs.jsonl"
    jl.write_text("".join(json.dumps({"src": a, "tgt": b}, ensure_ascii=False) + "\n" for a, b in zip(en, de)),
                  encoding="utf-8")
    _run(["build", "--source", f"jsonl:{jl}#inputs=src,targets=tgt", "--name", "pairs", "--sequence-length",
          "inputs=256,targets=256", "--pack", "--num-shards", "2", "--cache-dir", cache, "--json"])
    packed = str(cache / "pairs" / "train")
    assert json.loads(_run(["info", packed, "--json"]).stdout)["packing"] == "first_fit"
    got = []
    with CacheReader(packed) as r:
        rows = list(r.read_examples(range(len(r))))
    assert len(rows) < len(en) // 3
    for ex in rows:
        for s in range(1, int(ex["inputs_segment_ids"].max()) + 1):
            got.append((byte.decode(ex["inputs"][ex["inputs_segment_ids"] == s].tolist()),
                        byte.decode(ex["targets"][ex["targets_segment_ids"] == s].tolist())))
    assert sorted(got) == sorted((a[:255], b[:255]) for a, b in zip(en, de))


def test_misaligned_parallel_files_name_both_files_and_the_line(tmp_path):
    (tmp_path / "a.en").write_text("one\ntwo\nthree\n", encoding="utf-8")
    (tmp_path / "a.de").write_text("eins\nzwei\n", encoding="utf-8")
    out = _run(["build", "--source", f"parallel:inputs={tmp_path / 'a.en'},targets={tmp_path / 'a.de'}",
                "--name", "bad", "--cache-dir", tmp_path / "c"], code=1)
    assert "not line-aligned" in out.output and str(tmp_path / "a.en") in out.output
    assert str(tmp_path / "a.de") in out.output and "line 3" in out.output
    assert not (tmp_path / "c" / "bad" / "train" / "manifest.json").exists()


def test_prefix_lm_from_the_command_line(tmp_path, c4):
    path, texts = c4
    _run(["build", "--source", f"parquet:{path}#text", "--objective", "prefix_lm", "--on-error",
          "control_characters=keep", "--name", "plm", "--sequence-length", "128", "--num-shards", "1",
          "--cache-dir", tmp_path, "--json"])
    cache = str(tmp_path / "plm" / "train")
    byte = tasks.ByteVocabulary()
    with CacheReader(cache) as r:
        idx = list(range(len(r)))
        examples, sources = r.read_examples(idx), r.read_sources(idx)
    assert len(examples) == NUM_DOCS
    for ex, (p,) in zip(examples, sources):
        inputs, targets = ex["inputs"].tolist(), ex["targets"].tolist()
        assert len(inputs) <= 128 and len(targets) <= 128 and inputs[-1] == targets[-1] == byte.eos_id
        whole = bytes(t - 3 for t in inputs[:-1] + targets[:-1])  # prefix + rest = a chunk of the document
        assert len(inputs) > 1 and whole in texts[p["record_number"]].encode("utf-8")


@pytest.mark.parametrize("extra, message", [
    (["--objective", "span_corruption", "--sequence-length", "inputs=512"], "--extra-ids 100"),
    (["--objective", "span_corruption", "--extra-ids", "5", "--sequence-length", "inputs=512"],
     "--extra-ids 28 or more"),
    (["--objective", "span_corruption", "--extra-ids", "100"], "needs --sequence-length inputs=N or targets=N"),
    (["--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", "512"], "inputs=N or targets=N"),
    (["--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", "inputs=512,targets=100"],
     "use targets=114"),
    (["--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", "inputs=512", "--pack", "lm"],
     "use --pack first_fit"),
    (["--noise-density", "0.3"], "--noise-density applies to --objective span_corruption or prefix_lm"),
    (["--objective", "prefix_lm", "--mean-noise-span-length", "2"], "--mean-noise-span-length applies"),
    (["--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", "inputs=512",
      "--noise-density", "1.5"], "--noise-density must be in (0, 1)"),
    (["--sequence-length", "inputs=512"], "the task has no feature inputs"),
    (["--objective", "supervised"], "--objective supervised needs a source of two values"),
    (["--pack", "first_fit"], "--pack needs --sequence-length"),
    (["--pack", "zigzag", "--sequence-length", "8"], "'zigzag' is not one of"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_options_that_do_not_go_together_name_the_flag(tmp_path, c4, extra, message):
    path, _ = c4
    out = _run(["build", "--source", f"parquet:{path}#text", "--name", "x", "--cache-dir", tmp_path, *extra], code=2)
    assert message in out.output
    assert not (tmp_path / "x").exists()


def test_parallel_source_errors(tmp_path, corpora):
    d = corpora.multi30k
    src = f"parallel:inputs={d / 'val.en.gz'},targets={d / 'val.de.gz'}"
    out = _run(["build", "--source", src, "--objective", "span_corruption", "--extra-ids", "100", "--name", "x",
                "--sequence-length", "inputs=64", "--cache-dir", tmp_path], code=2)
    assert "one text value per record, but --source gives inputs and targets" in out.output
    out = _run(["build", "--source", src, "--sequence-length", "32", "--pack", "lm", "--name", "x",
                "--cache-dir", tmp_path], code=2)
    assert "use --pack first_fit" in out.output
    out = _run(["build", "--source", f"parallel:inputs={d / 'val.en.gz'}", "--name", "x", "--cache-dir", tmp_path],
               code=2)
    assert "two or more line-aligned files as KEY=PATTERN" in out.output
    out = _run(["build", "--source", f"parallel:en={d / 'val.en.gz'},de={d / 'val.de.gz'}", "--name", "x",
                "--cache-dir", tmp_path], code=2)
    assert "inputs and targets (got de, en)" in out.output


def test_t5_options_with_a_registered_task_are_usage_errors(tmp_path):
    for extra, named in [(["--objective", "span_corruption"], "--objective"), (["--noise-density", "0.2"],
                                                                              "--noise-density"),
                         (["--pack", "first_fit"], "--pack")]:
        out = _run(["build", "some_task", "--cache-dir", tmp_path, *extra], code=2)
        assert f"{named} describes an ad-hoc --source" in out.output


def test_source_specs_of_two_values(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"")  # patterns are matched when the files are listed, not here
    jl = tasks.parse_source_spec(f"jsonl:{tmp_path}/*.jsonl#inputs=q.text,targets=a")
    assert isinstance(jl, tasks.JsonLinesSource) and jl.fields == {"inputs": "q.text", "targets": "a"}
    pa_ = tasks.parse_source_spec(f"parquet:{tmp_path}/*.parquet#targets=de, inputs=en")
    assert isinstance(pa_, tasks.ParquetSource) and pa_.columns == {"inputs": "en", "targets": "de"}
    par = tasks.parse_source_spec(f"parallel:targets={tmp_path}/b.de,inputs={tmp_path}/b.en")
    assert isinstance(par, tasks.ParallelTextSource)
    assert list(par.files.items()) == [("inputs", f"{tmp_path}/b.en"), ("targets", f"{tmp_path}/b.de")]
    for bad, message in [("jsonl:x.jsonl#inputs=a,inputs=b", "'inputs' is given twice"),
                         ("parquet:x.parquet#inputs=,targets=b", "'inputs=' is not KEY=VALUE"),
                         ("parallel:x.en,y.de", "two or more line-aligned files as KEY=PATTERN"),
                         ("parallel:inputs=x.en", "two or more line-aligned files")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            tasks.parse_source_spec(bad)
    with pytest.raises(ValueError, match="exclude does not apply to a parallel source"):
        tasks.parse_source_spec("parallel:inputs=a,targets=b", exclude=["*.tmp"])
