"""Spill sections are written sorted, and a shard writer reads the example
bytes of spill files range by range: the same records, in the same order, as
loading every section whole, with only a range's bytes in memory at a time."""

import os

import numpy as np
import pytest

from seqcache import fs
from seqcache.pipelines import spill, transforms


def _batch(rng, n, *, num_features=1, mean_bytes=30, duplicate=False):
    keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    if duplicate and n > 4:
        keys[1] = keys[0]  # identical records: the ties are broken by sub-index, file, record
        keys[3, :8] = keys[2, :8]  # a 64-bit collision of the high halves
    sizes = rng.integers(0, 2 * mean_bytes, n)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return transforms.EncodedExamples(
        shard=np.zeros(n, np.int64),
        key=keys.view("V16").reshape(n),
        sub_index=rng.integers(0, 2, n).astype(np.uint32),
        file_index=rng.integers(0, 3, n).astype(np.uint32),
        record_number=rng.permutation(n).astype(np.uint64) + np.uint64(rng.integers(0, 1000) * 10_000),
        truncated=rng.integers(0, 5, n).astype(np.uint32),
        lengths=rng.integers(0, 100, (n, num_features)).astype(np.uint32),
        data=rng.integers(0, 256, int(offsets[-1]), dtype=np.uint8),
        offsets=offsets,
    )


def _flush_files(tmp_path, rng, *, flushes=4, batches=3, n=200, mean_bytes=30):
    """Flush files of one shard (shard 0) and two others; returns the shard-0
    values a writer gets, and the whole sections' bytes."""
    values, whole = [], []
    for f in range(flushes):
        buffers = {}
        for shard in (0, 1, 2):
            buf = spill.SpillBuffer()
            for _ in range(batches):
                buf.add_batch(_batch(rng, int(rng.integers(1, n)), mean_bytes=mean_bytes, duplicate=True))
            buffers[shard] = buf
        data, sections = spill.flush_bytes(buffers, 1)
        path = os.path.join(tmp_path, f"flush-{f}.bin")
        fs.write_bytes(path, data)
        for shard, offset, length in sections:
            if shard == 0:
                values.append((path, offset, length))
                whole.append((f"{path}@{offset}", data[offset:offset + length]))
    return values, whole


def _section_is_sorted(section: bytes) -> bool:
    cols = spill._parse(section, 1, "section")
    hi_lo = cols["keys"].view(">u8").reshape(-1, 2)
    order = spill.sort_order(hi_lo[:, 0].astype(np.uint64), hi_lo[:, 1].astype(np.uint64), cols["sub_index"],
                             cols["file_index"], cols["record_number"])
    return np.array_equal(order, np.arange(len(order)))


def test_sections_are_written_sorted_and_keep_every_entry(tmp_path):
    rng = np.random.default_rng(1)
    buf = spill.SpillBuffer()
    batches = [_batch(rng, 300, duplicate=True) for _ in range(3)]
    for b in batches:
        buf.add_batch(b)
    section = buf.to_bytes(1)
    assert _section_is_sorted(section)
    cols = spill._parse(section, 1, "section")
    got = {(bytes(k), int(r), int(f)): cols["data"][cols["base"] + int(a):cols["base"] + int(z)]
           for k, r, f, a, z in zip(cols["keys"], cols["record_number"], cols["file_index"],
                                    cols["offsets"][:-1], cols["offsets"][1:])}
    expect = {(bytes(b.key[i]), int(b.record_number[i]), int(b.file_index[i])):
              b.data[b.offsets[i]:b.offsets[i + 1]].tobytes() for b in batches for i in range(len(b))}
    assert got == expect


@pytest.mark.parametrize("mean_bytes", [8, 300])
@pytest.mark.parametrize("budget", ["small", "large"])
def test_sections_on_disk_give_the_records_of_whole_sections(tmp_path, monkeypatch, mean_bytes, budget):
    rng = np.random.default_rng(mean_bytes)
    values, whole = _flush_files(tmp_path, rng, mean_bytes=mean_bytes)
    reference = spill.load_shard(whole, 1)
    reads = []
    real = fs.RangeReader.read

    def counting(self, path, offset, length):
        reads.append(length)
        return real(self, path, offset, length)

    monkeypatch.setattr(fs.RangeReader, "read", counting)
    max_bytes = 2000
    monkeypatch.setattr(spill, "CHUNK_BYTES", max_bytes)
    if budget == "small":
        monkeypatch.setattr(spill, "READ_BYTES", 1000)
        monkeypatch.setattr(spill, "MIN_READ_BYTES", 100)
    entries = transforms.load_batches(values, 1)
    head_reads = len(reads)
    heads = [spill.section_head_bytes(data[:spill.HEAD_SIZE], where) for where, data in whole]
    # One read of the head, the columns and the first example bytes; a
    # second only where the columns are longer than that read.
    assert head_reads == len(values) + sum(h > spill.MIN_READ_BYTES for h in heads)
    for name in ("sub_index", "file_index", "record_number", "truncated", "lengths"):
        assert np.array_equal(getattr(entries, name), getattr(reference, name))
    got = [(r, p) for records, provs in entries.record_chunks(chunk=50) for r, p in zip(records, provs)]
    expect = [(r, p) for records, provs in reference.record_chunks(chunk=50) for r, p in zip(records, provs)]
    assert got == expect and len(got) == len(reference)
    assert all(type(r) is bytes for r, _ in got)
    data_reads = reads[head_reads:]
    sizes = reference.end - reference.begin
    assert sum(reads) == sum(len(data) for _, data in whole)  # every byte read once
    chunks = len(list(reference.chunk_bounds(50, max_bytes)))
    if budget == "small":
        # A read at most a range's share or the read-ahead (1000 / 4 sections),
        # and fewer reads than one per section and range.
        assert max(data_reads) <= max(max_bytes, int(sizes.max()), 250)
        assert len(values) < len(data_reads) < chunks * len(values)
    else:
        # Sections under the read-ahead (8 MiB / 4): the first read, then at
        # most one more for the rest of its example bytes.
        assert len(reads) <= 2 * len(values) and len(data_reads) <= len(values)
    assert list(entries.items()) == list(reference.items())


