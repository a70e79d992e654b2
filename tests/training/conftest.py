"""Fixtures for the trainer tests.

The fake feeder module is loaded under a unique module name so that it cannot
collide with helper modules of other test folders (tests run with
``--import-mode=importlib``, without package ``__init__`` files).
"""

import importlib.util
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
FAKES_MODULE = "seqcache_training_test_fakes"


def _load_fakes():
    if FAKES_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(FAKES_MODULE, HERE / "fakes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[FAKES_MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[FAKES_MODULE]


_load_fakes()


import jax
import pytest


@pytest.fixture(scope="session")
def _compilation_cache_dir(tmp_path_factory):
    """One folder for this test run: under pytest-xdist, the parent of the
    workers' own temporary folders, so that a program one worker compiled is
    loaded by the other."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return str(tmp_path_factory.mktemp("jax-compilation-cache"))
    path = tmp_path_factory.getbasetemp().parent / "jax-compilation-cache"
    path.mkdir(exist_ok=True)
    return str(path)


_CACHE_OPTIONS = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": -1,
}
if importlib.util.find_spec("filelock") is not None:
    # A size limit makes JAX lock the folder around each read and write: several
    # processes (xdist workers, the children they start) share it. No entry is evicted.
    _CACHE_OPTIONS["jax_compilation_cache_max_size"] = 1 << 40


@pytest.fixture(autouse=True, scope="module")
def _reuse_compiled_programs(_compilation_cache_dir):
    """A per-session persistent compilation cache for these tests: several tests
    build trainers whose programs are identical (same config, same mesh), and
    loading the executable instead of compiling it again keeps the suite fast.
    A cached executable is the one XLA compiled for the same program, so results
    are the same."""
    options = {"jax_compilation_cache_dir": _compilation_cache_dir, **_CACHE_OPTIONS}
    previous = {name: getattr(jax.config, name) for name in options}
    for name, value in options.items():
        jax.config.update(name, value)
    yield
    for name, value in previous.items():
        jax.config.update(name, value)


@pytest.fixture(scope="session")
def compilation_cache_env(_compilation_cache_dir) -> dict:
    """Environment variables that give a child process the same compilation cache."""
    env = {"JAX_COMPILATION_CACHE_DIR": _compilation_cache_dir}
    env.update({name.upper(): str(value) for name, value in _CACHE_OPTIONS.items()})
    return env

