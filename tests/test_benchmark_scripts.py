"""The benchmark scripts run from the repository root (which comes first on
sys.path and holds no ``seqcache/`` folder: they import the installed package),
child processes included.

A script that reads the corpora of ../shared/data (tinyshakespeare, C4,
NTREX-128, WikiText-2: ``DATA`` in scale.py, small_files.py, pipeline.py) is
tested with the ``shared_data`` fixture, so that a checkout without them
skips the test, saying why, and CI fails it (tests/conftest.py;
tests/test_ci_requires_data.py runs this file without the corpora)."""

import json
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a fresh interpreter importing JAX and Beam: the slow tests run it
def test_feeder_benchmark_runs_from_the_repository_root(tmp_path):
    out = tmp_path / "feeder.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/feeder.py", "--records", "3000", "--length", "32", "--shards", "2",
         "--batch-size", "32", "--threads", "2", "--steps", "4", "--grain-steps", "4", "--rounds", "1",
         "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    # The RSS child (a fresh interpreter) opened the cache and read a batch.
    rss = {k: v for k, v in report.items() if "rss" in k.lower()}
    assert rss and all(isinstance(v, (int, float)) and v > 0 for v in rss.values()), report


@pytest.mark.slow  # a fresh interpreter importing JAX and Beam: the slow tests run it
def test_scale_benchmark_builds_with_a_sentencepiece_model(tmp_path, shared_data):
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/scale.py", "--mb", "0.5", "--dask-mb", "0", "--vocabulary", "sentencepiece",
         "--vocab-size", "1000", "--corpus", "documents", "--work-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["vocabulary"] == "sentencepiece" and report["vocab_size"] == 1000, report
    (row,) = report["rows"]
    # The byte vocabulary stores at least 2 bytes a raw byte (a uint16 token a
    # byte); 1,000 pieces hold several characters each.
    assert row["examples"] == row["records"] > 0 and 0 < row["cache_mb"] < 2 * row["mb"], row


def test_small_files_benchmark_builds_both_and_compares_the_shards(tmp_path, shared_data):
    out = tmp_path / "small_files.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/small_files.py", "--files", "40", "--repeat", "1", "--work-dir", str(tmp_path),
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["rounds"]
    assert report["files"] == 40 and report["data_sha256_equal"], report
    assert row["one"]["data_sha256"] == row["many"]["data_sha256"] and row["one"]["examples"] == 32_777, row
    assert all(report[f"ratio_{what}"]["median"] > 0 for what in ("wall_s", "cpu_s", "build_s")), report
    # The source table is in its own file: the manifests are within bytes of each other, the tables are not.
    assert abs(report["many_manifest_bytes"] - report["one_manifest_bytes"]) < 64, report
    assert report["many_source_table_bytes"] > report["one_source_table_bytes"] + 39 * len("part-00000.txt"), report


def test_small_files_corpus_of_one_line_files_repeats_the_lines_with_a_copy_number(shared_data):
    sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
    try:
        import small_files
    finally:
        sys.path.remove(os.path.join(REPO_ROOT, "benchmarks"))
    lines = small_files.corpus_lines(1, None)
    n = len(lines)
    assert n == 40_000 and lines[0] == b"First Citizen:"
    many = small_files.corpus_lines(n + 3, 1)
    assert len(many) == n + 3 and many[:n] == lines
    assert many[n:] == [b"2 " + lines[0], b"2 " + lines[1], b"2 " + lines[2]]
    assert small_files.corpus_lines(5, 2) == lines[:10]


def test_overlap_benchmark_builds_scans_and_measures_memory(tmp_path, shared_data):
    out = tmp_path / "overlap.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/overlap.py", "--mb", "1", "--mb2", "0", "--repeat", "1", "--bench-mb",
         "--work-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    (row,) = report["speed"]["rounds"]
    assert row["scanned_examples"] > 0 and row["build_mb_s"] > 0 and row["scan_mb_s"] > 0, report
    (ntrex,) = report["memory"]
    assert ntrex["items"] == 1997 and ntrex["peak_tree_rss_mb"] > 0, report