def test_an_unsorted_section_on_disk_is_refused(tmp_path, monkeypatch):
    rng = np.random.default_rng(5)
    monkeypatch.setattr(spill, "sort_order", lambda hi, *rest: np.arange(len(hi)))  # write them unsorted
    values, _ = _flush_files(tmp_path, rng, flushes=2)
    monkeypatch.undo()
    entries = transforms.load_batches(values, 1)
    with pytest.raises(ValueError, match="not in sorted order"):
        for _ in entries.record_chunks(chunk=10):
            pass


def test_a_truncated_section_on_disk_names_the_file(tmp_path):
    rng = np.random.default_rng(7)
    values, _ = _flush_files(tmp_path, rng, flushes=1)
    path, offset, length = values[0]
    with pytest.raises(ValueError, match="flush-0.bin at byte 0: truncated spill file"):
        transforms.load_batches([(path, offset, 40)], 1)
    with pytest.raises(ValueError, match="flush-0.bin at byte 0: spill file data has"):
        transforms.load_batches([(path, offset, length - 1)], 1)


@pytest.mark.parametrize("exchange", ["runner", "spill"])
def test_batch_and_flush_sizes_do_not_change_a_byte(tmp_path, corpora, exchange, attempt, group):
    """Preprocessing batches cut by bytes, and flushes of any size, give the
    shards of the default sizes, byte for byte."""
    from testsupport import lines_task

    path = str(corpora.shakespeare)
    task = lines_task(path, eos=False)

    def shards(name, batch_bytes, flush_bytes):
        out_dir = tmp_path / name
        spill_dir = out_dir / "_tmp" / "spill"
        spill_dir.mkdir(parents=True)
        reader = transforms.ReadPreprocess(task, seed=3, sequence_length=None, num_shards=3, batch_bytes=batch_bytes)
        read = transforms.ReadUnit(reader, paths=[path], spill_dir=str(spill_dir), exchange=exchange,
                                   flush_bytes=flush_bytes)
        groups = group(attempt(read, (0, ((0, 0, None),))))
        spread = transforms.SpreadCopies(seed=3, num_features=1, spill_dir=str(spill_dir), exchange=exchange,
                                         num_shards=3, flush_bytes=flush_bytes)
        groups = group([kv for k in sorted(groups) for kv in attempt(spread, (k, groups[k]))])
        write = transforms.WriteGroup(task, out_dir=str(out_dir), scratch_dir=str(spill_dir), num_shards=3,
                                      sequence_length=None)
        entries = [attempt(write, (k, groups[k]))[0][1]["entry"] for k in range(3)]
        return [(e["sha256"], e["provenance_sha256"], e["num_records"]) for e in entries], len(os.listdir(spill_dir))

    default, default_files = shards("default", transforms.BATCH_BYTES, None)
    small, small_files = shards("small", 2_000, 100_000)
    assert small == default and sum(n for _, _, n in default) == 40000
    if exchange == "spill":
        assert small_files > default_files  # the small flushes made more spill files


def test_range_reader_keeps_files_open_up_to_its_limit(tmp_path):
    paths = []
    for k in range(5):
        p = tmp_path / f"f{k}.bin"
        p.write_bytes(bytes(range(k, k + 50)))
        paths.append(str(p))
    reader = fs.RangeReader(max_open=2)
    assert [reader.read(p, 3, 4) for p in paths] == [bytes(range(k + 3, k + 7)) for k in range(5)]
    assert len(reader._files) == 2 and list(reader._files) == paths[-2:]
    assert reader.read(paths[3], 0, 2) == bytes([3, 4]) and list(reader._files) == [paths[4], paths[3]]
    with pytest.raises(ValueError, match=r"f0.bin: 10 bytes expected at byte 45, the file has 5 there"):
        reader.read(paths[0], 45, 10)
    opened = list(reader._files.values())
    reader.close()
    assert not reader._files and all(f.closed for f in opened)
