"""The shard count follows the uncompressed size of the text, not file bytes:
Parquet column-chunk sizes from the footer, a sampled ratio for ``.gz``."""

import gzip
import math

import pyarrow as pa
import pyarrow.parquet as pq

from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task, plan, shuffle


def test_parquet_content_is_its_uncompressed_text(corpora, tmp_path):
    texts = corpora.c4_texts(300)
    text_bytes = sum(len(t.as_py().encode()) for t in texts)
    path = tmp_path / "p.parquet"
    # A second column the source does not read must not count.
    pq.write_table(pa.table({"text": texts, "other": pa.array(range(len(texts)))}), path, compression="zstd",
                   row_group_size=64)
    source = tasks.ParquetSource(str(path), column="text")
    files = source.list_files()
    content = plan.content_bytes(source, files)
    assert files[0].num_bytes < text_bytes / 2  # compressed
    # Decoded values: the text plus a 4-byte length per value (PLAIN) or the
    # dictionary indices: within 5% of the text, far from the file size.
    assert abs(content - text_bytes) < 0.05 * text_bytes, (content, text_bytes)
    assert plan._parquet_content(str(path), None) > content  # the unread column does not count
    shard_size = int(text_bytes / 2.5)  # 2.5 shards of text: 3
    assert shuffle.choose_num_shards(content, target_shard_bytes=shard_size) == 3
    assert shuffle.choose_num_shards(files[0].num_bytes, target_shard_bytes=shard_size) < 3


def test_gzip_content_is_estimated_from_its_ratio(corpora, tmp_path, monkeypatch):
    lines = corpora.shakespeare.read_bytes()
    path = tmp_path / "a.txt.gz"
    path.write_bytes(gzip.compress(lines, mtime=0))
    source = tasks.TextLineSource(str(path))
    files = source.list_files()
    # Small file: decompressed whole, exact.
    assert plan.content_bytes(source, files) == len(lines)
    # Large file: the ratio of the first SAMPLE_BYTES compressed bytes, within 10%.
    monkeypatch.setattr(plan, "SAMPLE_BYTES", 64 << 10)
    estimate = plan.content_bytes(source, files)
    assert estimate != len(lines) and abs(estimate - len(lines)) < 0.1 * len(lines), (estimate, len(lines))
    # Concatenated members are followed.
    two = tmp_path / "two" / "b.txt.gz"
    two.parent.mkdir()
    two.write_bytes(gzip.compress(b"x" * 1000, mtime=0) + gzip.compress(b"y" * 500, mtime=0))
    source2 = tasks.TextLineSource(str(two))
    assert plan.content_bytes(source2, source2.list_files()) == 1500


def test_sampled_files_lend_their_ratio(tmp_path, monkeypatch):
    folder = tmp_path / "many"
    folder.mkdir()
    for k in range(6):
        (folder / f"f{k}.txt.gz").write_bytes(gzip.compress(b"abc\n" * 5000, mtime=0))
    (folder / "plain.txt").write_bytes(b"q\n" * 100)
    monkeypatch.setattr(plan, "MAX_SAMPLED_FILES", 2)
    source = tasks.TextLineSource(str(folder / "*"))
    assert plan.content_bytes(source, source.list_files()) == 6 * 20000 + 200


def test_build_shard_count_follows_gz_text(corpora, tmp_path):
    lines = corpora.shakespeare.read_bytes()
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt.gz").write_bytes(gzip.compress(lines, mtime=0))
    task = tasks.Task("gz_lines", source=tasks.TextLineSource(str(tmp_path / "in" / "*.gz"), on_error={"empty": "keep"}),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    shard_size = 300_000
    result = build_task(task, cache_dir=str(tmp_path / "cache"), config=BuildConfig(shard_size=shard_size))
    sharding = result.manifest.sharding
    assert sharding.content_bytes == len(lines)
    assert len(result.manifest.shards) == math.ceil(len(lines) / shard_size) == 4
    assert math.ceil(sharding.input_bytes / shard_size) < 4  # what file bytes would have given
