"""``TextLineSource.read_batches`` (blocks of lines, one scan per block) gives
exactly the records of ``read_split`` (line by line), for every kind of bad
line, every split of the file and block sizes that cut lines everywhere."""

import itertools

import pytest

from seqcache.tasks.sources import TextLineSource
from seqcache.tasks.sources.base import SourceFile

LINES = [
    "\ufeffFirst line after a byte order mark",
    "plain text",
    "",
    "   ",
    "\u3000\u2003",  # Unicode spaces only
    "tab\tinside is text",
    "windows line\r",  # CRLF ending
    "a lone\rcarriage return",
    "control \x07 bell",
    "next line \x85 is text",
    "lower one eighth \u2581 block",
    "caf\u00e9 \u4e2d\u6587 \U0001F600",
    "",
]


def _write(tmp_path, lines, last_newline=True, bad_utf8=True):
    data = "\n".join(lines).encode("utf-8")
    if bad_utf8:
        data += b"\nbroken \xff\xfe utf-8\nafter broken"
    if last_newline:
        data += b"\n"
    else:
        data += b"\nno newline at the end\r"
    path = tmp_path / "lines.txt"
    path.write_bytes(data)
    return path


def _records(source, split, block_bytes=None):
    if block_bytes is not None:
        source.block_bytes = block_bytes
    return [list(b[i] for i in range(len(b))) for b in source.read_batches(split, 3)]


POLICIES = [
    {"carriage_return": "skip", "invalid_utf8": "skip"},  # the other kinds' defaults
    {"empty": "keep", "whitespace": "keep", "control_characters": "skip", "invalid_utf8": "replace",
     "carriage_return": "replace", "u2581": "replace"},
    {"invalid_utf8": "skip", "carriage_return": "skip", "u2581": "skip", "control_characters": "replace"},
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("last_newline", [True, False])
def test_batches_match_line_by_line(tmp_path, policy, last_newline):
    path = _write(tmp_path, LINES * 3, last_newline=last_newline)
    source = TextLineSource(str(path), on_error=policy)
    file = SourceFile(str(path), path.stat().st_size, 0)
    whole = list(source.read_split(source.splits(0, file, 1 << 30)[0]))
    assert len(whole) > 3 * len(LINES)
    assert any(r.issue is not None for r in whole)  # the bad lines are really there
    for target, block in itertools.product([7, 40, 1 << 30], [1, 16, 1 << 20]):
        got = []
        for split in source.splits(0, file, target):
            expect = list(source.read_split(split))
            batches = _records(source, split, block)
            assert all(0 < len(b) <= 3 for b in batches)
            flat = [r for b in batches for r in b]
            assert flat == expect, (target, block, split)
            # The columns the pipeline hashes and numbers are the records' own.
            for b in source.read_batches(split, 3):
                assert b.raws == [r.raw for r in b] and b.record_numbers == [r.record_number for r in b]
            got += flat
        assert got == whole


def test_batch_special_lists_only_odd_records(tmp_path):
    path = _write(tmp_path, LINES, bad_utf8=False)
    source = TextLineSource(str(path), on_error={"carriage_return": "skip"})
    file = SourceFile(str(path), path.stat().st_size, 0)
    (split,) = source.splits(0, file, 1 << 30)
    (batch,) = source.read_batches(split, 1000)
    odd = dict(batch.special())
    assert odd == {i: r for i, r in enumerate(batch) if r.issue is not None or r.kept}
    assert 0 not in odd  # the BOM is removed, not an issue
    clean = [i for i in range(len(batch)) if i not in odd]
    assert batch.text_values("text", clean) == [batch[i].data["text"] for i in clean]
    assert batch.text_values("other", clean) is None


def test_read_error_names_the_file(tmp_path):
    source = TextLineSource(str(tmp_path / "gone.txt"))
    from seqcache.tasks.sources.base import Split

    with pytest.raises(ValueError, match="gone.txt"):
        list(source.read_batches(Split(0, str(tmp_path / "gone.txt"), 0, None, 10), 5))


def test_raised_errors_are_the_same(tmp_path):
    path = _write(tmp_path, LINES)
    source = TextLineSource(str(path))  # carriage returns raise by default
    file = SourceFile(str(path), path.stat().st_size, 0)
    (split,) = source.splits(0, file, 1 << 30)
    with pytest.raises(ValueError) as line_by_line:
        list(source.read_split(split))
    with pytest.raises(ValueError) as batched:
        list(source.read_batches(split, 4))
    assert "line 8 (byte" in str(batched.value)
    assert str(batched.value) == str(line_by_line.value)


def test_line_endings_and_compression_give_the_same_cache(tmp_path):
    """G1: CRLF or LF endings, a byte order mark, plain or gzipped: the same
    records, so the same shard bytes (the shuffle key hashes the line without
    its terminator and the mark)."""
    import gzip
    import hashlib

    from seqcache import tasks
    from seqcache.pipelines import BuildConfig, build_task
    from seqcache.tasks import preprocessors as P

    lines = [f"line {i} " + "x" * (i % 7) for i in range(300)]
    variants = {
        "lf": "\n".join(lines).encode() + b"\n",
        "crlf": "\r\n".join(lines).encode() + b"\r\n",
        "bom": b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n",
    }
    digests = {}
    for name, data in list(variants.items()) + [("bom.gz", None)]:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        if data is None:
            (folder / "a.txt.gz").write_bytes(gzip.compress(variants["bom"]))
        else:
            (folder / "a.txt").write_bytes(data)
        task = tasks.Task(name.replace(".", "_"), source=tasks.TextLineSource(str(folder / "a.txt*")),
                          output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                          preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])
        result = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(seed=3, num_shards=2))
        digests[name] = [hashlib.sha256(open(f"{result.cache_dir}/{f}", "rb").read()).hexdigest()
                         for f in result.manifest.shards.files]
    assert len({tuple(d) for d in digests.values()}) == 1, digests


