"""What the ``seqcache`` executable imports (benchmarks/README.md, "Start-up:
what a command imports"): ``seqcache --help`` the group and click alone,
``seqcache build --help`` the command's flags without Beam, and a one-record
local build Beam and its local engine without pandas
(``seqcache.process.import_beam``), cloud file systems, TensorFlow or JAX.
Beam's own package imports every IO connector it has (``apache_beam.io``'s
``__init__``: pymongo, boto3, BigQuery's modules); seqcache does not reach
into Beam's import to avoid them. Each command runs in a fresh interpreter
that writes the names in ``sys.modules`` as it exits; the bounds are the
counts measured when they were set, plus about 10%, so that an import that
creeps back in fails here."""

import json
import os
import subprocess
import sys

import pytest

# The executable, with the modules loaded written to $SEQCACHE_MODULES_OUT at exit.
WRAPPER = r'''
import atexit, json, os, sys


def _write():
    with open(os.environ["SEQCACHE_MODULES_OUT"], "w") as f:
        json.dump(sorted(sys.modules), f)


atexit.register(_write)
sys.argv[0] = "seqcache"
from seqcache.cli.executable import run

run()
'''

# Measured counts (Python 3.11, the test extras installed) and the bounds: +~10%.
HELP_MODULES = 163
BUILD_HELP_MODULES = 417
ONE_RECORD_BUILD_MODULES = 1708
HEADROOM = 1.1

# What a local build of text needs none of (Beam's own import brings boto3 and
# pymongo, with its S3 file system and MongoDB connector).
NOT_IN_A_LOCAL_BUILD = ("pandas", "tensorflow", "jax", "s3fs", "gcsfs", "torch", "matplotlib")


def _modules(tmp_path, *args, expect_ok=True) -> tuple[list[str], subprocess.CompletedProcess]:
    """The modules loaded by ``seqcache ARGS`` run in ``tmp_path``, and the
    finished process (status 0, or 2, a usage error, without ``expect_ok``)."""
    script = tmp_path / "seqcache_modules.py"
    script.write_text(WRAPPER)
    out = tmp_path / "modules.json"
    env = {**os.environ, "SEQCACHE_MODULES_OUT": str(out)}
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=env)
    assert done.returncode == (0 if expect_ok else 2), done.stderr[-3000:]
    return json.loads(out.read_text()), done


def _under(modules, *packages) -> list[str]:
    """The modules of ``modules`` that are one of ``packages`` or inside one."""
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


def test_seqcache_help_imports_the_group_alone(tmp_path):
    modules, done = _modules(tmp_path, "--help")
    assert "build" in done.stdout and "Commands" in done.stdout
    assert len(modules) <= HELP_MODULES * HEADROOM, f"{len(modules)} modules (measured {HELP_MODULES})"
    assert not _under(modules, "apache_beam", "numpy", "rich", "pyarrow", "msgspec", "seqcache.tasks")
    assert not [m for m in modules if m.startswith("seqcache.cli.commands.")]  # the summaries come from the text


@pytest.mark.parametrize("flags", [["--source", "nosuchkind:x.txt", "--name", "t"], ["--source", "text:x.txt"],
                                   ["--source", "text:x.txt", "--name", "t", "--no-pack", "--pack", "lm"]],
                         ids=["bad source spec", "no name", "contradicting flags"])
def test_a_bad_build_flag_is_refused_before_beam_is_imported(tmp_path, flags):
    modules, done = _modules(tmp_path, "build", *flags, "--cache-dir", "caches", expect_ok=False)
    assert "Error:" in done.stderr and not _under(modules, "apache_beam", "seqcache.cli.commands.build_run")


def test_build_help_imports_no_beam(tmp_path):
    modules, done = _modules(tmp_path, "build", "--help")
    assert "--cache-dir" in done.stdout and "--source" in done.stdout
    assert len(modules) <= BUILD_HELP_MODULES * HEADROOM, f"{len(modules)} modules (measured {BUILD_HELP_MODULES})"
    assert not _under(modules, "apache_beam", "seqcache.pipelines.build", "seqcache.pipelines.runner",
                      "seqcache.cli.commands.build_run", "grpc", "jax", "tensorflow", "pandas")


def test_a_one_record_local_build_imports_beam_without_pandas_or_ml_frameworks(tmp_path):
    (tmp_path / "one.txt").write_text("hello world\n")
    modules, done = _modules(tmp_path, "build", "--source", "text:one.txt", "--name", "one",
                             "--cache-dir", str(tmp_path / "caches"))
    assert "1 example in 1 shard" in done.stderr, done.stderr
    assert (tmp_path / "caches" / "one" / "train" / "manifest.json").exists()
    assert len(modules) <= ONE_RECORD_BUILD_MODULES * HEADROOM, \
        f"{len(modules)} modules (measured {ONE_RECORD_BUILD_MODULES})"
    assert "apache_beam.runners.portability.fn_api_runner" in modules  # the local engine: Beam is there
    assert not _under(modules, *NOT_IN_A_LOCAL_BUILD)
    # google.cloud alone is a namespace package (Beam's Dataflow runner tries `from google.cloud import
    # dataflow`); a client library would be a module inside it.
    assert not [m for m in modules if m.startswith("google.cloud.")]
