"""TsvSource and ``tsv:`` specs: tab-separated pairs (a translation corpus as
one file), columns by index, bad lines named or counted."""

import gzip
import json

import pytest
from click.testing import CliRunner

from seqcache import tasks
from seqcache.cli.main import main
from seqcache.feeders import CacheReader


def _pairs(corpora, n=400):
    en = gzip.open(corpora.multi30k / "val.en.gz", "rt", encoding="utf-8").read().splitlines()[:n]
    de = gzip.open(corpora.multi30k / "val.de.gz", "rt", encoding="utf-8").read().splitlines()[:n]
    return list(zip(en, de))


def _records(source):
    files = source.list_files()
    out = []
    for i, f in enumerate(files):
        for split in source.splits(i, f, 1 << 20):
            out.extend(source.read_split(split))
    return out


def test_columns_by_index_and_byte_offsets(tmp_path, corpora):
    pairs = _pairs(corpora, 50)
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{i}\t{en}\t{de}\n" for i, (en, de) in enumerate(pairs)), encoding="utf-8")
    records = _records(tasks.TsvSource(str(path), columns={"inputs": 2, "targets": 1}))
    assert [(r.data["targets"], r.data["inputs"]) for r in records] == pairs
    text = path.read_bytes()
    for r in records:  # the record number is the line's byte offset; raw, the columns read (by index)
        line = text[r.record_number:].split(b"\n", 1)[0].decode().split("\t")
        assert json.loads(r.raw) == {"1": line[1], "2": line[2]} == {"1": r.data["targets"], "2": r.data["inputs"]}


def test_split_reads_give_the_records_of_a_whole_read(tmp_path, corpora):
    path = tmp_path / "pairs.tsv"
    path.write_text("".join(f"{en}\t{de}\n" for en, de in _pairs(corpora)), encoding="utf-8")
    source = tasks.TsvSource(str(path))
    f = source.list_files()[0]
    whole = [(r.record_number, r.data) for r in source.read_split(source.splits(0, f, 1 << 30)[0])]
    pieces = [(r.record_number, r.data) for s in source.splits(0, f, 997) for r in source.read_split(s)]
    assert len(source.splits(0, f, 997)) > 5 and pieces == whole and len(whole) == 400


def test_a_short_line_raises_naming_file_and_line_or_is_counted(tmp_path):
    path = tmp_path / "bad.tsv"
    path.write_text("a\tb\nonly one column\n\nc\td\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad.tsv: line 2 \(byte 4\) has 1 tab-separated column\(s\), column 1"):
        _records(tasks.TsvSource(str(path)))
    records = _records(tasks.TsvSource(str(path), on_error={"malformed": "skip"}))
    assert [r.data for r in records if r.issue is None] == [{"inputs": "a", "targets": "b"},
                                                           {"inputs": "c", "targets": "d"}]
    assert [r.issue.kind for r in records if r.issue is not None] == ["malformed"]


def test_header_and_bad_column_specs(tmp_path):
    path = tmp_path / "h.tsv"
    path.write_text("src\ttgt\nx\ty\n", encoding="utf-8")
    assert [r.data for r in _records(tasks.TsvSource(str(path), header=True))] == [{"inputs": "x", "targets": "y"}]
    with pytest.raises(ValueError, match="0-based index"):
        tasks.TsvSource(str(path), columns={"inputs": -1})
    with pytest.raises(ValueError, match="0-based indices"):
        tasks.parse_source_spec(f"tsv:{path}#inputs=a,targets=b")
    s = tasks.parse_source_spec(f"tsv:{path}#targets=0,inputs=1")
    assert isinstance(s, tasks.TsvSource) and s.columns == {"inputs": 1, "targets": 0}


def test_a_translation_cache_from_a_tsv_on_the_command_line(tmp_path, corpora):
    pairs = _pairs(corpora)
    path = tmp_path / "val.en-de.tsv"
    path.write_text("".join(f"{en}\t{de}\n" for en, de in pairs), encoding="utf-8")
    out = CliRunner().invoke(main, ["build", "--source", f"tsv:{path}", "--vocabulary", "byte", "--name", "en_de",
                                    "--sequence-length", "inputs=512,targets=512", "--num-shards", "2",
                                    "--cache-dir", str(tmp_path / "caches"), "--json"])
    assert out.exit_code == 0, out.output
    cache = json.loads(out.stdout[out.stdout.index("["):])[0]["cache_dir"]
    vocab = tasks.ByteVocabulary()
    with CacheReader(cache) as r:
        examples = r.read_examples(range(len(r)))
        got = sorted((vocab.decode(e["inputs"].tolist()), vocab.decode(e["targets"].tolist())) for e in examples)
    assert got == sorted(pairs)
