"""TFRecord, TFDS and Hugging Face sources: formats checked against the libraries
that write them, record ids, bad records, builds and provenance.

TensorFlow, TFDS and ``datasets`` write the fixtures; the sources read them
without those libraries. Without the ``tfds`` extra these tests skip, except
under CI (``CI=true``), where a missing extra is a failure.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pickle
import subprocess
import sys

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main
from seqcache.tasks import sources as S
from seqcache.tasks.sources import tfrecord as tfr


def _need(module: str):
    """``module``, imported; a skip when it is missing, a failure under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{module} is not installed under CI (make install installs the tfds extra): {e}")
        pytest.skip(f"{module} is not installed (pip install 'seqcache[tfds]')")


@pytest.fixture(scope="module")
def lines(corpora):
    """The first 300 non-empty lines of tinyshakespeare."""
    text = corpora.shakespeare.read_text(encoding="utf-8")
    return [line for line in text.split("\n") if line][:300]


@pytest.fixture(scope="module")
def crc32c():
    """google-crc32c, which the TFRecord reader needs (TensorFlow it does not)."""
    return _need("google_crc32c")


@pytest.fixture(scope="module")
def tf(crc32c):
    return _need("tensorflow")


# ---------------------------------------------------------------------------
# TFRecord framing and tf.train.Example, against TensorFlow's own.


def test_framing_and_example_match_tensorflow(tmp_path, tf, lines):
    # TensorFlow writes (plain and GZIP), seqcache reads.
    examples = [tf.train.Example(features=tf.train.Features(feature={
        "text": tf.train.Feature(bytes_list=tf.train.BytesList(value=[line.encode()])),
        "ids": tf.train.Feature(int64_list=tf.train.Int64List(value=[k, 2**40 + k, -k])),
        "score": tf.train.Feature(float_list=tf.train.FloatList(value=[0.5])),
    })).SerializeToString() for k, line in enumerate(lines[:50])]
    for name, options in (("a.tfrecord", None), ("b.tfrecord.gz", "GZIP")):
        with tf.io.TFRecordWriter(str(tmp_path / name), options=options) as w:
            for e in examples:
                w.write(e)
        got = list(tfr.iter_tfrecords(str(tmp_path / name)))
        assert [d for _, d, _ in got] == examples and all(ok for _, _, ok in got)
        assert [i for i, _, _ in got] == list(range(50))
    decoded = tfr.decode_example(examples[7])
    assert decoded == {"text": ("bytes_list", [lines[7].encode()]), "ids": ("int64_list", [7, 2**40 + 7, -7]),
                       "score": ("float_list", [0.5])}
    # seqcache writes, TensorFlow reads.
    ours = [tfr.encode_example({"text": line, "ids": [k, k + 1]}) for k, line in enumerate(lines[:20])]
    tfr.write_tfrecords(str(tmp_path / "c.tfrecord"), ours)
    read_back = [bytes(r.numpy()) for r in tf.data.TFRecordDataset(str(tmp_path / "c.tfrecord"))]
    assert read_back == ours
    parsed = tf.train.Example.FromString(read_back[3])
    assert parsed.features.feature["text"].bytes_list.value == [lines[3].encode()]
    assert list(parsed.features.feature["ids"].int64_list.value) == [3, 4]
    # A slice of the records: indices keep counting from the start of the file.
    assert [i for i, _, _ in tfr.iter_tfrecords(str(tmp_path / "c.tfrecord"), 5, 8)] == [5, 6, 7]


