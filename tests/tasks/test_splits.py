"""Splits below file level: every split of a file read in turn gives exactly the
records of the whole file, with the same ids, data, raw bytes and issues."""

import bz2
import gzip
import json

import pytest

from seqcache.tasks import sources as S

# Policies under which no record raises, so that whole and split reads can be compared
# record for record (skipped records included, with their messages).
SKIP = {"default": "skip", "empty": "keep", "whitespace": "keep"}
SKIP_EMPTY = "skip"
REPLACE = {"default": "replace", "empty": "keep", "whitespace": "keep"}


def _rows(records):
    return [(r.file_index, r.record_number, r.data, r.raw, r.issue) for r in records]


def _read_by_splits(source, target_bytes):
    """Records of all splits of all files, in order; checks on the way that the
    splits tile each file and that every record lies in its split's range."""
    out = []
    for i, f in enumerate(source.list_files()):
        splits = source.splits(i, f, target_bytes)
        assert splits[0].start == 0 and splits[-1].stop is None
        assert all(a.stop == b.start for a, b in zip(splits, splits[1:]))
        assert all(s.file_index == i and s.path == f.path for s in splits)
        for split in splits:
            got = list(source.read_split(split))
            for r in got:
                assert split.start <= r.record_number and (split.stop is None or r.record_number < split.stop)
            out.extend(got)
    return out


def _check_same(source, targets):
    whole = _rows(source.read_all())
    for target in targets:
        parts = _rows(_read_by_splits(source, target))
        assert sorted(map(repr, parts)) == sorted(map(repr, whole)), target  # the same multiset ...
        assert parts == whole, target  # ... and the same order
    return whole


# ---------------------------------------------------------------------------
# Text lines and JSON lines: byte ranges.

EDGE_CASES = {
    "crlf": b"ab\r\ncd\r\n\r\nlast\r\n",
    "no_final_newline": b"one\ntwo\nthree",
    "bom": b"\xef\xbb\xbfhead\nbody\n\xef\xbb\xbfnot at byte 0\n",
    "blank_lines": b"\n\na\n\n \n\nb\n\n",
    "multibyte": "é€😀\nçà\n🎉 end\n中文字符\n".encode(),
    "only_newline": b"\n",
    "newlines": b"\n\n\n",
    "empty_file": b"",
    "lone_cr_at_end": b"x\ny\r",
    "cr_inside": b"a\rb\nc\r\n",
    "invalid_utf8": b"ok\n\xff\xfe\xe2\x82\nok2\n\xe2\x82\xac",
    "controls": "tab\there\nbell\a\n▁piece\n".encode(),
}
TINY = [1, 2, 3, 5, 7, 64, 1 << 20]


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
@pytest.mark.parametrize("policy", [SKIP, REPLACE], ids=["skip", "replace"])
def test_text_lines_edge_cases_read_the_same_in_any_split(tmp_path, name, policy):
    p = tmp_path / f"{name}.txt"
    p.write_bytes(EDGE_CASES[name])
    whole = _check_same(S.TextLineSource(str(p), on_error=policy), TINY)
    data = EDGE_CASES[name]
    for _, offset, _, raw, _ in whole:
        start = offset + (3 if offset == 0 and data.startswith(b"\xef\xbb\xbf") else 0)
        assert data[start:start + len(raw)] == raw  # the record number is the line's byte offset
        assert offset == 0 or data[offset - 1:offset] == b"\n"


