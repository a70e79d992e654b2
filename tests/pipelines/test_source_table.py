"""The per-file source table in its own file (cache format 3): a build of
many small files keeps manifest.json small, writes source-table.json
checksummed before the manifest, and lists the files once; opening a cache
(info, the feeder, the grain and levanter sources) never reads the file,
provenance look-ups and verify do and refuse a missing or other one with one
line; a format-2 cache (the table inline) still reads."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import codec, fs
from seqcache import format as fmt
from seqcache.cli.main import main
from seqcache.feeders import CacheDataSource, Feeder
from seqcache.feeders.trainers.levanter import FeederRows
from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import build as build_mod
from seqcache.cli.verify import verify_cache
from testsupport import lines_task, rewrite_as_format_2

NUM_FILES = 2000
B, L = 4, 16


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A build of NUM_FILES one-line files (two shards): (cache folder, the
    files' paths in order, the pattern, the fs.match calls of the build)."""
    root = tmp_path_factory.mktemp("many")
    folder = root / "in"
    folder.mkdir()
    paths = []
    for i in range(NUM_FILES):
        p = folder / f"part-{i:05d}.txt"
        p.write_bytes(f"line {i} of many small files\n".encode())
        paths.append(str(p))
    pattern = str(folder / "*.txt")
    calls, hashed = [], []
    real_match, real_fingerprint = fs.match, fmt.fingerprint_of
    mp = pytest.MonkeyPatch()
    mp.setattr(fs, "match", lambda p: calls.append(p) or real_match(p))
    for module in (codec, fmt):  # the build calls fmt's, the manifest codec's
        mp.setattr(module, "fingerprint_of", lambda obj: hashed.append(obj) or real_fingerprint(obj))
    try:
        result = build_task(lines_task(pattern), cache_dir=str(root / "c"), config=BuildConfig(num_shards=2))
    finally:
        mp.undo()
    # The fingerprint inputs (with the file list) are hashed once: when planned, not again for the manifest.
    assert sum(1 for obj in hashed if "task" in obj) == 1, [sorted(obj) for obj in hashed]
    return result.cache_dir, paths, pattern, calls


@pytest.fixture
def copy(many, tmp_path):
    """A copy of the built cache, to damage."""
    return str(shutil.copytree(many[0], tmp_path / "c"))


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_the_manifest_stays_small_and_the_table_is_in_its_checksummed_file(many):
    cache, paths, _, _ = many
    text = pathlib.Path(cache, fmt.MANIFEST_NAME).read_text(encoding="utf-8")
    raw = json.loads(text)
    assert raw["format_version"] == fmt.FORMAT_VERSION == 3
    # A few KB whatever the file count: no per-file entry is left in it.
    assert len(text.encode()) < 8 * 1024, len(text.encode())
    assert "part-00001.txt" not in text and "sources" not in raw and "source_files" not in raw["statistics"]
    assert "files" not in raw["fingerprint_inputs"]["task"]["source"]
    data = pathlib.Path(cache, fmt.SOURCE_TABLE_NAME).read_bytes()
    record = raw["source_table"]
    assert record == {"file": fmt.SOURCE_TABLE_NAME, "num_bytes": len(data),
                      "sha256": hashlib.sha256(data).hexdigest(), "num_files": NUM_FILES,
                      "fingerprint_files": ["task", "source", "files"], "inputs_sha256": record["inputs_sha256"]}
    assert data.endswith(b"\n") and data.count(b"\n") == 1  # one line of compact JSON
    table = fmt.read_source_table(cache, fmt.read_manifest(cache))
    assert [e["path"] for e in table] == paths
    assert [e["num_bytes"] for e in table] == [os.path.getsize(p) for p in paths]
    assert {e["locator"] for e in table} == {"byte_offset"}
    stats = table.statistics
    assert stats["examples"] == [1] * NUM_FILES
    assert stats["tokens"]["targets"] == [os.path.getsize(p) for p in paths]  # the bytes, less "\n", plus EOS
    assert sum(stats["examples"]) == fmt.read_manifest(cache).statistics.source_examples