def test_tfrecord_source_text_ids_and_raw(tmp_path, crc32c, lines):
    records = [tfr.encode_example({"text": line, "ids": list(range(k % 4 + 1))}) for k, line in enumerate(lines)]
    tfr.write_tfrecords(str(tmp_path / "part-0.tfrecord"), records[:100])
    tfr.write_tfrecords(str(tmp_path / "part-1.tfrecord"), records[100:])
    src = S.TFRecordSource(str(tmp_path / "part-*.tfrecord"), feature="text")
    got = list(src.read_all())
    assert [r.data["text"] for r in got] == lines
    assert [(r.file_index, r.record_number) for r in got[98:102]] == [(0, 98), (0, 99), (1, 0), (1, 1)]
    assert got[5].raw == S.canonical_json_bytes({"text": lines[5]})
    assert src.locator == "record" and src.kind == "tfrecord"
    # Token ids from an int64 feature, under another key.
    ids = S.TFRecordSource(str(tmp_path / "part-0.tfrecord"), feature="ids", output_key="targets")
    assert [r.data["targets"] for r in list(ids.read_all())[:5]] == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0]]
    # Raw UTF-8 records, and a pickled source reads the same.
    tfr.write_tfrecords(str(tmp_path / "raw.tfrecord"), [line.encode() for line in lines[:30]])
    raw = pickle.loads(pickle.dumps(S.parse_source_spec(f"tfrecord:{tmp_path}/raw.tfrecord")))
    out = list(raw.read_all())
    assert [r.data["text"] for r in out] == lines[:30] and out[4].raw == lines[4].encode()
    # Token ids enter the cache as they are (no tokenize), with EOS appended.
    tfr.write_tfrecords(str(tmp_path / "ids.tfrecord"), [tfr.encode_example({"ids": [5 + k, 7, 255 - k]})
                                                        for k in range(40)])
    built = _build(CliRunner(), ["--source", f"tfrecord:{tmp_path}/ids.tfrecord#ids"], tmp_path / "c")
    assert built["num_examples"] == 40
    from seqcache.feeders import Feeder

    feeder = Feeder(cache=str(tmp_path / "c" / "shk" / "train"), global_batch_size=40, sequence_length=4,
                    num_epochs=1)
    rows = sorted(tuple(int(t) for t in row) for row in feeder.get_batch(0)["targets"])
    assert rows == sorted((5 + k, 7, 255 - k, 1) for k in range(40))
    # The fingerprint follows the files and the feature.
    assert src.fingerprint() != S.TFRecordSource(str(tmp_path / "part-*.tfrecord"), feature="ids").fingerprint()


def test_tfrecord_bad_records_go_through_the_policy(tmp_path, crc32c):
    path = tmp_path / "bad.tfrecord"
    records = [
        tfr.encode_example({"text": "fine"}),
        b"\x0a\xff",                                     # 1: not a tf.train.Example
        tfr.encode_example({"other": "x"}),              # 2: no feature "text"
        tfr.encode_example({"text": b"\xff\xfe bad"}),   # 3: not UTF-8
        tfr.encode_example({"text": 1.5}),               # 4: a float feature
        tfr.encode_example({"text": "also fine"}),
        b"First Citizen:",                               # 6: text, not an Example
    ]
    tfr.write_tfrecords(str(path), records)
    with pytest.raises(ValueError, match=r"bad.tfrecord: record 1 is not a tf.train.Example .*--on-error malformed="):
        list(S.TFRecordSource(str(path), feature="text").read_all())
    got = list(S.TFRecordSource(str(path), feature="text", on_error="skip").read_all())
    assert [r.issue.kind if r.issue else None for r in got] == [
        None, "malformed", "missing_field", "invalid_utf8", "bad_value", None, "malformed"]
    assert got[2].issue.message == f"{path}: record 2 has no feature 'text' (its features: other)"
    assert got[1].raw == b"\x0a\xff" and got[1].data == {}
    assert got[6].issue.message == f"{path}: record 6 is not a tf.train.Example (its bytes do not parse as one)"
    with pytest.raises(ValueError, match=r"none of its bytes are Example fields"):
        tfr.decode_example(b"\x18\x01")  # parses, as a field Example does not have
    assert tfr.decode_example(b"") == {}  # an Example without features
    replaced = list(S.TFRecordSource(str(path), feature="text", on_error={"default": "skip", "invalid_utf8": "replace"})
                    .read_all())
    assert replaced[3].data == {"text": "\ufffd\ufffd bad"} and replaced[3].issue.action == "replaced"
    # A damaged record (its data CRC) is malformed; a truncated file raises, naming the record.
    data = bytearray(path.read_bytes())
    data[12 + 2] ^= 0xFF  # inside record 0's data
    (tmp_path / "crc.tfrecord").write_bytes(bytes(data))
    first = next(iter(S.TFRecordSource(str(tmp_path / "crc.tfrecord"), feature="text", on_error="skip").read_all()))
    assert first.issue.kind == "malformed" and "CRC does not match" in first.issue.message
    (tmp_path / "cut.tfrecord").write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"cut.tfrecord: record 6: the file ends inside the record"):
        list(S.TFRecordSource(str(tmp_path / "cut.tfrecord"), feature="text", on_error="skip").read_all())
    (tmp_path / "text.tfrecord").write_bytes(b"just some text, not a TFRecord file\n")
    with pytest.raises(ValueError, match=r"text.tfrecord: record 0: the length's CRC does not match"):
        list(S.TFRecordSource(str(tmp_path / "text.tfrecord")).read_all())


