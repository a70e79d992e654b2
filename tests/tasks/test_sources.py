"""Sources: record ids, raw bytes, formats and errors, on the shared corpora."""

import gzip
import json
import pickle

import pytest

from seqcache.tasks import sources as S


def _first(source, n=None):
    out = []
    for r in source.read_all():
        out.append(r)
        if n is not None and len(out) == n:
            break
    return out


def test_text_lines_tinyshakespeare(corpora):
    path = str(corpora.shakespeare)
    with pytest.raises(S.BadInputError, match=r"input.txt: line 3 \(byte 61\) is empty; .*--on-error empty="):
        _first(S.TextLineSource(path, on_error="raise"))  # empty lines raise when asked to
    # By default the blank lines that separate speeches are skipped, each marked for the quarantine file.
    default = list(S.TextLineSource(path).read_all())
    skipped = [r for r in default if S.is_error_record(r)]
    assert len(skipped) == 7_223 and {r.issue.kind for r in skipped} == {"empty"} and len(default) == 40_000
    src = S.TextLineSource(path, on_error={"empty": "keep"})
    (f,) = src.list_files()
    assert f.num_bytes == 1_115_394
    records = list(src.read_file(7, f.path))
    assert len(records) == 40_000
    # Record numbers are byte offsets of the lines' first bytes.
    assert [r.record_number for r in records[:5]] == [0, 15, 61, 62, 67]
    assert all(r.file_index == 7 for r in records)
    assert records[0] == S.SourceRecord(7, 0, {"text": "First Citizen:"}, b"First Citizen:")
    # Kept empty lines are records.
    assert records[2].data == {"text": ""} and records[2].raw == b""
    assert sum(1 for r in records if r.raw == b"") > 1000
    # raw is the UTF-8 line without its terminator: the lines rebuild the file.
    with open(f.path, "rb") as fh:
        assert b"\n".join(r.raw for r in records) + b"\n" == fh.read()


def test_text_lines_crlf(corpora):
    src = S.TextLineSource(str(corpora.wikitext / "wiki.test.raw.crlf"))
    records = _first(src)
    assert len(records) == 2891
    assert records[0].data["text"] == " = Robert Boulter = "
    assert not any(r.raw.endswith(b"\r") or b"\n" in r.raw for r in records)
    with open(src.list_files()[0].path, "rb") as fh:
        assert b"\r\n".join(r.raw for r in records) + b"\r\n" == fh.read()


def test_text_lines_bom_gz_and_last_line(tmp_path, corpora):
    # botchan.txt starts with a UTF-8 BOM, removed from the first record.
    (first,) = _first(S.TextLineSource(str(corpora.botchan)), 1)
    assert not first.raw.startswith(b"\xef\xbb\xbf") and not first.data["text"].startswith("\ufeff")
    p = tmp_path / "a.txt.gz"
    with gzip.open(p, "wb") as fh:
        fh.write("één\r\n\nlast".encode("utf-8"))
    records = _first(S.TextLineSource(str(p), field="line", on_error={"empty": "keep"}))
    # Offsets in the decompressed stream: "één\r\n" is 7 bytes.
    assert [(r.record_number, r.data["line"], r.raw) for r in records] == [
        (0, "één", "één".encode()), (7, "", b""), (8, "last", b"last")]


def test_text_lines_invalid_utf8(tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"good\n\xff\xfe broken\n\xc0\xaf overlong\nfine\n")
    with pytest.raises(ValueError, match=r"bad.txt: line 2 \(byte 5\) is not valid UTF-8"):
        _first(S.TextLineSource(str(p)))
    records = _first(S.TextLineSource(str(p), on_error="skip"))
    assert [S.is_error_record(r) for r in records] == [False, True, True, False]
    assert [r.record_number for r in records] == [0, 5, 15, 27]
    assert records[1].raw == b"\xff\xfe broken"  # kept for the quarantine file
    assert records[1].data == {} and records[1].issue.action == "skipped" and records[1].issue.kind == "invalid_utf8"
    # The message names the line by its byte offset only: it does not depend on the split.
    assert records[2].issue.message.startswith(f"{p}: line at byte 15 is not valid UTF-8: ")
    assert records[0].issue is None and records[3].data == {"text": "fine"}


