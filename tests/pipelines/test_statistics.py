"""The build's length histograms and per-file counts: exact on real text, the
same however the input is split into work units and shards, and merged by
addition."""

from __future__ import annotations

import collections

import numpy as np

from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import stats
from testsupport import lines_task


def test_bucket_edges():
    # Exact below 16, then 8 buckets per power of two: written out, since caches record them.
    lengths = np.array([0, 1, 15, 16, 17, 18, 31, 32, 35, 36, 511, 512, 513, 1000, 2**40 + 5])
    assert stats.bucket_lo(lengths).tolist() == [0, 1, 15, 16, 16, 18, 30, 32, 32, 36, 480, 512, 512, 960, 2**40]
    assert [stats.bucket_hi(lo) for lo in (0, 15, 16, 30, 32, 480, 512, 960)] == [1, 16, 18, 32, 36, 512, 576, 1024]
    assert stats.merge_histograms([[[1, 2, 3], [16, 18, 1]], [[0, 1, 2], [16, 18, 4]]]) == \
        [[0, 1, 2], [1, 2, 3], [16, 18, 5]]


def _task(name, path, pack):
    return lines_task(path, name, on_error={"empty": "skip"}, packing="lm" if pack else None)


def test_histogram_and_per_file_counts_are_exact(tmp_path, corpora):
    lines = corpora.shakespeare_lines(5000)
    folder = tmp_path / "in"
    folder.mkdir()
    parts = [lines[:3000], lines[3000:4500], lines[4500:]]
    for i, part in enumerate(parts):
        (folder / f"part-{i}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
    results = {}
    for pack in (False, True):
        for split_size in (1 << 30, 4096):
            results[pack, split_size] = build_task(
                _task("lines", str(folder / "*.txt"), pack), cache_dir=str(tmp_path / f"c-{pack}-{split_size}"),
                config=BuildConfig(num_shards=3, sequence_length={"targets": 128} if pack else None),
                split_size=split_size).manifest
    m = results[False, 1 << 30]
    files = [s["path"] for s in m.read_source_table()]
    kept = {f"{folder}/part-{i}.txt": [x for x in part if x] for i, part in enumerate(parts)}
    st, per_file = m.statistics.to_json(), m.read_source_table().statistics
    assert per_file["examples"] == [len(kept[f]) for f in files]
    assert per_file["tokens"]["targets"] == [sum(len(x.encode()) + 1 for x in kept[f]) for f in files]
    assert sum(per_file["examples"]) == st["source_examples"]
    want = collections.Counter(int(lo) for lo in stats.bucket_lo(
        np.array([len(x.encode()) + 1 for f in files for x in kept[f]])))
    assert st["length_histogram"]["targets"] == [[lo, stats.bucket_hi(lo), want[lo]] for lo in sorted(want)]
    for (pack, split_size), other in results.items():
        # Packing changes the cached examples, not the source examples the histogram and the file table count.
        assert other.statistics.length_histogram == st["length_histogram"], (pack, split_size)
        assert other.read_source_table().statistics == per_file, (pack, split_size)
    assert results[True, 4096].statistics == results[True, 1 << 30].statistics