# ---------------------------------------------------------------------------
# TFDS: a tiny dataset, prepared by the test in both file formats.


def _prepare(tfds, data_dir: str, file_format: str, lines: list[str]) -> None:
    import numpy as np

    class TinyShakespeareLines(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        """Lines of tinyshakespeare, with their line number as token ids."""

        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
                "text": tfds.features.Text(), "ids": tfds.features.Sequence(np.int64),
                "meta": {"line": np.int64}}))

        def _split_generators(self, dl_manager):
            return {"train": self._generate_examples(0, 240), "test": self._generate_examples(240, len(lines))}

        def _generate_examples(self, lo, hi):
            for k in range(lo, hi):
                yield k, {"text": lines[k], "ids": [k % 7, k % 5], "meta": {"line": k}}

    TinyShakespeareLines(data_dir=data_dir, file_format=file_format).download_and_prepare()


@pytest.fixture(scope="module")
def tfds_dirs(tmp_path_factory, lines):
    """{file format: TFDS data_dir holding tiny_shakespeare_lines/1.0.0}."""
    _need("google_crc32c")
    _need("tensorflow")
    tfds = _need("tensorflow_datasets")
    out = {}
    for file_format in ("tfrecord", "array_record"):
        d = str(tmp_path_factory.mktemp(f"tfds-{file_format}"))
        _prepare(tfds, d, file_format, lines)
        out[file_format] = d
    return out


