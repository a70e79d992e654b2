"""G7 integrity: verify names bad shards; unfinished builds never look complete;
fingerprints decide reuse; zero examples is an error (G8)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache import tasks
from seqcache.cli.main import main as cli
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.pipelines import build as build_mod
from seqcache.feeders.reader import CacheReader
from seqcache.cli.verify import verify_cache
from testsupport import byte_task, write_files
from testsupport import lines_task as _task


@pytest.fixture
def corpus(shakespeare_halves):
    return str(shakespeare_halves(4000) / "*.txt")


@pytest.fixture
def cache(tmp_path, corpus):
    return build_task(_task(corpus), cache_dir=str(tmp_path / "cache"), config=BuildConfig(num_shards=3)).cache_dir


def _verify_cli(cache_dir):
    result = CliRunner().invoke(cli, ["verify", cache_dir, "--json"])
    return result.exit_code, json.loads(result.output)


def test_verify_passes_on_a_good_cache(cache):
    code, report = _verify_cli(cache)
    assert code == 0 and report["ok"] and report["problems"] == []
    assert len(report["shards"]) == 6  # 3 data shards + 3 provenance sidecars


def test_verify_catches_truncated_shard(cache):
    m = fmt.read_manifest(cache)
    path = os.path.join(cache, m.shards[1].file)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    code, report = _verify_cli(cache)
    assert code == 1
    assert any(m.shards[1].file in p and f"size {size - 100} bytes, expected {size}" in p for p in report["problems"])
    # Opening the cache for reading refuses it too (cheap size check).
    with pytest.raises(fmt.CacheError, match=m.shards[1].file):
        CacheReader(cache)


def test_verify_catches_flipped_byte(cache):
    m = fmt.read_manifest(cache)
    path = os.path.join(cache, m.shards[0].file)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x40
    open(path, "wb").write(bytes(data))
    code, report = _verify_cli(cache)
    assert code == 1
    actual = hashlib.sha256(bytes(data)).hexdigest()
    recorded = fmt.read_shard_checksums(cache, m)[0][0]  # from the shard checksum file
    assert any(m.shards[0].file in p and actual in p and recorded in p for p in report["problems"])


def _edit_column(raw, key, shard, delta):
    """Adds ``delta`` to shard ``shard``'s value in the manifest's integer column
    ``key``; returns the old value."""
    column = fmt.decode_int_column(raw["shards"][key]).copy()
    old = int(column[shard])
    column[shard] += delta
    raw["shards"][key] = fmt.encode_int_column(column)
    return old


def test_verify_catches_a_tampered_shard_checksum_file(cache):
    m = fmt.read_manifest(cache)
    sums_path = os.path.join(cache, fmt.SHARD_CHECKSUMS_NAME)
    original = open(sums_path, "rb").read()
    sums = json.loads(original)
    sums["sha256"][1] = "0" * 64
    tampered = (json.dumps(sums, separators=(",", ":")) + "\n").encode()
    assert len(tampered) == len(original)  # the same size: only the sha256 gives it away
    open(sums_path, "wb").write(tampered)
    code, report = _verify_cli(cache)
    recorded = m.shards.checksums["sha256"]
    assert code == 1 and report["problems"][0] == (
        f"{sums_path}: shard checksum file has sha256 {hashlib.sha256(tampered).hexdigest()}, the manifest expects "
        f"{recorded}; the shards' checksums were not compared")
    # Sizes, counts and records are still checked.
    assert len(report["shards"]) == 6 and all(s["ok"] for s in report["shards"])
    # Reading is unaffected: opening a cache never reads the checksum file.
    with CacheReader(cache) as r:
        assert len(r) == m.num_examples
    os.unlink(sums_path)
    code, report = _verify_cli(cache)
    assert code == 1 and report["problems"][0].startswith(
        f"{sums_path}: shard checksum file is missing (the manifest lists it with {len(original)} bytes)")


def test_verify_catches_a_shard_checksum_edited_in_the_file_and_the_manifest(cache):
    """A checksum file rewritten with its size and sha256 updated in the manifest
    passes its own check; the edited shard checksum is then caught."""
    sums_path = os.path.join(cache, fmt.SHARD_CHECKSUMS_NAME)
    sums = json.load(open(sums_path))
    real = sums["provenance_sha256"][2]
    sums["provenance_sha256"][2] = "f" * 64
    data = fmt.shard_checksums_json(sums["sha256"], sums["provenance_sha256"])
    open(sums_path, "wb").write(data)
    mpath = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    raw["shards"]["checksums"].update(num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    json.dump(raw, open(mpath, "w"))
    code, report = _verify_cli(cache)
    prov = fmt.shard_name(fmt.PROVENANCE_PREFIX, 2, 3)
    assert code == 1 and report["problems"] == [f"{os.path.join(cache, prov)}: sha256 {real}, expected {'f' * 64}"]


def test_verify_catches_missing_shard(cache):
    m = fmt.read_manifest(cache)
    os.unlink(os.path.join(cache, m.shards[2].file))
    code, report = _verify_cli(cache)
    assert code == 1
    assert any(m.shards[2].file in p and "missing" in p and str(m.shards[2].num_records) in p for p in report["problems"])


def test_verify_catches_manifest_claiming_one_more_record(cache):
    path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    n = _edit_column(raw, "num_records", 0, +1)
    raw["num_examples"] += 1  # the totals agree with the edited count: only the shard file tells
    raw["statistics"]["examples"] += 1
    json.dump(raw, open(path, "w"))
    code, report = _verify_cli(cache)
    assert code == 1
    name = fmt.shard_name(fmt.DATA_PREFIX, 0, 3)
    assert any(name in p and f"{n} records, expected {n + 1}" in p for p in report["problems"])


def test_verify_catches_manifest_with_a_wrong_shard_size(cache):
    path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    size = _edit_column(raw, "provenance_num_bytes", 1, -7)
    json.dump(raw, open(path, "w"))
    code, report = _verify_cli(cache)
    name = os.path.join(cache, fmt.shard_name(fmt.PROVENANCE_PREFIX, 1, 3))
    assert code == 1 and f"{name}: size {size} bytes, expected {size - 7}" in report["problems"]
    with pytest.raises(fmt.CacheError, match=rf"^{name}: shard file has {size} bytes, the manifest expects {size - 7}"):
        CacheReader(cache)


def test_manifest_with_path_outside_the_cache_is_refused(cache):
    path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    raw["shards"]["checksums"]["file"] = "../../etc/passwd"
    json.dump(raw, open(path, "w"))
    with pytest.raises(fmt.CacheError, match="shards.checksums: file name '../../etc/passwd' is not a plain file name"):
        fmt.read_manifest(cache)


def test_same_fingerprint_is_reused_and_different_is_refused(tmp_path, corpus, cache):
    root = os.path.dirname(os.path.dirname(cache))
    before = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in os.listdir(cache)}
    again = build_task(_task(corpus), cache_dir=root, config=BuildConfig(num_shards=3))
    assert again.reused
    assert {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in os.listdir(cache)} == before
    with pytest.raises(BuildError, match="--overwrite"):
        build_task(_task(corpus), cache_dir=root, config=BuildConfig(num_shards=3, seed=7))
    replaced = build_task(_task(corpus), cache_dir=root, config=BuildConfig(num_shards=3, seed=7), overwrite=True)
    assert not replaced.reused and replaced.manifest.seed == 7


def test_zero_examples_is_an_error_naming_task_and_split(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(BuildError, match=r"task 'nothing' split 'validation': zero examples"):
        build_task(_task(str(empty), name="nothing"), cache_dir=str(tmp_path / "c"),
                   config=BuildConfig(split="validation", num_shards=2))
    assert not os.path.exists(tmp_path / "c" / "nothing" / "validation" / fmt.MANIFEST_NAME)


def test_killed_build_leaves_no_manifest_and_rerun_gives_same_bytes(tmp_path, corpus, cache, kill_a_build_at_shard_2):
    root = str(tmp_path / "killed")
    kill_a_build_at_shard_2(corpus, root)
    out_dir = os.path.join(root, "lines", "train")
    names = os.listdir(out_dir)
    assert fmt.MANIFEST_NAME not in names
    assert "data.array_record-00000-of-00003" in names  # it did get that far
    with pytest.raises(fmt.IncompleteCacheError, match="incomplete"):
        CacheReader(out_dir)
    code, report = _verify_cli(out_dir)
    assert code == 1 and "incomplete" in report["problems"][0]
    # Re-running the same build finishes and gives the uninterrupted build's bytes.
    result = build_task(_task(corpus), cache_dir=root, config=BuildConfig(num_shards=3))
    assert not result.reused
    for s in result.manifest.shards:
        assert open(os.path.join(out_dir, s.file), "rb").read() == open(os.path.join(cache, s.file), "rb").read()
    assert sorted(os.listdir(out_dir)) == sorted(os.listdir(cache))  # no leftovers


BAD_UTF8_A = b"first line\nsecond \xff\xfe line\nthird line\n"
# A line's record number is the byte offset of its first byte: the bad line is line 2.
BAD_UTF8_RECORD = BAD_UTF8_A.index(b"second")


def _bad_utf8_corpus(tmp_path):
    return str(write_files(tmp_path / "bad", {"a.txt": BAD_UTF8_A, "b.txt": b"fourth line\n"}) / "*.txt")


def test_bad_record_raises_naming_file_and_line_by_default(tmp_path):
    pattern = _bad_utf8_corpus(tmp_path)
    with pytest.raises(Exception, match=rf"a\.txt: line 2 \(byte {BAD_UTF8_RECORD}\) "):
        build_task(_task(pattern), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    assert not os.path.exists(tmp_path / "c" / "lines" / "train" / fmt.MANIFEST_NAME)


def test_skipped_records_are_counted_and_quarantined(tmp_path):
    pattern = _bad_utf8_corpus(tmp_path)
    task = _task(pattern, on_error="skip", eos=False)
    result = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    m = result.manifest
    assert m.num_examples == 3
    assert m.statistics.skipped_records == 1
    assert m.statistics.source_records == 4  # every record read, the skipped one included
    assert m.quarantine == fmt.QUARANTINE_NAME
    entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
    assert [(os.path.basename(e["path"]), e["record_number"]) for e in entries] == [("a.txt", BAD_UTF8_RECORD)]
    assert "UTF-8" in entries[0]["error"] and f"line at byte {BAD_UTF8_RECORD} " in entries[0]["error"]


def test_opening_refuses_a_manifest_with_edited_counts(cache):
    """Refused when the cache is opened (not at the first read of that shard)."""
    path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    n = _edit_column(raw, "num_records", 2, -1)
    raw["num_examples"] -= 1
    raw["statistics"]["examples"] -= 1
    json.dump(raw, open(path, "w"))
    name = fmt.shard_name(fmt.DATA_PREFIX, 2, 3)
    with pytest.raises(fmt.CacheError, match=rf"{name}: shard has {n} records, the manifest expects {n - 1}"):
        CacheReader(cache)


def test_opening_refuses_a_shard_swapped_in_from_another_cache(tmp_path, corpus, cache):
    other = build_task(_task(corpus), cache_dir=str(tmp_path / "other"), config=BuildConfig(num_shards=3, seed=5))
    m = fmt.read_manifest(cache)
    shutil.copy(os.path.join(other.cache_dir, m.shards[0].file), os.path.join(cache, m.shards[0].file))
    with pytest.raises(fmt.CacheError, match=m.shards[0].file):
        CacheReader(cache)
    code, report = _verify_cli(cache)
    assert code == 1 and any(m.shards[0].file in p and "sha256" in p for p in report["problems"])


def test_a_second_concurrent_build_of_the_same_cache_is_refused(tmp_path, corpus):
    import fcntl

    root = tmp_path / "c"
    (root / "lines").mkdir(parents=True)
    with open(root / "lines" / ".train.lock", "a+") as held:  # as a running build holds it
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(BuildError, match="another build of this cache is running"):
            build_task(_task(corpus), cache_dir=str(root), config=BuildConfig(num_shards=2))
    assert build_task(_task(corpus), cache_dir=str(root), config=BuildConfig(num_shards=2)).manifest.num_examples == 4000


def test_refusal_names_what_changed(tmp_path, corpus, cache):
    root = os.path.dirname(os.path.dirname(cache))
    with pytest.raises(BuildError, match=r"what changed: task\.seed: 0 -> 7"):
        build_task(_task(corpus), cache_dir=root, config=BuildConfig(num_shards=3, seed=7))


def test_refusal_names_a_changed_file_by_its_path(tmp_path, shakespeare_halves):
    folder = shakespeare_halves(4000)
    corpus = str(folder / "*.txt")
    build_task(_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    changed = sorted(folder.glob("*.txt"))[1]
    os.utime(changed, ns=(10**18, 10**18))
    with pytest.raises(BuildError, match=r"task\.source\.files\[1\] \(" + re.escape(str(changed)) + r"\)\.mtime_ns: "):
        build_task(_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))


def test_a_working_folder_removed_during_the_build_is_one_line_and_nothing_is_published(tmp_path, corpus,
                                                                                          monkeypatch):
    real = build_mod._run_pipeline

    def removing(plan, **kw):  # the scratch folder goes away while the pipeline runs
        shutil.rmtree(kw["scratch"])
        return real(plan, **kw)

    monkeypatch.setattr(build_mod, "_run_pipeline", removing)
    with pytest.raises(BuildError, match=r"working folder .*_tmp was removed while it ran; nothing was published"):
        build_task(_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    assert not os.path.exists(tmp_path / "c" / "lines" / "train" / "manifest.json")


def test_pattern_spelling_does_not_change_the_fingerprint(tmp_path, corpus, cache, monkeypatch):
    root = os.path.dirname(os.path.dirname(cache))
    folder = os.path.dirname(corpus)
    monkeypatch.chdir(folder)
    # The same two files, matched by other patterns: the cache is reused.
    again = build_task(_task(["./a.txt", os.path.join(folder, "b.txt")]), cache_dir=root, config=BuildConfig(num_shards=3))
    assert again.reused


def test_absurd_shard_counts_and_unknown_sequence_length_features_are_refused(tmp_path, corpus):
    with pytest.raises(BuildError, match="too many"):
        build_task(_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=100_000))
    with pytest.raises(BuildError, match=r"sequence length given for \['inputs'\]"):
        build_task(_task(corpus), cache_dir=str(tmp_path / "c"),
                   config=BuildConfig(num_shards=2, sequence_length={"inputs": 8}))


@pytest.mark.parametrize(
    "value, message",
    [("[\"a\", \"b\"]", "is a list"), ("5", "is an int"), ("null", "is null"), ("[1.5, 2]", "is a list"),
     ("[true, false]", "is a list"), ("[[1, 2]]", "is a list"), ("[300, 5]", "token id 300, outside its vocabulary"),
     ("[-1]", "token id -1, outside")],
)
def test_wrong_json_types_name_the_file_and_record(tmp_path, value, message):
    src = tmp_path / "d.jsonl"
    first = '{"text": "fine"}\n'
    src.write_text(first + '{"text": ' + value + '}\n', encoding="utf-8")
    task = byte_task("j", tasks.JsonLinesSource(str(src)), eos=False)
    # The second line's record number is the byte offset of its first byte.
    with pytest.raises(ValueError, match=rf"d\.jsonl: task 'j', line at byte {len(first.encode())} of file 0: "
                                         rf"feature 'targets' .*{re.escape(message)}"):
        build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))


def test_records_failing_the_task_checks_are_skipped_when_asked(tmp_path):
    src = tmp_path / "d.jsonl"
    data = b'{"text": "fine"}\n{"text": [300, 5]}\n{"text": "also fine"}\n'
    src.write_bytes(data)
    task = byte_task("j", tasks.JsonLinesSource(str(src), on_error="skip"))
    result = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))
    assert result.manifest.num_examples == 2 and result.manifest.statistics.skipped_records == 1
    (entry,) = fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME))
    offset = data.index(b'{"text": [300')  # the record number: the byte offset of the line's first byte
    assert entry["record_number"] == offset and "outside its vocabulary" in entry["error"]
    assert f"task 'j', line at byte {offset} of file 0: " in entry["error"]


def test_parquet_schema_that_differs_between_files_names_the_file_and_record(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "pq"
    src.mkdir()
    pq.write_table(pa.table({"text": ["one", "two"]}), src / "a.parquet")
    pq.write_table(pa.table({"text": [3, 4]}), src / "b.parquet")  # same column, another type
    task = byte_task("p", tasks.ParquetSource(str(src / "*.parquet")), eos=False)
    with pytest.raises(ValueError, match=r"b\.parquet: task 'p', row 0 of file 1: feature 'targets' is an int"):
        build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))


def test_lone_carriage_returns_raise_by_default_and_can_be_repaired(tmp_path):
    src = tmp_path / "mac.txt"
    data = b"first\rsecond\nthird \xff\nfourth\r"  # a lone CR mid-line, bad UTF-8, a CR ending the file
    src.write_bytes(data)
    def task(on_error):
        return _task(str(src), "mac", on_error=on_error, eos=False)
    with pytest.raises(ValueError, match=r"mac\.txt: line 1 \(byte 0\) contains a carriage return"):
        build_task(task("raise"), cache_dir=str(tmp_path / "a"), config=BuildConfig(num_shards=1))
    skipped = build_task(task("skip"), cache_dir=str(tmp_path / "b"), config=BuildConfig(num_shards=1))
    assert skipped.manifest.num_examples == 1 and skipped.manifest.statistics.skipped_records == 2
    repaired = build_task(task("replace"), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))
    stats = repaired.manifest.statistics.to_json()
    assert repaired.manifest.num_examples == 3 and stats["replaced_records"] == 2 and stats["skipped_records"] == 0
    vocab = tasks.ByteVocabulary()
    with CacheReader(repaired.cache_dir) as r:
        texts = sorted(vocab.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
    assert texts == ["first\nsecond", "fourth", "third \ufffd"]
    actions = [(e["record_number"], e["action"], e["kind"]) for e in
               fmt.iter_json_lines(os.path.join(repaired.cache_dir, fmt.QUARANTINE_NAME))]
    # Record numbers are the byte offsets of the lines' first bytes.
    assert actions == [(0, "replaced", "carriage_return"), (data.index(b"third"), "replaced", "invalid_utf8")]


def test_control_characters_in_c4_raise_or_are_counted(tmp_path, corpora):
    """C4 holds a few documents with C0/C1 control characters (mojibake, terminal
    escapes): raised by default naming the row; skipped or repaired on request,
    counted in the manifest and listed in the quarantine file."""
    import re

    import pyarrow.parquet as pq

    path = corpora.c4
    texts = pq.read_table(path, columns=["text"]).column("text").to_pylist()
    control = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
    bad = [i for i, t in enumerate(texts) if control.search(t)]
    assert 0 < len(bad) < 20

    def task(on_error):
        return byte_task("c4", tasks.ParquetSource(str(path), on_error=on_error), eos=False)

    with pytest.raises(ValueError, match=rf"c4_validation_2k\.parquet: record {bad[0]} \(row index {bad[0]}\) contains "
                                         r"control character U\+[0-9A-F]{4}"):
        build_task(task("raise"), cache_dir=str(tmp_path / "a"), config=BuildConfig(num_shards=2))
    assert not os.path.exists(tmp_path / "a" / "c4" / "train" / fmt.MANIFEST_NAME)
    vocab = tasks.ByteVocabulary()
    for action, expected in [("skip", [t for i, t in enumerate(texts) if i not in bad]),
                             ("replace", [control.sub("\ufffd", t) for t in texts])]:
        result = build_task(task({"control_characters": action}), cache_dir=str(tmp_path / action),
                            config=BuildConfig(num_shards=2))
        stats = result.manifest.statistics.to_json()
        assert stats["skipped_records" if action == "skip" else "replaced_records"] == len(bad)
        with CacheReader(result.cache_dir) as r:
            got = sorted(vocab.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
        assert got == sorted(expected)
        entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
        assert [e["record_number"] for e in entries] == bad
        assert {e["action"] for e in entries} == {"skipped" if action == "skip" else "replaced"}


def test_changing_the_policy_changes_the_fingerprint_and_says_so(tmp_path, corpus):
    build_task(_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    other = _task(corpus, on_error={"empty": "skip"})
    with pytest.raises(BuildError, match=r"what changed: task\.source\.on_error\.empty: \"keep\" -> \"skip\""):
        build_task(other, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))


def _sentencepiece_cache(tmp_path, corpora, num_lines):
    """A one-shard cache of botchan lines with a small SentencePiece model stored in it."""
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    vocab = tasks.train_sentencepiece(lines[:2000], output_path=str(tmp_path / "m.model"), vocab_size=400)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(line for line in lines[:num_lines] if line.strip()) + "\n", encoding="utf-8")
    task = tasks.Task("sp", source=tasks.TextLineSource(str(src)), output_features={"targets": tasks.Feature(vocab)},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    return build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1)).cache_dir


def test_a_changed_or_missing_vocabulary_model_is_named_by_verify_and_show(tmp_path, corpora):
    from click.testing import CliRunner

    cache = _sentencepiece_cache(tmp_path, corpora, 300)
    model = os.path.join(cache, "vocabulary-targets.model")
    data = bytearray(open(model, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(model, "wb").write(bytes(data))
    report = verify_cache(cache)
    assert not report.ok and any("vocabulary-targets.model" in p and "sha256" in p for p in report.problems)
    shown = CliRunner().invoke(cli, ["show", cache, "--index", "0"])
    assert shown.exit_code == 1 and "Traceback" not in shown.output and "sha256" in shown.output
    os.remove(model)
    assert any("is missing" in p for p in verify_cache(cache).problems)
    shown = CliRunner().invoke(cli, ["show", cache, "--index", "0"])
    assert shown.exit_code == 1 and "Traceback" not in shown.output and "vocabulary-targets.model" in shown.output


def _fails_on_boom(example, ctx):
    if example["text"] == "boom":
        raise KeyError("no such field in the lookup table")
    return example


def test_an_exception_in_a_user_preprocessor_names_the_record_and_the_code(tmp_path):
    src = tmp_path / "p.txt"
    data = b"fine\nalso fine\nboom\nlast\n"
    src.write_bytes(data)
    lookup = tasks.FunctionPreprocessor(_fails_on_boom, name="lookup")
    task = byte_task("pp", tasks.TextLineSource(str(src)), first=[lookup], eos=False)
    with pytest.raises(ValueError, match=rf"p\.txt: task 'pp', line at byte {data.index(b'boom')} of file 0: preprocessor "
                                         r"'lookup' raised KeyError: 'no such field in the lookup table' at "
                                         r".*test_integrity\.py:\d+ in _fails_on_boom"):
        build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))
    assert not os.path.exists(tmp_path / "c" / "pp" / "train" / fmt.MANIFEST_NAME)


def test_verify_names_a_model_that_is_a_folder_or_not_named(tmp_path, corpora):
    cache = _sentencepiece_cache(tmp_path, corpora, 100)
    model = os.path.join(cache, "vocabulary-targets.model")
    os.remove(model)
    os.mkdir(model)
    assert any("not a file" in p for p in verify_cache(cache).problems)
    os.rmdir(model)
    path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    del raw["vocabularies"]["targets"]["file"]
    json.dump(raw, open(path, "w"))
    assert any("names no model file" in p for p in verify_cache(cache).problems)