def test_the_fingerprint_keeps_its_definition_and_verify_recomputes_it(many):
    cache, _, pattern, _ = many
    m = fmt.read_manifest(cache)
    # The inputs as hashed, listed afresh, and the file's part put back: the same sha256.
    inputs = build_mod.task_fingerprint_inputs(lines_task(pattern), BuildConfig(num_shards=2), 2)
    assert m.full_fingerprint_inputs() == inputs
    assert fmt.fingerprint_of(inputs) == m.fingerprint != fmt.fingerprint_of(m.fingerprint_inputs)
    assert verify_cache(cache).problems == []


def test_a_build_lists_its_files_once(many):
    _, _, pattern, calls = many
    assert calls == [pattern]


def test_the_source_table_is_written_before_the_manifest(many, tmp_path, monkeypatch):
    written = []
    real = fs.write_bytes_atomic
    monkeypatch.setattr(fs, "write_bytes_atomic", lambda path, data, **kw: (written.append(os.path.basename(path)),
                                                                           real(path, data, **kw)))
    m = fmt.read_manifest(many[0])
    made = fmt.Manifest.create(task="t", split="train", fingerprint=fmt.fingerprint_of({}), fingerprint_inputs={},
                               features=[f.to_json() for f in m.features], shards=[], sources=[{"path": "a.txt", "num_bytes": 3}],
                               statistics={})
    made.write(str(tmp_path))
    assert written == [fmt.SHARD_CHECKSUMS_NAME, fmt.SOURCE_TABLE_NAME, fmt.MANIFEST_NAME]
    assert [dict(e) for e in fmt.read_manifest(str(tmp_path)).read_source_table()] == [{"path": "a.txt",
                                                                                       "num_bytes": 3}]


def _opens_and_reads(cache) -> None:
    """info, Feeder, CacheDataSource and FeederRows open the cache and read from it."""
    out = _cli("info", cache)
    assert out.exit_code == 0 and f"{NUM_FILES:,} files" in out.output, out.output
    info = json.loads(_cli("info", cache, "--json").output)
    assert info["num_sources"] == NUM_FILES
    with Feeder(cache=cache, global_batch_size=B, sequence_length=L, host_index=0, host_count=1, prefetch=0) as f:
        assert f.get_batch(0)["targets"].shape == (B, L)
    src = CacheDataSource(cache)
    assert len(src) == NUM_FILES and src[3]["targets"].size > 0
    rows = FeederRows(cache=cache, global_batch_size=B, sequence_length=L)
    assert np.asarray(rows.rows([0, 1])["targets"]).shape == (2, L)


def test_opening_never_reads_the_source_table(copy):
    os.unlink(os.path.join(copy, fmt.SOURCE_TABLE_NAME))
    _opens_and_reads(copy)


def test_which_source_and_verify_refuse_a_missing_table_with_one_line(copy):
    table = os.path.join(copy, fmt.SOURCE_TABLE_NAME)
    os.unlink(table)
    out = _cli("which", copy, "--batch-size", B, "--num-epochs", 1, "--source", "part-00007.txt:1")
    assert out.exit_code == 1 and out.output.strip().splitlines() == [
        f"error: {table}: source table file is missing (the manifest lists it with "
        f"{fmt.read_manifest(copy).source_table.num_bytes} bytes for {NUM_FILES:,} source files); rebuild the "
        "cache"], out.output
    report = verify_cache(copy)
    assert not report.ok and [p for p in report.problems if fmt.SOURCE_TABLE_NAME in p] == report.problems
    assert report.problems[0].startswith(f"{table}: source table file is missing")
    assert all(s.ok for s in report.shards)  # the shards are still checked


def test_a_folder_in_the_tables_place_is_one_line_for_which_report_and_verify(copy):
    table = os.path.join(copy, fmt.SOURCE_TABLE_NAME)
    os.unlink(table)
    os.mkdir(table)
    for args in (("which", copy, "--batch-size", B, "--num-epochs", 1, "--source", "part-00007.txt:1"),
                 ("report", copy)):
        out = _cli(*args)
        assert out.exit_code == 1 and out.output.strip().splitlines() == [
            f"error: {table}: source table file cannot be read (Is a directory); rebuild the cache"], out.output
    report = verify_cache(copy)
    assert report.problems and report.problems[0].startswith(f"{table}: source table file cannot be read")
    assert all(s.ok for s in report.shards)  # the shards are still checked


