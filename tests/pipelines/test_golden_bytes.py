"""Golden cache bytes (G1): the sha256 of every data and provenance shard of two
small caches, written out here. A change to the build path that changes them
changes users' caches and needs a cache format version bump
(docs/cache-format.md); a faster build path must keep them."""

import hashlib
import os

import pyarrow as pa
import pyarrow.parquet as pq

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.tasks import preprocessors as P

# Short lines, byte vocabulary, no packing: the first 5,000 lines of
# tinyshakespeare in two files, seed 7, 3 shards.
GOLDEN_LINES_DATA = [
    "103470fe9d58ff09bbd32bdc8319cf5a1d51a86577573c12efa2be9f251e45a1",
    "8ecc67f5cf9f5d3e3e878cbc039fbe236707a9fce6e8606306c9558d66aa2353",
    "4426c5f78a88109244c7be08664f095d88483d3829a1de81cb2a8d8f6ae141db",
]
GOLDEN_LINES_PROVENANCE = [
    "e493538145091a02e2835fa9a256a11036084a2de792d52e2b85cf85caaf6bc4",
    "61da78c9488a98380d563b53818bb893e423fca1e8b9bd3ab1c7d5439449e3fc",
    "bd03554206c32bb2164c9651033e7bf1f09d665a18b679d5e4b59eb186b7f808",
]
# T5 span corruption with first-fit packing of (inputs, targets): the first 400
# C4 documents in one Parquet file of row groups of 50, seed 7, 3 shards.
GOLDEN_SPAN_DATA = [
    "88ad25a9ee87ce7cbf4fb90bfd3c1abfc3aeb9075d54073c45f39e66a0722079",
    "d3dab0282a989d04c158e95297ad09c30c45908a6e87cd2eb1f3aae044853949",
    "dbb0fabac1b6b30937b9a3efad7720f85ad1877a80d4a896808d6331661a92a9",
]
GOLDEN_SPAN_PROVENANCE = [
    "89d61751d2f2034a44af1e0120ac393066aa2e6172df931899ba0b1ece664a4e",
    "16a05d08a7ab0015c377058dedd7b5144744af771f2d138031bf99a8570ddf61",
    "fef2b9eb9551733c776fcf8b1e54d0852cac3b90fc8ab0d6d7f3c4b1f5f68f06",
]


def _build(task, tmp_path, sequence_length=None):
    result = build_task(task, cache_dir=str(tmp_path / "cache"),
                        config=BuildConfig(seed=7, num_shards=3, sequence_length=sequence_length))
    table = result.manifest.shards
    digest = lambda name: hashlib.sha256(open(os.path.join(result.cache_dir, name), "rb").read()).hexdigest()  # noqa: E731
    hashed = [digest(n) for n in table.files], [digest(n) for n in table.provenance_files]
    # The checksum file the build wrote records the same bytes.
    assert tuple(fmt.read_shard_checksums(result.cache_dir, result.manifest)) == hashed
    return hashed


def test_golden_short_lines(corpora, tmp_path):
    lines = corpora.shakespeare_lines(5000)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n".join(lines[:2500]) + "\n", encoding="utf-8")
    (tmp_path / "in" / "b.txt").write_text("\n".join(lines[2500:]) + "\n", encoding="utf-8")
    task = tasks.Task("a", source=tasks.TextLineSource(str(tmp_path / "in" / "*.txt"), on_error={"empty": "keep"}),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])
    assert _build(task, tmp_path) == (GOLDEN_LINES_DATA, GOLDEN_LINES_PROVENANCE)


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
    assert _build(task, tmp_path, {"inputs": 512, "targets": 114}) == (GOLDEN_SPAN_DATA, GOLDEN_SPAN_PROVENANCE)
