"""Golden cache bytes (G1): for every data and provenance shard of two small
caches written out here, the sha256 of its records (each as a little-endian
uint32 length and its bytes, in order: what readers see, whatever the chunking)
and the sha256 of the file. A change to the build path that changes the records
changes users' caches and needs a cache format version bump
(docs/cache-format.md); a faster build path must keep them. The file hashes
pin the chunking too (ArrayRecord group sizes, ``fmt.group_size_for``); the
record hashes are those of the files written with one record per chunk, before
group sizes followed record sizes."""

import hashlib
import os
import struct

import pyarrow as pa
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordReader

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.tasks import preprocessors as P

# Short lines, byte vocabulary, no packing: the first 5,000 lines of
# tinyshakespeare in two files, seed 7, 3 shards.
GOLDEN_LINES_RECORDS = (
    ["274db20a0151435924add1ca133a9e583d4e77ae0478d00256c7e60059e5d6a6",
     "e5c8e0a7f68723d777ead2ae2d854ffa8e29530196e8a2825a9703fb192f2ac4",
     "917c250bf3004596754638a2eb6884417239a19ace46bdb35b662c35240d3632"],
    ["7f9752326865078f78b4da4c0e3f11d37f4dfaded88d71c47f45201f264764a6",
     "9977ff8e764248b14f6444a31f9c501f3f98b5337d9cd406d72789ed7d9b14f5",
     "ab69eb5a35d45c981f9aaa6029a19ce17bd90027f6fa8ec88940afc8d55c20d2"],
)
GOLDEN_LINES_GROUP_SIZES = ([16, 16, 8], [64, 64, 64])
# T5 span corruption with first-fit packing of (inputs, targets): the first 400
# C4 documents in one Parquet file of row groups of 50, seed 7, 3 shards.
GOLDEN_SPAN_RECORDS = (
    ["066829e3b989591d546919fa87eab7bade01192d9925514e54def0d6feeda228",
     "64a827cd8d8a303e7ac1ef6621e466567bb3d86e67037a86cb0068a6eaec4e58",
     "824d5800a7ac0bd4f388b8436ce4cbd15285f68291c5243eaf570f3800f8b930"],
    ["a0b1810660a3f2cb5d35de63250145f8199cc7a4976ffdcba18dd078104f1ce1",
     "f32c6ed985812e1bb03ca5fff79793be90fe3049c16f5e36e5476bc7959040ab",
     "36214e4b3d3480d6d77274c7f59288926528f64cad30d75a393636efa4b984d1"],
)
GOLDEN_SPAN_GROUP_SIZES = ([1, 1, 1], [64, 64, 64])
# The files themselves (data, provenance). The span-corruption data files keep
# one record per chunk (packed rows of over 1 KiB): the same bytes as before.
GOLDEN_LINES_FILES = (
    ["df872dfbe3156d038c68b26216654c99914d021b75082f06a615b8df877f3e2c",
     "9413dacf1b4554b33c92763998bcacde47c48d7566315b5391f88af707f5f680",
     "9c07c590a45c81051e858b1679bfc86a78aea989041ef4f3cbbe7b6a5dab199b"],
    ["1a8a1f5f1c3446facf7dbb57758dfbf02cc71dfc71ae45305fd7110f35471c05",
     "328371657dcdb32d961f741f109a0a15cd1dcd864ee962b88d61812b15509612",
     "eee8181ea0441c20a8b5226b8eba5263377ca8886cec6cd7c62817fc9031e8fa"],
)
GOLDEN_SPAN_FILES = (
    ["88ad25a9ee87ce7cbf4fb90bfd3c1abfc3aeb9075d54073c45f39e66a0722079",
     "d3dab0282a989d04c158e95297ad09c30c45908a6e87cd2eb1f3aae044853949",
     "dbb0fabac1b6b30937b9a3efad7720f85ad1877a80d4a896808d6331661a92a9"],
    ["509f790d771caf60b36746486664c1d65e1b79af3db009feaf798a5db24a9e03",
     "407782cabc80b7a0c5d1c8e98047f7d1d4a41bb206962e29b4b1bc04bba2572e",
     "ea0219b93c92d0ea4c42e83c34519c3c19c7aec60e3e360d5c5682ba80516012"],
)


def _records_digest(path: str) -> tuple[str, int]:
    """(sha256 of the file's records, the group size in the file's header)."""
    reader = ArrayRecordReader(path)
    try:
        n = reader.num_records()
        h = hashlib.sha256()
        for record in (reader.read(list(range(n))) if n else []):
            h.update(struct.pack("<I", len(record)))
            h.update(record)
        options = dict(o.split(":", 1) for o in reader.writer_options_string().split(",") if ":" in o)
        return h.hexdigest(), int(options["group_size"])
    finally:
        reader.close()


