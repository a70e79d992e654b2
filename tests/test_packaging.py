"""The installed package's layout (docs/architecture.md): one copy of every
module under one name, its data files, its entry points, and no folder of the
repository root in the way of the installed package."""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import importlib.util
import pathlib
import subprocess
import sys

import pytest

import seqcache

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROBE = ("import importlib.util, seqcache, seqcache.tasks, seqcache.feeders; "
         "print(seqcache.__file__); print(importlib.util.find_spec('seqcache.seqcache'))")


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_the_package_imports_once_from_the_repository_root_and_elsewhere(tmp_path, where):
    """``python -c`` puts its working directory first on sys.path: from the
    repository root too, ``seqcache`` is the package the tests import, whole
    (``seqcache.tasks``), and ``seqcache.seqcache`` (a second copy of the core)
    does not exist."""
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT if where == "root" else tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [seqcache.__file__, "None"], done.stdout


def test_python_m_seqcache_cli_from_the_repository_root_is_the_command():
    done = subprocess.run([sys.executable, "-m", "seqcache.cli", "--version"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(seqcache.__version__), done.stdout


@pytest.mark.parametrize("old", ["seqcache.seqcache", "seqcache.commands", "seqcache.verify", "seqcache.report",
                                 "seqcache.executable", "seqcache.interrupts", "seqcache.feeders.t5x",
                                 "seqcache.feeders.export", "seqcache.feeders.t5x_gin",
                                 "seqcache.__main__"])
def test_a_module_has_one_name(old):
    assert importlib.util.find_spec(old) is None, f"{old} is importable: a second copy under an old name"


def test_the_package_data_is_installed():
    from seqcache.feeders.trainers import t5x

    schema = importlib.resources.files("seqcache").joinpath("manifest.schema.json")
    assert schema.is_file() and '"$schema"' in schema.read_text(encoding="utf-8")
    gins = sorted(p.name for p in pathlib.Path(t5x.gin_dir()).glob("*.gin"))
    assert gins == sorted(p.name for p in (ROOT / "feeders" / "trainers" / "t5x_gin").glob("*.gin")) and gins
    templates = sorted(p.name for p in importlib.resources.files("seqcache.cli").joinpath("templates").iterdir())
    assert templates == sorted(p.name for p in (ROOT / "cli" / "templates").glob("*.j2")) and templates


def test_the_seqcache_command_is_the_executable():
    (entry,) = importlib.metadata.entry_points(group="console_scripts", name="seqcache")
    assert entry.value == "seqcache.cli.executable:run"
    from seqcache.cli import executable

    assert entry.load() is executable.run
