"""Exact deduplication as a bad-input policy: ``on_error={"duplicate": "skip"}``
keeps the first copy of each identical record (copy k = 0, ranked by file
index and record number as ``transforms.SpreadCopies`` ranks them) and
quarantines the others; ``"keep"`` (the default) keeps and spreads them.

Vocabulary: a *copy* is a record whose raw bytes equal another's; the *kept*
copy is the first of them in provenance order."""

from __future__ import annotations

import collections
import os

import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.cli.verify import verify_cache
from testsupport import MULTI_PROCESSING, lines_task, write_lines

# Two files, read as file 0 (a.txt) and file 1 (b.txt); 6 of the 12 lines are
# copies of an earlier line.
FILES = {
    "a.txt": ["alpha", "beta", "alpha", "gamma", "beta", "alpha", "delta"],
    "b.txt": ["beta", "epsilon", "alpha", "gamma", "zeta"],
}
VOCABULARY = tasks.ByteVocabulary()  # lines_task's: decodes a record, EOS and all, to its line


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("copies")
    for name, lines in FILES.items():
        write_lines(folder / name, lines)
    return folder


def _lines():
    """(file index, path name, record number: the line's byte offset, text) of every line, in provenance order."""
    out = []
    for fi, (name, lines) in enumerate(sorted(FILES.items())):
        offset = 0
        for line in lines:
            out.append((fi, name, offset, line))
            offset += len(line.encode()) + 1
    return out


def _task(folder, duplicate=None):
    on_error = {"empty": "skip"} | ({"duplicate": duplicate} if duplicate else {})
    return lines_task(str(folder / "*.txt"), "copies", on_error=on_error)


def _texts(cache_dir) -> collections.Counter:
    with CacheReader(cache_dir) as r:
        return collections.Counter(VOCABULARY.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))


def _build(folder, where, duplicate=None, **kw):
    return build_task(_task(folder, duplicate), cache_dir=str(where),
                      config=BuildConfig(num_shards=kw.pop("num_shards", 3)), **kw)


def _fingerprint(result) -> tuple:
    """Everything a build wrote that must not depend on the runner or the split:
    data and provenance shard sha256s, the quarantine file's bytes, the statistics."""
    with open(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME), "rb") as f:
        quarantine = f.read()
    return fmt.read_shard_checksums(result.cache_dir, result.manifest), quarantine, result.manifest.statistics.to_json()


def test_skip_keeps_one_of_each_record_and_quarantines_the_other_copies(tmp_path, corpus):
    result = _build(corpus, tmp_path / "c", "skip")
    lines = _lines()
    assert _texts(result.cache_dir) == collections.Counter({t: 1 for *_, t in lines})

    first = {}
    expected = []
    for fi, name, rn, text in lines:
        if text in first:
            expected.append((fi, name, rn, first[text]))
        else:
            first[text] = (fi, name, rn)
    assert len(expected) == 6
    entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
    assert [(e["source_index"], os.path.basename(e["path"]), e["record_number"],
             (e["kept"]["source_index"], os.path.basename(e["kept"]["path"]), e["kept"]["record_number"]))
            for e in entries] == expected
    assert {(e["action"], e["kind"]) for e in entries} == {("skipped", "duplicate")}
    kept = entries[0]["kept"]
    assert entries[0]["error"] == (f"line at byte {entries[0]['record_number']} is identical to {kept['path']}: "
                                   f"line at byte {kept['record_number']}, which is kept (on_error duplicate=skip)")

    stats = result.manifest.statistics.to_json()
    assert stats["source_records"] == 12 and stats["examples"] == 6
    assert stats["skipped_records"] == 6
    assert stats["bad_input_records"]["skipped"] == {"duplicate": 6}
    assert stats["bad_input_records"]["records"]["skipped"] == 6
    # Per source file: the kept copies' examples and tokens (bytes and EOS) only.
    kept_lines = [(fi, t) for fi, _, rn, t in lines if first[t][2] == rn and first[t][0] == fi]
    per_file = result.manifest.read_source_table().statistics
    assert per_file["examples"] == [sum(1 for fi, _ in kept_lines if fi == k) for k in (0, 1)]
    assert per_file["tokens"]["targets"] == [
        sum(len(t) + 1 for fi, t in kept_lines if fi == k) for k in (0, 1)]
    assert stats["tokens"]["targets"] == sum(len(t) + 1 for t in first)
    assert verify_cache(result.cache_dir).problems == []


def test_keep_is_the_default_and_holds_every_copy(tmp_path, corpus):
    default = _build(corpus, tmp_path / "default")
    keep = _build(corpus, tmp_path / "keep", "keep")
    assert _texts(default.cache_dir) == collections.Counter(t for *_, t in _lines())
    assert default.manifest.statistics.skipped_records == 0
    assert default.manifest.quarantine is None
    assert fmt.read_shard_checksums(default.cache_dir, default.manifest) == \
        fmt.read_shard_checksums(keep.cache_dir, keep.manifest)


def test_the_policy_is_in_the_fingerprint(tmp_path, corpus):
    _build(corpus, tmp_path / "c")
    with pytest.raises(BuildError, match=r"task\.source\.on_error\.duplicate: \"keep\" -> \"skip\""):
        _build(corpus, tmp_path / "c", "skip")


