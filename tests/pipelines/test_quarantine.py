"""The quarantine file of skipped and repaired records (G8): exact counts and
entries however many records are skipped, memory that does not grow with them,
retry safety, the zero-example error, and what ``seqcache verify`` checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache import tasks
from seqcache.cli.main import main as cli
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.pipelines import spill
from seqcache.cli.verify import verify_cache
from testsupport import lines_task

POLICY = {"empty": "skip", "whitespace": "skip", "invalid_utf8": "replace"}


def _task(pattern, on_error=POLICY, name="q"):
    return lines_task(pattern, name, on_error=on_error, eos=False)


def _corpus(folder, num_files=3, lines_per_file=3000):
    """Files whose line k is blank when k % 3 == 1 (skipped), whitespace when
    k % 11 == 5 (skipped), bad UTF-8 when k % 7 == 2 (repaired), else text.
    Returns the glob and the expected sorted (path, record_number, action) list;
    a line's record number is the byte offset of its first byte."""
    folder.mkdir()
    expected = []
    for f in range(num_files):
        path = folder / f"part-{f}.txt"
        lines = []
        offset = 0
        for k in range(lines_per_file):
            if k % 3 == 1:
                lines.append(b"")
                expected.append((str(path), offset, "skipped"))
            elif k % 11 == 5:
                lines.append(b"  \t ")
                expected.append((str(path), offset, "skipped"))
            elif k % 7 == 2:
                lines.append(b"caf\xe9 %d" % k)
                expected.append((str(path), offset, "replaced"))
            else:
                lines.append(b"file %d line %d" % (f, k))
            offset += len(lines[-1]) + 1
        path.write_bytes(b"\n".join(lines) + b"\n")
    return str(folder / "*.txt"), sorted(expected)


def test_many_skipped_records_are_counted_and_listed_exactly(tmp_path, monkeypatch):
    """Thousands of skipped and repaired records, written by the read step as many
    small quarantine chunks and merged in several rounds: the manifest counts
    them exactly, quarantine.jsonl lists each once, sorted by (file, record), and
    its bytes do not depend on how the entries were chunked."""
    pattern, expected = _corpus(tmp_path / "in")
    skipped = sum(1 for e in expected if e[2] == "skipped")
    replaced = len(expected) - skipped
    assert (skipped, replaced) == (3 * 1182, 3 * 260)

    default = build_task(_task(pattern), cache_dir=str(tmp_path / "default"), config=BuildConfig(num_shards=2))
    monkeypatch.setattr(spill, "QUARANTINE_BYTES", 2000)  # about 12 entries a chunk: hundreds of chunks
    monkeypatch.setattr(spill, "MERGE_FAN_IN", 3)  # merged in rounds of 3 files
    chunked = build_task(_task(pattern), cache_dir=str(tmp_path / "chunked"), config=BuildConfig(num_shards=2))

    for result in (default, chunked):
        stats = result.manifest.statistics.to_json()
        assert stats["skipped_records"] == skipped and stats["replaced_records"] == replaced
        assert stats["source_records"] == 9000
        assert result.manifest.num_examples == 9000 - skipped
        path = os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)
        entries = list(fmt.iter_json_lines(path))
        assert [(e["path"], e["record_number"], e["action"]) for e in entries] == expected
        assert [e["source_index"] for e in entries] == [int(e["path"][-5]) for e in entries]
        # The path is not repeated at the start of the message; the rest is kept.
        first = entries[0]  # line 2 of part-0.txt, after the line "file 0 line 0\n"
        offset = len(b"file 0 line 0\n")
        assert first["record_number"] == offset and first["error"] == f"line at byte {offset} is empty"
        assert not any(e["error"].startswith(e["path"]) for e in entries)
        assert result.manifest.quarantine_num_bytes == os.path.getsize(path)
        assert result.manifest.quarantine_sha256 == fmt.file_sha256(path)
        assert verify_cache(result.cache_dir).ok
        assert not os.path.exists(os.path.join(result.cache_dir, "_tmp"))
    assert open(os.path.join(default.cache_dir, fmt.QUARANTINE_NAME), "rb").read() == \
        open(os.path.join(chunked.cache_dir, fmt.QUARANTINE_NAME), "rb").read()


