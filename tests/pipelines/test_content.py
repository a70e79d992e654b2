"""Exactly-once content: decoding a whole cache gives back the multiset of the
input records after the task's preprocessing, on real corpora."""

from __future__ import annotations

import collections
import gzip
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.feeders.reader import CacheReader


def _task(name, source, vocab, *, sequence_length=None, pack=False):
    pre = [tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(), tasks.preprocessors.append_eos()]
    if sequence_length and not pack:
        pre.append(tasks.preprocessors.trim())
    return tasks.Task(
        name,
        source=source,
        output_features={"targets": tasks.Feature(vocab)},
        preprocessors=pre,
        packing="lm" if pack else None,
    )


def _decoded_multiset(cache_dir):
    with CacheReader(cache_dir) as r:
        return collections.Counter(tuple(e["targets"].tolist()) for e in r.read_examples(range(len(r))))


def _line_starts(data: bytes) -> list[int]:
    """The byte offset of every line's first byte (a line source's record numbers)."""
    starts, start = [], 0
    for line in data.split(b"\n"):
        starts.append(start)
        start += len(line) + 1
    return starts


def _expected(texts, vocab, trim_to=None):
    out = collections.Counter()
    for ids in vocab.encode_batch(list(texts)):
        seq = tuple(ids.tolist()) + (vocab.eos_id,)
        out[seq[:trim_to] if trim_to else seq] += 1
    return out


def test_tinyshakespeare_every_line_once(tmp_path, corpora):
    """Blank lines separate the speeches: skipped on request, counted and listed."""
    path = corpora.shakespeare
    vocab = tasks.ByteVocabulary()
    result = build_task(
        _task("shakespeare", tasks.TextLineSource(str(path), on_error={"empty": "skip"}), vocab),
        cache_dir=str(tmp_path),
        config=BuildConfig(num_shards=5),
    )
    data = path.read_bytes()
    lines = data.decode("utf-8").split("\n")
    starts = _line_starts(data)
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline: no record after it
    assert len(lines) == 40000
    kept = [line for line in lines if line]
    # A line's record number is the byte offset of its first byte.
    empty = [starts[i] for i, line in enumerate(lines) if not line]
    assert result.manifest.num_examples == len(kept) and len(empty) > 7000
    assert _decoded_multiset(result.cache_dir) == _expected(kept, vocab)
    stats = result.manifest.statistics.to_json()
    assert stats["tokens"]["targets"] == sum(len(line.encode()) + 1 for line in kept)
    assert stats["skipped_records"] == len(empty) and stats["source_records"] == 40000
    quarantined = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
    assert [e["record_number"] for e in quarantined] == empty
    assert all(e["error"].endswith(f"line at byte {e['record_number']} is empty") and e["action"] == "skipped"
               for e in quarantined)


def test_c4_parquet_every_document_once_with_trim(tmp_path, corpora):
    path = corpora.c4
    vocab = tasks.ByteVocabulary()
    result = build_task(
        _task("c4", tasks.ParquetSource(str(path), column="text", on_error={"control_characters": "keep"}), vocab,
              sequence_length={"targets": 512}),
        cache_dir=str(tmp_path),
        config=BuildConfig(num_shards=3, sequence_length={"targets": 512}),
    )
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    assert result.manifest.num_examples == 2000
    assert _decoded_multiset(result.cache_dir) == _expected(texts, vocab, trim_to=512)
    full = sum(len(t.encode()) + 1 for t in texts)
    kept = sum(min(512, len(t.encode()) + 1) for t in texts)
    assert result.manifest.statistics.truncated_tokens == full - kept
    assert result.manifest.statistics.max_length["targets"] == 512


def test_dolma_jsonl_gz_every_document_once(tmp_path, corpora):
    pattern = str(corpora.dolma / "*.jsonl.gz")
    vocab = tasks.ByteVocabulary()
    result = build_task(
        _task("dolma", tasks.JsonLinesSource(pattern, field="text", on_error={"control_characters": "keep"}), vocab),
        cache_dir=str(tmp_path),
        config=BuildConfig(num_shards=2),
    )
    texts = []
    for p in sorted(corpora.dolma.glob("*.jsonl.gz")):
        with gzip.open(p, "rt", encoding="utf-8") as f:
            texts += [json.loads(line)["text"] for line in f if line.strip()]
    assert result.manifest.num_examples == len(texts) == 20
    assert _decoded_multiset(result.cache_dir) == _expected(texts, vocab)