@pytest.mark.parametrize("file_format", ["tfrecord", "array_record"])
def test_tfds_source_reads_a_prepared_split(tfds_dirs, lines, file_format):
    d = tfds_dirs[file_format]
    src = S.TfdsSource("tiny_shakespeare_lines:1.0.0", split="train", data_dir=d)
    files = src.list_files()
    assert files and all(f".{file_format}-" in f.path and f.path.startswith(d) for f in files)
    got = list(pickle.loads(pickle.dumps(src)).read_all())
    assert sorted(r.data["text"] for r in got) == sorted(lines[:240])  # TFDS shuffles at prepare time
    ids = [(r.file_index, r.record_number) for r in got]
    assert len(set(ids)) == 240 and sorted(n for _, n in ids) == sorted(ids_in_files(got))
    assert all(r.raw == S.canonical_json_bytes({"text": r.data["text"]}) for r in got)
    # A nested feature, as token ids; a slice keeps the shard's record numbers.
    nested = S.TfdsSource("tiny_shakespeare_lines", split="test", data_dir=d, field="meta/line", output_key="n")
    assert sorted(r.data["n"][0] for r in nested.read_all()) == list(range(240, len(lines)))
    sliced = list(S.TfdsSource("tiny_shakespeare_lines", split="train[10:30]", data_dir=d).read_all())
    assert [r.record_number for r in sliced] == list(range(10, 30)) and len(files) == 1
    assert [r.data["text"] for r in sliced] == [r.data["text"] for r in got[10:30]]
    # Work units: splits of about target_bytes hold each record once.
    (f,) = files
    parts = src.splits(0, f, max(1, f.num_bytes // 5))
    if file_format == "array_record":
        assert len(parts) > 1
    again = [r for p in parts for r in src.read_split(p)]
    assert [(r.record_number, r.raw) for r in again] == [(r.record_number, r.raw) for r in got]


def ids_in_files(records):
    """Record numbers 0..n-1 of each file, for the records read."""
    per_file: dict[int, int] = {}
    for r in records:
        per_file[r.file_index] = per_file.get(r.file_index, 0) + 1
    return [n for count in per_file.values() for n in range(count)]


def test_tfds_shards_are_read_without_tfds_or_tensorflow(tfds_dirs, tmp_path, lines):
    # What a build's worker does: unpickle the resolved source and read its splits, in a
    # process where importing TFDS or TensorFlow fails.
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Blocked:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('tensorflow', 'tensorflow_datasets'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, _Blocked())\n")
    jobs = []
    for file_format, d in tfds_dirs.items():
        src = S.TfdsSource("tiny_shakespeare_lines", split="train", data_dir=d)
        parts = [p for i, f in enumerate(src.list_files()) for p in src.splits(i, f, 2048)]
        jobs.append((src, parts))
    (tmp_path / "jobs.pkl").write_bytes(pickle.dumps(jobs))
    script = ("import pickle, sys, json\n"
              "jobs = pickle.load(open(sys.argv[1], 'rb'))\n"
              "out = [sorted(r.data['text'] for p in parts for r in src.read_split(p)) for src, parts in jobs]\n"
              "assert not [m for m in sys.modules if m.startswith(('tensorflow', 'tensorflow_datasets'))]\n"
              "print(json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "jobs.pkl")], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(tmp_path / "site")), timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [sorted(lines[:240])] * 2


def test_tfds_errors_say_what_to_do(tfds_dirs, tmp_path):
    d = tfds_dirs["tfrecord"]
    with pytest.raises(FileNotFoundError, match=r"not_prepared_here: no prepared dataset .*tfds build not_prepared_here "
                                                 r"--data_dir .*download_and_prepare\(\)"):
        S.TfdsSource("not_prepared_here", data_dir=str(tmp_path)).list_files()
    with pytest.raises(ValueError, match=r"no split 'dev'.*its splits: test, train"):
        S.TfdsSource("tiny_shakespeare_lines", split="dev", data_dir=d).list_files()
    with pytest.raises(ValueError, match=r"no feature 'body' \(its features: ids, meta/line, text\)"):
        S.TfdsSource("tiny_shakespeare_lines", field="body", data_dir=d).list_files()


def _build(runner, args, cache_root):
    out = runner.invoke(main, ["build", *args, "--name", "shk", "--num-shards", "2", "--cache-dir", str(cache_root),
                               "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)[0]


def _shard_digests(cache: str) -> list[str]:
    m = fmt.read_manifest(cache)
    digests = [hashlib.sha256(open(os.path.join(cache, name), "rb").read()).hexdigest() for name in m.shards.files]
    assert digests == fmt.read_shard_checksums(cache, m)[0]
    return digests


def test_tfds_build_in_both_formats_gives_the_same_bytes_and_provenance(tfds_dirs, tmp_path, lines):
    runner = CliRunner()
    caches = {}
    for file_format, d in tfds_dirs.items():
        built = _build(runner, ["--source", "tfds:tiny_shakespeare_lines:1.0.0@test#text", "--tfds-data-dir", d],
                       tmp_path / file_format)
        assert built["num_examples"] == len(lines) - 240
        caches[file_format] = os.path.join(tmp_path, file_format, "shk", "train")
    # Same records, same cache bytes, whatever the TFDS file format (G1).
    assert _shard_digests(caches["tfrecord"]) == _shard_digests(caches["array_record"])
    shown = json.loads(runner.invoke(main, ["show", caches["array_record"], "--index", "3", "--json"]).output)[0]
    prov = shown["features"]["targets"]["segments"][0]["provenance"]
    assert ".array_record-00000-of-" in prov["path"] and prov["locator"] == "record"
    assert shown["features"]["targets"]["segments"][0]["text"] in lines[240:]
    # `which` names the shard file and the record index: reading that record back gives the row's text.
    for file_format, cache in caches.items():
        res = runner.invoke(main, ["which", cache, "--step", "1", "--row", "1", "--batch-size", "4", "--json"])
        assert res.exit_code == 0, res.output
        seg = json.loads(res.output)["segments"][0]
        (record,) = [r for r in S.TfdsSource("tiny_shakespeare_lines", split="test", data_dir=tfds_dirs[file_format])
                     .read_all() if (r.record_number, r.file_index) == (seg["record_number"], 0)]
        assert f".{file_format}-" in seg["source"] and seg["locator"] == "record"
        assert record.data["text"] == seg["text"]
    missing = runner.invoke(main, ["build", "--source", "tfds:tiny_shakespeare_lines#text", "--tfds-data-dir",
                                   str(tmp_path / "empty"), "--name", "x", "--cache-dir", str(tmp_path / "x")])
    assert missing.exit_code == 1 and "tfds build tiny_shakespeare_lines" in missing.output


# ---------------------------------------------------------------------------
# Hugging Face datasets saved on disk.


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory, lines):
    """{layout: folder} of the same rows: save_to_disk of a Dataset (2 Arrow files),
    of a DatasetDict, and Hub-style Parquet shards."""
    datasets = _need("datasets")
    root = tmp_path_factory.mktemp("hf")
    rows = {"text": lines, "n": list(range(len(lines)))}
    train = datasets.Dataset.from_dict({k: v[:240] for k, v in rows.items()})
    test = datasets.Dataset.from_dict({k: v[240:] for k, v in rows.items()})
    train.save_to_disk(str(root / "dataset"), num_shards=2)
    datasets.Dataset.from_dict(rows, split=datasets.Split.TEST).save_to_disk(str(root / "named"))
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(root / "dict"))
    (root / "hub" / "data").mkdir(parents=True)
    for name, ds, shards in (("train", train, 2), ("test", test, 1)):
        for k in range(shards):
            ds.shard(shards, k, contiguous=True).to_parquet(str(root / "hub" / "data" / f"{name}-{k:05d}-of-{shards:05d}.parquet"))
    return {"dataset": str(root / "dataset"), "dict": str(root / "dict"), "hub": str(root / "hub"),
            "named": str(root / "named")}


def test_hf_layouts_read_the_same_rows(hf_dirs, lines):
    read = {}
    for layout in ("dataset", "dict", "hub"):
        folder = hf_dirs[layout]
        src = S.HfDatasetSource(folder, split="train")
        got = list(pickle.loads(pickle.dumps(src)).read_all())
        read[layout] = got
        assert [r.data["text"] for r in got] == lines[:240], layout
        assert src.locator == "row"
    # Two files each: row numbers restart per file; raw is the same in every layout.
    assert [(r.file_index, r.record_number) for r in read["dataset"][119:122]] == [(0, 119), (1, 0), (1, 1)]
    assert [r.raw for r in read["dataset"]] == [r.raw for r in read["hub"]] == [r.raw for r in read["dict"]]
    numbers = S.HfDatasetSource(hf_dirs["dict"], split="test", column="n", output_key="n")
    assert [r.data["n"] for r in numbers.read_all()] == list(range(240, len(lines)))
    with pytest.raises(FileNotFoundError, match=r"has no split 'dev' \(its splits: train, test\)"):
        S.HfDatasetSource(hf_dirs["dict"], split="dev").list_files()
    with pytest.raises(FileNotFoundError, match=r"no Hugging Face dataset split 'dev' here.*data/train-00000-of-00002"):
        S.HfDatasetSource(hf_dirs["hub"], split="dev").list_files()
    # A saved Dataset that names its split is that split only.
    assert len(list(S.HfDatasetSource(hf_dirs["named"], split="test").read_all())) == len(lines)
    with pytest.raises(FileNotFoundError, match=r"the saved Dataset is split 'test', not 'train'"):
        S.HfDatasetSource(hf_dirs["named"], split="train").list_files()
    with pytest.raises(ValueError, match=r"data-00000-of-00002.arrow: Arrow file has no column 'body'"):
        list(S.HfDatasetSource(hf_dirs["dataset"], column="body").read_all())


def test_hf_build_arrow_and_parquet_give_the_same_bytes(hf_dirs, tmp_path, lines):
    runner = CliRunner()
    a = _build(runner, ["--source", f"hf:{hf_dirs['dict']}@test#text"], tmp_path / "a")
    b = _build(runner, ["--source", f"hf:{hf_dirs['hub']}#text", "--split", "test"], tmp_path / "b")
    assert a["num_examples"] == b["num_examples"] == len(lines) - 240
    assert _shard_digests(os.path.join(tmp_path, "a", "shk", "train")) == \
        _shard_digests(os.path.join(tmp_path, "b", "shk", "test"))


def test_specs_parse_to_the_dataset_sources(tmp_path):
    _need("google_crc32c")
    spec = S.parse_source_spec("tfrecord:/data/*.tfrecord#ids")
    assert isinstance(spec, S.TFRecordSource) and spec.features == {"text": "ids"}
    assert S.parse_source_spec("tfrecord:/data/x.tfrecord").features == {}
    hf = S.parse_source_spec("hf:/data/ds@validation#body", split="train")
    assert (hf.path, hf.split, hf.columns) == ("/data/ds", "validation", {"text": "body"})
    assert S.parse_source_spec("hf:/data/ds", split="test").split == "test"
    if importlib.util.find_spec("tensorflow_datasets"):
        t = S.parse_source_spec("tfds:c4/en:3.0.1@validation#text", tfds_data_dir="rel/dir")
        assert (t.name, t.split, t.field, t.data_dir) == ("c4/en:3.0.1", "validation", "text",
                                                          os.path.abspath("rel/dir"))
    with pytest.raises(ValueError, match="bad source spec"):
        S.parse_source_spec("tfrecord:#text")