def test_a_listing_of_one_folder_is_what_glob_lists(tmp_path, monkeypatch):
    """A pattern whose wildcards are all in its last part is listed from the
    folder directly: the same files, sizes and times as glob and stat give
    (hidden names only for a pattern that starts with a dot; folders and
    broken links left out), sorted by path; relative patterns too."""
    import glob
    import os

    from seqcache import fs

    for name, data in [("b.txt", b"bb\n"), ("a.txt", b"a\n"), ("A.TXT", b"AAA\n"), (".hidden.txt", b"h\n"),
                       ("c.md", b"c\n"), ("[x].txt", b"x\n")]:
        (tmp_path / name).write_bytes(data)
    (tmp_path / "folder.txt").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "broken.txt")
    os.symlink(tmp_path / "a.txt", tmp_path / "link.txt")
    for pattern in ["*.txt", ".*.txt", "*", "[ab].*", "?.txt", "[[]x].txt", "*.TXT", "a.txt"]:
        expect = sorted(p for p in glob.glob(str(tmp_path / pattern)) if os.path.isfile(p))
        got = fs.match(str(tmp_path / pattern))
        assert [f.path for f in got] == expect, pattern
        assert [(f.num_bytes, f.mtime_ns) for f in got] == [(os.stat(p).st_size, os.stat(p).st_mtime_ns)
                                                            for p in expect], pattern
    assert [f.path for f in fs.match(str(tmp_path / "*.txt"))] == [str(tmp_path / n) for n in
                                                                   ["[x].txt", "a.txt", "b.txt", "link.txt"]]
    monkeypatch.chdir(tmp_path)
    assert [f.path for f in fs.match("*.md")] == [str(tmp_path / "c.md")]
    assert fs.match(str(tmp_path / "nothing" / "*.txt")) == []


def test_glob_sorted_recursive_and_no_match(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "deep").mkdir()
    for rel in ["z.txt", "a.txt", "b/m.txt", "b/deep/c.txt"]:
        (tmp_path / rel).write_text("x\n")
    files = S.TextLineSource(str(tmp_path / "**" / "*.txt")).list_files()
    assert [f.path for f in files] == sorted(str(tmp_path / r) for r in ["z.txt", "a.txt", "b/m.txt", "b/deep/c.txt"])
    # Two overlapping patterns: the union, once each.
    both = S.TextLineSource([str(tmp_path / "*.txt"), str(tmp_path / "a.txt")]).list_files()
    assert [f.path for f in both] == [str(tmp_path / "a.txt"), str(tmp_path / "z.txt")]
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(FileNotFoundError, match=r"\*\.nothing"):
        S.TextLineSource(pattern).list_files()
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        S.TextLineSource(str(tmp_path / "missing.txt")).list_files()


def test_text_file_source(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "b.py").write_text("x = 2\n")
    src = S.TextFileSource(str(tmp_path / "*.py"))
    records = _first(src)
    assert [(r.file_index, r.record_number, r.data["text"]) for r in records] == [
        (0, 0, "def f():\n    return 1\n"), (1, 0, "x = 2\n")]
    assert records[1].raw == b"x = 2\n"


def test_jsonl_dotted_field(corpora):
    src = S.JsonLinesSource(str(corpora.dolma / "*.jsonl.gz"), field="metadata.title")
    files = src.list_files()
    assert [f.path.rsplit("/", 1)[1] for f in files] == ["cc_en_head-0091.jsonl.gz", "cc_en_head-0174.jsonl.gz"]
    records = _first(src)
    assert len(records) == 20
    with gzip.open(files[0].path) as fh:
        last = sum(len(line) for line in fh.readlines()[:9])  # the byte offset of the 10th line
    with gzip.open(files[1].path) as fh:
        second = len(fh.readline())
    assert [(r.file_index, r.record_number) for r in records[9:12]] == [(0, last), (1, 0), (1, second)]
    assert records[0].data == {"text": "First Teleconference Calls for Invoice Factoring, and more. — 100K Investing, LLC."}
    # raw is what the task reads, the selected value by its path, as canonical JSON (not the whole line).
    assert json.loads(records[0].raw) == {"metadata.title": records[0].data["text"]}
    assert records[0].raw == S.canonical_json_bytes({"metadata.title": records[0].data["text"]})


def test_jsonl_several_fields_and_errors(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": {"b": "one"}, "c": 1}\n\n{"a": {"b": "two"}, "c": 2}\n{"a": {}}\nnot json\n[1]\n')
    src = S.JsonLinesSource(str(p), fields={"text": "a.b", "n": "c"}, on_error="skip")
    records = _first(src)
    assert [r.record_number for r in records] == [0, 29, 57, 67, 76]  # the blank line at byte 28 is no record
    assert records[0].data == {"n": 1, "text": "one"} and records[1].data == {"n": 2, "text": "two"}
    assert all(S.is_error_record(r) for r in records[2:])
    assert [r.issue.kind for r in records[2:]] == ["missing_field", "malformed", "malformed"]
    with pytest.raises(ValueError, match=r"x.jsonl: line 4 \(byte 57\) has no field 'a.b'"):
        _first(S.JsonLinesSource(str(p), field="a.b"))
    deep = tmp_path / "deep.jsonl"  # was: a RecursionError out of the build
    deep.write_text('{"text": "ok"}\n{"text": ' + "[" * 100_000 + "]" * 100_000 + '}\n{"text": "two"}\n')
    records = _first(S.JsonLinesSource(str(deep), on_error="skip"))
    assert [r.issue.kind for r in records if S.is_error_record(r)] == ["malformed"]
    assert [r.data for r in records if not S.is_error_record(r)] == [{"text": "ok"}, {"text": "two"}]
    with pytest.raises(ValueError, match=r"deep.jsonl: line 2 \(byte 15\) is not valid JSON: nested deeper"):
        _first(S.JsonLinesSource(str(deep)))
    q = tmp_path / "y.jsonl"
    q.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"y.jsonl: line 2 \(byte 15\) is not valid JSON"):
        _first(S.JsonLinesSource(str(q)))


