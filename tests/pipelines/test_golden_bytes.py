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
# tinyshakespeare in two files, seed 7, 3 shards. Changing these values breaks
# users' reproducibility: every cache built before holds other bytes. They
# changed once, with shuffle version 2 (``shuffle.SHUFFLE_VERSION``, in the
# fingerprint): each copy of a repeated line (here the blank lines and speaker
# names) takes its own key instead of one shared key.
GOLDEN_LINES_RECORDS = (
    ["b33ec2514fadd74e7bd921ddabe678dc4f37ee625c6218cdfba4f555e919ee42",
     "189523bb642fa2d9a68d93334bf6507ee3465065a397b6c0e9e99e977daaa121",
     "a333d2602cd72ef44d7d622523bb2e48b50c0c7df47777bc0d07a374c8126ef8"],
    ["9e62543fbb9ed28b03abe409f1b4ab87291c3d87dd9cb53efc7354b835ac6731",
     "803487216ddca26e6bf44e84f763a9723170d9ead16a032e9e9051ef6e50ddba",
     "94f02b3482f171dc47b7c3e4366f48759b5f0df71dae124be7848ab4242c3956"],
)
GOLDEN_LINES_GROUP_SIZES = ([16, 16, 16], [64, 64, 64])
# T5 span corruption with first-fit packing of (inputs, targets): the first 400
# C4 documents in one Parquet file of row groups of 50, seed 7, 3 shards (no
# document repeats, so shuffle version 2 left these bytes as they were).
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
    ["d36cc3e673ceea0d675be7503437014e8af711abf1841962b5af39f8ac9814da",
     "2af3cc77172d325ba9235e04c0c058808f2edb4bd98e23e6eb7b94cc64480fc0",
     "0165ba19a2b21a700ea600d0019d704bf7d4c287517e5c1a397e1de79f696b07"],
    ["1ed1c3423e9c5630a175b689e5460f49ea9ac35d89e285f496f9c4f2b65ca566",
     "936d0a7d8e156b9145eb70c3e470f51ab44787c4d17f74d8122fd60bd96458f6",
     "a75ae027cae22fc9d59928c800f51ce8ced978ca48d703382d0a635f9a0d21bf"],
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