def _build(task, tmp_path, sequence_length=None):
    """((data records, provenance records), (data group sizes, provenance group
    sizes), (data files, provenance files)): sha256 hex digests, per shard."""
    result = build_task(task, cache_dir=str(tmp_path / "cache"),
                        config=BuildConfig(seed=7, num_shards=3, sequence_length=sequence_length))
    table = result.manifest.shards
    names = table.files, table.provenance_files
    path = lambda name: os.path.join(result.cache_dir, name)  # noqa: E731
    files = tuple([hashlib.sha256(open(path(n), "rb").read()).hexdigest() for n in kind] for kind in names)
    # The checksum file the build wrote records the same bytes.
    assert tuple(fmt.read_shard_checksums(result.cache_dir, result.manifest)) == files
    read = [[_records_digest(path(n)) for n in kind] for kind in names]
    records = tuple([d for d, _ in kind] for kind in read)
    groups = tuple([g for _, g in kind] for kind in read)
    return records, groups, files


def _short_lines_task(corpora, tmp_path):
    lines = corpora.shakespeare_lines(5000)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n".join(lines[:2500]) + "\n", encoding="utf-8")
    (tmp_path / "in" / "b.txt").write_text("\n".join(lines[2500:]) + "\n", encoding="utf-8")
    return tasks.Task("a", source=tasks.TextLineSource(str(tmp_path / "in" / "*.txt"), on_error={"empty": "keep"}),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])


def test_golden_short_lines(corpora, tmp_path):
    records, groups, files = _build(_short_lines_task(corpora, tmp_path), tmp_path)
    assert records == GOLDEN_LINES_RECORDS
    assert groups == GOLDEN_LINES_GROUP_SIZES
    assert files == GOLDEN_LINES_FILES


def test_golden_short_lines_whatever_the_shard_writer_copies_at_a_time(corpora, tmp_path, monkeypatch):
    # A shard writer copies its examples out of the spill sections a few
    # hundred bytes at a time (a handful of records): the same files, group
    # sizes included (the first chunk no longer holds the records the group
    # size rule averages).
    from seqcache.pipelines import spill

    monkeypatch.setattr(spill, "CHUNK_BYTES", 300)
    records, groups, files = _build(_short_lines_task(corpora, tmp_path), tmp_path)
    assert (records, groups, files) == (GOLDEN_LINES_RECORDS, GOLDEN_LINES_GROUP_SIZES, GOLDEN_LINES_FILES)


def test_golden_span_corruption_first_fit(corpora, tmp_path):
    texts = corpora.c4_texts(400)
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"text": texts}), tmp_path / "pq" / "p.parquet", row_group_size=50)
    vocab = tasks.ByteVocabulary(extra_ids=100)
    task = tasks.Task(
        "d", source=tasks.ParquetSource(str(tmp_path / "pq" / "*.parquet"), on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
        packing="first_fit")
    records, groups, files = _build(task, tmp_path, {"inputs": 512, "targets": 114})
    assert records == GOLDEN_SPAN_RECORDS
    assert groups == GOLDEN_SPAN_GROUP_SIZES
    assert files == GOLDEN_SPAN_FILES


def test_group_size_follows_the_mean_record_size(tmp_path):
    assert [fmt.group_size_for(b) for b in (1, 16, 17, 36, 100, 512, 513, 1024, 5000)] == [
        64, 64, 32, 16, 8, 2, 1, 1, 1]
    from seqcache.pipelines import writer
    import numpy as np

    specs = [fmt.FeatureSpec("targets", "uint16")]
    short = [({"targets": np.arange(n, dtype=np.uint16)}, [(0, i, 0)]) for i, n in enumerate([5, 9, 13] * 50)]
    for name, examples, group_size, expect in (("auto", short, None, 32), ("given", short, 4, 4)):
        (tmp_path / name).mkdir()
        entry = writer.write_shard(str(tmp_path / name), index=0, num_shards=1, features=specs, examples=examples,
                                   group_size=group_size)
        assert entry["num_records"] == len(short)
        assert _records_digest(str(tmp_path / name / entry["file"]))[1] == expect
        assert _records_digest(str(tmp_path / name / entry["provenance_file"]))[1] == fmt.PROVENANCE_GROUP_SIZE
    # The same records, whatever the chunking.
    assert _records_digest(str(tmp_path / "auto" / entry["file"]))[0] == \
        _records_digest(str(tmp_path / "given" / entry["file"]))[0]