_PEAK_RSS = textwrap.dedent(
    """
    import json, os, resource, sys
    from seqcache import tasks
    from seqcache.pipelines import BuildConfig, build_task

    corpus, action, cache_dir = sys.argv[1:]
    task = tasks.Task(
        "blank",
        source=tasks.TextLineSource(corpus, on_error={"empty": action}),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )
    result = build_task(task, cache_dir=cache_dir, config=BuildConfig(num_shards=2))
    print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                      "skipped": result.manifest.statistics.skipped_records,
                      "examples": result.manifest.num_examples}))
    """
)


def test_skipped_records_cost_no_more_memory_than_kept_ones(tmp_path):
    """Peak RSS of a build where N = 100,000 of 200,000 lines (blank ones) are
    skipped, against the same build keeping them (as empty examples): skipped
    records go to quarantine chunk files, not through the runner one element each.

    Measured (DirectRunner, the development machine): keep 217 MB; skip 195 MB,
    was 270-343 MB when each skipped record was a runner element gathered into
    one list. With 1,000,000 blank lines among 2,000,000 (a 6 MB file,
    benchmarks/quarantine.py): keep 439 MB; skip 431 MB, was 1,316 MB; and
    quarantine.jsonl 147 MB, was 166 MB (the path is no longer repeated in the
    message).
    """
    corpus = tmp_path / "blank.txt"
    corpus.write_bytes(b"word\n\n" * 100_000)
    peaks = {}
    for action in ("keep", "skip"):
        done = subprocess.run([sys.executable, "-c", _PEAK_RSS, str(corpus), action, str(tmp_path / action)],
                              capture_output=True, text=True, check=True)
        peaks[action] = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["skip"]["skipped"] == 100_000 and peaks["skip"]["examples"] == 100_000
    assert peaks["keep"]["skipped"] == 0 and peaks["keep"]["examples"] == 200_000
    ratio = peaks["skip"]["maxrss_kb"] / peaks["keep"]["maxrss_kb"]
    assert ratio < 1.05, peaks  # was 1.24 to 1.53


def test_a_retried_unit_quarantines_each_record_once(tmp_path, monkeypatch, flaky_reader, attempt, group):
    """A failed attempt's quarantine chunks are never named by an output, so the
    merged quarantine holds each skipped record once (the retry is played step by
    step on the real steps, as in test_faults.py)."""
    from seqcache.pipelines import transforms, writer

    pattern, expected = _corpus(tmp_path / "in", num_files=1)
    path = pattern.replace("*.txt", "part-0.txt")
    spill_dir = tmp_path / "cache" / "_tmp" / "spill"
    spill_dir.mkdir(parents=True)
    monkeypatch.setattr(spill, "QUARANTINE_BYTES", 20_000)  # several chunks per unit, emitted before the failure
    reader = transforms.ReadPreprocess(_task(path), seed=0, sequence_length=None, num_shards=2, batch_records=256)
    unit = (0, ((0, 0, None),))

    def step(r):
        return transforms.ReadUnit(r, paths=[path], spill_dir=str(spill_dir), exchange="spill", flush_bytes=50_000)

    assert attempt(step(flaky_reader(reader, fail_after=800)), unit) is None
    orphans = {n for n in os.listdir(spill_dir) if n.startswith(spill.QUARANTINE_PREFIX)}
    assert orphans  # the failed attempt did write chunks
    chunks = group(attempt(step(reader), unit))[transforms.QUARANTINE_KEY]
    assert len(chunks) > 1 and not orphans & {os.path.basename(c) for c in chunks}

    out = tmp_path / "quarantine.jsonl"
    with open(out, "wb") as f:
        summary = spill.merge_quarantine(chunks, f, scratch_dir=str(spill_dir), open_read=writer.open_read,
                                         open_write=writer.open_write, join=writer.join)
    entries = list(fmt.iter_json_lines(str(out)))
    assert [(e["path"], e["record_number"], e["action"]) for e in entries] == expected
    assert summary.skipped_records == 1182 and summary.replaced_records == 260
    assert summary.sha256 == fmt.file_sha256(str(out))


