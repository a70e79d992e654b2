"""Opening a cache reads only its manifest; each shard is checked at its first read (G7).

A shard whose byte size or record count disagrees with the manifest is refused at
its first read, with the same message as an eager check, before any of its
records is returned; ``seqcache verify`` still checks every shard.
"""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders import Feeder
from seqcache.feeders.reader import CacheReader
from seqcache.cli.verify import verify_cache

N, SHARDS, B = 40, 8, 4


def _open_shards(feeder) -> list[int]:
    return [s for s, r in enumerate(feeder.readers[0]._data) if r is not None]


def test_opening_a_cache_opens_no_shard_and_stats_no_file(make_cache, monkeypatch):
    path = make_cache(n=N, num_shards=SHARDS)
    calls = []
    real = os.path.getsize
    monkeypatch.setattr(os.path, "getsize", lambda p: calls.append(p) or real(p))
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, prefetch=0) as f:
        assert _open_shards(f) == [] and calls == []
        batch = f.get_batch(0)
        starts = f.readers[0].shard_starts
        touched = sorted({int(np.searchsorted(starts, i, side="right") - 1) for i in batch["cache_index"]})
        # The first batch opened (and checked) exactly the shards it read.
        assert _open_shards(f) == touched
        assert sorted(os.path.basename(c) for c in calls) == [fmt.read_manifest(path).shards[s].file for s in touched]


def _edit_column(raw, key, shard, value):
    """Sets shard ``shard``'s value in the integer column ``key`` of a version-2
    manifest; returns the old value."""
    column = fmt.decode_int_column(raw["shards"][key]).copy()
    old = int(column[shard])
    column[shard] = value
    raw["shards"][key] = fmt.encode_int_column(column)
    return old


def _edit_count(path, shard, delta):
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    n = int(fmt.decode_int_column(raw["shards"]["num_records"])[shard])
    _edit_column(raw, "num_records", shard, n + delta)
    raw["num_examples"] += delta
    json.dump(raw, open(mpath, "w"))
    return n


def to_format_version_1(path):
    """Rewrites the version-2 cache at ``path`` as the previous format wrote it:
    ``format_version`` 1 and one JSON object per shard (file names and
    checksums included), no shard checksum file. Returns the manifest dict."""
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    table = raw["shards"]
    sums = json.load(open(os.path.join(path, table["checksums"]["file"])))
    count = table["num_shards"]
    columns = {k: fmt.decode_int_column(table[k]).tolist() for k in ("num_records", "num_bytes", "provenance_num_bytes")}
    raw["format_version"] = 1
    raw["shards"] = [
        {"file": fmt.shard_name(fmt.DATA_PREFIX, i, count), "num_records": columns["num_records"][i],
         "num_bytes": columns["num_bytes"][i], "sha256": sums["sha256"][i],
         "provenance_file": fmt.shard_name(fmt.PROVENANCE_PREFIX, i, count),
         "provenance_num_bytes": columns["provenance_num_bytes"][i], "provenance_sha256": sums["provenance_sha256"][i]}
        for i in range(count)
    ]
    os.unlink(os.path.join(path, table["checksums"]["file"]))
    json.dump(raw, open(mpath, "w"), indent=2)
    return raw


def _steps_before_shard(path, shard):
    """The first step of a 1-epoch run that reads ``shard`` (located, not read)."""
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, num_epochs=1,
                prefetch=0) as f:
        starts = f.readers[0].shard_starts
        for s in range(f.num_steps):
            loc = f.stream.locate(s * B + np.arange(B))
            ci = loc.cache_index[loc.valid]
            if ((ci >= starts[shard]) & (ci < starts[shard + 1])).any():
                return s
    raise AssertionError


def test_a_shard_with_another_record_count_is_refused_at_its_first_read(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    n = _edit_count(path, 5, -1)
    first = _steps_before_shard(path, 5)  # with the edited counts: the mapping the reader uses
    name = fmt.read_manifest(path).shards[5].file
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, num_epochs=1,
                prefetch=0) as f:
        got = [next(f) for _ in range(first)]  # batches before it are served
        assert len(got) == first
        with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records, the manifest expects {n - 1}"):
            next(f)
        assert f.step == first
    with CacheReader(path, open_shards=False) as r:
        lo = int(r.shard_starts[5])
        with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records"):
            r.read([0, lo])  # nothing of the batch is returned, not even record 0
    with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records"):
        CacheReader(path)  # the eager open still checks every shard