def test_text_lines_edge_cases_by_value(tmp_path):
    def lines(name, policy=SKIP, target=1):
        p = tmp_path / f"{name}.txt"
        p.write_bytes(EDGE_CASES[name])
        return [(n, d.get("text"), None if i is None else i.action)
                for _, n, d, _, i in _rows(_read_by_splits(S.TextLineSource(str(p), on_error=policy), target))]

    # Splits of one byte: the edges at bytes 3, 7, 9 fall between "\r" and "\n".
    assert lines("crlf") == [(0, "ab", None), (4, "cd", None), (8, "", None), (10, "last", None)]
    assert lines("no_final_newline", target=2) == [(0, "one", None), (4, "two", None), (8, "three", None)]
    assert lines("bom") == [(0, "head", None), (8, "body", None), (13, "\ufeffnot at byte 0", None)]
    assert lines("blank_lines", target=3) == [(0, "", None), (1, "", None), (2, "a", None), (4, "", None),
                                              (5, " ", None), (7, "", None), (8, "b", None), (10, "", None)]
    assert lines("multibyte") == [(0, "é€😀", None), (10, "çà", None), (15, "🎉 end", None), (24, "中文字符", None)]
    assert lines("only_newline") == [(0, "", None)]
    assert lines("newlines") == [(0, "", None), (1, "", None), (2, "", None)]
    assert lines("empty_file") == []
    assert lines("lone_cr_at_end") == [(0, "x", None), (2, "y", None)]
    assert lines("cr_inside") == [(0, None, "skipped"), (4, "c", None)]
    assert lines("cr_inside", REPLACE) == [(0, "a\nb", "replaced"), (4, "c", None)]
    assert lines("invalid_utf8") == [(0, "ok", None), (3, None, "skipped"), (8, "ok2", None), (12, "€", None)]
    assert lines("controls", REPLACE, 4) == [(0, "tab\there", None), (9, "bell\ufffd", "replaced"),
                                             (15, " piece", "replaced")]


