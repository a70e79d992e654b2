"""``ParquetSource.read_batches`` (a text column in column form, its suspect
characters found in the column's bytes) gives exactly the records of
``read_split`` (row by row), for every kind of bad value, every split and
both Arrow string types; and the byte scan finds what the per-value regular
expression finds."""

import itertools
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqcache.tasks.sources import ParquetSource
from seqcache.tasks.sources.base import SourceFile, canonical_json_bytes, json_string_bodies
from seqcache.tasks.sources.policy import _SUSPECT_RE, SUSPECT_CHARACTERS, suspect_utf8_values

VALUES = [
    "plain text",
    "",
    None,
    "   ",
    "\u3000\u2003",  # Unicode spaces only
    "\x1c\x1d",  # Python counts these as whitespace
    "tab\tinside\nand a newline\r\nare text",
    "control \x07 bell",
    "next line \x85 is text",
    "C1 \x80 and \x9f",
    "\xa0 no-break space, \xa9 sign, \u00e9",
    "curly \u201cquotes\u201d \u2014 dash \u2580 upper half",
    "lower one eighth \u2581 block",
    "\ud7ff edge of Hangul, \ue000 private use",
    "caf\u00e9 \u4e2d\u6587 \U0001F600 \"quoted\" back\\slash",
    "\x7f delete",
    "ends in \u2581",
    "ends in \x84",
    'a "quote", a back\\slash \\" and \\\\n',
    "vertical\x0btab, backspace\b, form feed\f, escape \x1b",
    "\\",
    "vertical\x0btab and form feed\f: clean, escaped as JSON",
]

POLICIES = [
    {},  # the defaults
    {"empty": "keep", "whitespace": "keep", "control_characters": "keep", "u2581": "keep"},
    {"control_characters": "replace", "u2581": "replace", "whitespace": "skip", "empty": "skip"},
]


def _write(tmp_path, values, *, large=False, row_group_size=5):
    kind = pa.large_string() if large else pa.string()
    table = pa.table({"text": pa.array(values, type=kind), "other": pa.array(range(len(values)))})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("large", [False, True])
def test_batches_match_row_by_row(tmp_path, policy, large):
    path = _write(tmp_path, VALUES * 3, large=large)
    file = SourceFile(str(path), path.stat().st_size, 0)
    for batch_size, target in itertools.product([1, 4, 1024], [1, 1 << 30]):
        source = ParquetSource(str(path), batch_size=batch_size, on_error=policy)
        got = []
        for split in source.splits(0, file, target):
            expect = list(source.read_split(split))
            batches = list(source.read_batches(split, 3))
            assert all(0 < len(b) <= 3 for b in batches)
            flat = [b[i] for b in batches for i in range(len(b))]
            assert flat == expect, (batch_size, target, split)
            for b in batches:
                assert b.raws == [r.raw for r in b] and b.record_numbers == [r.record_number for r in b]
                assert dict(b.special()) == {i: r for i, r in enumerate(b) if r.issue is not None or r.kept}
            got += flat
        assert len(got) == 3 * len(VALUES)
        # The bad values are really there: acted on, or counted as kept.
        assert any(r.issue is not None for r in got) if policy != POLICIES[1] else any(r.kept for r in got)


def test_clean_rows_are_in_column_form(tmp_path):
    path = _write(tmp_path, ["one", "two \u201cthree\u201d", "four"])
    source = ParquetSource(str(path))
    (split,) = source.splits(0, SourceFile(str(path), path.stat().st_size, 0), 1 << 30)
    (batch,) = source.read_batches(split, 100)
    assert not list(batch.special())
    assert batch.text_values("text", [0, 1, 2]) == ["one", "two \u201cthree\u201d", "four"]
    assert batch.raws[1] == canonical_json_bytes({"text": "two \u201cthree\u201d"})


def test_several_columns_read_row_by_row(tmp_path):
    path = _write(tmp_path, ["a", "b", None])
    source = ParquetSource(str(path), columns={"text": "text", "n": "other"})
    (split,) = source.splits(0, SourceFile(str(path), path.stat().st_size, 0), 1 << 30)
    flat = [b[i] for b in source.read_batches(split, 2) for i in range(len(b))]
    assert flat == list(source.read_split(split))
    assert [r.data["n"] for r in flat] == [0, 1, 2]


