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