def test_skip_gives_the_same_bytes_on_every_run_runner_and_split(tmp_path, corpus):
    runs = {
        "in memory": dict(),
        "in memory again": dict(),
        "runner shuffle, tiny splits": dict(split_size=16, exchange="runner"),
        "multi_processing x2": dict(pipeline_args=MULTI_PROCESSING, split_size=24),
    }
    results = {name: _fingerprint(_build(corpus, tmp_path / str(k), "skip", **kw))
               for k, (name, kw) in enumerate(runs.items())}
    first = results["in memory"]
    assert first[2]["skipped_records"] == 6
    for name, got in results.items():
        assert got == first, name


def test_skip_with_one_shard_and_packing_keeps_one_of_each(tmp_path, corpus):
    task = lines_task(str(corpus / "*.txt"), "copies_lm", on_error={"empty": "skip", "duplicate": "skip"},
                      packing="lm")
    result = build_task(task, cache_dir=str(tmp_path / "c"),
                        config=BuildConfig(num_shards=1, sequence_length={"targets": 16}))
    stats = result.manifest.statistics.to_json()
    assert stats["skipped_records"] == 6 and stats["source_examples"] == 6
    assert stats["tokens"]["targets"] == sum(len(t) + 1 for t in {t for *_, t in _lines()})


# What the task reads: the same texts as JSON lines (under other urls, with
# other spacing and key order) and as a Parquet column.
TEXTS = ["alpha", "beta", "alpha", "gamma", "beta", "alpha"]


def _jsonl_lines():
    """Each of ``TEXTS`` as a JSON line that differs from every other line as a line."""
    import json

    out = []
    for i, text in enumerate(TEXTS):
        obj = {"url": f"https://example.com/{i}", "text": text}
        out.append(json.dumps(obj) if i % 2 else json.dumps(dict(reversed(obj.items())), indent=None,
                                                             separators=(" , ", " :  ")))
    return out


def test_json_lines_compare_the_field_the_task_reads(tmp_path):
    """``jsonl:FILE#text`` under ``duplicate=skip`` keeps one record per distinct
    text, whatever the other fields and the spacing; a Parquet file of the same
    texts gives the same kept set, in the same cache order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from testsupport import byte_task

    lines = _jsonl_lines()
    assert len(set(lines)) == len(TEXTS)
    write_lines(tmp_path / "in" / "a.jsonl", lines)
    pq.write_table(pa.table({"text": TEXTS, "url": [f"u{i}" for i in range(len(TEXTS))]}), tmp_path / "in" / "a.parquet")
    on_error = {"duplicate": "skip"}
    built = {}
    for kind, source in (("jsonl", tasks.JsonLinesSource(str(tmp_path / "in" / "a.jsonl"), on_error=on_error)),
                         ("parquet", tasks.ParquetSource(str(tmp_path / "in" / "a.parquet"), on_error=on_error))):
        result = build_task(byte_task(f"copies_{kind}", source), cache_dir=str(tmp_path / kind),
                            config=BuildConfig(num_shards=2))
        with CacheReader(result.cache_dir) as r:
            built[kind] = [VOCABULARY.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r)))]
        stats = result.manifest.statistics.to_json()
        assert stats["bad_input_records"]["skipped"] == {"duplicate": 3}, kind
        entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
        # The skipped copies are records 2, 4 and 5 (Parquet rows; JSON lines by their byte offsets).
        numbers = [e["record_number"] for e in entries]
        kept = [e["kept"]["record_number"] for e in entries]
        if kind == "parquet":
            assert numbers == [2, 4, 5] and kept == [0, 1, 0]
        else:
            starts = [sum(len(x) + 1 for x in lines[:i]) for i in range(len(lines))]
            assert numbers == [starts[2], starts[4], starts[5]] and kept == [starts[0], starts[1], starts[0]]
    assert sorted(built["jsonl"]) == ["alpha", "beta", "gamma"]
    assert built["jsonl"] == built["parquet"]  # the same keys: the same order


def test_a_skipped_copy_is_counted_once_as_skipped(tmp_path):
    """A copy that holds a control character (kept by default) and is skipped
    as a duplicate counts as skipped only: ``kept`` counts the record the
    cache holds; a repaired copy skipped as a duplicate is not also listed
    and counted as replaced."""
    write_lines(tmp_path / "in" / "a.txt", ["one\x01", "two", "one\x01", "one\x01", "three\x02", "three\x02"])
    task = lines_task(str(tmp_path / "in" / "*.txt"), "cc", on_error={"empty": "skip", "duplicate": "skip"})
    result = build_task(task, cache_dir=str(tmp_path / "keep"), config=BuildConfig(num_shards=2))
    bad = result.manifest.statistics.to_json()["bad_input_records"]
    assert bad["skipped"] == {"duplicate": 3}
    assert bad["kept"] == {"control_characters": 2}  # "one\x01" and "three\x02", once each
    assert bad["records"] == {"skipped": 3, "replaced": 0, "kept": 2}
    assert verify_cache(result.cache_dir).problems == []

    task = lines_task(str(tmp_path / "in" / "*.txt"), "cc_replace",
                      on_error={"empty": "skip", "duplicate": "skip", "control_characters": "replace"})
    result = build_task(task, cache_dir=str(tmp_path / "replace"), config=BuildConfig(num_shards=2))
    stats = result.manifest.statistics.to_json()
    assert stats["bad_input_records"]["replaced"] == {"control_characters": 2}
    assert stats["bad_input_records"]["records"] == {"skipped": 3, "replaced": 2, "kept": 0}
    assert stats["replaced_records"] == 2 and stats["skipped_records"] == 3
    entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
    assert [(e["record_number"], e["action"]) for e in entries] == [
        (0, "replaced"), (9, "skipped"), (14, "skipped"), (19, "replaced"), (26, "skipped")]
    assert verify_cache(result.cache_dir).problems == []