def test_byte_scan_finds_what_the_regular_expression_finds():
    rng = np.random.default_rng(0)
    # Every suspect character, its neighbours, and characters sharing their lead bytes.
    alphabet = [chr(c) for c in [*range(0x00, 0x30), *range(0x70, 0xC0), *range(0x2570, 0x2590),
                                 *range(0x2000, 0x2030), 0xD7FF, 0xE000, 0x1F600]]
    values = ["".join(rng.choice(alphabet, size=rng.integers(0, 6))) for _ in range(5000)]
    values += ["x" * 40, "\u2581", "\x85", "\x86", "\xc2", "\xe2\x96"]
    data = b"".join(v.encode("utf-8") for v in values)
    offsets = np.concatenate([[0], np.cumsum([len(v.encode("utf-8")) for v in values])]).astype(np.int64)
    expect = [i for i, v in enumerate(values) if _SUSPECT_RE.search(v)]
    assert expect and len(expect) < len(values)
    assert suspect_utf8_values(np.frombuffer(data, np.uint8), offsets).tolist() == expect
    # Offsets need not start at 0 (a slice of a column).
    assert suspect_utf8_values(np.frombuffer(data, np.uint8)[offsets[10]:], offsets[10:]).tolist() == \
        [i - 10 for i in expect if i >= 10]
    assert "\u2581" in SUSPECT_CHARACTERS


def test_column_escapes_equal_json_dumps():
    rng = np.random.default_rng(1)
    alphabet = [chr(c) for c in [*range(0x00, 0x80), 0xE9, 0x2028, 0x1F600]]
    values = ["".join(rng.choice(alphabet, size=rng.integers(0, 8))) for _ in range(3000)] + ["", '"', "\\"]
    encoded = [v.encode("utf-8") for v in values]
    offsets = np.concatenate([[7], 7 + np.cumsum([len(e) for e in encoded])])  # need not start at 0
    escaped, out = json_string_bodies(b"".join(encoded), offsets)
    assert len(out) == len(values) + 1
    for i, v in enumerate(values):
        assert escaped[out[i]:out[i + 1]] == json.dumps(v, ensure_ascii=False)[1:-1].encode("utf-8"), v
    plain = b"no escapes at all"
    assert json_string_bodies(plain, np.array([0, 3, len(plain)])) == (plain, [0, 3, len(plain)])


@pytest.mark.parametrize("large", [False, True])
def test_string_column_with_bytes_that_are_not_utf8_follows_the_policy(tmp_path, large):
    # Parquet writers need not check a string column's UTF-8: the invalid_utf8
    # policy decides each row, as for a binary column, and errors name the row.
    kind, raw_kind = (pa.large_string(), pa.large_binary()) if large else (pa.string(), pa.binary())
    values = pa.array([b"fine", b"bad \xff byte", b"also fine"], type=raw_kind).view(kind)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": values}), path)
    file = SourceFile(str(path), path.stat().st_size, 0)
    for policy, texts in (("skip", ["fine", "also fine"]), ("replace", ["fine", "bad \ufffd byte", "also fine"])):
        source = ParquetSource(str(path), on_error={"invalid_utf8": policy})
        (split,) = source.splits(0, file, 1 << 30)
        expect = list(source.read_split(split))
        flat = [b[i] for b in source.read_batches(split, 2) for i in range(len(b))]
        assert flat == expect
        assert [r.data["text"] for r in flat if r.issue is None or r.issue.action != "skipped"] == texts
        (bad,) = [r for r in flat if r.issue is not None]
        assert bad.record_number == 1 and "row index 1" in bad.issue.message and "UTF-8" in bad.issue.message
    source = ParquetSource(str(path), on_error={"invalid_utf8": "raise"})
    (split,) = source.splits(0, file, 1 << 30)
    with pytest.raises(ValueError, match=r"rows\.parquet.*row index 1.*UTF-8"):
        list(source.read_batches(split, 2))
