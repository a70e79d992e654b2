"""scan_task: every kind of bad input counted in one pass, nothing written."""

import json
import re

from seqcache import tasks
from testsupport import byte_task


def _task(source):
    return byte_task("scanned", source, eos=False)


def test_every_kind_of_a_real_file_is_counted(corpora):
    path = corpora.blns
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    control = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")
    expected = {
        "control_characters": sum(1 for line in lines if control.search(line)),
        "empty": sum(1 for line in lines if line == ""),
        "whitespace": sum(1 for line in lines if line and line.isspace() and not control.search(line)),
    }
    report = tasks.scan_task(_task(tasks.TextLineSource(str(path), on_error={"default": "raise", "empty": "skip"})))
    assert report.records == len(lines) and report.complete
    assert {k.kind: k.records for k in report.kinds} == {k: n for k, n in expected.items() if n}
    actions = {k.kind: k.action for k in report.kinds}
    assert actions["empty"] == "skip" and actions["control_characters"] == "raise"
    assert report.stops_build.kind == "control_characters"
    # With the default policy the same counts are reported, and nothing stops a build.
    default = tasks.scan_task(_task(tasks.TextLineSource(str(path))))
    assert {k.kind: (k.records, k.action) for k in default.kinds} == {
        k: (n, {"control_characters": "keep"}.get(k, "skip")) for k, n in expected.items() if n}
    assert default.stops_build is None
    first_empty = lines.index("")
    offset = len("".join(line + "\n" for line in lines[:first_empty]).encode("utf-8"))
    assert next(k.first for k in report.kinds if k.kind == "empty") == f"{path}: line at byte {offset} is empty"


def test_structure_and_task_checks_are_counted_and_max_records_stops(tmp_path):
    p = tmp_path / "d.jsonl"
    rows = ['{"text": "fine"}', '{"text": 5}', 'not json', '{"other": "x"}', '{"text": "bad \\u0007"}',
            '{"text": [300]}', '{"text": "ok"}']
    p.write_text("\n".join(rows) + "\n", encoding="utf-8")
    source = tasks.JsonLinesSource(str(p), on_error={"default": "skip", "control_characters": "keep"})
    report = tasks.scan_task(_task(source))
    assert {k.kind: k.records for k in report.kinds} == {
        "control_characters": 1, "malformed": 1, "missing_field": 1, "bad_value": 2}
    assert report.stops_build is None  # this policy skips or keeps every kind found
    assert json.loads(json.dumps(report.to_json()))["records"] == 7
    assert "d.jsonl" in next(k.first for k in report.kinds if k.kind == "bad_value")
    partial = tasks.scan_task(_task(source), max_records=3)
    assert partial.records == 3 and not partial.complete
    assert {k.kind: k.records for k in partial.kinds} == {"malformed": 1, "bad_value": 1}
    # The task's own source is untouched.
    assert source.on_error.action("malformed") == "skip" and source.on_error.action("control_characters") == "keep"


def test_unreadable_files_are_listed_and_the_scan_goes_on(tmp_path, corpora):
    whole = (corpora.multi30k / "val.en.gz").read_bytes()
    (tmp_path / "a.gz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "b.gz").write_bytes(b"not gzip\n")
    import gzip

    with gzip.open(tmp_path / "c.gz", "wt", encoding="utf-8") as f:
        f.write("one\n\ntwo\n")
    report = tasks.scan_task(_task(tasks.TextLineSource(str(tmp_path / "*.gz"))))
    assert [m.split(":")[0].rsplit("/", 1)[1] for m in report.unreadable_files] == ["a.gz", "b.gz"]
    assert all("truncated or corrupt gzip" in m for m in report.unreadable_files)
    assert {k.kind: k.records for k in report.kinds} == {"empty": 1}
    assert report.to_json()["unreadable_files"] == report.unreadable_files


def _raises_on_boom(example, ctx):
    if example["text"] == "boom":
        raise KeyError("boom here")
    return example


def test_a_failing_preprocessor_is_named_with_its_file(tmp_path):
    import pytest

    (tmp_path / "k.txt").write_text("fine\nboom\n", encoding="utf-8")
    task = tasks.Task("kerr", source=tasks.TextLineSource(str(tmp_path / "k.txt")),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[tasks.FunctionPreprocessor(_raises_on_boom, name="lookup"),
                                     tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    with pytest.raises(ValueError, match=r"k\.txt: task 'kerr', line at byte 5 of file 0: "
                                         r"preprocessor 'lookup' raised KeyError"):
        tasks.scan_task(task)