def test_messages_do_not_depend_on_the_split_but_raised_errors_give_the_line(tmp_path):
    p = tmp_path / "gaps.txt"
    p.write_bytes(b"first\nsecond\n\nthird\n\n")
    src = S.TextLineSource(str(p), on_error={"empty": "skip"})
    expected = [S.RecordIssue("skipped", "empty", f"{p}: line at byte 13 is empty"),
                S.RecordIssue("skipped", "empty", f"{p}: line at byte 20 is empty")]
    for target in (1, 4, 13, 100):
        assert [r.issue for r in _read_by_splits(src, target) if r.issue] == expected
    # Raised from a split that starts in the middle of the file: the line is counted from byte 0.
    split = S.Split(0, str(p), 13, 14, 1)
    with pytest.raises(ValueError, match=r"gaps\.txt: line 3 \(byte 13\) is empty; .*--on-error empty="):
        list(S.TextLineSource(str(p), on_error={"empty": "raise"}).read_split(split))
    q = tmp_path / "bad.jsonl"
    q.write_bytes(b'{"text": "a"}\n\n{"text": "b"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 4 \(byte 29\) is not valid JSON"):
        list(S.JsonLinesSource(str(q)).read_split(S.Split(0, str(q), 20, None)))
    (skipped,) = [r for r in S.JsonLinesSource(str(q), on_error="skip").read_split(S.Split(0, str(q), 20, None))
                  if r.issue]
    assert skipped.record_number == 29 and skipped.raw == b"not json" and skipped.data == {}
    assert skipped.issue.message.startswith(f"{q}: line at byte 29 is not valid JSON: ")


JSONL_CASES = {
    "crlf": b'{"text": "a"}\r\n{"text": "b"}\r\n\r\n{"text": "c"}\r\n',
    "bom_blank_and_no_newline": b'\xef\xbb\xbf{"text": "first"}\n\n   \n{"text": "mid"}\n{"text": "end"}',
    "multibyte": '{"text": "é€😀"}\n{"text": "中文"}\n{"text": "🎉"}\n'.encode(),
    "bad_lines": b'{"text": "ok"}\nnot json\n[1, 2]\n{"other": 1}\n{"text": ""}\n{"text": "\xff"}\n{"text": "\\ud800"}\n',
    "only_newline": b"\n",
}


@pytest.mark.parametrize("name", sorted(JSONL_CASES))
def test_json_lines_edge_cases_read_the_same_in_any_split(tmp_path, name):
    p = tmp_path / f"{name}.jsonl"
    p.write_bytes(JSONL_CASES[name])
    for policy in (SKIP, SKIP_EMPTY, REPLACE):
        _check_same(S.JsonLinesSource(str(p), on_error=policy), TINY)


def test_json_lines_edge_cases_by_value(tmp_path):
    def read(name, target):
        p = tmp_path / f"{name}.jsonl"
        p.write_bytes(JSONL_CASES[name])
        return [(r.record_number, r.data.get("text"), r.issue and r.issue.kind)
                for r in _read_by_splits(S.JsonLinesSource(str(p), on_error="skip"), target)]

    assert read("crlf", 1) == [(0, "a", None), (15, "b", None), (32, "c", None)]
    assert read("bom_blank_and_no_newline", 2) == [(0, "first", None), (26, "mid", None), (42, "end", None)]
    assert read("multibyte", 3) == [(0, "é€😀", None), (22, "中文", None), (41, "🎉", None)]
    assert read("bad_lines", 1) == [(0, "ok", None), (15, None, "malformed"), (24, None, "malformed"),
                                    (31, None, "missing_field"), (44, None, "empty"), (57, None, "invalid_utf8"),
                                    (71, None, "invalid_utf8")]
    assert read("only_newline", 1) == []


def _prefix(src, dest, n):
    """The first ``n`` bytes of ``src`` (cut anywhere, even inside a character) in ``dest``."""
    dest.write_bytes(src.read_bytes()[:n])
    return dest


def test_real_text_files_read_the_same_in_any_split(corpora, tmp_path):
    wiki_crlf = corpora.wikitext / "wiki.test.raw.crlf"
    shakespeare = corpora.shakespeare
    for path in [wiki_crlf, shakespeare, corpora.unicode_edge / "emoji-test.txt"]:
        whole = _check_same(S.TextLineSource(str(path), on_error=SKIP), [509, 1 << 16])
        assert len(whole) == path.read_bytes().count(b"\n")
    for path in [corpora.unicode_edge / "UTF-8-test.txt", corpora.blns]:
        for policy in (SKIP, REPLACE):
            _check_same(S.TextLineSource(str(path), on_error=policy), [3, 64])
    # Prefixes cut anywhere (inside a CRLF, inside a character), in splits of a few bytes.
    prefixes = [_prefix(wiki_crlf, tmp_path / "wiki_prefix.txt", 3001),
                _prefix(corpora.botchan, tmp_path / "botchan_prefix.txt", 2001),
                _prefix(corpora.ntrex / "newstest2019-ref.jpn.txt", tmp_path / "jpn_prefix.txt", 2000),
                _prefix(corpora.unicode_edge / "UTF-8-test.txt", tmp_path / "utf8_prefix.txt", 2500)]
    for path in prefixes:
        for policy in (SKIP, REPLACE):
            _check_same(S.TextLineSource(str(path), on_error=policy), [1, 2, 3, 7])
    # The CRLF file: raw never holds "\r", and the records rebuild the file.
    records = list(S.TextLineSource(str(wiki_crlf)).read_split(S.Split(0, str(wiki_crlf), 100_000, 200_000)))
    data = wiki_crlf.read_bytes()
    assert records[0].record_number == data.index(b"\n", 99_999) + 1
    assert b"".join(data[r.record_number:r.record_number + len(r.raw) + 2] for r in records) == \
        data[records[0].record_number:records[-1].record_number + len(records[-1].raw) + 2]


def test_real_json_lines_read_the_same_in_any_split(corpora, tmp_path):
    (tmp_path / "cut").mkdir()
    for name in ("cc_en_head-0091", "cc_en_head-0174"):
        with gzip.open(corpora.dolma / f"{name}.jsonl.gz") as f:
            data = f.read()
        (tmp_path / f"{name}.jsonl").write_bytes(data)
        (tmp_path / "cut" / f"{name}.jsonl").write_bytes(data[:4000] + b"\n" + data[-3000:])
    fields = {"text": "text", "title": "metadata.title"}
    src = S.JsonLinesSource(str(tmp_path / "*.jsonl"), fields=fields, on_error=SKIP)
    whole = _check_same(src, [64, 4093])
    assert len(whole) == 20
    _check_same(S.JsonLinesSource(str(tmp_path / "cut" / "*.jsonl"), fields=fields, on_error=SKIP), [1, 2, 7])
    # The same records as the compressed files (one split each), with the same ids
    # (the messages name the other path).
    gz = S.JsonLinesSource(str(corpora.dolma / "*.jsonl.gz"), fields=fields, on_error=SKIP)
    strip = lambda rows: [(*row[:4], row[4] and row[4][:2]) for row in rows]
    assert strip(_rows(gz.read_all())) == strip(whole)


def test_compressed_files_are_one_split_read_whole(tmp_path):
    text = "één\n\ntwee\r\ndrie".encode()
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(text)
    (tmp_path / "b.txt.bz2").write_bytes(bz2.compress(text))
    src = S.TextLineSource(str(tmp_path / "a.txt.gz"), on_error=SKIP)
    (f,) = src.list_files()
    assert src.splits(0, f, 1) == [S.Split(0, f.path, 0, None, f.num_bytes)]
    # Offsets in the decompressed stream.
    assert [(r.record_number, r.data["text"]) for r in src.read_all()] == [(0, "één"), (6, ""), (7, "twee"),
                                                                          (13, "drie")]
    with pytest.raises(ValueError, match=r"a\.txt\.gz: a compressed file is read whole"):
        list(src.read_split(S.Split(0, f.path, 3, None)))
    (b,) = S.TextLineSource(str(tmp_path / "b.txt.bz2")).list_files()
    assert len(S.TextLineSource(b.path).splits(0, b, 1)) == 1
    assert len(S.JsonLinesSource(b.path).splits(0, b, 1)) == 1
    assert [s.start for s in S.TextLineSource("x").splits(0, S.SourceFile("/d/x.TXT.ZST", 100, 0), 10)] == [0]


def test_byte_splits_sizes_and_bad_targets(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"x" * 99 + b"\n")
    src = S.TextLineSource(str(p))
    (f,) = src.list_files()
    splits = src.splits(0, f, 30)
    assert [(s.start, s.stop, s.num_bytes) for s in splits] == [(0, 25, 25), (25, 50, 25), (50, 75, 25),
                                                                (75, None, 25)]
    assert src.splits(0, f, 100) == [S.Split(0, f.path, 0, None, 100)]
    assert [r.record_number for s in splits for r in src.read_split(s)] == [0]  # in the first split only
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="target_bytes must be an int >= 1"):
            src.splits(0, f, bad)


