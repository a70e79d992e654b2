"""The command line end to end: build an ad-hoc task, then info, show, verify."""

from __future__ import annotations

import json
import os

from click.testing import CliRunner

from seqcache.cli import main


def test_build_info_show_verify(tmp_path, shared_data):
    corpus = tmp_path / "in"
    corpus.mkdir()
    lines = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n")[:3000]
    (corpus / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (corpus / "skip-me.txt").write_text("not part of the corpus\n", encoding="utf-8")
    runner = CliRunner()
    args = ["build", "--source", f"text:{corpus}/*.txt", "--exclude", "*/skip-me.txt", "--name", "shk",
            "--sequence-length", "256", "--pack", "--num-shards", "2", "--cache-dir", str(tmp_path / "c"), "--json"]
    first = runner.invoke(main, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    built = json.loads(first.output)[0]
    assert built["reused"] is False and built["num_shards"] == 2
    again = runner.invoke(main, args, catch_exceptions=False)
    assert json.loads(again.output)[0]["reused"] is True

    cache = os.path.join(tmp_path, "c", "shk", "train")
    info = json.loads(runner.invoke(main, ["info", cache, "--json"]).output)
    total_bytes = sum(len(line.encode()) + 1 for line in lines)  # byte vocabulary: 1 token per byte, + EOS
    assert info["statistics"]["tokens"]["targets"] == total_bytes
    assert info["num_sources"] == 1 and info["packing"] == "lm"
    assert info["num_examples"] == built["num_examples"] >= total_bytes // 256

    shown = json.loads(runner.invoke(main, ["show", cache, "--index", "0", "--json"]).output)[0]
    segments = shown["features"]["targets"]["segments"]
    assert sum(s["length"] for s in segments) == shown["features"]["targets"]["length"]
    first_seg = segments[0]
    record = first_seg["provenance"]["record_number"]
    assert first_seg["provenance"]["path"].endswith("a.txt")
    if first_seg["provenance"]["token_offset"] == 0:
        assert first_seg["text"].startswith(lines[record])

    ok = runner.invoke(main, ["verify", cache])
    assert ok.exit_code == 0 and "ok" in ok.output


def test_unknown_task_suggests_close_names(tmp_path):
    out = CliRunner().invoke(main, ["build", "definitely_not_registered", "--cache-dir", str(tmp_path)])
    assert out.exit_code != 0
    assert "definitely_not_registered" in out.output