def test_parquet_c4(corpora):
    src = S.ParquetSource(str(corpora.c4), batch_size=300,
                          on_error={"control_characters": "keep"})
    records = _first(src)
    assert len(records) == 2000
    assert [r.record_number for r in records] == list(range(2000))
    assert records[0].raw == S.canonical_json_bytes({"text": records[0].data["text"]})
    assert records[0].data["text"].startswith("We offer valet parking")
    # Several columns: raw holds the selected columns under their column names.
    two = S.ParquetSource(str(corpora.c4.parent / "*.parquet"), columns={"text": "text", "link": "url"})
    (r0,) = _first(two, 1)
    assert json.loads(r0.raw) == {"text": r0.data["text"], "url": r0.data["link"]}


def test_parquet_missing_column(corpora):
    src = S.ParquetSource(str(corpora.c4), column="body")
    with pytest.raises(ValueError, match=r"c4_validation_2k.parquet: Parquet file has no column 'body'"):
        _first(src)


def _numbers():
    return [{"text": f"n{i}", "i": i} for i in range(5)]


def test_function_source():
    src = S.FunctionSource(_numbers, name="numbers", version="2")
    assert src.list_files() == [S.SourceFile("<function numbers>", 0, 0)]
    records = _first(src)
    assert [r.record_number for r in records] == [0, 1, 2, 3, 4]
    assert records[3].raw == b'{"i":3,"text":"n3"}'
    assert src.fingerprint()["version"] == "2"
    assert pickle.loads(pickle.dumps(src)).fingerprint() == src.fingerprint()


