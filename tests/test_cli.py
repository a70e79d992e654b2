"""The command line end to end: build an ad-hoc task, then info, show, verify."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main
from testsupport import write_lines


def test_build_info_show_verify(tmp_path, corpora):
    corpus = tmp_path / "in"
    lines = corpora.shakespeare_lines(3000)
    write_lines(corpus / "a.txt", lines)
    (corpus / "skip-me.txt").write_text("not part of the corpus\n", encoding="utf-8")
    runner = CliRunner()
    args = ["build", "--source", f"text:{corpus}/*.txt", "--exclude", "*/skip-me.txt", "--on-error", "empty=skip", "--name", "shk",
            "--sequence-length", "256", "--pack", "--num-shards", "2", "--cache-dir", str(tmp_path / "c"), "--json"]
    first = runner.invoke(main, args, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    built = json.loads(first.stdout)[0]  # warnings go to stderr
    assert built["reused"] is False and built["num_shards"] == 2
    again = runner.invoke(main, args, catch_exceptions=False)
    assert json.loads(again.stdout)[0]["reused"] is True

    cache = os.path.join(tmp_path, "c", "shk", "train")
    info = json.loads(runner.invoke(main, ["info", cache, "--json"]).output)
    total_bytes = sum(len(line.encode()) + 1 for line in lines if line)  # byte vocabulary: 1 token per byte, + EOS
    assert info["statistics"]["tokens"]["targets"] == total_bytes
    assert info["statistics"]["skipped_records"] == lines.count("") > 0  # the blank lines, counted
    assert info["num_sources"] == 1 and info["packing"] == "lm"
    assert info["num_examples"] == built["num_examples"] >= total_bytes // 256

    shown = json.loads(runner.invoke(main, ["show", cache, "--index", "0", "--json"]).output)[0]
    segments = shown["features"]["targets"]["segments"]
    assert sum(s["length"] for s in segments) == shown["features"]["targets"]["length"]
    first_seg = segments[0]
    record = first_seg["provenance"]["record_number"]
    assert first_seg["provenance"]["path"].endswith("a.txt")
    # A text line's record number is the byte offset of its first byte: map it back to the line.
    line_starts, start = {}, 0
    for k, line in enumerate(lines):
        line_starts[start] = k
        start += len(line.encode("utf-8")) + 1
    assert record in line_starts and lines[line_starts[record]]  # a line start, and not a skipped blank line
    if first_seg["provenance"]["token_offset"] == 0:
        assert first_seg["text"].startswith(lines[line_starts[record]])

    ok = runner.invoke(main, ["verify", cache])
    assert ok.exit_code == 0 and "ok" in ok.output


def test_unknown_task_suggests_close_names(tmp_path):
    out = CliRunner().invoke(main, ["build", "definitely_not_registered", "--cache-dir", str(tmp_path)])
    assert out.exit_code != 0
    assert "definitely_not_registered" in out.output


def test_usage_errors_and_warnings(tmp_path, corpora):
    corpus = tmp_path / "in"
    lines = corpora.shakespeare_lines(500)
    write_lines(corpus / "a.txt", lines)
    runner = CliRunner()
    base = ["build", "--source", f"text:{corpus}/*.txt", "--on-error", "empty=keep", "--cache-dir", str(tmp_path / "c")]
    for bad in (["--name", "x", "--num-shards", "0"], ["--name", "x", "--seed", "-1"], ["--name", "bad name/x"],
                ["--name", "x", "--on-error", "empty=replace"], ["--name", "x", "--on-error", "no_such_kind=skip"],
                ["--name", "x", "--on-error", "keep"]):
        out = runner.invoke(main, base + bad)
        assert out.exit_code == 2, (bad, out.output)
        assert "Traceback" not in out.output
    trimmed = runner.invoke(main, base + ["--name", "t", "--sequence-length", "8", "--num-shards", "2"])
    assert trimmed.exit_code == 0
    assert "dropped" in trimmed.output and "--pack keeps every token" in trimmed.output

    cache = os.path.join(tmp_path, "c", "t", "train")
    n = json.loads(runner.invoke(main, ["info", cache, "--json"]).output)["num_examples"]
    near_end = runner.invoke(main, ["show", cache, "--index", str(n - 2), "--count", "5", "--json"])
    shown = json.loads(near_end.stdout)
    assert [s["index"] for s in shown] == [n - 2, n - 1]  # stops at the end, and says so
    assert f"showing 2 of the 5 asked for, from index {n - 2:,}" in near_end.stderr
    assert runner.invoke(main, ["show", cache, "--count", "0"]).exit_code == 2
    # info still describes a cache with a damaged shard, warns and exits 1.
    shard = sorted(f for f in os.listdir(cache) if f.startswith("data."))[0]
    with open(os.path.join(cache, shard), "ab") as f:
        f.write(b"junk")
    damaged = runner.invoke(main, ["info", cache])
    assert damaged.exit_code == 1 and "examples" in damaged.output and shard in damaged.output


def test_module_in_the_working_folder_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_registered_tasks.py").write_text(
        "from seqcache import tasks\n"
        "tasks.TaskRegistry.add('cwd_module_task', source=tasks.TextLineSource('unused.txt'),\n"
        "    output_features={'targets': tasks.Feature(tasks.ByteVocabulary())})\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(main, ["tasks", "--module", "my_registered_tasks", "--json"])
    assert out.exit_code == 0, out.output
    assert "cwd_module_task" in [t["name"] for t in json.loads(out.output)["tasks"]]
    missing = CliRunner().invoke(main, ["tasks", "--module", "no_such_module_here"])
    assert missing.exit_code == 2 and "PYTHONPATH" in missing.output


def test_vocab_train_creates_the_output_folder(tmp_path, corpora):
    out = tmp_path / "new" / "folder" / "spm.model"
    result = CliRunner().invoke(main, ["vocab", "train", "--source", f"text:{corpora.botchan}",
                                       "--vocab-size", "400", "--max-records", "2000", "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 0


def test_an_interrupt_inside_a_beam_step_is_reported_as_an_interrupt(tmp_path, monkeypatch):
    import seqcache.pipelines

    def interrupted(*args, **kwargs):  # what Beam raises when Ctrl-C lands inside a step
        raise RuntimeError("KeyboardInterrupt [while running 'SortPackWrite']")

    monkeypatch.setattr(seqcache.pipelines, "build_task", interrupted)
    (tmp_path / "a.txt").write_text("one line\n", encoding="utf-8")
    out = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/a.txt", "--name", "x",
                                    "--cache-dir", str(tmp_path / "c")])
    assert out.exit_code == 130 and "interrupted" in out.output and "Traceback" not in out.output


SCAN_HINT = "`seqcache scan` with the same task or --source lists every kind of bad input"


def test_bad_input_that_the_policy_raises_on_points_to_scan(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n", encoding="utf-8")
    args = ["build", "--source", f"text:{tmp_path}/a.txt", "--name", "x", "--cache-dir", str(tmp_path / "c")]
    raised = CliRunner().invoke(main, [*args, "--on-error", "empty=raise"])  # a BadInputError from a step
    assert raised.exit_code == 1 and "line 2 (byte 4) is empty" in raised.output, raised.output
    assert SCAN_HINT in " ".join(raised.output.split())
    (tmp_path / "b.txt").write_text("\n\n", encoding="utf-8")  # every record skipped, and they can be kept
    skipped = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/b.txt", "--name", "y",
                                        "--cache-dir", str(tmp_path / "d")])
    assert skipped.exit_code == 1 and "on_error={'empty': 'keep'}" in skipped.output, skipped.output
    assert SCAN_HINT in " ".join(skipped.output.split())
    missing = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/none-*.txt", "--name", "z",
                                        "--cache-dir", str(tmp_path / "e")])
    assert missing.exit_code != 0 and SCAN_HINT not in " ".join(missing.output.split()), missing.output


def test_bad_input_that_beam_hands_back_as_text_points_to_scan(tmp_path, monkeypatch):
    import seqcache.pipelines
    from seqcache.tasks.sources import error_hint

    def failed(*args, **kwargs):  # a worker's error across processes: only its text comes back
        raise RuntimeError(f"Traceback (most recent call last):\n  ...\nValueError: a.txt: line 2 is empty; "
                           f"{error_hint('empty')} [while running 'ReadSplits']")

    monkeypatch.setattr(seqcache.pipelines, "build_task", failed)
    (tmp_path / "a.txt").write_text("one line\n", encoding="utf-8")
    out = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/a.txt", "--name", "x",
                                    "--cache-dir", str(tmp_path / "c")])
    assert out.exit_code == 1 and "error: a.txt: line 2 is empty; set the source's on_error=" in out.output
    assert SCAN_HINT in " ".join(out.output.split()) and "while running" not in out.output, out.output


def test_vocab_check_reports_what_does_not_survive_the_round_trip(tmp_path, corpora):
    model = tmp_path / "nfkc.model"
    runner = CliRunner()
    trained = runner.invoke(main, ["vocab", "train", "--source", f"text:{corpora.botchan}",
                                   "--vocab-size", "400", "--max-records", "2000", "--output", str(model)])
    assert trained.exit_code == 0, trained.output
    text = tmp_path / "t.txt"
    data = "plain line\nspaces  collapsed\nmeta \u2581 symbol\n".encode("utf-8")
    text.write_bytes(data)
    out = runner.invoke(main, ["vocab", "check", "--vocabulary", str(model), "--source", f"text:{text}", "--json"])
    assert out.exit_code == 1
    report = json.loads(out.output)
    assert report["records"] == 3 and report["changed"] == 2
    reasons = {p["record_number"]: p["reason"] for p in report["examples"]}
    # Record numbers of a text source are the byte offsets of the lines' first bytes.
    assert reasons == {data.index(b"spaces"): "normalisation", data.index(b"meta"): "contains U+2581"}
    clean = runner.invoke(main, ["vocab", "check", "--vocabulary", "byte", "--source", f"text:{text}"])
    assert clean.exit_code == 0 and "0 change" in clean.output


def test_show_checks_the_counts_it_relies_on_and_names_bad_shards(tmp_path, corpora):
    corpus = tmp_path / "in"
    lines = corpora.shakespeare_lines(2000)
    write_lines(corpus / "a.txt", lines)
    runner = CliRunner()
    built = runner.invoke(main, ["build", "--source", f"text:{corpus}/a.txt", "--on-error", "empty=skip",
                                 "--name", "s", "--num-shards", "3", "--cache-dir", str(tmp_path / "c")])
    assert built.exit_code == 0, built.output
    cache = os.path.join(tmp_path, "c", "s", "train")
    manifest_path = os.path.join(cache, "manifest.json")
    original = open(manifest_path).read()
    raw = json.loads(original)
    files = [fmt.shard_name(fmt.DATA_PREFIX, i, 3) for i in range(3)]
    counts = fmt.decode_int_column(raw["shards"]["num_records"]).copy()
    # Move one record from shard 1's count to shard 0's: the total still adds up.
    counts[0] += 1
    counts[1] -= 1
    raw["shards"]["num_records"] = fmt.encode_int_column(counts)
    with open(manifest_path, "w") as f:
        json.dump(raw, f)
    last = raw["num_examples"] - 1  # in shard 2, whose own count is right
    out = runner.invoke(main, ["show", cache, "--index", str(last)])
    assert out.exit_code == 1 and "Traceback" not in out.output
    assert files[0] in out.output and "the manifest expects" in out.output
    with open(manifest_path, "w") as f:
        f.write(original)
    # A shard whose bytes are damaged but whose size is right: named, no traceback.
    shard = os.path.join(cache, files[1])
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.seek(min(4096, size // 3))  # inside the records (a shard file is padded to 64 KiB blocks)
        f.write(b"\0" * 4096)
    first_of_shard_1 = int(counts[0]) - 1  # the edited count was one more
    # Every record of shard 1 but its first (the edited count was one fewer): the damaged chunk among them.
    out = runner.invoke(main, ["show", cache, "--index", str(first_of_shard_1 + 1), "--count", str(int(counts[1]))])
    assert out.exit_code == 1 and "Traceback" not in out.output and files[1] in out.output


def _register_line_task(folder, module, task, text):
    """Writes ``text`` to folder/a.txt and a module ``module`` registering ``task``
    over its lines (byte vocabulary, default policy)."""
    (folder / "a.txt").write_text(text, encoding="utf-8")
    (folder / f"{module}.py").write_text(
        "from seqcache import tasks\n"
        f"tasks.TaskRegistry.add({task!r}, source=tasks.TextLineSource({str(folder / 'a.txt')!r}),\n"
        "    output_features={'targets': tasks.Feature(tasks.ByteVocabulary())},\n"
        "    preprocessors=[tasks.preprocessors.rekey({'targets': 'text'}), tasks.preprocessors.tokenize()])\n",
        encoding="utf-8",
    )


def test_source_options_with_a_registered_task_are_usage_errors(tmp_path, monkeypatch):
    _register_line_task(tmp_path, "reg_tasks_for_options", "opt_task", "one\n")
    monkeypatch.chdir(tmp_path)
    base = ["build", "opt_task", "--module", "reg_tasks_for_options", "--cache-dir", str(tmp_path / "c")]
    for extra, named in [(["--on-error", "skip"], "--on-error describes"),
                         (["--exclude", "*.md"], "--exclude describes"),
                         (["--on-error", "empty=skip", "--exclude", "x"], "--on-error and --exclude describe")]:
        out = CliRunner().invoke(main, base + extra)
        assert out.exit_code == 2 and named in out.output and "on_error=" in out.output, out.output
    assert CliRunner().invoke(main, base).exit_code == 0


def test_scan_lists_every_kind_and_the_options_that_go_on(tmp_path, corpora):
    runner = CliRunner()
    corpus = corpora.blns
    # The default policy skips the blank and whitespace-only lines and keeps the control characters.
    default = runner.invoke(main, ["scan", "--source", f"text:{corpus}", "--json"])
    assert default.exit_code == 0, default.output
    (report,) = json.loads(default.stdout)
    kinds = {k["kind"]: k for k in report["kinds"]}
    assert {k: v["action"] for k, v in kinds.items()} == {
        "control_characters": "keep", "empty": "skip", "whitespace": "skip"}
    # The strict policy raises on each of them.
    out = runner.invoke(main, ["scan", "--source", f"text:{corpus}", "--on-error", "raise", "--json"])
    assert out.exit_code == 1, out.output
    strict = {k["kind"]: k for k in json.loads(out.stdout)[0]["kinds"]}
    assert {k: v["records"] for k, v in strict.items()} == {k: v["records"] for k, v in kinds.items()}
    assert all(k["action"] == "raise" for k in strict.values())
    flags = ["--on-error", "control_characters=skip", "--on-error", "empty=skip", "--on-error", "whitespace=skip"]
    table = runner.invoke(main, ["scan", "--source", f"text:{corpus}", "--on-error", "raise"])
    assert table.exit_code == 1 and " ".join(flags) in " ".join(table.output.split())
    ok = runner.invoke(main, ["scan", "--source", f"text:{corpus}", "--on-error", "raise", *flags, "--json"])
    assert ok.exit_code == 0 and [k["action"] for k in json.loads(ok.stdout)[0]["kinds"]] == ["skip"] * 3
    # The flags scan suggests make the build go through, skipping exactly the counted records.
    built = runner.invoke(main, ["build", "--source", f"text:{corpus}", "--on-error", "raise", *flags,
                                 "--name", "blns", "--cache-dir", str(tmp_path / "c"), "--json"])
    assert built.exit_code == 0, built.output
    assert json.loads(built.stdout)[0]["skipped_records"] == sum(k["records"] for k in kinds.values())
    # With no flag at all the build skips the blank lines and counts the kept control characters.
    built = runner.invoke(main, ["build", "--source", f"text:{corpus}", "--name", "blns",
                                 "--cache-dir", str(tmp_path / "d"), "--json"])
    assert built.exit_code == 0, built.output
    counts = json.loads(built.stdout)[0]["bad_input_records"]
    assert counts["skipped"] == {k: kinds[k]["records"] for k in ("empty", "whitespace")}
    assert counts["kept"] == {"control_characters": kinds["control_characters"]["records"]}


def test_an_interrupted_replacing_build_says_the_old_cache_is_untouched(tmp_path, monkeypatch):
    import seqcache.pipelines

    (tmp_path / "a.txt").write_text("one line\n", encoding="utf-8")
    args = ["build", "--source", f"text:{tmp_path}/a.txt", "--name", "x", "--cache-dir", str(tmp_path / "c")]
    assert CliRunner().invoke(main, args).exit_code == 0

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(seqcache.pipelines, "build_task", interrupted)
    out = CliRunner().invoke(main, args + ["--overwrite", "--seed", "3"])
    assert out.exit_code == 130 and "still holds the cache from before" in out.output
    fresh = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/a.txt", "--name", "y",
                                      "--cache-dir", str(tmp_path / "c")])
    assert fresh.exit_code == 130 and "has no manifest" in fresh.output


def test_vocab_check_policy_flags_override_its_own_defaults(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("plain line\nmeta \u2581 symbol\n\n", encoding="utf-8")
    runner = CliRunner()
    kept = json.loads(runner.invoke(main, ["vocab", "check", "--vocabulary", "byte", "--source", f"text:{text}",
                                           "--json"]).stdout)
    assert kept["records"] == 3  # the content kinds are kept by default: reported, not refused
    out = runner.invoke(main, ["vocab", "check", "--vocabulary", "byte", "--source", f"text:{text}", "--json",
                               "--on-error", "u2581=skip", "--on-error", "empty=skip"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["records"] == 1


def test_ad_hoc_options_with_a_registered_task_and_scan_advice_for_it(tmp_path, monkeypatch):
    _register_line_task(tmp_path, "reg_tasks_for_adhoc", "adhoc_opts", "one\rtwo\nthree\n")
    monkeypatch.chdir(tmp_path)
    base = ["build", "adhoc_opts", "--module", "reg_tasks_for_adhoc", "--cache-dir", str(tmp_path / "c")]
    for extra, named in [(["--vocabulary", "/nonexistent.model"], "--vocabulary"), (["--name", "zz"], "--name"),
                         (["--extra-ids", "5"], "--extra-ids"), (["--pack"], "--pack")]:
        out = CliRunner().invoke(main, base + extra)
        assert out.exit_code == 2 and f"{named} describes an ad-hoc --source" in out.output, out.output
        # --pack: the task's packing=, not its source's on_error/exclude.
        assert ("packing=" in out.output) == (named == "--pack") and ("on_error" in out.output) != (named == "--pack")
    scan = CliRunner().invoke(main, ["scan", "adhoc_opts", "--module", "reg_tasks_for_adhoc"])
    assert scan.exit_code == 1 and "on_error={'carriage_return': 'skip'} in the task's source" in scan.output
    assert "--on-error" not in scan.output
    refused = CliRunner().invoke(main, ["scan", "adhoc_opts", "--module", "reg_tasks_for_adhoc", "--vocabulary", "x"])
    assert refused.exit_code == 2 and "--vocabulary" in refused.output


def test_info_says_none_the_same_way_and_show_names_the_index_out_of_range(tmp_path):
    import re

    import pytest

    from seqcache.feeders.reader import CacheReader

    write_lines(tmp_path / "in" / "a.txt", [f"line {i}" for i in range(40)])
    runner = CliRunner()
    built = runner.invoke(main, ["build", "--source", f"text:{tmp_path}/in/a.txt", "--name", "u", "--num-shards", "2",
                                 "--cache-dir", str(tmp_path / "c")])
    assert built.exit_code == 0, built.output
    cache = os.path.join(tmp_path, "c", "u", "train")
    raw = json.loads(open(os.path.join(cache, fmt.MANIFEST_NAME), encoding="utf-8").read())
    assert raw["sequence_length"] is None and raw["packing"] is None and raw["num_examples"] == 40
    info = runner.invoke(main, ["info", cache])
    assert info.exit_code == 0, info.output
    assert re.search(r"sequence length\W+none\W", info.output) and re.search(r"packing\W+none\W", info.output)
    assert "None" not in info.output and "null" not in info.output
    # An index one past the end: named alone, with the cache's range (not "40..40").
    out = runner.invoke(main, ["show", cache, "--index", "40"])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert "index 40 out of range: the cache has 40 examples, indices 0 to 39" in out.output and ".." not in out.output
    out = runner.invoke(main, ["show", cache, "--index", "3", "--index", "41", "--index", "-1"])
    assert out.exit_code == 2 and out.output.strip().splitlines()[-1] == (
        "Error: Invalid value for --index: indices -1, 41 out of range: the cache has 40 examples, indices 0 to 39")
    assert runner.invoke(main, ["show", cache, "--index", "39"]).exit_code == 0
    with CacheReader(cache) as reader, pytest.raises(IndexError, match=r"out of range \[0, 40\) \(got 40, 42\)$"):
        reader.read_examples([3, 42, 40])
    # --help and info, in a fresh process: neither Beam nor JAX nor matplotlib nor Jinja2 is imported.
    probe = ("import sys\nfrom click.testing import CliRunner\nfrom seqcache.cli.main import main\n"
             "for args in (['--help'], ['info', sys.argv[1]]):\n"
             "    assert CliRunner().invoke(main, args).exit_code == 0, args\n"
             "print(sorted(m for m in ('apache_beam', 'jax', 'matplotlib', 'jinja2') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, cache], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_a_bad_encoding_threads_variable_is_refused_before_any_command_runs(tmp_path, monkeypatch):
    """$SEQCACHE_ENCODING_THREADS that is not a positive integer: one line naming
    it, exit 1, before the command reads anything (scan would otherwise blame
    the first record it tokenizes, vocab train fail after writing its model)."""
    corpus = tmp_path / "a.txt"
    write_lines(corpus, ["to be", "or not"])
    monkeypatch.setenv("SEQCACHE_ENCODING_THREADS", "abc")
    out = CliRunner().invoke(main, ["scan", "--source", f"text:{corpus}"])
    assert out.exit_code == 1
    assert "SEQCACHE_ENCODING_THREADS='abc': expected a positive integer" in out.output
    assert "a.txt" not in out.output
    monkeypatch.setenv("SEQCACHE_ENCODING_THREADS", "1")
    assert CliRunner().invoke(main, ["scan", "--source", f"text:{corpus}"]).exit_code == 0


def test_a_beam_option_with_a_bad_value_is_named_before_the_build(tmp_path):
    """A Beam option whose value Beam refuses is reported in one line (the
    build's standard error is hidden from its workers, where argparse would
    say it), and a negative worker count too; nothing is built."""
    corpus = tmp_path / "a.txt"
    write_lines(corpus, ["to be", "or not"])
    base = ["build", "--source", f"text:{corpus}", "--name", "t", "--cache-dir", str(tmp_path / "c")]
    for option, said in (("--direct_running_mode=multiprocess", "invalid choice: 'multiprocess'"),
                         ("--direct_num_workers=abc", "invalid int value: 'abc'"),
                         ("--direct_num_workers=-3", "--direct_num_workers=-3: expected 0")):
        out = CliRunner().invoke(main, base + [option])
        assert out.exit_code == 2, out.output
        assert "Beam pipeline option:" in out.output and said in out.output, out.output
    assert not (tmp_path / "c" / "t").exists()


def test_on_error_duplicate_skip_deduplicates_an_ad_hoc_source(tmp_path):
    write_lines(tmp_path / "in" / "a.txt", ["one", "two", "one", "three", "two", "one"])
    out = CliRunner().invoke(main, ["build", "--source", f"text:{tmp_path}/in/a.txt", "--on-error", "duplicate=skip",
                                    "--name", "d", "--num-shards", "2", "--cache-dir", str(tmp_path / "c")])
    assert out.exit_code == 0, out.output
    cache = os.path.join(tmp_path, "c", "d", "train")
    manifest = fmt.read_manifest(cache)
    assert manifest.num_examples == 3 and manifest.statistics.skipped_records == 3
    assert manifest.statistics.bad_input_records.skipped == {"duplicate": 3}
    entries = list(fmt.iter_json_lines(os.path.join(cache, fmt.QUARANTINE_NAME)))
    # Lines at bytes 8 ("one"), 18 ("two") and 22 ("one"), each naming the first copy (bytes 0 and 4).
    assert [(e["record_number"], e["kind"], e["kept"]["record_number"]) for e in entries] == [
        (8, "duplicate", 0), (18, "duplicate", 4), (22, "duplicate", 0)]
    verified = CliRunner().invoke(main, ["verify", cache])
    assert verified.exit_code == 0, verified.output


def test_on_error_near_duplicate_skip_with_parameters_on_an_ad_hoc_source(tmp_path):
    base = "the quick brown fox jumps over the lazy dog and runs far away into the woods"
    write_lines(tmp_path / "in" / "a.txt", [base, base.replace("lazy", "sleepy") + "!", "Something else entirely.",
                                            base.upper()])
    args = ["build", "--source", f"text:{tmp_path}/in/a.txt", "--name", "n", "--num-shards", "2",
            "--cache-dir", str(tmp_path / "c")]
    out = CliRunner().invoke(main, args + ["--on-error", "near_duplicate=skip", "--near-duplicates",
                                           "ngram=2,bands=16,rows=2,seed=3"])
    assert out.exit_code == 0, out.output
    cache = os.path.join(tmp_path, "c", "n", "train")
    manifest = fmt.read_manifest(cache)
    assert manifest.num_examples == 2 and manifest.statistics.bad_input_records.skipped == {"near_duplicate": 2}
    assert manifest.fingerprint_inputs["near_duplicates"] == {"version": 2, "ngram": 2, "bands": 16, "rows": 2,
                                                              "seed": 3, "fields": []}
    entries = list(fmt.iter_json_lines(os.path.join(cache, fmt.QUARANTINE_NAME)))
    assert {e["kind"] for e in entries} == {"near_duplicate"} and all("similarity" in e for e in entries)
    info = CliRunner().invoke(main, ["info", cache])
    assert "skipped 2 records (near_duplicate 2)" in info.output, info.output
    verified = CliRunner().invoke(main, ["verify", cache])
    assert verified.exit_code == 0, verified.output

    bad = CliRunner().invoke(main, args + ["--on-error", "near_duplicate=skip", "--near-duplicates", "grams=3"])
    assert bad.exit_code == 2 and "'grams=3' is not NAME=VALUE" in bad.output, bad.output
    for twice in (["--near-duplicates", "bands=10", "--near-duplicates", "bands=12"],
                  ["--near-duplicates", "bands=14,bands=20"]):  # never the last one silently
        again = CliRunner().invoke(main, args + ["--on-error", "near_duplicate=skip", *twice])
        assert again.exit_code == 2 and "bands given twice" in again.output, again.output
    unasked = CliRunner().invoke(main, args[:-1] + [str(tmp_path / "d"), "--near-duplicates", "bands=20"])
    assert unasked.exit_code == 1, unasked.output
    assert "near-duplicate parameters were given, but its source keeps near duplicates" in unasked.output


def test_scan_estimates_the_share_of_near_duplicates_in_one_line(tmp_path):
    base = "the quick brown fox jumps over the lazy dog and runs far away into the woods"
    write_lines(tmp_path / "a.txt", [base, base.replace("lazy", "sleepy") + "!", "Something else entirely.",
                                     base.upper()])
    args = ["scan", "--source", f"text:{tmp_path}/a.txt"]
    out = CliRunner().invoke(main, args + ["--near-duplicates", "ngram=2,bands=16,rows=2,seed=3"])
    assert out.exit_code == 0, out.output
    assert "adhoc: near duplicates: 50.0% of the 4 records sampled (2 would be removed" in out.output, out.output
    small = CliRunner().invoke(main, args + ["--near-duplicates", "--near-sample", "2", "--json"])
    assert json.loads(small.stdout)[0]["near_duplicates"]["sampled"] == 2
    assert "near_duplicates" not in json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)[0]
    # The sample holds what a build keeps: a line with a control character, which the
    # scan's own pass counts as a kind of bad input, is compared too.
    write_lines(tmp_path / "b.txt", [base + "\x07", base + "\x07", "Something else entirely."])
    ctrl = CliRunner().invoke(main, ["scan", "--source", f"text:{tmp_path}/b.txt", "--near-duplicates"])
    assert "of the 3 records sampled (1 would be removed" in ctrl.output, ctrl.output
    # A record the source's policy raises on ends that file's sample, and the line says where.
    (tmp_path / "m.jsonl").write_text('{"text": "a b c"}\n{"nope": 1}\n{"text": "d e f"}\n')
    missing = CliRunner().invoke(main, ["scan", "--source", f"jsonl:{tmp_path}/m.jsonl#text", "--near-duplicates"])
    assert missing.exit_code == 1, missing.output  # scan: some records a build would raise on
    assert "of the 1 records sampled" in missing.output and "the sample stopped early in 1 file" in missing.output
    assert "line 2 (byte 18) has no field 'text'" in missing.output, missing.output
    # Parameters that name a field the records lack: one error line, as a build gives.
    bogus = CliRunner().invoke(main, ["scan", "--source", f"jsonl:{tmp_path}/m.jsonl#inputs=text,targets=text",
                                      "--near-duplicates", "fields=bogus"])
    assert bogus.exit_code == 1 and "has no field 'bogus', which near-duplicate detection reads" in bogus.output, \
        bogus.output


def test_a_source_given_twice_is_refused_not_half_built(tmp_path):
    """click keeps the last of a repeated single-value option; ``build`` and ``scan`` refuse it."""
    write_lines(tmp_path / "a.txt", ["one", "two"])
    write_lines(tmp_path / "b.txt", ["three"])
    for command in (["build", "--name", "x", "--cache-dir", str(tmp_path / "c")], ["scan"]):
        out = CliRunner().invoke(main, [*command, "--source", f"text:{tmp_path}/a.txt",
                                        "--source", f"text:{tmp_path}/b.txt"])
        assert out.exit_code == 2, out.output
        assert "given 2 times" in out.output and "give it once" in out.output
    assert not (tmp_path / "c").exists()


def test_a_task_module_that_raises_is_one_error_line_and_its_traceback_with_verbose(tmp_path, monkeypatch):
    bad = tmp_path / "bad_metric_tasks.py"
    bad.write_text(
        "from seqcache import tasks\n"
        "def wrong(predictions):\n"
        "    return {'x': 0.0}\n"
        "tasks.TaskRegistry.add('bad_metric_task', source=tasks.TextLineSource('unused.txt'),\n"
        "    output_features={'targets': tasks.Feature(tasks.ByteVocabulary())}, metric_fns=[wrong])\n",
        encoding="utf-8",
    )
    monkeypatch.chdir(tmp_path)
    for args in (["tasks", "--module", str(bad)], ["tasks", "--module", "bad_metric_tasks"],
                 ["build", "bad_metric_task", "--module", str(bad), "--cache-dir", str(tmp_path / "c")],
                 ["eval", "--checkpoint-dir", str(tmp_path), "--module", str(bad), "--task", "x"]):
        out = CliRunner().invoke(main, args)
        lines = out.output.strip().splitlines()
        assert out.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: --module "), (args, out.output)
        assert "bad_metric_tasks" in lines[0] and "TypeError" in lines[0] and "'wrong'" in lines[0], lines[0]
        assert "line 4" in lines[0], lines[0]  # the module's own line that raised
    out = CliRunner().invoke(main, ["build", "bad_metric_task", "--module", str(bad), "--cache-dir",
                                    str(tmp_path / "c"), "-v"])
    assert out.exit_code == 1 and "Traceback" in out.output and out.output.strip().splitlines()[-1].startswith("error:")


def test_a_bare_sequence_length_is_every_feature_of_a_registered_task(tmp_path):
    (tmp_path / "a.txt").write_text("a long first line\nsecond line here\n", encoding="utf-8")
    module = tmp_path / "pair_tasks_for_lengths.py"
    module.write_text(
        "from seqcache import tasks\n"
        "from seqcache.tasks import preprocessors as P\n"
        f"tasks.TaskRegistry.add('pair_lengths', source=tasks.TextLineSource({str(tmp_path / 'a.txt')!r}),\n"
        "    output_features={'inputs': tasks.Feature(tasks.ByteVocabulary()),\n"
        "                     'targets': tasks.Feature(tasks.ByteVocabulary())},\n"
        "    preprocessors=[P.rekey({'inputs': 'text', 'targets': 'text'}), P.tokenize(), P.append_eos_after_trim()])\n",
        encoding="utf-8",
    )
    for lengths, expected in ((["5"], {"inputs": 5, "targets": 5}),
                              (["5", "targets=7"], {"inputs": 5, "targets": 7})):
        out = CliRunner().invoke(main, ["build", "pair_lengths", "--module", str(module), "--cache-dir",
                                        str(tmp_path / "c"), "--overwrite", "--num-shards", "1",
                                        *[x for n in lengths for x in ("--sequence-length", n)]])
        assert out.exit_code == 0, out.output
        cache = str(tmp_path / "c" / "pair_lengths" / "train")
        assert fmt.read_manifest(cache).sequence_length == expected
        from seqcache.feeders.reader import CacheReader

        with CacheReader(cache) as r:
            examples = list(r.read_examples(list(range(len(r)))))
        assert len(examples) == 2
        assert all(len(ex[f]) == expected[f] for ex in examples for f in expected)  # both lines are longer


def test_tasks_names_the_class_of_a_users_source_subclass(tmp_path, monkeypatch):
    (tmp_path / "subclassed_source_task.py").write_text(
        "from seqcache import tasks\n"
        "class Upper(tasks.TextLineSource):\n"
        "    def read_split(self, split):\n"
        "        for r in super().read_split(split):\n"
        "            yield self.with_data(r, lambda d: {'text': d['text'].upper()}, path=split.path)\n"
        "tasks.TaskRegistry.add('subclassed_source_task', source=Upper('/x/*.txt'),\n"
        "                       output_features={'targets': tasks.Feature(tasks.ByteVocabulary())})\n")
    monkeypatch.chdir(tmp_path)
    from seqcache import tasks

    try:
        out = CliRunner().invoke(main, ["tasks", "--module", "subclassed_source_task", "--json"])
    finally:  # the registry is the process's: other tests list its names
        if "subclassed_source_task" in tasks.TaskRegistry.names():
            tasks.TaskRegistry.remove("subclassed_source_task")
    assert out.exit_code == 0, out.output
    [row] = [t for t in json.loads(out.output)["tasks"] if t["name"] == "subclassed_source_task"]
    assert row["source"] == "text lines of /x/*.txt (subclassed_source_task.Upper)"