def test_a_batch_keeps_each_records_file_index():
    from seqcache.pipelines.transforms import LiveRecords
    from seqcache.tasks.sources.base import RecordBatch, RecordIssue, SourceRecord

    records = [SourceRecord(0, 5, {"text": "a"}, b"a"), SourceRecord(2, 7, {}, b"b", RecordIssue("skipped", "k", "m")),
               SourceRecord(3, 9, {"text": "c"}, b"c")]
    batch = RecordBatch.from_records(records)
    live = LiveRecords(batch, [i for i, r in batch.special() if r.issue.action == "skipped"])
    assert live.file_index_column().tolist() == [0, 3]
    assert live.record_numbers == [5, 9] and live.raws == [b"a", b"c"]
    same = LiveRecords(RecordBatch.from_records([records[0], records[0]._replace(record_number=6)]), [])
    assert same.file_index_column().tolist() == [0, 0]


@pytest.mark.parametrize("data", [b"a\nbb\nccc", b"a\nbb\nccc\n", b"ccc", b"", b"\n\n"])
def test_a_small_whole_file_is_read_in_one_call_with_the_blocks_of_a_range(tmp_path, data, monkeypatch):
    from seqcache.tasks.sources import lines

    path = tmp_path / "small.txt"
    path.write_bytes(data)
    whole = list(lines.read_line_blocks(str(path)))  # one read (the file fits in a block)
    # The same file read as a range (the general path): blocks of whole lines, then the unended last one.
    monkeypatch.setattr(lines, "_small_whole_file", lambda p, b: None)
    ranged = list(lines.read_line_blocks(str(path)))
    assert whole == ranged
    end = data.rfind(b"\n") + 1
    assert whole == [(0, data[:end])] * bool(end) + [(end, data[end:])] * (end < len(data))