def test_a_resized_shard_is_refused_at_its_first_read_and_by_verify(make_cache):
    from seqcache.cli.verify import verify_cache

    path = make_cache(n=N, num_shards=SHARDS)
    info = fmt.read_manifest(path).shards[3]
    shard = os.path.join(path, info.file)
    with open(shard, "ab") as f:
        f.write(b"x")
    with CacheReader(path, open_shards=False) as r:
        assert r.read_examples([0])[0]["targets"][0] == 1  # shard 0 reads
        with pytest.raises(fmt.CacheError) as e:
            r.read([int(r.shard_starts[3])])
        assert str(e.value).startswith(f"{shard}: shard file has {info.num_bytes + 1} bytes, the manifest expects "
                                       f"{info.num_bytes}")
        assert f"seqcache verify {path}" in str(e.value)
    report = verify_cache(path)
    assert any(info.file in p for p in report.problems)


def _edit_manifest(path, edit):
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    edit(raw)
    json.dump(raw, open(mpath, "w"))
    return mpath


def test_the_manifest_keeps_the_shard_table_as_columns_and_builds_shard_entries_on_access(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    raw = json.load(open(os.path.join(path, fmt.MANIFEST_NAME)))
    table = raw["shards"]
    assert raw["format_version"] == fmt.FORMAT_VERSION == 3
    # No file names and no checksums in the manifest: they follow from index and
    # count, and live in the shard checksum file.
    assert sorted(table) == ["checksums", "encoding", "num_bytes", "num_records", "num_shards", "provenance_num_bytes"]
    assert table["num_shards"] == SHARDS and table["checksums"]["file"] == fmt.SHARD_CHECKSUMS_NAME
    m = fmt.read_manifest(path)
    counts = np.frombuffer(base64.b64decode(table["num_records"]), "<i8")
    assert m.shards.num_records.tolist() == counts.tolist() and counts.sum() == N
    assert m.shard_starts.tolist() == np.concatenate([[0], np.cumsum(m.shards.num_records)]).tolist()
    assert m.num_examples == N and not m.shard_starts.flags.writeable
    assert m.shards._infos == [None] * SHARDS  # nothing built at open
    names = [fmt.shard_name("data", i, SHARDS) for i in range(SHARDS)]
    assert [s.file for s in m.shards] == names == m.shards.files
    assert list(m.shards.provenance_files) == [fmt.shard_name("provenance", i, SHARDS) for i in range(SHARDS)]
    assert m.shards[3] is m.shards[3] and m.shards[-1] == m.shards[SHARDS - 1]
    assert [s.num_bytes for s in m.shards] == [os.path.getsize(os.path.join(path, n)) for n in names]
    assert not hasattr(m.shards[2], "sha256")  # checksums are not read at open: they are in their own file
    sha, prov = fmt.read_shard_checksums(path, m)
    assert sha[2] == fmt.file_sha256(os.path.join(path, names[2]))
    assert prov[5] == fmt.file_sha256(os.path.join(path, fmt.shard_name("provenance", 5, SHARDS)))


def test_opening_never_reads_the_shard_checksum_file(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    os.unlink(os.path.join(path, fmt.SHARD_CHECKSUMS_NAME))
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, prefetch=0) as f:
        assert f.get_batch(0)["targets"].shape == (B, 4)
    with CacheReader(path) as r:  # the eager open checks sizes and counts, not checksums
        assert len(r) == N


def _refused_at_shard_6s_first_read(path, mpath, value, *, parse_match):
    """Shard 6's num_bytes, ``value`` as the error writes it, is refused: at the
    first read of shard 6 by a lazy reader (shard 0 reads), by an eager open, and
    by ``parse_manifest`` (what a writer checks before writing; ``parse_match``)."""
    with CacheReader(path, open_shards=False) as r:
        assert r.read_examples([0])[0]["targets"][0] == 1  # shard 0 reads
        with pytest.raises(fmt.CacheError, match=rf"^{mpath}: shard 6: num_bytes is {value}, expected an integer >= 0"):
            r.read([0, int(r.shard_starts[6])])
    with pytest.raises(fmt.CacheError, match=f"shard 6: num_bytes is {value}"):
        CacheReader(path)
    with pytest.raises(fmt.CacheError, match=parse_match):
        fmt.parse_manifest(json.load(open(mpath)))


def test_a_bad_size_column_is_refused_at_the_first_read_naming_the_shard(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    mpath = _edit_manifest(path, lambda raw: _edit_column(raw, "num_bytes", 6, -12))
    # A shard's byte sizes are decoded at its first read; the eager open checks every shard.
    _refused_at_shard_6s_first_read(path, mpath, "-12", parse_match="shard 6: num_bytes is -12")
    size = os.path.getsize(os.path.join(path, fmt.shard_name(fmt.DATA_PREFIX, 6, SHARDS)))
    _edit_manifest(path, lambda raw: (_edit_column(raw, "num_bytes", 6, size), raw["shards"].update(
        provenance_num_bytes="!" * len(raw["shards"]["num_bytes"]))))
    with pytest.raises(fmt.CacheError, match=rf"^{mpath}: shards.provenance_num_bytes is not base64 of little-endian"):
        verify_cache(path)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: _edit_column(raw, "num_records", 4, -1), r"shard 4: num_records is -1, expected an integer >= 0"),
    (lambda raw: raw["shards"].update(num_records=fmt.encode_int_column(
        fmt.decode_int_column(raw["shards"]["num_records"])[:6])),
     r"shards.num_records has 6 values, expected 8 \(shards.num_shards\)"),
    (lambda raw: raw["shards"].update(num_shards=9), r"shards.num_records has 8 values, expected 9"),
    (lambda raw: raw["shards"].update(num_bytes="not base64!"), r"shards.num_bytes is not base64 of little-endian int64"),
    (lambda raw: raw["shards"].update(num_bytes=[1, 2]), r"shards.num_bytes is not base64"),
    (lambda raw: raw["shards"].pop("provenance_num_bytes"), r"shards: missing column 'provenance_num_bytes'"),
    (lambda raw: raw["shards"]["checksums"].update(file="../x"),
     r"shards.checksums: file name '../x' is not a plain file name inside the cache folder"),
    (lambda raw: raw["shards"]["checksums"].update(file="/etc/passwd"), r"shards.checksums: file name '/etc/passwd' is not a plain"),
    (lambda raw: raw["shards"]["checksums"].update(file="other.json"),
     r"shards.checksums: file name 'other.json', expected 'shard-checksums.json'"),
    (lambda raw: raw["shards"]["checksums"].update(sha256="12"), r"shards.checksums: sha256 is '12', expected 64 hex"),
    (lambda raw: raw.update(shards=[]), r"shards is list, expected a JSON object \(format version 2\)"),
    (lambda raw: raw.update(format_version=4),
     r"format_version is 4, this seqcache reads format version 2 or 3: read the cache with the seqcache release that wrote "
     r"it, or rebuild it with this one \(seqcache build ... --overwrite\)"),
])
def test_the_shard_table_is_checked_at_open(make_cache, edit, message):
    path = make_cache(n=N, num_shards=SHARDS)
    mpath = _edit_manifest(path, edit)
    with pytest.raises(fmt.CacheError, match=rf"^{mpath}: {message}"):
        Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1)


