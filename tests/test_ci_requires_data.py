"""Under CI a missing ../shared/data fails the tests that need it; elsewhere it skips them.

The check runs the project's own conftest in a fresh pytest process, with the
corpora folder pointed at a path that does not exist."""

import pathlib
import subprocess
import sys

import pytest

CONFTEST = pathlib.Path(__file__).with_name("conftest.py")


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