# ---------------------------------------------------------------------------
# Parquet: row groups.


def _parquet(path, n, row_group_size):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"row {i} " + "é" * (i % 7) if i % 97 else "   " for i in range(n)]  # every 97th is whitespace
    pq.write_table(pa.table({"text": texts, "n": list(range(n))}), path, row_group_size=row_group_size)
    return texts


def test_parquet_splits_by_row_groups_read_the_same(tmp_path):
    import pyarrow.parquet as pq

    p = tmp_path / "rows.parquet"
    texts = _parquet(p, 1000, 100)
    src = S.ParquetSource(str(p), columns={"text": "text", "n": "n"}, batch_size=7, on_error={"whitespace": "skip"})
    (f,) = src.list_files()
    whole = _check_same(src, [1, 500, 2000, 1 << 30])
    assert [n for _, n, *_ in whole] == list(range(1000))  # row index in the file, whatever the split
    assert [d.get("text") for _, _, d, _, _ in whole] == [t if not t.isspace() else None for t in texts]
    assert [i.message for *_, i in whole if i] == [
        f"{p}: record {n} (row index {n}), field 'text', holds only whitespace" for n in range(0, 1000, 97)]
    # One row group per split for a tiny target; groups of whole row groups up to the target.
    one = src.splits(0, f, 1)
    assert [(s.start, s.stop) for s in one] == [(k * 100, (k + 1) * 100 if k < 9 else None) for k in range(10)]
    md = pq.ParquetFile(p).metadata
    sizes = [sum(md.row_group(g).column(c).total_compressed_size for c in range(md.num_columns))
             for g in range(md.num_row_groups)]
    assert [s.num_bytes for s in one] == sizes
    target = sizes[0] * 3 + 1
    grouped = src.splits(0, f, target)
    assert all(s.num_bytes <= target for s in grouped) and 3 <= len(grouped) <= 5
    assert sum(s.num_bytes for s in grouped) == sum(sizes)
    assert all(s.start % 100 == 0 for s in grouped)
    assert src.splits(0, f, 1 << 30) == [S.Split(0, f.path, 0, None, f.num_bytes)]
    # A split reads only its own rows.
    assert [r.record_number for r in src.read_split(one[3])] == list(range(300, 400))
    with pytest.raises(ValueError, match=r"rows \[150, 300\) do not lie on row-group boundaries"):
        list(src.read_split(S.Split(0, f.path, 150, 300)))