def test_fingerprint_and_pickle(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("one\ntwo\n")
    src = S.TextLineSource(str(p))
    fp = src.fingerprint()
    assert fp["kind"] == "text" and fp["files"][0]["num_bytes"] == 8 and fp["params"] == {"field": "text"}
    clone = pickle.loads(pickle.dumps(src))
    assert clone.fingerprint() == fp
    assert len(pickle.dumps(src)) < 1000
    p.write_text("one\ntwo\nthree\n")
    assert src.fingerprint() != fp  # size changed
    assert S.TextLineSource(str(p), field="x").fingerprint()["params"] != fp["params"]


@pytest.mark.parametrize("spec, cls, attrs", [
    ("text:data/*.txt", S.TextLineSource, {"patterns": ("data/*.txt",)}),
    ("files:src/**/*.py", S.TextFileSource, {"patterns": ("src/**/*.py",)}),
    ("jsonl:d/*.jsonl.gz#metadata.title", S.JsonLinesSource, {"fields": {"text": "metadata.title"}}),
    ("jsonl:d/*.jsonl", S.JsonLinesSource, {"fields": {"text": "text"}}),
    ("parquet:c4/*.parquet#body", S.ParquetSource, {"columns": {"text": "body"}}),
])
def test_parse_source_spec(spec, cls, attrs):
    src = S.parse_source_spec(spec)
    assert type(src) is cls
    for k, v in attrs.items():
        assert getattr(src, k) == v


@pytest.mark.parametrize("spec", ["csv:x.csv", "x.txt", "text:", "jsonl:x.jsonl#"])
def test_parse_source_spec_errors(spec):
    with pytest.raises(ValueError, match="accepted source specs"):
        S.parse_source_spec(spec)


def test_a_source_with_a_kind_and_from_spec_is_a_command_line_form(tmp_path):
    from seqcache.tasks.sources.base import SPEC_KINDS

    assert sorted(SPEC_KINDS) == ["files", "hf", "jsonl", "parallel", "parquet", "text", "tfds", "tfrecord", "tsv"]

    class UpperLines(S.TextLineSource):  # one class, no other edit
        kind = "upper"
        spec_forms = "'upper:PATTERN' (lines, upper-cased)"

        def read_split(self, split):
            return (r._replace(data={"text": r.data["text"].upper()}) for r in super().read_split(split))

    p = tmp_path / "a.txt"
    p.write_text("ab\ncd\n")
    try:
        src = S.parse_source_spec(f"upper:{p}")
        assert type(src) is UpperLines and [r.data["text"] for r in src.read_all()] == ["AB", "CD"]
        with pytest.raises(ValueError, match=r"unknown kind 'nope'; accepted source specs: .*'upper:PATTERN'"):
            S.parse_source_spec("nope:x")
    finally:
        del SPEC_KINDS["upper"]


UPPER_SOURCES = """
from seqcache.tasks import sources as S


class UpperLines(S.TextLineSource):
    kind = "upper"
    spec_forms = "'upper:PATTERN' (lines, upper-cased)"

    def read_split(self, split):
        for r in super().read_split(split):
            yield self.with_data(r, lambda data: {"text": data["text"].upper()}, path=split.path)


class UpperRows(S.ParquetSource):
    kind = "upperpq"
    spec_forms = "'upperpq:PATTERN#COLUMN' (rows, upper-cased)"

    def read_split(self, split):
        for r in super().read_split(split):
            yield self.with_data(r, lambda data: {k: v.upper() for k, v in data.items()}, path=split.path)
"""


def _built_texts(tmp_path, name, *args) -> list[str]:
    """The texts of the cache that ``seqcache build --vocabulary byte ARGS`` makes, sorted."""
    from click.testing import CliRunner

    from seqcache.cli.main import main
    from seqcache.feeders.reader import CacheReader
    from seqcache.tasks.vocabularies import ByteVocabulary

    out = CliRunner().invoke(main, ["build", *args, "--name", name, "--vocabulary", "byte", "--sequence-length", "64",
                                    "--cache-dir", str(tmp_path / "c"), "--num-shards", "1"])
    assert out.exit_code == 0, out.output
    with CacheReader(str(tmp_path / "c" / name / "train")) as r:
        examples = list(r.read_examples(list(range(len(r)))))
    vocab = ByteVocabulary()
    return sorted(vocab.decode([int(t) for t in ex["targets"] if t > 1]) for ex in examples)


def test_a_subclass_that_overrides_read_split_is_what_a_build_reads(tmp_path):
    """The batch paths of text lines and Parquet read the files without
    calling read_split; a subclass that overrides it alone is read through it
    by the build, as by read_all and scan."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from seqcache.tasks.sources.base import SPEC_KINDS

    module = tmp_path / "upper_sources.py"
    module.write_text(UPPER_SOURCES, encoding="utf-8")
    lines = [f"line {i} of the corpus, mixed Case" for i in range(40)]
    (tmp_path / "a.txt").write_text("\n".join(lines[:20] + [""] + lines[20:]) + "\n", encoding="utf-8")  # one skipped
    pq.write_table(pa.table({"text": lines}), tmp_path / "a.parquet")
    expected = sorted(x.upper() for x in lines)
    try:
        assert _built_texts(tmp_path, "up", "--module", str(module), "--source", f"upper:{tmp_path}/a.txt") == expected
        assert _built_texts(tmp_path, "uppq", "--module", str(module),
                            "--source", f"upperpq:{tmp_path}/a.parquet#text") == expected
        assert _built_texts(tmp_path, "plain", "--source", f"text:{tmp_path}/a.txt") == sorted(lines)
    finally:
        SPEC_KINDS.pop("upper", None)
        SPEC_KINDS.pop("upperpq", None)


class _Upper(S.TextLineSource):
    def read_split(self, split):
        for r in super().read_split(split):
            yield self.with_data(r, lambda data: {"text": data["text"].upper()}, path=split.path)


def test_a_subclass_is_its_own_input_and_its_derived_records_meet_the_policy(tmp_path):
    """A subclass's class and version enter the fingerprint (a cache of the
    parent is not reused for it), its own fingerprint() is honoured, and a
    record it derives with with_data is checked by on_error again."""
    p = tmp_path / "a.txt"
    p.write_text("ab\n\ncd\n")
    plain, upper = S.TextLineSource(str(p)), _Upper(str(p))
    files = plain.list_files()
    assert plain.fingerprint_of_files(files) == plain.fingerprint() and "class" not in plain.fingerprint()
    mine = upper.fingerprint_of_files(files)
    assert mine["class"] == f"{_Upper.__module__}._Upper" and mine["version"] == 1 and mine != plain.fingerprint()

    class MinLength(S.TextLineSource):
        def __init__(self, pattern, min_length):
            super().__init__(pattern)
            self.min_length = min_length

        def fingerprint(self):
            out = super().fingerprint()
            return {**out, "params": {**out["params"], "min_length": self.min_length}}

    assert MinLength(str(p), 3).fingerprint_of_files(files)["params"]["min_length"] == 3
    assert [r.data.get("text") for r in upper.read_all()] == ["AB", None, "CD"]  # the empty line stays skipped

    class Controlled(S.TextLineSource):
        def read_split(self, split):
            for r in super().read_split(split):
                yield self.with_data(r, {"text": r.data.get("text", "") + "\x01"}, path=split.path)

    with pytest.raises(S.BadInputError, match=r"a.txt: line 1 \(byte 0\) contains control character U\+0001"):
        list(Controlled(str(p), on_error={"control_characters": "raise"}).read_all())


def test_a_subclass_that_overrides_a_method_its_parent_reads_around_is_refused_and_errors_name_the_file(tmp_path):
    with pytest.raises(TypeError, match=r"ViaFile overrides read_file, which the reads of TextLineSource do not "
                                        r"call .*override read_split"):
        class ViaFile(S.TextLineSource):
            def read_file(self, file_index, path):
                return iter(())

    with pytest.raises(TypeError, match=r"ViaBatches overrides read_batches, .*override read_split"):
        class ViaBatches(S.TextLineSource):
            def read_batches(self, split, batch_records):
                return iter(())

    class Careless(S.TextLineSource):
        def read_split(self, split):
            for r in super().read_split(split):
                yield r._replace(data={"text": r.data["text"].upper()})  # a skipped record has no "text"

    p = tmp_path / "a.txt"
    p.write_text("ab\n\ncd\n")
    source = Careless(str(p))
    splits = source.splits(0, source.list_files()[0], 1 << 20)
    with pytest.raises(ValueError, match=rf"^{p}: reading it raised KeyError: 'text'$"):
        list(source.read_batches_of(splits, 10))
    from seqcache import tasks

    report = tasks.scan_task(tasks.Task("careless", source=source,
                                        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())}))
    assert report.unreadable_files == [f"{p}: reading it raised KeyError: 'text'"]


def test_describe_record_is_the_one_wording_of_a_place(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("x\n" * 600)
    assert S.describe_record(str(p), "byte_offset", 1100) == "line 551 (byte 1,100)"
    assert S.describe_record(str(p), "byte_offset", 1100, stable=True) == "line at byte 1100"  # reads nothing
    assert [S.describe_record(None, loc, 1234, stable=True) for loc in ("row", "record", "line", "file")] == [
        "row 1234", "record 1234", "line 1235", "file"]
    assert S.describe_record(None, None, 1234) == "record 1234" and S.describe_record("a", "row", None) == "record ?"
    src = S.TextLineSource(str(p))
    assert src.where(str(p), 1100).text == f"{p}: line at byte 1100"
    assert src.where(str(p), 1100).raised() == f"{p}: line 551 (byte 1,100)"


# ---------------------------------------------------------------------------
# The content kinds: control characters, U+2581, empty and whitespace-only text.


def _texts(source):
    def message(r, action):
        return r.issue.message if r.issue is not None and r.issue.action == action else None

    return [(r.record_number, r.data.get("text"), message(r, "skipped"), message(r, "replaced"))
            for r in source.read_all()]


def test_with_path_names_the_file_once_and_keeps_bad_input_typed():
    bad = S.with_path(S.BadInputError("line 2 is empty; set ..."), "a.txt")
    assert type(bad) is S.BadInputError and str(bad) == "a.txt: line 2 is empty; set ..."
    assert S.with_path(bad, "a.txt") is bad
    plain = S.with_path(ValueError("no"), "b.txt")
    assert type(plain) is ValueError and str(plain) == "b.txt: no"


def test_control_characters_raise_skip_replace_or_keep(tmp_path):
    p = tmp_path / "ctl.txt"
    # ESC, a C1 control (U+0092, cp1252 mojibake) and NUL; tab, form feed and NEL are whitespace, not controls.
    p.write_bytes("plain\ncolour \x1b[31mred\nit\u0092s\ttab\x0cff\u0085nel\nnul\x00\n".encode())
    with pytest.raises(ValueError, match=r"ctl.txt: line 2 \(byte 6\) contains control character U\+001B at "
                                         r"character 7; .*--on-error control_characters="):
        _first(S.TextLineSource(str(p), on_error={"control_characters": "raise"}))
    # The default keeps them as they are and names the kind on the record, for the build to count.
    default = _first(S.TextLineSource(str(p)))
    assert [r.data["text"] for r in default] == p.read_text().split("\n")[:-1]
    assert [r.kept for r in default] == [(), ("control_characters",), ("control_characters",), ("control_characters",)]
    assert all(r.issue is None for r in default)
    skipped = _texts(S.TextLineSource(str(p), on_error={"control_characters": "skip"}))
    assert [(n, t) for n, t, err, _ in skipped if err is None] == [(0, "plain")]
    assert "U+0092 at character 2" in skipped[2][2] and "U+0000" in skipped[3][2]
    replaced = _texts(S.TextLineSource(str(p), on_error={"control_characters": "replace"}))
    assert [t for _, t, _, _ in replaced] == ["plain", "colour \ufffd[31mred", "it\ufffds\ttab\x0cff\x85nel", "nul\ufffd"]
    assert [rep is not None for *_, rep in replaced] == [False, True, True, True]
    kept = _texts(S.TextLineSource(str(p), on_error={"control_characters": "keep"}))
    assert [t for _, t, _, _ in kept] == p.read_text().split("\n")[:-1] and all(e is None for _, _, e, _ in kept)


def test_u2581_raises_and_can_become_a_space(tmp_path):
    p = tmp_path / "pieces.txt"
    p.write_text("▁already ▁tokenized\nclean\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 1 \(byte 0\) contains U\+2581 .* at character 0"):
        _first(S.TextLineSource(str(p), on_error={"u2581": "raise"}))
    default = _first(S.TextLineSource(str(p)))  # kept by default, and named for the count
    assert [(r.data["text"], r.kept) for r in default] == [("▁already ▁tokenized", ("u2581",)), ("clean", ())]
    assert [t for _, t, _, _ in _texts(S.TextLineSource(str(p), on_error={"u2581": "replace"}))] == [
        " already  tokenized", "clean"]
    assert _texts(S.TextLineSource(str(p), on_error={"u2581": "keep"}))[0][1] == "▁already ▁tokenized"
    # A repair that leaves only whitespace meets the whitespace policy next.
    q = tmp_path / "only.txt"
    q.write_text("▁\n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds only whitespace"):
        _first(S.TextLineSource(str(q), on_error={"u2581": "replace", "whitespace": "raise"}))


def test_whitespace_only_lines_of_wikitext(corpora):
    path = corpora.wikitext / "wiki.test.tokens"
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode("utf-8")) + 1)
    blank = [i for i, line in enumerate(lines) if line.isspace()]
    with pytest.raises(ValueError, match=rf"line {blank[0] + 1} \(byte {offsets[blank[0]]}\) holds only whitespace"):
        _first(S.TextLineSource(str(path), on_error={"whitespace": "raise"}))
    records = _first(S.TextLineSource(str(path)))  # skipped by default
    assert records == _first(S.TextLineSource(str(path), on_error={"whitespace": "skip"}))
    assert [r.record_number for r in records if S.is_error_record(r)] == [offsets[i] for i in blank]
    assert len(blank) > 1000
    assert [r.data["text"] for r in records if not S.is_error_record(r)] == [l for l in lines if not l.isspace()]


def test_empty_values_in_every_kind_of_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "zero.txt").write_bytes(b"")
    (tmp_path / "zero.py").write_bytes(b"")
    (tmp_path / "e.jsonl").write_text('{"text": "x"}\n{"text": ""}\n', encoding="utf-8")
    pq.write_table(pa.table({"text": ["x", "  "]}), tmp_path / "e.parquet")
    # A zero-byte file has no lines (no record), but as a whole file it is one empty record.
    assert _first(S.TextLineSource(str(tmp_path / "zero.txt"))) == []
    with pytest.raises(S.BadInputError, match=r"zero.py: file is empty"):
        _first(S.TextFileSource(str(tmp_path / "zero.py"), on_error="raise"))
    with pytest.raises(S.BadInputError, match=r"e.jsonl: line 2 \(byte 14\) is empty"):
        _first(S.JsonLinesSource(str(tmp_path / "e.jsonl"), on_error="raise"))
    with pytest.raises(S.BadInputError, match=r"e.parquet: record 1 \(row index 1\) holds only whitespace"):
        _first(S.ParquetSource(str(tmp_path / "e.parquet"), on_error="raise"))
    # By default each is skipped, with its kind.
    for source, kind in [(S.TextFileSource(str(tmp_path / "zero.py")), "empty"),
                         (S.JsonLinesSource(str(tmp_path / "e.jsonl")), "empty"),
                         (S.ParquetSource(str(tmp_path / "e.parquet")), "whitespace")]:
        assert [r.issue.kind for r in _first(source) if S.is_error_record(r)] == [kind]
    kept = S.ParquetSource(str(tmp_path / "e.parquet"), on_error={"whitespace": "keep"})
    assert [r.data["text"] for r in _first(kept)] == ["x", "  "]


def test_several_fields_name_the_field(tmp_path):
    p = tmp_path / "pairs.jsonl"
    p.write_text('{"src": "Hallo", "tgt": "Hello"}\n{"src": "Welt", "tgt": ""}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 \(byte 33\), field 'targets', is empty"):
        _first(S.JsonLinesSource(str(p), fields={"inputs": "src", "targets": "tgt"}, on_error="raise"))


def test_function_source_values_are_checked_too():
    src = S.FunctionSource(_with_control, name="ctl", on_error={"control_characters": "raise"})
    with pytest.raises(ValueError, match=r"<function ctl>: record 1 contains control character U\+0007"):
        _first(src)
    assert [r.kept for r in _first(S.FunctionSource(_with_control, name="ctl"))] == [(), ("control_characters",)]
    assert [r.data["text"] for r in _first(S.FunctionSource(_with_control, name="ctl",
                                                            on_error={"control_characters": "replace"}))] == [
        "fine", "bell\ufffd"]


def _with_control():
    return [{"text": "fine"}, {"text": "bell\a"}]


def test_error_policy_parsing_and_fingerprint():
    assert S.ErrorPolicy("replace").action("empty") == "skip"  # cannot be repaired
    assert S.ErrorPolicy("replace").action("control_characters") == "replace"
    policy = S.ErrorPolicy({"default": "skip", "empty": "keep"})
    assert policy.action("invalid_utf8") == "skip" and policy.action("empty") == "keep"
    assert S.ErrorPolicy({"empty": "skip"}).action("malformed") == "raise"
    # The defaults: skip empty and whitespace-only records, keep control characters and U+2581, raise on the rest.
    defaults = S.ErrorPolicy().to_json()
    assert {k for k, v in defaults.items() if v == "skip"} == {"empty", "whitespace"}
    assert {k for k, v in defaults.items() if v == "keep"} == {"control_characters", "u2581", "duplicate"}
    assert {k for k, v in defaults.items() if v == "raise"} == {
        "invalid_utf8", "carriage_return", "malformed", "missing_field", "bad_value"}
    assert S.ErrorPolicy(None) == S.ErrorPolicy({}) == S.TextLineSource("x.txt").on_error
    assert S.ErrorPolicy({"control_characters": "raise"}).to_json() == {**defaults, "control_characters": "raise"}
    # Strict: every kind but duplicate and near_duplicate, which only their names set (deduplication is no
    # error); near_duplicate is named in the fingerprint only when not "keep" (older caches keep theirs).
    strict = {k: "raise" for k in S.ERROR_KINDS if k != "near_duplicate"}
    assert S.ErrorPolicy("raise").to_json() == {**strict, "duplicate": "keep"}
    assert "near_duplicate" not in defaults and S.ErrorPolicy("raise").action("near_duplicate") == "keep"
    assert S.ErrorPolicy({"near_duplicate": "skip"}).to_json() == {**defaults, "near_duplicate": "skip"}
    assert S.parse_on_error(["near_duplicate=skip"]) == {"near_duplicate": "skip"}
    assert defaults["duplicate"] == "keep" and S.ErrorPolicy({"default": "skip"}).action("duplicate") == "keep"
    assert S.ErrorPolicy({"duplicate": "skip"}).to_json() == {**defaults, "duplicate": "skip"}
    assert S.parse_on_error(["duplicate=skip"]) == {"duplicate": "skip"}
    with pytest.raises(ValueError, match="duplicate can be keep, skip"):
        S.parse_on_error(["duplicate=raise"])
    assert S.parse_on_error([]) is None and S.parse_on_error(["raise"]) == "raise"
    for bad, message in [({"empty": "replace"}, r"on_error\['empty'\] must be one of"),
                         ({"nope": "skip"}, "unknown kind of bad input 'nope'"), ("keep", "set per kind"),
                         ("ignore", "must be one of")]:
        with pytest.raises(ValueError, match=message):
            S.ErrorPolicy(bad)
    assert S.parse_on_error(["skip", "empty=keep"]) == {"default": "skip", "empty": "keep"}
    assert S.parse_on_error(["replace"]) == "replace"
    a = S.TextLineSource("x.txt", on_error={"empty": "skip"})
    assert pickle.loads(pickle.dumps(a)).on_error == a.on_error == {"empty": "skip"}
    assert a.on_error != S.ErrorPolicy("raise")
    assert S.ErrorPolicy(S.ErrorPolicy("skip")).to_json() == {
        **{k: "skip" for k in S.ERROR_KINDS if k != "near_duplicate"}, "duplicate": "keep"}


def test_truncated_or_corrupt_gzip_names_the_file(tmp_path, corpora):
    whole = (corpora.multi30k / "train.en.gz").read_bytes()
    (tmp_path / "cut.txt.gz").write_bytes(whole[: len(whole) // 3])
    with pytest.raises(ValueError, match=r"cut\.txt\.gz: truncated or corrupt gzip data after line \d+"):
        _first(S.TextLineSource(str(tmp_path / "cut.txt.gz")))
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip at all\n")
    with pytest.raises(ValueError, match=r"fake\.jsonl\.gz: truncated or corrupt gzip data at the start"):
        _first(S.JsonLinesSource(str(tmp_path / "fake.jsonl.gz")))
    (tmp_path / "cut.py.gz").write_bytes(whole[:1000])
    with pytest.raises(ValueError, match=r"cut\.py\.gz: truncated or corrupt gzip"):
        _first(S.TextFileSource(str(tmp_path / "cut.py.gz")))
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match=r"bad\.parquet: cannot be read"):
        _first(S.ParquetSource(str(tmp_path / "bad.parquet")))


def test_binary_and_temporal_parquet_values(tmp_path):
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    day = datetime.date(2024, 2, 29)
    pq.write_table(pa.table({"text": pa.array([b"caf\xc3\xa9", b"bad \xff", b"ok"], pa.binary()),
                             "day": pa.array([day] * 3, pa.date32())}), tmp_path / "b.parquet")
    src = S.ParquetSource(str(tmp_path / "b.parquet"), columns={"text": "text", "day": "day"})
    with pytest.raises(ValueError, match=r"b\.parquet: record 1 \(row index 1\): value 'text' is not valid UTF-8"):
        _first(src)
    records = _first(S.ParquetSource(str(tmp_path / "b.parquet"), columns={"text": "text", "day": "day"},
                                     on_error="replace"))
    assert [r.data["text"] for r in records] == ["café", "bad \ufffd", "ok"]
    assert json.loads(records[0].raw) == {"day": "2024-02-29", "text": "café"}
    assert records[0].issue is None and records[1].issue.action == "replaced"
    assert records[1].issue.kind == "invalid_utf8" and records[1].data == {"text": "bad \ufffd", "day": day}
    assert records[1].issue.message.startswith(f"{tmp_path / 'b.parquet'}: record 1 (row index 1): value 'text'")


def test_function_source_bytes_and_values_without_json(tmp_path):
    src = S.FunctionSource(_odd_values, name="odd")
    records = _first(S.FunctionSource(_odd_values, name="odd", on_error="skip"))
    assert records[0].data == {"text": "bytes as text"}
    assert records[1].data == {} and records[1].issue.kind == "bad_value"
    assert records[1].issue.message == "<function odd>: record 1: a value of type object has no JSON form"
    with pytest.raises(ValueError, match=r"<function odd>: record 1: a value of type object has no JSON form"):
        _first(src)


def _odd_values():
    return [{"text": b"bytes as text"}, {"text": object()}]


def test_lone_surrogates_and_bad_utf8_in_json_lines(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "bad \\ud800 escape"}\n{"text": "raw \xff byte"}\n')
    with pytest.raises(ValueError, match=r"s\.jsonl: line 2 \(byte 15\) contains a lone surrogate U\+D800 at character 4"):
        _first(S.JsonLinesSource(str(p)))
    records = _first(S.JsonLinesSource(str(p), on_error={"invalid_utf8": "replace"}))
    assert [r.data["text"] for r in records] == ["ok", "bad \ufffd escape", "raw \ufffd byte"]
    skipped = _first(S.JsonLinesSource(str(p), on_error={"invalid_utf8": "skip"}))
    assert [S.is_error_record(r) for r in skipped] == [False, True, True]
    assert skipped[1].issue.message.startswith(f"{p}: line at byte 15 contains a lone surrogate U+D800")
    assert skipped[2].issue.message.startswith(f"{p}: line at byte 45 is not valid UTF-8: ")


def test_empty_token_lists_are_empty_records(tmp_path):
    p = tmp_path / "ids.jsonl"
    p.write_text('{"text": [5, 6]}\n{"text": []}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"line 2 \(byte 17\) is empty \(no token ids\)"):
        _first(S.JsonLinesSource(str(p), on_error={"empty": "raise"}))
    assert [S.is_error_record(r) for r in _first(S.JsonLinesSource(str(p)))] == [False, True]  # skipped by default
    assert [r.data["text"] for r in _first(S.JsonLinesSource(str(p), on_error={"empty": "keep"}))] == [[5, 6], []]


def test_exclude_patterns_relative_names_and_unused(tmp_path, monkeypatch, caplog):
    (tmp_path / "in").mkdir()
    for name in ["a.txt", "b.txt", "notes.md"]:
        (tmp_path / "in" / name).write_text("x\n")
    monkeypatch.chdir(tmp_path)
    names = lambda src: [f.path.rsplit("/", 1)[1] for f in src.list_files()]
    assert names(S.TextLineSource("in/*", exclude=["in/b.txt"])) == ["a.txt", "notes.md"]  # relative path
    assert names(S.TextLineSource("in/*", exclude=["./in/b.txt"])) == ["a.txt", "notes.md"]
    assert names(S.TextLineSource("in/*", exclude=["*.md"])) == ["a.txt", "b.txt"]  # a file name pattern
    assert names(S.TextLineSource("in/*", exclude=["a.txt"])) == ["b.txt", "notes.md"]
    with caplog.at_level("WARNING"):
        assert names(S.TextLineSource("in/*", exclude=["in/zzz.txt"])) == ["a.txt", "b.txt", "notes.md"]
    assert "'in/zzz.txt' leaves out no file" in caplog.text


def test_command_line_policy_values():
    assert S.parse_on_error(["empty=skip", "empty=skip"]) == {"empty": "skip"}
    for values, message in [(["empty=skip", "empty=keep"], "empty given twice"),
                            (["skip", "replace"], "the action for every kind given twice"),
                            (["keep"], "'keep' is given per kind, e.g. empty=keep"),
                            (["empty=replace"], "empty can be skip, raise, keep"),
                            (["nope=skip"], "unknown kind 'nope'")]:
        with pytest.raises(ValueError, match=message):
            S.parse_on_error(values)