def test_lm_packing_keeps_every_token_and_records_provenance(tmp_path, corpora):
    pattern = str(corpora.dolma / "*.jsonl.gz")
    vocab = tasks.ByteVocabulary()
    length = 1024
    result = build_task(
        _task("dolma_packed", tasks.JsonLinesSource(pattern, field="text", on_error={"control_characters": "keep"}),
              vocab, sequence_length={"targets": length}, pack=True),
        cache_dir=str(tmp_path),
        config=BuildConfig(num_shards=2, sequence_length={"targets": length}),
    )
    texts = {}
    for fi, p in enumerate(sorted(corpora.dolma.glob("*.jsonl.gz"))):
        with gzip.open(p, "rb") as f:
            offset = 0  # a line's record number: the byte offset of its first byte, decompressed
            for line in f:
                texts[(fi, offset)] = json.loads(line)["text"]
                offset += len(line)
    with CacheReader(result.cache_dir) as r:
        examples = r.read_examples(range(len(r)))
        provenance = r.read_sources(range(len(r)))
    total = 0
    pieces = collections.defaultdict(dict)
    for ex, prov in zip(examples, provenance):
        tokens, seg = ex["targets"], ex["targets_segment_ids"]
        # Stored compactly: uint16 ids and segment ids; positions are derived by readers.
        assert tokens.dtype == np.uint16 and seg.dtype == np.uint16 and "targets_positions" not in ex
        assert tokens.size <= length and seg.size == tokens.size
        assert (np.diff(seg.astype(np.int64)) >= 0).all() and seg.min() == 1
        total += tokens.size
        assert len(prov) == int(seg.max())
        for k, p in enumerate(prov, start=1):
            piece = tokens[seg == k]
            pieces[(p["source_index"], p["record_number"])][p["token_offset"]] = piece
    expected_total = sum(len(t.encode()) + 1 for t in texts.values())
    assert total == expected_total
    # Reassemble every document from its pieces (provenance says where each goes).
    for key, text in texts.items():
        parts = pieces[key]
        doc = np.concatenate([parts[o] for o in sorted(parts)])
        assert doc.tolist() == vocab.encode(text) + [vocab.eos_id]
        assert doc.size > 0
    # All examples but the last of each shard are full.
    starts = result.manifest.shard_starts
    full = [i for i in range(len(examples)) if i + 1 not in set(starts.tolist())]
    assert all(examples[i]["targets"].size == length for i in full)


def test_sentencepiece_vocabulary_travels_with_the_cache(tmp_path, corpora):
    model = tmp_path / "spm.model"
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    vocab = tasks.train_sentencepiece(lines[:3000], output_path=str(model), vocab_size=600)
    result = build_task(
        _task("botchan", tasks.TextLineSource(str(corpora.botchan)), vocab),
        cache_dir=str(tmp_path / "cache"),
        config=BuildConfig(num_shards=2),
    )
    model.unlink()  # the cache must not depend on the model file outside it
    with CacheReader(result.cache_dir) as r:
        v = r.vocabulary("targets")
        ex = r.read_examples([0])[0]["targets"]
        prov = r.read_sources([0])[0][0]
    data = corpora.botchan.read_bytes()
    all_lines = data.decode("utf-8").split("\n")
    # The record number is the byte offset of the line's first byte.
    line = all_lines[_line_starts(data).index(prov["record_number"])]
    assert ex.tolist() == vocab.encode(line) + [vocab.eos_id]
    assert v.decode(ex.tolist()) == vocab.decode(vocab.encode(line))  # same model, rebuilt from the cache


def test_fresh_worker_processes_get_the_sentencepiece_model(tmp_path, corpora, monkeypatch):
    """multi_processing workers are fresh processes: the vocabulary travels with the
    task as a reference to the copy the cache stores (Beam compresses each
    pickle of a step with bz2: no pickle carries the model's bytes), not as the
    path it was loaded from, which they may not open."""
    import bz2

    pickled = []
    compress = bz2.compress
    monkeypatch.setattr(bz2, "compress", lambda data, *a, **k: (pickled.append(len(data)), compress(data, *a, **k))[1])
    model = tmp_path / "spm.model"
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    vocab = tasks.train_sentencepiece(lines[:3000], output_path=str(model), vocab_size=600)
    vocab = tasks.SentencePieceVocabulary(str(model))
    vocab.encode("load it")  # loaded from the file ...
    model.unlink()  # ... which is now gone
    task = _task("botchan", tasks.TextLineSource(str(corpora.botchan)), vocab)
    args = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    a = build_task(task, cache_dir=str(tmp_path / "a"), config=BuildConfig(num_shards=2), pipeline_args=args)
    b = build_task(task, cache_dir=str(tmp_path / "b"), config=BuildConfig(num_shards=2))
    assert (fmt.read_shard_checksums(a.cache_dir, a.manifest)
            == fmt.read_shard_checksums(b.cache_dir, b.manifest))
    assert pickled and max(pickled) < len(vocab.model_bytes()) // 4, (pickled, len(vocab.model_bytes()))
    data = corpora.botchan.read_bytes()
    assert a.manifest.num_examples == data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def test_an_unpacked_task_that_does_not_trim_to_its_sequence_length_is_refused(tmp_path):
    """A manifest's sequence length says the cache is trimmed (or packed) to it:
    a task that neither trims nor packs, built to a length its examples exceed,
    is refused naming the record and the way out, and nothing is published."""
    p = tmp_path / "lines.txt"
    p.write_text("short\n" + "a line much longer than eight bytes\n")
    untrimmed = _task("untrimmed", tasks.TextLineSource(str(p)), tasks.ByteVocabulary())
    with pytest.raises(Exception, match=r"task 'untrimmed': file 0 record 6: feature 'targets' has 36 tokens, more "
                                        r"than its sequence length 8; the task neither packs nor trims: add "
                                        r"seqcache.tasks.trim\(\)"):
        build_task(untrimmed, cache_dir=str(tmp_path / "c"),
                   config=BuildConfig(sequence_length={"targets": 8}, num_shards=1))
    assert not (tmp_path / "c" / "untrimmed" / "train" / fmt.MANIFEST_NAME).exists()
    trimmed = _task("trimmed", tasks.TextLineSource(str(p)), tasks.ByteVocabulary(), sequence_length=8)
    result = build_task(trimmed, cache_dir=str(tmp_path / "c"),
                        config=BuildConfig(sequence_length={"targets": 8}, num_shards=1))
    assert result.manifest.statistics.max_length == {"targets": 8}