# --- the previous format version (1): one JSON object per shard, no longer read ---------------


def test_a_version_1_cache_is_refused_by_every_reader_with_the_advice_to_rebuild(make_cache):
    path = make_cache(n=N, num_shards=SHARDS)
    to_format_version_1(path)
    mpath = os.path.join(path, fmt.MANIFEST_NAME)
    message = (rf"^{mpath}: format_version is 1, this seqcache reads format version 2 or 3: read the cache with the "
               r"seqcache release that wrote it, or rebuild it with this one \(seqcache build ... --overwrite\)$")
    with pytest.raises(fmt.CacheError, match=message):
        Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1)
    with pytest.raises(fmt.CacheError, match=message):
        CacheReader(path)
    with pytest.raises(fmt.CacheError, match=message):
        verify_cache(path)


def test_a_shards_sizes_are_decoded_from_its_own_base64_quanta():
    """``table[i]`` decodes only shard i's 8 bytes of each size column; every
    offset of an 8-byte value in the 3-byte base64 quanta gives the column's value."""
    count = 1001
    values = np.random.default_rng(1).integers(0, 2**62, count)
    table = fmt.ShardTable({
        "num_shards": count, "num_records": fmt.encode_int_column(np.arange(count)),
        "num_bytes": fmt.encode_int_column(values), "provenance_num_bytes": fmt.encode_int_column(values[::-1]),
        "checksums": {"file": fmt.SHARD_CHECKSUMS_NAME, "num_bytes": 1, "sha256": "0" * 64}})
    assert table._columns.keys() == {"num_records"}  # the size columns are not decoded whole
    assert [table[i].num_bytes for i in range(count)] == values.tolist()
    assert [table[i].provenance_num_bytes for i in range(count)] == values[::-1].tolist()
    assert table[7].file == "data.array_record-00007-of-01001" and table[7].num_records == 7


def test_read_sorted_returns_the_records_in_index_order_with_their_order(make_cache):
    path = make_cache(n=50, num_shards=4)
    with CacheReader(path) as r:
        idx = np.array([37, 2, 49, 2, 11, 30, 0])
        records, order = r.read_sorted(idx)
        assert np.array_equal(idx[order], np.sort(idx, kind="stable"))
        assert records == [r.read([int(i)])[0] for i in idx[order]]
        assert r.read(idx) == [records[j] for j in np.argsort(order)]
        ascending, none = r.read_sorted([1, 5, 33])
        assert none is None and ascending == r.read([1, 5, 33])