@pytest.mark.slow  # a batch search and a training run (about 20-35 s)
def test_accelerator_benchmark_searches_the_batch_and_trains_from_a_cache(tmp_path, tmp_path_factory,
                                                                          shakespeare_lm_cache):
    cache = shakespeare_lm_cache(tmp_path_factory, num_lines=400, sequence_length=64) / "shakespeare_lm" / "train"
    out = tmp_path / "accelerator.json"
    # The CPU reports no memory limit: --memory-limit gives one, so that the search
    # runs (the tiny model's step takes a few MB per device: some sizes fit, some not).
    done = subprocess.run(
        [sys.executable, "benchmarks/accelerator.py", "--cache", str(cache), "--models", "tiny",
         "--batch-sizes", "8", "--steps", "4", "--warmup", "1", "--max-batch", "16",
         "--memory-limit", "4600000", "--set", "optimizer.lr=1e-3", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    env = report["environment"]
    assert env["sequence_length"] == 64 and env["overrides"] == ["optimizer.lr=1e-3"], env
    assert "--memory-limit 4600000" in env["command"], env
    (search,) = report["search"]
    tried = search["tried"]
    assert [t["batch_size"] for t in tried] == [8, 16][:len(tried)], tried
    # Every size up to the largest fits within 95% of the limit; the one after it does not.
    fitting = [t["batch_size"] for t in tried if t["fits"]]
    assert fitting == [t["batch_size"] for t in tried[:len(fitting)]], tried
    assert search["largest"] == max(fitting, default=None), search
    assert all((t["program_bytes"] <= 4_370_000) == t["fits"] for t in tried), tried
    assert sorted(t["program_bytes"] for t in tried) == [t["program_bytes"] for t in tried], tried
    assert len(tried) == 2 or not tried[-1]["fits"], tried
    runs = {r["batch_size"]: r for r in report["runs"]}
    assert set(runs) == {8} | set(fitting[-1:]), runs
    for b, row in runs.items():
        assert row["status"] == "ok" and row["steps_measured"] == 3, row
        assert row["tokens_per_step"] == b * 64 and row["tokens_per_s"] > 0 and 0 <= row["data_wait_share"] < 1, row
        assert row["largest_that_fits"] == (b == search["largest"]), row
    assert "| tiny | 0.1 M | 8 | 64 |" in done.stdout, done.stdout


@pytest.mark.slow  # a build on every runner (about 15-35 s)
def test_runners_benchmark_builds_on_each_runner_and_compares_the_shards(tmp_path, shared_data):
    out = tmp_path / "runners.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/runners.py", "--mb", "0.3", "--runners", "local,multi_processing,prism",
         "--ratio", "--work-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(s["runner"], s["workers"]): s for s in report["summary"]}
    assert set(rows) == {("local", 1), ("multi_processing", 2), ("prism", 1), ("multi_processing", 1)}, rows
    assert all(s["same_bytes"] and s["cpu_s"] > 0 and s["peak_tree_rss_mb"] > 0 for s in rows.values()), rows
    mp = rows[("multi_processing", 2)]
    assert mp["cpu_2_over_1"] == round(mp["cpu_s"] / rows[("multi_processing", 1)]["cpu_s"], 3), mp
    assert len({r["examples"] for r in report["rows"]}) == 1 and report["rows"][0]["examples"] > 100, report["rows"]


@pytest.mark.slow  # a fresh interpreter importing JAX: the slow tests run it
def test_decode_benchmark_gives_the_same_tokens_with_and_without_the_cache(tmp_path):
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/decode.py", "--models", "tiny,t5-tiny", "--batch-size", "2", "--prompt", "6",
         "--length", "4", "--vocab", "64", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [row["model"] for row in report] == ["tiny", "t5-tiny"]
    assert all(row["same_tokens"] and row["cache_tokens_per_s"] > 0 for row in report), report


@pytest.mark.slow  # nine builds of a small corpus (about 25 s)
def test_resume_benchmark_kills_grows_changes_and_compares_the_bytes(tmp_path, shared_data):
    out = tmp_path / "resume.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/resume.py", "--mb", "1", "--files", "4", "--repeat", "1", "--kill-at", "0.3",
         "--work-dir", str(tmp_path), "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["bytes_equal"] and set(report["ratios"]) == {"rerun_after_kill", "grown", "one_file_changed",
                                                                "cpu_keeping_work"}
    (round_,) = report["rounds"]
    grown = round_["grown"]["work"]
    assert grown["units_reused"] >= 1 and grown["units_reused"] < grown["units"]


@pytest.mark.slow  # fourteen fresh interpreters (about 20 s)
def test_hostile_input_benchmark_refuses_every_shape_in_one_line(tmp_path):
    out = tmp_path / "hostile.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/hostile_input.py", "--only", "resume,info", "--timeout", "60", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {row["entry"] for row in rows} == {"resume: feeder/metadata", "info"} and len(rows) == 14, rows
    for row in rows:  # every refusal one line; the byte order mark read as the rest of the file
        assert (row["exit"], row["lines"] == 1) == ((0, False) if row["shape"] == "BOM" else (1, True)), row
        assert 0 < row["peak_rss_mb"] < 300 and row["seconds"] < 60, row


@pytest.mark.slow  # a fresh interpreter importing Beam, a build of 600 documents: the slow tests run it
def test_near_duplicates_benchmark_measures_recall_per_band_of_similarity(tmp_path, shared_data):
    out = tmp_path / "near.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/near_duplicates.py", "--no-cost", "--quality", "300", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    bands = json.loads(out.read_text())["quality"]["bands"]
    assert sum(b["pairs"] for b in bands) == 300
    top = bands[-1]  # J >= 0.9: every pair found, as the curve says
    assert top["pairs"] and top["removed"] == top["pairs"] and top["predicted"] > 0.99


def test_startup_benchmark_counts_modules_and_times_each_command(tmp_path):
    out = tmp_path / "startup.json"
    done = subprocess.run([sys.executable, "benchmarks/startup.py", "--repeat", "1", "--json", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {row["command"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"seqcache --help", "seqcache build --help", "seqcache scan (one line)",
                         "seqcache build (one record)"}, rows
    assert all(row["modules"] > 50 and row["cpu_s"] > 0 for row in rows.values()), rows
    # Beam comes with the build alone (tests/test_startup.py pins the counts).
    assert rows["seqcache --help"]["modules"] < rows["seqcache build --help"]["modules"] \
        < rows["seqcache build (one record)"]["modules"], rows


@pytest.mark.slow  # a fresh interpreter importing the feeders
def test_host_wait_benchmark_measures_both_feeders_on_an_encoder_decoder_cache(tmp_path, corpora):
    from seqcache import tasks
    from seqcache.pipelines.build import BuildConfig, build_task
    from seqcache.tasks import preprocessors as P

    v = tasks.ByteVocabulary(extra_ids=10)
    d = corpora.multi30k
    task = tasks.Task("m30k_wait", source=tasks.ParallelTextSource({"en": str(d / "val.en.gz"),
                                                                    "de": str(d / "val.de.gz")}),
                      output_features={"inputs": tasks.Feature(v), "targets": tasks.Feature(v)},
                      preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(),
                                     P.append_eos_after_trim()])
    built = build_task(task, cache_dir=str(tmp_path), config=BuildConfig(
        num_shards=2, sequence_length={"inputs": 96, "targets": 96}))
    out = tmp_path / "wait.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/host_wait.py", "--cache", built.cache_dir, "--batch-size", "8", "--step-ms",
         "5", "--steps", "6", "--warmup", "2", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report) == {"read ahead", "on the caller", "ratio"}
    assert all(len(report[k]["ms"]) == 1 and report[k]["ms"][0] > 0 for k in ("read ahead", "on the caller"))
    assert "| read ahead |" in done.stdout


@pytest.mark.slow  # a build and five trainings in fresh interpreters (about 20 s)
def test_compile_cache_benchmark_reads_the_resumed_train_step_from_the_cache(tmp_path, shared_data):
    out = tmp_path / "compile_cache.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/compile_cache.py", "--models", "tiny", "--rounds", "1", "--length", "64",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert row["model"] == "tiny" and row["hits"] >= 1
    assert row["compile_s_cache"] > 0 and row["compile_s_off"] > 0
    assert row["ratio"] == pytest.approx(row["compile_s_cache"] / row["compile_s_off"], abs=0.01)