def test_which_source_and_verify_refuse_an_edited_table(copy):
    table = os.path.join(copy, fmt.SOURCE_TABLE_NAME)
    data = pathlib.Path(table).read_bytes()
    pathlib.Path(table).write_bytes(data.replace(b"part-00007", b"part-00008", 1))  # same size, other bytes
    out = _cli("which", copy, "--batch-size", B, "--num-epochs", 1, "--source", "part-00007.txt:1")
    assert out.exit_code == 1 and len(out.output.strip().splitlines()) == 1, out.output
    assert out.output.startswith(f"error: {table}: source table file has sha256 "), out.output
    assert "the manifest expects" in out.output
    problems = verify_cache(copy).problems
    assert len(problems) == 1 and problems[0].startswith(f"{table}: source table file has sha256 ")


def test_verify_finds_a_table_that_does_not_give_the_fingerprint(copy):
    # A consistent file and manifest record whose file list is not the one hashed.
    m = fmt.read_manifest(copy)
    obj = json.loads(pathlib.Path(copy, fmt.SOURCE_TABLE_NAME).read_bytes())
    obj["mtime_ns"][5] += 1
    data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
    pathlib.Path(copy, fmt.SOURCE_TABLE_NAME).write_bytes(data)
    raw = json.loads(pathlib.Path(copy, fmt.MANIFEST_NAME).read_text(encoding="utf-8"))
    raw["source_table"].update(num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    pathlib.Path(copy, fmt.MANIFEST_NAME).write_text(json.dumps(raw), encoding="utf-8")
    _opens_and_reads(copy)  # the manifest agrees with itself
    problems = verify_cache(copy).problems
    assert len(problems) == 1 and "the sha256 of fingerprint_inputs with this file's fingerprint_files is" in \
        problems[0] and problems[0].endswith(f"the manifest's fingerprint is {m.fingerprint}: the file or the "
                                             "manifest was edited or damaged; rebuild the cache")


def test_which_source_reads_the_table(many):
    cache, paths, _, _ = many
    out = _cli("which", cache, "--batch-size", B, "--num-epochs", 1, "--source", "part-00007.txt:1", "--json")
    assert out.exit_code == 0, out.output
    assert paths[7] in out.output


def test_a_format_2_cache_with_the_table_inline_still_reads(copy, many):
    raw = rewrite_as_format_2(copy)
    assert raw["format_version"] == 2 and len(raw["sources"]) == NUM_FILES
    assert not os.path.exists(os.path.join(copy, fmt.SOURCE_TABLE_NAME))
    m = fmt.read_manifest(copy)
    assert m.fingerprint == fmt.read_manifest(many[0]).fingerprint and m.num_sources == NUM_FILES
    table = m.read_source_table()
    assert [e["path"] for e in table] == many[1] and table.statistics["examples"] == [1] * NUM_FILES
    assert table == fmt.read_manifest(many[0]).read_source_table()
    _opens_and_reads(copy)
    with Feeder(cache=copy, global_batch_size=B, sequence_length=L, host_index=0, host_count=1, prefetch=0) as f:
        assert f.readers[0].sources[7]["path"] == many[1][7]
        assert {s["path"] for ex in f.readers[0].read_sources([0, 1]) for s in ex} <= set(many[1])
    out = _cli("which", copy, "--batch-size", B, "--num-epochs", 1, "--source", "part-00007.txt:1", "--json")
    assert out.exit_code == 0 and many[1][7] in out.output, out.output
    assert verify_cache(copy).problems == []
    report = json.loads(_cli("report", copy, "--json").output)["caches"][0]
    assert report["sources"]["num_files"] == NUM_FILES and report["sources"]["recorded"] is True


@pytest.mark.parametrize("odd", [None, 1.5e-7, True, 2**70, "a\x00\x1f\"\\\u2028é😀", {"nested": [1.0]}])
def test_canonical_json_of_a_long_file_list_is_json_dumps_bytes(odd):
    # Long lists of objects are encoded by msgspec; the bytes must be json.dumps's, whatever a row holds.
    rows = [{"path": f"/d/p\u00e9rt-{k:05d}\t.txt", "num_bytes": k * 7, "mtime_ns": None if k % 5 else 10**18 + k}
            for k in range(3000)]
    rows[1234]["odd"] = odd
    obj = {"task": {"source": {"files": rows, "kind": "text"}, "rate": 0.1}, "b": [rows[:2], 1e16]}
    expected = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    assert codec.canonical_json(obj) == expected
