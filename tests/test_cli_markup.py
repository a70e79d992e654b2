"""Paths, task names and manifest text that look like rich markup (``[/]``,
``[red]x[/red]``, ``[bold]``, ``\\[``, ``:smile:``) are printed as they are by
the text output of build, info, verify, show, scan, which, report and
train --dry-run: no ``MarkupError``, nothing dropped, no emoji."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from click.testing import CliRunner

from seqcache.cli.main import main

# Each looks like rich markup, an escaped bracket or an emoji code; "/" makes nested folders.
ROOT_NAME = "c[/]/[red]x[/red][bold]"
SOURCE_NAME = "in[/]/[red]x[/red]/[bold]a\\[b]\\[1]:smile:.txt"
TASK_NAME = "[bold red]X[/bold red][/]"
# Wide enough that no table cell is folded, so each name shows on one line.
WIDE = {"COLUMNS": "1000"}


def _run(*args):
    result = CliRunner().invoke(main, list(args), env=WIDE, catch_exceptions=False)
    assert "Traceback" not in result.output, result.output
    return result


def _ok(*args):
    result = _run(*args)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(tmp folder, source file, cache folder, build's output) of a 40-line cache."""
    tmp = tmp_path_factory.mktemp("markup")
    source = tmp / SOURCE_NAME
    source.parent.mkdir(parents=True)
    # A blank line: build and scan name the file and the quarantine file (a path in the cache).
    source.write_text("".join(f"line {i} of the corpus\n" for i in range(40)) + "\n", encoding="utf-8")
    root = str(tmp / ROOT_NAME)
    out = _ok("build", "--source", f"text:{tmp}/*/*/*/*/*.txt", "--name", "t", "--cache-dir", root)
    return tmp, str(source), os.path.join(root, "t", "train"), out


def test_build_info_verify_show_name_the_paths_as_they_are(built):
    tmp, source, cache, out = built
    assert "t/train: 40 examples in 1 shard, built in" in out and f"-> {cache}\n" in out
    assert f"listed with the reason in {cache}/quarantine.jsonl" in out
    info = _ok("info", cache, "--shards")
    assert f"│ {cache} " in info and "bad input" in info and "skipped 1 record (empty 1)" in info
    assert f"ok: {cache}: 2 files verified" in _ok("verify", cache)
    shown = _ok("show", cache, "--index", "3").splitlines()
    where = next(k for k, line in enumerate(shown) if line.startswith("segment 1 "))
    line = re.fullmatch(rf"segment 1 \(\d+ tokens\) <- {re.escape(source)} line (\d+) \(byte \d+\)", shown[where])
    assert line is not None, shown
    assert shown[where + 1] == f"line {int(line.group(1)) - 1} of the corpus"  # source lines count from 1


def test_scan_which_report_name_the_paths_as_they_are(built):
    tmp, source, cache, _ = built
    scanned = _ok("scan", "--source", f"text:{tmp}/*/*/*/*/*.txt")
    assert "adhoc: 41 records in 1 file" in scanned and f"│ {source}: line at byte " in scanned
    missing = _run("scan", "--source", f"text:{tmp}/none[/]/[red]x[/red]*.txt")
    assert missing.exit_code == 1
    assert missing.output == f"error: no file matches the source pattern '{tmp}/none[/]/[red]x[/red]*.txt'\n"
    which = _ok("which", cache, "--step", "0", "--row", "1", "--batch-size", "2")
    assert f"cache        {cache}\n" in which and f": {source} line " in which
    page = str(tmp / "r[/][red]x[/red].html")
    assert _ok("report", cache, "--output", page).startswith(f"wrote {page} (")
    assert os.path.getsize(page) > 0


def test_a_manifest_s_task_name_and_an_error_are_shown_as_they_are(built, tmp_path):
    _, _, cache, _ = built
    edited = tmp_path / "e[/]" / "t" / "train"
    shutil.copytree(cache, edited)
    manifest = json.loads((edited / "manifest.json").read_text(encoding="utf-8"))
    manifest["task"] = TASK_NAME
    (edited / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    info = _ok("info", str(edited))
    assert f" {TASK_NAME}/train " in info.splitlines()[0]
    missing = tmp_path / "no\\[red]x[/red]" / "t"
    bad = _run("info", str(missing))
    assert bad.exit_code == 1 and bad.output == f"error: {missing}: no such cache folder\n"


def test_train_dry_run_prints_the_cache_and_checkpoint_paths_as_they_are(built, tmp_path):
    _, _, cache, _ = built
    ckpt = str(tmp_path / "ck[/]" / "[red]x[/red]")
    out = _ok("train", "--task", cache, "--checkpoint-dir", ckpt, "--dry-run", "--steps", "2", "--batch-size", "8",
              "--model", "tiny", "--set", "progress=false")
    assert f" {cache} │" in out and f" {ckpt} │" in out and f" {ckpt}/metrics.jsonl │" in out
