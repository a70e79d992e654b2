"""T5 caches: span corruption (G1 across runners, file splits and split sizes)
and a translation cache from a parallel-text source, both with two features."""

import gzip
import hashlib
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines.build import BuildConfig, build_task
from seqcache.tasks import preprocessors as P

VOCAB = tasks.ByteVocabulary(extra_ids=100)
LENGTHS = {"inputs": 512, "targets": 114}
NUM_SHARDS = 3


def span_task(pattern, packing=None):
    return tasks.Task(
        "c4_span",
        source=tasks.ParquetSource(pattern, column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(VOCAB), "targets": tasks.Feature(VOCAB)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
        packing=packing,
    )


def _hashes(cache_dir, prefix=fmt.DATA_PREFIX):
    m = fmt.read_manifest(cache_dir)
    names = [s.file if prefix == fmt.DATA_PREFIX else s.provenance_file for s in m.shards]
    return [hashlib.sha256(open(os.path.join(cache_dir, n), "rb").read()).hexdigest() for n in names]


def _write(folder, texts, num_files, row_group_size=50):
    folder.mkdir(parents=True)
    for k, idx in enumerate(np.array_split(np.arange(len(texts)), num_files)):
        pq.write_table(pa.table({"text": texts.take(pa.array(idx))}), folder / f"part-{k}.parquet",
                       row_group_size=row_group_size)
    return str(folder / "*.parquet")


def _build(root, pattern, *, args=(), split_size=None, packing=None, seed=0):
    return build_task(span_task(pattern, packing), cache_dir=str(root / "cache"),
                      config=BuildConfig(seed=seed, num_shards=NUM_SHARDS, sequence_length=LENGTHS),
                      pipeline_args=list(args), split_size=split_size).cache_dir


@pytest.fixture(scope="module")
def span_reference(tmp_path_factory, corpora):
    root = tmp_path_factory.mktemp("span")
    texts = corpora.c4_texts(600)
    return texts, _build(root, _write(root / "in", texts, 2))


def test_span_corruption_cache_is_a_pure_function_of_its_records(span_reference, tmp_path):
    texts, ref = span_reference
    again = _build(tmp_path / "a", _write(tmp_path / "a" / "in", texts, 2))
    assert _hashes(again) == _hashes(ref)
    assert _hashes(again, fmt.PROVENANCE_PREFIX) == _hashes(ref, fmt.PROVENANCE_PREFIX)
    # Other files, tiny splits (a row group each) and worker processes: same shard bytes.
    other = _build(tmp_path / "b", _write(tmp_path / "b" / "in", texts, 5, row_group_size=17), split_size=1,
                   args=["--direct_running_mode=multi_processing", "--direct_num_workers=2"])
    assert _hashes(other) == _hashes(ref)
    # Another seed changes the corruption, not only the order.
    seeded = _build(tmp_path / "c", _write(tmp_path / "c" / "in", texts, 2), seed=1)
    with CacheReader(ref) as r0, CacheReader(seeded) as r1:
        a = {ex["inputs"].tobytes() for ex in r0.read_examples(range(len(r0)))}
        b = {ex["inputs"].tobytes() for ex in r1.read_examples(range(len(r1)))}
    assert len(a & b) < 0.1 * len(a)


def test_span_corruption_cache_content(span_reference):
    texts, ref = span_reference
    m = fmt.read_manifest(ref)
    assert [f.name for f in m.features] == ["inputs", "targets"]
    with CacheReader(ref) as r:
        assert len(r) == len(texts)
        indices = list(range(0, len(r), 7))
        for i, ex, (seg,) in zip(indices, r.read_examples(indices), r.read_sources(indices)):
            inputs, targets = np.asarray(ex["inputs"]), np.asarray(ex["targets"])
            assert inputs[-1] == VOCAB.eos_id and targets[-1] == VOCAB.eos_id
            assert len(inputs) <= 512 and len(targets) <= 114
            # Sentinels resolved, the example is a chunk of its source row's bytes.
            rebuilt = tasks.resolve_sentinels(inputs, targets, VOCAB)
            source_bytes = texts[seg["record_number"] + _row_offset(seg["path"])].as_py().encode("utf-8")
            assert (rebuilt - 3).astype(np.uint8).tobytes() in source_bytes


def _row_offset(path):
    # part-k of 2 files of 600 rows: rows 300 k ... 300 k + 299.
    return 300 * int(os.path.basename(path).split("-")[1].split(".")[0])


def _translation_task(d):
    return tasks.Task(
        "multi30k_en_de",
        source=tasks.ParallelTextSource({"en": str(d / "val.en.gz"), "de": str(d / "val.de.gz")}),
        output_features={"inputs": tasks.Feature(tasks.ByteVocabulary()),
                         "targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(), P.append_eos_after_trim()],
    )


def test_translation_cache_from_parallel_text(tmp_path, corpora):
    d = corpora.multi30k
    out = build_task(_translation_task(d), cache_dir=str(tmp_path / "cache"),
                     config=BuildConfig(num_shards=2, sequence_length={"inputs": 128, "targets": 128})).cache_dir
    en = gzip.open(d / "val.en.gz", "rt", encoding="utf-8").read().splitlines()
    de = gzip.open(d / "val.de.gz", "rt", encoding="utf-8").read().splitlines()
    m = fmt.read_manifest(out)
    assert m.read_source_table()[0]["locator"] == "line"
    with CacheReader(out) as r:
        assert len(r) == 1014
        idx = list(range(len(r)))
        seen = set()
        for ex, (seg,) in zip(r.read_examples(idx), r.read_sources(idx)):
            k = seg["record_number"]
            seen.add(k)
            assert ex["inputs"].tolist() == VOCAB.encode(en[k])[:127] + [VOCAB.eos_id]
            assert ex["targets"].tolist() == VOCAB.encode(de[k])[:127] + [VOCAB.eos_id]
        assert seen == set(range(1014))


def test_first_fit_cache_packs_the_same_examples(span_reference, tmp_path):
    texts, ref = span_reference
    pattern = _write(tmp_path / "in", texts, 2)
    packed = _build(tmp_path / "a", pattern, packing="first_fit")
    other = _build(tmp_path / "b", _write(tmp_path / "b" / "in", texts, 3, row_group_size=23), split_size=1,
                   packing="first_fit")
    assert _hashes(packed) == _hashes(other)
    from seqcache.cli.commands.inspect import packing_efficiency

    m = fmt.read_manifest(packed)
    assert m.statistics.segments == len(texts) and m.statistics.truncated_tokens == 0
    eff = packing_efficiency(m)
    unpacked_eff = packing_efficiency(fmt.read_manifest(ref))
    assert eff["inputs"] > unpacked_eff["inputs"] and eff["targets"] > unpacked_eff["targets"]
    assert eff["inputs"] > 0.9 and eff["targets"] > 0.9
    # Unpacking the rows by segment id gives exactly the unpacked cache's examples.
    with CacheReader(ref) as r:
        want = sorted((ex["inputs"].tobytes(), ex["targets"].tobytes()) for ex in r.read_examples(range(len(r))))
    got = []
    with CacheReader(packed) as r:
        for ex in r.read_examples(range(len(r))):
            seg_in, seg_tg = ex["inputs_segment_ids"], ex["targets_segment_ids"]
            for s in range(1, int(seg_in.max()) + 1):
                got.append((ex["inputs"][seg_in == s].astype(np.uint16).tobytes(),
                            ex["targets"][seg_tg == s].astype(np.uint16).tobytes()))
    assert sorted(got) == want
