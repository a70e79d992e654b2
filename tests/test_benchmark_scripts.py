"""The benchmark scripts run from the repository root (where the folder
``seqcache/`` comes first on sys.path), child processes included."""

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
def test_scale_benchmark_builds_with_a_sentencepiece_model(tmp_path):
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


def test_small_files_benchmark_builds_both_and_compares_the_shards(tmp_path):
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


def test_overlap_benchmark_builds_scans_and_measures_memory(tmp_path):
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