def test_zero_examples_says_what_was_read_and_skipped_and_why(tmp_path):
    """Every record skipped: nothing is written (so no quarantine file), so the
    error carries the counts and the first reasons."""
    src = tmp_path / "blank.txt"
    data = b"\n \n\n\t\n" * 3  # 12 records: 6 empty, 6 whitespace-only
    src.write_bytes(data)
    # The record numbers of the first 5 lines: the byte offsets of their first bytes (0, 1, 3, 4, 6).
    r = [0] + [i + 1 for i, b in enumerate(data) if b == ord("\n")][:4]
    task = _task(str(src), on_error={"empty": "skip", "whitespace": "skip"}, name="blank")
    with pytest.raises(BuildError) as info:
        build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(split="validation", num_shards=2))
    message = str(info.value)
    assert message.startswith("task 'blank' split 'validation': zero examples from 12 source records "
                              "(12 skipped, 0 replaced under the source's on_error policy; ")
    assert f"nothing was written. Skipped (first 5 of 12): {src}: line at byte {r[0]} is empty; " \
           f"{src}: line at byte {r[1]} holds only whitespace; " \
           f"{src}: line at byte {r[2]} is empty; " \
           f"{src}: line at byte {r[3]} holds only whitespace; " \
           f"{src}: line at byte {r[4]} is empty. Every record was skipped" in message
    assert "on_error={'empty': 'keep', 'whitespace': 'keep'}" in message
    assert "--on-error empty=keep --on-error whitespace=keep" in message
    assert not os.path.exists(tmp_path / "c" / "blank" / "validation")

    # Nothing to read at all says so, without reasons.
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(BuildError, match=r"zero examples from 0 source records \(0 skipped, 0 replaced.*"
                                         r"The files hold no records"):
        build_task(_task(str(empty), name="blank"), cache_dir=str(tmp_path / "d"), config=BuildConfig(num_shards=1))


@pytest.fixture
def quarantined(tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(b"one\n\ntwo \xff\n\nthree\n")
    return build_task(_task(str(src)), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2)).cache_dir


def _verify_cli(cache_dir):
    result = CliRunner().invoke(cli, ["verify", cache_dir, "--json"])
    return result.exit_code, json.loads(result.output)


def _edit_manifest(cache_dir, edit):
    path = os.path.join(cache_dir, fmt.MANIFEST_NAME)
    raw = json.load(open(path))
    edit(raw)
    json.dump(raw, open(path, "w"))


def test_verify_checks_the_quarantine_file_against_the_manifest(quarantined):
    m = fmt.read_manifest(quarantined)
    assert (m.statistics.skipped_records, m.statistics.replaced_records) == (2, 1)
    code, report = _verify_cli(quarantined)
    assert code == 0 and report["ok"] and report["problems"] == []
    path = os.path.join(quarantined, fmt.QUARANTINE_NAME)
    content = open(path, "rb").read()

    os.unlink(path)
    code, report = _verify_cli(quarantined)
    assert code == 1 and report["problems"] == [
        f"{path}: quarantine file is missing (the manifest names it, for 2 skipped and 1 replaced records)"]
    open(path, "wb").write(content)
    assert verify_cache(quarantined).ok

    _edit_manifest(quarantined, lambda raw: raw["statistics"].update(skipped_records=5))
    code, report = _verify_cli(quarantined)
    assert code == 1 and report["problems"] == [
        f"{path}: 2 entries with action 'skipped', the manifest's statistics.skipped_records is 5"]


