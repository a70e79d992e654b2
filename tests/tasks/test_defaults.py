"""The default bad-input policy builds the standard corpora with no --on-error
flag: blank and whitespace-only records are skipped and counted, control
characters and U+2581 are kept and counted, and what would mean a wrong file or
format still raises.

Each build reads the whole real file in ../shared/data through the command line;
the expected counts are computed here from the file itself, independently of
the sources' code.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main

# The Unicode Cc characters other than the White_Space ones, and U+2581 (see tasks/sources/policy.py).
CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f]")


def _lines(path) -> list[str]:
    """The lines of a text file as a line source reads them (the terminator removed)."""
    text = path.read_bytes().decode("utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def _parquet_texts(path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def _jsonl_gz_texts(paths) -> list[str]:
    out = []
    for p in paths:
        with gzip.open(p, "rt", encoding="utf-8") as f:
            out.extend(json.loads(line)["text"] for line in f if line.strip())
    return out


def _expected(texts) -> dict[str, dict[str, int]]:
    """The counts the default policy must give: records per (action, kind)."""
    skipped = {"empty": sum(1 for t in texts if t == ""),
               "whitespace": sum(1 for t in texts if t and t.isspace())}
    live = [t for t in texts if t and not t.isspace()]
    kept = {"control_characters": sum(1 for t in live if CONTROL.search(t)),
            "u2581": sum(1 for t in live if "\u2581" in t)}
    return {"skipped": {k: n for k, n in skipped.items() if n}, "kept": {k: n for k, n in kept.items() if n}}


CORPORA = {
    # name: (source spec relative to the shared data, texts of the file(s))
    "tinyshakespeare": ("text:{d}/tinyshakespeare/input.txt", lambda d: _lines(d / "tinyshakespeare" / "input.txt")),
    "wikitext2_valid": ("text:{d}/wikitext2/wiki.valid.tokens", lambda d: _lines(d / "wikitext2" / "wiki.valid.tokens")),
    "wikitext2_test": ("text:{d}/wikitext2/wiki.test.tokens", lambda d: _lines(d / "wikitext2" / "wiki.test.tokens")),
    "c4": ("parquet:{d}/c4/c4_validation_2k.parquet#text", lambda d: _parquet_texts(d / "c4" / "c4_validation_2k.parquet")),
    "dolma": ("jsonl:{d}/dolma_cc/*.jsonl.gz#text", lambda d: _jsonl_gz_texts(sorted((d / "dolma_cc").glob("*.jsonl.gz")))),
}
# What the task statement measured in these files: the reason for the defaults.
MEASURED = {
    "tinyshakespeare": {"skipped": {"empty": 7_223}},
    "wikitext2_valid": {"skipped": {"whitespace": 1_299}},
    "c4": {"kept": {"control_characters": 5}},
    "dolma": {"kept": {"control_characters": 1}},
}


def _build(tmp_path, name, spec, *extra):
    out = CliRunner().invoke(main, ["build", "--source", spec, "--name", name, "--num-shards", "2",
                                    "--cache-dir", str(tmp_path / "c"), *extra])
    return out, os.path.join(tmp_path, "c", name, "train")


@pytest.mark.parametrize("name", list(CORPORA))
def test_standard_corpora_build_with_the_default_policy(tmp_path, shared_data, name):
    spec, texts = CORPORA[name]
    texts = texts(shared_data)
    expected = _expected(texts)
    for action, kinds in MEASURED.get(name, {}).items():
        for kind, n in kinds.items():
            assert expected[action].get(kind) == n, (name, action, kind)
    out, cache = _build(tmp_path, name, spec.format(d=shared_data))
    assert out.exit_code == 0, out.output

    manifest = json.loads(open(os.path.join(cache, "manifest.json"), encoding="utf-8").read())
    stats = manifest["statistics"]
    counts = stats["bad_input_records"]
    skipped = sum(expected["skipped"].values())
    assert counts["skipped"] == expected["skipped"] and counts["kept"] == expected["kept"]
    assert counts["replaced"] == {} and stats["replaced_records"] == 0
    assert stats["skipped_records"] == counts["records"]["skipped"] == skipped
    assert counts["records"]["kept"] == sum(1 for t in texts if t and not t.isspace()
                                           and (CONTROL.search(t) or "\u2581" in t))
    assert stats["source_records"] == len(texts) and manifest["num_examples"] == len(texts) - skipped
    # Skipped records are listed with their kind; kept ones only counted.
    quarantine = os.path.join(cache, "quarantine.jsonl")
    if skipped:
        with open(quarantine, encoding="utf-8") as f:
            entries = [json.loads(line) for line in f]
        assert len(entries) == skipped and {e["action"] for e in entries} == {"skipped"}
        assert {e["kind"] for e in entries} == set(expected["skipped"])
    else:
        assert not os.path.exists(quarantine)
    # The build summary, info and verify say so.
    for action, kinds in expected.items():
        for kind, n in kinds.items():
            assert f"{kind} {n:,}" in out.output
    info = CliRunner().invoke(main, ["info", cache])
    assert info.exit_code == 0, info.output
    for action, kinds in expected.items():
        for kind, n in kinds.items():
            assert re.search(rf"{action} [\d,]+ records?\b.*{kind} {n:,}", info.output), info.output
    assert json.loads(CliRunner().invoke(main, ["info", cache, "--json"]).output)["statistics"][
        "bad_input_records"] == counts
    verify = CliRunner().invoke(main, ["verify", cache])
    assert verify.exit_code == 0, verify.output


def test_scan_shows_the_kept_counts_and_strict_flags_still_raise(tmp_path, corpora):
    path = corpora.c4
    spec = f"parquet:{path}#text"
    n = _expected(_parquet_texts(path))["kept"]["control_characters"]
    scan = CliRunner().invoke(main, ["scan", "--source", spec, "--json"])
    assert scan.exit_code == 0, scan.output  # nothing stops a build with the defaults
    (report,) = json.loads(scan.stdout)
    assert {k["kind"]: (k["records"], k["action"]) for k in report["kinds"]} == {"control_characters": (n, "keep")}
    # Each kind's action stays settable: strict on control characters stops the build, naming file and record.
    out, cache = _build(tmp_path, "c4", spec, "--on-error", "control_characters=raise")
    assert out.exit_code == 1 and "c4_validation_2k.parquet: record" in out.output
    # No cache (no manifest); the work read before the record is kept for the rerun once the record is fixed.
    assert "control character U+" in out.output and not os.path.exists(os.path.join(cache, "manifest.json"))
    # --on-error raise is strict for every kind, blank lines included.
    lines = corpora.shakespeare
    out, _ = _build(tmp_path, "shk", f"text:{lines}", "--on-error", "raise")
    assert out.exit_code == 1 and "input.txt: line 3 (byte 61) is empty" in out.output


def test_invalid_input_still_raises_by_default(tmp_path, shared_data):
    (tmp_path / "bad.txt").write_bytes(b"fine\nnot \xff utf-8\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\nnot json\n', encoding="utf-8")
    (tmp_path / "missing.jsonl").write_text('{"text": "a"}\n{"other": "b"}\n', encoding="utf-8")
    (tmp_path / "typed.jsonl").write_text('{"text": "a"}\n{"text": 5}\n', encoding="utf-8")
    for spec, message in [(f"text:{tmp_path}/bad.txt", "bad.txt: line 2 (byte 5) is not valid UTF-8"),
                          (f"jsonl:{tmp_path}/bad.jsonl#text", "bad.jsonl: line 2 (byte 14) is not valid JSON"),
                          (f"jsonl:{tmp_path}/missing.jsonl#text", "missing.jsonl: line 2 (byte 14)"),
                          (f"jsonl:{tmp_path}/typed.jsonl#text", "typed.jsonl")]:
        out, cache = _build(tmp_path, "bad", spec)
        assert out.exit_code == 1 and message in out.output, (spec, out.output)
        assert not os.path.exists(os.path.join(cache, "manifest.json"))


def _shard_digests(cache) -> list[str]:
    table = fmt.read_manifest(cache).shards
    return [hashlib.sha256(open(os.path.join(cache, name), "rb").read()).hexdigest()
            for name in [*table.files, *table.provenance_files]]


def test_the_defaults_leave_the_cache_bytes_unchanged(tmp_path, corpora):
    # A corpus without blank lines, control characters or U+2581 gives the same shard bytes under
    # the defaults as under the strict policy; a corpus with blank lines gives the bytes of the
    # explicit --on-error empty=skip that built it before.
    clean = f"text:{corpora.multi30k}/val.en.gz"
    a, ca = _build(tmp_path / "a", "clean", clean)
    b, cb = _build(tmp_path / "b", "clean", clean, "--on-error", "raise")
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert _shard_digests(ca) == _shard_digests(cb)
    lines = f"text:{corpora.shakespeare}"
    a, ca = _build(tmp_path / "c", "shk", lines)
    b, cb = _build(tmp_path / "d", "shk", lines, "--on-error", "empty=skip")
    assert a.exit_code == 0 and b.exit_code == 0, (a.output, b.output)
    assert _shard_digests(ca) == _shard_digests(cb)
    assert open(os.path.join(ca, "quarantine.jsonl"), "rb").read() == open(os.path.join(cb, "quarantine.jsonl"), "rb").read()


def test_verify_checks_the_counts_per_kind_against_the_quarantine_file(tmp_path):
    corpus = tmp_path / "a.txt"
    corpus.write_text("one\n\ntwo\n  \nthree \x1b[0m\n\n", encoding="utf-8")
    out, cache = _build(tmp_path, "small", f"text:{corpus}")
    assert out.exit_code == 0, out.output
    manifest_path = os.path.join(cache, "manifest.json")
    raw = json.loads(open(manifest_path, encoding="utf-8").read())
    assert raw["statistics"]["bad_input_records"] == {
        "skipped": {"empty": 2, "whitespace": 1}, "replaced": {}, "kept": {"control_characters": 1},
        "records": {"skipped": 3, "replaced": 0, "kept": 1}}
    assert CliRunner().invoke(main, ["verify", cache]).exit_code == 0
    raw["statistics"]["bad_input_records"]["skipped"] = {"empty": 3}  # the total still matches
    open(manifest_path, "w", encoding="utf-8").write(json.dumps(raw))
    bad = CliRunner().invoke(main, ["verify", cache])
    assert bad.exit_code == 1 and "per kind {'empty': 2, 'whitespace': 1}" in bad.output, bad.output
    assert "statistics.bad_input_records.skipped is {'empty': 3}" in bad.output
