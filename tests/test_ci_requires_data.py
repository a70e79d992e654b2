"""Under CI a missing ../shared/data fails the tests that need it; elsewhere it skips them.

The check runs the project's own conftest in a fresh pytest process, with the
corpora folder pointed at a path that does not exist; and the benchmark
scripts' tests (tests/test_benchmark_scripts.py) in a copy of the checkout
with no ../shared/data beside it, as a clone elsewhere has, where the scripts
look for their corpora too."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent
CONFTEST = TESTS / "conftest.py"
# The benchmark scripts' tests that read no corpus (and take a minute each):
# not run in the copy. Any other test of the file must skip there.
NEEDS_NO_CORPUS = ("test_feeder_benchmark_runs_from_the_repository_root",
                   "test_decode_benchmark_gives_the_same_tokens_with_and_without_the_cache",
                   "test_hostile_input_benchmark_refuses_every_shape_in_one_line",
                   "test_startup_benchmark_counts_modules_and_times_each_command")


def _run(tmp_path, ci_value):
    text = CONFTEST.read_text()
    marker = 'SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"'
    assert marker in text, "conftest no longer defines SHARED_DATA the way this test expects"
    (tmp_path / "conftest.py").write_text(text.replace(marker, f"SHARED_DATA = pathlib.Path({str(tmp_path / 'absent')!r})"))
    (tmp_path / "test_needs_data.py").write_text("def test_needs_data(shared_data):\n    assert shared_data.is_dir()\n")
    env = {"PATH": "/usr/bin:/bin", "CI": ci_value, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ci_value", ["true"])
def test_missing_corpora_fail_under_ci(tmp_path, ci_value):
    result = _run(tmp_path, ci_value)
    assert result.returncode != 0, result.stdout
    assert "1 error" in result.stdout or "1 failed" in result.stdout, result.stdout
    assert "the corpora are required" in result.stdout


def test_missing_corpora_skip_outside_ci(tmp_path):
    result = _run(tmp_path, "")
    assert result.returncode == 0, result.stdout
    assert "1 skipped" in result.stdout, result.stdout


def _run_benchmark_tests_without_corpora(tmp_path, ci_value):
    """tests/test_benchmark_scripts.py in a copy of the checkout (tests/conftest.py,
    the test file, benchmarks/) at tmp_path/repo, with no tmp_path/shared/data:
    (pytest's output, its counts by outcome)."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for name in ("conftest.py", "testsupport.py", "test_benchmark_scripts.py"):
        shutil.copy(TESTS / name, repo / "tests" / name)
    shutil.copytree(TESTS.parent / "benchmarks", repo / "benchmarks",
                    ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    assert not (tmp_path / "shared").exists()
    env = {"PATH": "/usr/bin:/bin", "CI": ci_value, "JAX_PLATFORMS": "cpu",
           **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
    deselect = [f"--deselect=tests/test_benchmark_scripts.py::{name}" for name in NEEDS_NO_CORPUS]
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "tests/test_benchmark_scripts.py", *deselect],
                            cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    counts = {word.rstrip("s"): int(n) for n, word in
              re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", result.stdout.splitlines()[-1])}
    return result.stdout, counts


def test_benchmark_script_tests_skip_without_corpora_saying_why(tmp_path):
    """A clone without ../shared/data: every benchmark test that reads a corpus
    skips, naming the folder, and none fails (three of them failed, reading
    the corpora the scripts did not find)."""
    out, counts = _run_benchmark_tests_without_corpora(tmp_path, "")
    tests = len(re.findall(r"^def test_", (TESTS / "test_benchmark_scripts.py").read_text(), re.M))
    assert counts == {"skipped": tests - len(NEEDS_NO_CORPUS), "deselected": len(NEEDS_NO_CORPUS)}, out
    reasons = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all(f"shared corpora not found at {tmp_path / 'shared' / 'data'}" in line
                           for line in reasons), out


def test_benchmark_script_tests_fail_without_corpora_under_ci(tmp_path):
    out, counts = _run_benchmark_tests_without_corpora(tmp_path, "true")
    tests = len(re.findall(r"^def test_", (TESTS / "test_benchmark_scripts.py").read_text(), re.M))
    assert counts == {"error": tests - len(NEEDS_NO_CORPUS), "deselected": len(NEEDS_NO_CORPUS)}, out
    assert out.count("the corpora are required") >= counts["error"], out