def test_verify_names_an_edited_quarantine_and_reads_older_manifests(quarantined):
    path = os.path.join(quarantined, fmt.QUARANTINE_NAME)
    lines = open(path, "rb").read().splitlines(keepends=True)
    open(path, "wb").write(b"".join(lines[1:]))  # one entry removed
    problems = verify_cache(quarantined).problems
    assert len(problems) == 3
    assert problems[0].startswith(f"{path}: size ") and problems[1].startswith(f"{path}: sha256 ")
    assert problems[2] == f"{path}: 1 entries with action 'skipped', the manifest's statistics.skipped_records is 2"

    # A manifest written before the size and sha256 were recorded verifies on counts alone.
    open(path, "wb").write(b"".join(lines))
    _edit_manifest(quarantined, lambda raw: [raw.pop("quarantine_sha256"), raw.pop("quarantine_num_bytes")])
    assert verify_cache(quarantined).ok
    open(path, "wb").write(b"".join(lines[:-1]) + b"not json\n")
    assert verify_cache(quarantined).problems == [
        f"{path}: line 3 is not a quarantine entry with action 'skipped', 'replaced' or 'excluded': 'not json'",
        f"{path}: 1 entries with action 'skipped', the manifest's statistics.skipped_records is 2",
    ]


def test_verify_refuses_counts_without_a_quarantine_file(tmp_path):
    src = tmp_path / "in.txt"
    src.write_bytes(b"one\ntwo\n")
    cache = build_task(_task(str(src)), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1)).cache_dir
    assert fmt.read_manifest(cache).quarantine is None and verify_cache(cache).ok
    _edit_manifest(cache, lambda raw: raw["statistics"].update(replaced_records=3))
    assert verify_cache(cache).problems == [
        f"{os.path.join(cache, fmt.MANIFEST_NAME)}: statistics count 0 skipped and 3 replaced records, but the "
        "manifest names no quarantine file (quarantine is null)"]
    _edit_manifest(cache, lambda raw: raw.update(quarantine="../elsewhere.jsonl"))
    with pytest.raises(fmt.CacheError, match=r"quarantine is '\.\./elsewhere\.jsonl': invalid enum value$"):
        fmt.read_manifest(cache)


def test_skipped_entries_name_their_kind(tmp_path):
    src = tmp_path / "k.jsonl"
    lines = [b'{"text": "fine"}', b'{"text": ""}', b"not json", b'{"text": "bell \\u0007"}', b'{"text": [999]}']
    src.write_bytes(b"".join(line + b"\n" for line in lines))
    # A line's record number is the byte offset of its first byte.
    starts = [sum(len(line) + 1 for line in lines[:k]) for k in range(len(lines))]
    task = tasks.Task(
        "kinds",
        source=tasks.JsonLinesSource(str(src), on_error="skip"),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )
    result = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))
    entries = list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))
    assert [(e["record_number"], e["kind"]) for e in entries] == [
        (starts[1], "empty"), (starts[2], "malformed"), (starts[3], "control_characters"), (starts[4], "bad_value")]


def test_every_record_malformed_says_to_fix_the_input(tmp_path):
    """Records of kinds that cannot be kept: the message does not suggest keeping them."""
    from seqcache import tasks
    from seqcache.tasks import preprocessors as P

    src = tmp_path / "bad.jsonl"
    src.write_text("{not json\n[1, 2\n", encoding="utf-8")
    task = tasks.Task("broken", source=tasks.JsonLinesSource(str(src), on_error={"malformed": "skip"}),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])
    with pytest.raises(BuildError) as info:
        build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=1))
    message = str(info.value)
    assert message.endswith("Every record was skipped: fix the input (malformed: these cannot be kept as they are)")
    assert "keep" not in message.split("Every record was skipped")[1].replace("cannot be kept", "")