def test_parquet_with_one_row_group_is_one_split(corpora):
    src = S.ParquetSource(str(corpora.c4))
    (f,) = src.list_files()
    assert src.splits(0, f, 1) == [S.Split(0, f.path, 0, None, f.num_bytes)]


# ---------------------------------------------------------------------------
# Whole-file sources, and the default of a custom source.


def _numbers():
    return [{"text": f"n{i}"} for i in range(3)]


def test_whole_file_sources_are_one_split(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    files = S.TextFileSource(str(tmp_path / "a.py"))
    (f,) = files.list_files()
    assert files.splits(0, f, 1) == [S.Split(0, f.path, 0, None, 6)]
    assert [r.data for r in files.read_split(files.splits(0, f, 1)[0])] == [{"text": "x = 1\n"}]
    with pytest.raises(ValueError, match=r"a\.py: TextFileSource reads whole files only"):
        files.read_split(S.Split(0, f.path, 2, None))
    fn = S.FunctionSource(_numbers, name="numbers")
    (g,) = fn.list_files()
    assert fn.splits(0, g, 1) == [S.Split(0, "<function numbers>", 0, None, 0)]
    assert [r.record_number for r in fn.read_split(S.Split(0, g.path))] == [0, 1, 2]
    with pytest.raises(ValueError, match="FunctionSource reads whole files only"):
        fn.read_split(S.Split(0, g.path, 0, 2))


class _OnlyReadFile(S.Source):
    def list_files(self):
        return [S.SourceFile("<one>", 0, 0)]

    def read_file(self, file_index, path):
        yield S.SourceRecord(file_index, 0, {"text": "x"}, b"x")

    def fingerprint(self):
        return {}

    def describe(self):
        return "one"


class _Neither(_OnlyReadFile):
    read_file = S.Source.read_file


def test_a_custom_source_with_read_file_only_reads_whole_splits():
    assert [r.data for r in _OnlyReadFile().read_split(S.Split(0, "<one>"))] == [{"text": "x"}]
    with pytest.raises(TypeError, match="implements neither read_split nor read_file"):
        _Neither().read_split(S.Split(0, "<one>"))


# ---------------------------------------------------------------------------
# describe_record: a locator in words.


def test_describe_record(tmp_path):
    p = tmp_path / "long.txt"
    p.write_bytes(b"".join(b"x" * 499 + b"\n" for _ in range(5)))
    assert S.describe_record(str(p), "byte_offset", 0) == "line 1 (byte 0)"
    assert S.describe_record(str(p), "byte_offset", 1500) == "line 4 (byte 1,500)"
    assert S.describe_record(str(p), "byte_offset", 1234) == "byte 1,234"  # no line begins there
    assert S.describe_record(str(p), "byte_offset", 99_000) == "byte 99,000"  # beyond the end
    assert S.describe_record(str(tmp_path / "gone.txt"), "byte_offset", 1500) == "byte 1,500"
    assert S.describe_record("s3://bucket/a.txt", "byte_offset", 1500) == "byte 1,500"  # not read
    with gzip.open(tmp_path / "z.txt.gz", "wb") as f:
        f.write(b"a\nbb\nccc\n")
    assert S.describe_record(str(tmp_path / "z.txt.gz"), "byte_offset", 5) == "line 3 (byte 5)"
    assert S.describe_record(str(p), "line", 11) == "line 12"
    assert S.describe_record(str(p), "row", 7) == "row 7"
    assert S.describe_record(str(p), "record", 3) == "record 3"
    assert S.describe_record(str(p), "file", 0) == "whole file"
    # Every record of a split read names a line that really begins at its offset.
    src = S.TextLineSource(str(p))
    (f,) = src.list_files()
    numbers = [r.record_number for s in src.splits(0, f, 700) for r in src.read_split(s)]
    assert [S.describe_record(str(p), src.locator, n) for n in numbers] == [
        "line 1 (byte 0)", "line 2 (byte 500)", "line 3 (byte 1,000)", "line 4 (byte 1,500)", "line 5 (byte 2,000)"]
    assert json.loads(json.dumps(S.LOCATORS)) == ["byte_offset", "row", "record", "file", "line"]
