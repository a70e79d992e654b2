"""``--compilation-cache``: where JAX's persistent compilation cache lives, and
a run stopped and resumed in a fresh process that loads its train step from it
instead of compiling it again."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from seqcache.training import compile_cache
from testsupport import SMALL_MODEL

L = 64


@pytest.mark.parametrize("flag, platform, environ, expected", [
    ("off", "tpu", {"JAX_COMPILATION_CACHE_DIR": "/env"}, None),
    ("/given", "cpu", {"JAX_COMPILATION_CACHE_DIR": "/env"}, "/given"),
    (None, "cpu", {"JAX_COMPILATION_CACHE_DIR": "/env"}, "/env"),
    (None, "cpu", {"JAX_COMPILATION_CACHE_DIR": "~/env"}, os.path.expanduser("~/env")),
    (None, "tpu", {"XDG_CACHE_HOME": "/xdg"}, "/xdg/seqcache/jax"),
    (None, "gpu", {"XDG_CACHE_HOME": "/xdg"}, "/xdg/seqcache/jax"),
    (None, "cpu", {"XDG_CACHE_HOME": "/xdg"}, None),
])
def test_the_folder_comes_from_the_flag_then_jax_variable_then_the_device(flag, platform, environ, expected):
    assert compile_cache.resolve(flag, platform=platform, environ=environ) == expected


def test_the_default_folder_is_under_the_users_cache():
    home = os.path.expanduser("~")
    assert compile_cache.default_dir({}) == os.path.join(home, ".cache", "seqcache", "jax")


def _train(cache_root, ckpt, folder, *extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    # Tiny programs compile in well under JAX's default threshold of 1 s for writing them.
    env.update(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    args = [sys.executable, "-m", "seqcache.cli", "train", "--cache-dir", str(cache_root), "--task", "shakespeare_lm",
            "--batch-size", "8", "--sequence-length", str(L), "--checkpoint-dir", str(ckpt), "--model", "tiny",
            "--set", SMALL_MODEL, "--set", "progress=false", "--steps", "3", "--no-tensorboard",
            "--compilation-cache", str(folder), *extra]
    proc = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_a_resumed_run_loads_its_train_step_from_the_cache(tmp_path, shakespeare_lm_cache, tmp_path_factory):
    root = shakespeare_lm_cache(tmp_path_factory, num_lines=300, sequence_length=L)
    folder, ckpt = tmp_path / "jax-cache", tmp_path / "run"
    first = _train(root, ckpt, folder, "--stop-at-step", "1")
    assert first["end_step"] == 1
    assert first["compilation_cache"]["dir"] == str(folder)
    assert first["compilation_cache"]["hits"] == 0 and first["compilation_cache"]["misses"] >= 1
    entries = sorted(os.listdir(folder))
    assert entries

    resumed = _train(root, ckpt, folder)  # a fresh process: the same train step, read from the folder
    assert resumed["start_step"] == 1 and resumed["end_step"] == 3
    assert resumed["compilation_cache"]["hits"] >= 1 and resumed["compilation_cache"]["misses"] == 0
    assert sorted(os.listdir(folder)) == entries

    # The entries do not depend on the folder's path: a copy elsewhere serves a new run as well.
    moved = tmp_path / "elsewhere" / "jax-cache"
    shutil.copytree(folder, moved)
    again = _train(root, tmp_path / "run2", moved, "--stop-at-step", "1")
    assert again["compilation_cache"]["hits"] >= 1 and again["compilation_cache"]["misses"] == 0
    assert again["params_sha256"] == first["params_sha256"]
