"""Many small files: a work unit's files share preprocessing batches, and a
build of many small files writes the bytes of one file of the same lines (G1).

The batching is checked by structure (how many preprocessing batches a unit
of many files makes), never by timing; benchmarks/small_files.py measures
the time.
"""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest

from seqcache import format as fmt
from seqcache import fs
from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task, plan, transforms
from seqcache.tasks import Split
from seqcache.tasks.sources.base import RecordBatch
from testsupport import lines_task

NUM_FILES = 500


def _write_parts(folder, lines, num_files, name=lambda k: f"part-{k:05d}.txt"):
    """``lines`` cut into ``num_files`` files of consecutive lines, in order."""
    folder.mkdir(parents=True)
    for k in range(num_files):
        part = lines[len(lines) * k // num_files:len(lines) * (k + 1) // num_files]
        (folder / name(k)).write_text("".join(line + "\n" for line in part), encoding="utf-8")
    return str(folder / "*.txt")


@pytest.fixture(scope="module")
def shakespeare(corpora):
    """The lines of tinyshakespeare (40,000; no final empty text)."""
    lines = corpora.shakespeare_lines()
    assert lines[-1] == ""
    return lines[:-1]


def _splits(task):
    return [Split(i, f.path, 0, None, f.num_bytes) for i, f in enumerate(task.source.list_files())]


def _batch_sizes(reader, splits):
    """The record count of each preprocessing batch ``reader.read`` makes."""
    return [n for kind, n in reader.read(splits) if kind == "records"]


class _CountingReader:
    """Wraps the read step's reader; ``batches``: the record count of each
    preprocessing batch it made (its ``("records", n)`` outputs)."""

    def __init__(self, inner):
        self.inner, self.features, self.num_shards, self.batches = inner, inner.features, inner.num_shards, []

    def read(self, splits, skip=0):
        for kind, payload in self.inner.read(splits, skip=skip):
            if kind == "records":
                self.batches.append(payload)
            yield kind, payload


def test_a_unit_of_many_small_files_is_one_preprocessing_batch_per_2048_records(tmp_path, shakespeare):
    lines = shakespeare[:4000]
    task = lines_task(_write_parts(tmp_path / "in", lines, NUM_FILES))
    files = task.source.list_files()
    assert len(files) == NUM_FILES
    # The plan puts the small files into one unit ...
    units = plan.plan_units(task.source, files, 1 << 20)
    assert len(units) == 1 and len(units[0][1]) == NUM_FILES
    # ... whose records the read step preprocesses in full batches, not one per file.
    reader = _CountingReader(transforms.ReadPreprocess(task, seed=0, sequence_length=None, num_shards=2))
    (spill := tmp_path / "spill").mkdir()
    outputs = list(transforms.ReadUnit(reader, paths=[f.path for f in files], spill_dir=str(spill),
                                       exchange="runner")(units[0]))
    assert reader.batches == [2048, 4000 - 2048]
    ((_, counts),) = [(k, v) for k, v in outputs if k == transforms.COUNTS_KEY]
    assert counts[1] == 4000 and len(counts[2][0]) == NUM_FILES  # records read, and examples of every file
    assert counts[2][0] == list(range(NUM_FILES)) and sum(counts[2][1]) == 4000  # empty lines kept: 4000 examples
    # The byte bound holds across files too: batches of at most 20,000 raw
    # bytes, each as full as the next record allows.
    reader = transforms.ReadPreprocess(task, seed=0, sequence_length=None, num_shards=2, batch_bytes=20_000)
    sizes = _batch_sizes(reader, _splits(task))
    raw = [len(line.encode()) for line in lines]
    assert sum(sizes) == len(lines)
    ends = [sum(sizes[:k + 1]) for k in range(len(sizes))]
    for start, stop in zip([0, *ends], ends):
        assert sum(raw[start:stop]) <= 20_000
        assert stop == len(lines) or sum(raw[start:stop + 1]) > 20_000


def test_batches_across_files_give_the_records_of_each_file(tmp_path, shakespeare):
    """The examples of a unit read as one stream are those of its files read
    one by one: same keys, provenance and bytes; quarantined lines keep their
    file."""
    task = lines_task(_write_parts(tmp_path / "in", shakespeare[:3000], 60), on_error={"empty": "skip"})
    reader = transforms.ReadPreprocess(task, seed=5, sequence_length=None, num_shards=3)
    splits = _splits(task)

    def columns(outputs):
        rows, issues = [], []
        for kind, payload in outputs:
            if kind == "examples":
                for k in range(len(payload)):
                    data = payload.data[payload.offsets[k]:payload.offsets[k + 1]].tobytes()
                    rows.append((payload.key[k].tobytes(), int(payload.file_index[k]),
                                 int(payload.record_number[k]), int(payload.shard[k]), data))
            elif kind == "issue":
                issues.append(payload)
        return sorted(rows), sorted(issues)

    together = columns(reader.read(splits))
    one_by_one = columns(item for split in splits for item in reader.read(split))
    assert together == one_by_one
    rows, issues = together
    assert len({fi for _, fi, *_ in rows}) == 60 and len(rows) + len(issues) == 3000
    assert issues and all(i[2] == "skipped" and i[4] == "empty" for i in issues)
    assert {i[0] for i in issues} == {k for k in range(60) if any(
        line == "" for line in shakespeare[3000 * k // 60:3000 * (k + 1) // 60])}


# Files of a few lines each, with every kind of line the text source looks at
# on its own: a byte order mark at the start of a file, empty and
# whitespace-only lines, CRLF and lone CR, control characters, U+2581,
# invalid UTF-8 (that file's block is read on its own), no final newline, a
# last line ended by a lone CR, an empty file.
ODD_FILES = [
    b"\xef\xbb\xbfmarked first line\nplain\n",
    "\n   \n\u3000\u2003\n".encode(),
    b"windows\r\nline\r\n",
    b"a lone\rcarriage return\ncontrol \x07 bell\n",
    "lower one eighth \u2581 block\ncaf\u00e9 \u4e2d\u6587\n".encode(),
    b"broken \xff\xfe utf-8\nafter broken\n",
    b"no newline at the end",
    b"",
    b"ends with a lone CR\r",
    b"\xef\xbb\xbf\n",
    b"last file\n",
]


@pytest.mark.parametrize("policy", [
    {"carriage_return": "skip", "invalid_utf8": "skip"},
    {"empty": "keep", "whitespace": "keep", "control_characters": "skip", "invalid_utf8": "replace",
     "carriage_return": "replace", "u2581": "replace"},
])
def test_text_lines_of_many_files_read_together_are_each_files_records(tmp_path, policy):
    folder = tmp_path / "in"
    folder.mkdir()
    for k, data in enumerate(ODD_FILES * 3):
        (folder / f"part-{k:03d}.txt").write_bytes(data)
    source = tasks.TextLineSource(str(folder / "*.txt"), on_error=policy)
    files = source.list_files()
    for target in (9, 1 << 20):  # files cut into byte ranges, or whole
        splits = [s for i, f in enumerate(files) for s in source.splits(i, f, target)]
        expect = [r for split in splits for r in source.read_split(split)]
        assert any(r.issue is not None for r in expect) and len({r.file_index for r in expect}) > 20
        for block in (1, 30, 1 << 20):  # a block per split, a few files a block, all in one
            source.block_bytes = block
            batches = list(source.read_batches_of(splits, 7))
            got = [b[i] for b in batches for i in range(len(b))]
            assert got == expect, (target, block)
            for b in batches:
                assert 0 < len(b) <= 7
                assert b.raws == [r.raw for r in b] and b.record_numbers == [r.record_number for r in b]
                indices = b.file_indices or [b.file_index] * len(b)
                assert indices == [r.file_index for r in b]
            if block == 1 << 20 and target == 1 << 20:
                assert any(b.file_indices for b in batches)  # batches did span files
                # A whole file is read with its listed size; unknown (0), it is read as a range: the
                # same records. Listed with another size than it has now, it changed since: one line.
                unknown = [s._replace(num_bytes=0) for s in splits]
                batches = list(source.read_batches_of(unknown, 7))
                assert [b[i] for b in batches for i in range(len(b))] == expect
                changed = max(range(len(splits)), key=lambda k: splits[k].num_bytes)
                for listed, now in ((splits[changed].num_bytes - 1, "more than"), (splits[changed].num_bytes + 1, "")):
                    other = list(splits)
                    other[changed] = splits[changed]._replace(num_bytes=listed)
                    with pytest.raises(ValueError, match=rf"{other[changed].path}: changed since it was listed "
                                                         rf"\({listed:,} bytes then, {now}"):
                        list(source.read_batches_of(other, 7))


def test_concat_keeps_each_records_file(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\n\ntwo\n", encoding="utf-8")
    other = tmp_path / "b.txt"
    other.write_text("three\n", encoding="utf-8")
    source = tasks.TextLineSource(str(tmp_path / "*.txt"), on_error={"empty": "skip"})
    a = next(source.read_batches(Split(0, str(path)), 10))
    b = next(source.read_batches(Split(1, str(other)), 10))
    joined = RecordBatch.concat([a, b])
    assert [tuple(r[:3]) for r in joined] == [(0, 0, {"text": "one"}), (0, 4, {}), (0, 5, {"text": "two"}),
                                              (1, 0, {"text": "three"})]
    assert joined.file_indices == [0, 0, 0, 1] and [i for i, _ in joined.special()] == [1]
    assert joined.text_values("text", [0, 2, 3]) == ["one", "two", "three"]
    assert RecordBatch.concat([a, a]).file_indices is None
    with pytest.raises(ValueError, match="at least one batch"):
        RecordBatch.concat([])


def _refuse_poison(example, ctx):
    if "POISON" in example["text"]:
        raise ValueError("poisoned line")
    return example


def test_a_preprocessing_error_names_the_file_of_its_record(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(20):
        text = "POISON\n" if k == 13 else f"line {k}\n"
        (folder / f"part-{k:02d}.txt").write_text(text * 3, encoding="utf-8")
    vocab = tasks.ByteVocabulary()
    task = tasks.Task(
        "poison", source=tasks.TextLineSource(str(folder / "*.txt")),
        output_features={"targets": tasks.Feature(vocab)},
        preprocessors=[tasks.preprocessors.FunctionPreprocessor(_refuse_poison, "refuse_poison"),
                       tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    reader = transforms.ReadPreprocess(task, seed=0, sequence_length=None, num_shards=1)
    with pytest.raises(ValueError) as e:
        list(reader.read(_splits(task)))
    assert str(e.value).startswith(f"{folder / 'part-13.txt'}: ") and "poisoned line" in str(e.value)


def _hashes(cache_dir, which):
    m = fmt.read_manifest(cache_dir)
    names = [s.file if which == "data" else s.provenance_file for s in m.shards]
    return [hashlib.sha256(open(os.path.join(cache_dir, n), "rb").read()).hexdigest() for n in names]


def _build(pattern, cache_dir, **kw):
    result = build_task(lines_task(pattern, "small_files", on_error={"empty": "skip"}), cache_dir=str(cache_dir),
                        config=BuildConfig(seed=3, num_shards=3), **kw)
    return result


def test_many_small_files_write_the_bytes_of_one_file(tmp_path, shakespeare):
    """G1: tinyshakespeare as 500 files writes the data shards of the same
    lines as one file. Record ids differ (file index, byte offset in the
    file), so provenance differs; between two builds of the 500 files whose
    work is cut differently (one unit, or a unit per few files read through
    the runner's shuffle), everything is the same."""
    one = _build(_write_parts(tmp_path / "one", shakespeare, 1), tmp_path / "c-one")
    many = _build(_write_parts(tmp_path / "many", shakespeare, NUM_FILES), tmp_path / "c-many")
    recut = _build(str(tmp_path / "many" / "*.txt"), tmp_path / "c-recut", split_size=4096, exchange="runner")
    assert many.manifest.num_examples == one.manifest.num_examples == sum(1 for line in shakespeare if line)
    assert _hashes(many.cache_dir, "data") == _hashes(one.cache_dir, "data")
    assert many.manifest.statistics.tokens == one.manifest.statistics.tokens
    assert _hashes(many.cache_dir, "provenance") != _hashes(one.cache_dir, "provenance")
    for which in ("data", "provenance"):
        assert _hashes(recut.cache_dir, which) == _hashes(many.cache_dir, which)
    assert recut.manifest.statistics == many.manifest.statistics
    assert recut.manifest.quarantine_sha256 == many.manifest.quarantine_sha256


def test_the_order_of_many_small_files_does_not_change_the_data(tmp_path, shakespeare):
    """The same 500 files named so that the sorted order is the reverse of the
    content order: the same data shards."""
    lines = shakespeare[:8000]
    ordered = _build(_write_parts(tmp_path / "a", lines, NUM_FILES), tmp_path / "c-a")
    reverse = _build(_write_parts(tmp_path / "b", lines, NUM_FILES, name=lambda k: f"part-{NUM_FILES - k:05d}.txt"),
                     tmp_path / "c-b")
    assert _hashes(reverse.cache_dir, "data") == _hashes(ordered.cache_dir, "data")
    assert _hashes(reverse.cache_dir, "provenance") != _hashes(ordered.cache_dir, "provenance")


@pytest.mark.slow
def test_many_small_files_on_two_worker_processes_write_the_same_cache(tmp_path, shakespeare):
    pattern = _write_parts(tmp_path / "in", shakespeare, NUM_FILES)
    local = _build(pattern, tmp_path / "c-local")
    workers = _build(pattern, tmp_path / "c-workers", split_size=64 << 10,
                     pipeline_args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    for which in ("data", "provenance"):
        assert _hashes(workers.cache_dir, which) == _hashes(local.cache_dir, which)
    assert workers.manifest.quarantine_sha256 == local.manifest.quarantine_sha256


def test_a_file_that_changes_after_it_is_listed_stops_the_build_in_one_line(tmp_path, monkeypatch):
    """A file grown since the listing (whose size and time the fingerprint
    and the source table record) is refused when read, naming it; nothing
    is left that looks like a cache."""
    from seqcache import fs

    pattern = _write_parts(tmp_path / "in", [f"line {i}" for i in range(60)], 30)
    listing = fs.match

    def listed_before_a_line_was_appended(p):
        files = listing(p)
        grown = files[7].path
        with open(grown, "ab") as f:  # written after the listing, before the read
            f.write(b"appended\n")
        return files

    monkeypatch.setattr(fs, "match", listed_before_a_line_was_appended)
    with pytest.raises(Exception, match=r"part-00007\.txt: changed since it was listed \((\d+) bytes then, more than "
                                        r"\1 bytes now\)") as raised:
        _build(pattern, tmp_path / "c")
    assert len(str(raised.value).strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "c" / "small_files" / "train" / fmt.MANIFEST_NAME)


def test_a_file_deleted_after_it_is_listed_stops_the_build_in_one_line(tmp_path, monkeypatch):
    pattern = _write_parts(tmp_path / "in", [f"line {i}" for i in range(60)], 30)
    listing = fs.match

    def listed_before_a_file_was_deleted(p):
        files = listing(p)
        os.unlink(files[11].path)
        return files

    monkeypatch.setattr(fs, "match", listed_before_a_file_was_deleted)
    with pytest.raises(Exception, match=r"part-00011\.txt: cannot be read \(FileNotFoundError\)") as raised:
        _build(pattern, tmp_path / "c")
    assert len(str(raised.value).strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "c" / "small_files" / "train" / fmt.MANIFEST_NAME)


def test_a_stored_work_table_pickles_as_its_file_and_reads_back_what_was_stored(tmp_path):
    paths = [f"/data/part-{k:05d}.txt" for k in range(5000)]
    sizes = [k % 300 for k in range(5000)]
    files = [fs.FileInfo(p, n, 0) for p, n in zip(paths, sizes)]
    units = [unit for _, unit in plan.plan_units(lines_task("/data/*.txt").source, files, 1000)]
    table = transforms.WorkTable.store(str(tmp_path), paths, sizes, units)
    stored = [p for p in os.listdir(tmp_path) if p.startswith("work-table-")]
    assert len(stored) == 1
    data = pickle.dumps(table)
    assert len(data) < 300  # the file's name and checksum, not the paths
    back = pickle.loads(data)
    assert back.paths == paths and back.sizes == sizes
    assert len(back.units) == len(units) > 1 and all((a == b).all() for a, b in zip(back.units, units))
    # A table that was not stored pickles whole.
    inline = pickle.loads(pickle.dumps(transforms.WorkTable(paths, sizes, units)))
    assert inline.paths == paths and inline.sizes == sizes and (inline.units[3] == units[3]).all()


def test_a_work_table_changed_or_gone_is_refused_naming_its_file(tmp_path):
    table = transforms.WorkTable.store(str(tmp_path), ["/a.txt", "/b.txt"], [1, 2], [])
    path = tmp_path / os.listdir(tmp_path)[0]
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(ValueError, match=r"work-table-.*changed since the build wrote it"):
        pickle.loads(pickle.dumps(table)).paths
    path.unlink()
    transforms._read_work_table.cache_clear()
    with pytest.raises(ValueError, match=r"work-table-.*cannot be read"):
        pickle.loads(pickle.dumps(table)).units
