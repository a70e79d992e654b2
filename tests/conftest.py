"""Test-wide set-up.

Eight host-platform devices let sharding tests run on CPU; the flag must be set
before JAX is first imported, so it is set here, at collection time.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib

import pytest

SHARED_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def _run_outside_the_source_tree(tmp_path_factory):
    """Every test (and every process it starts: Beam workers, resume checks) runs
    from an empty folder. From the repository root, ``python -m``/``-c`` would put
    the source folder ``seqcache/`` first on sys.path and shadow the installed
    package, whose subpackages live elsewhere in the source tree."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The real corpora in ../shared/data (never copied into the repository).

    Outside CI a checkout without the corpora skips the tests that need them; under
    CI (``CI`` set to a true value) a missing folder fails those tests instead, so
    that a run without the data can never pass while testing little."""
    if not SHARED_DATA.is_dir():
        message = f"shared corpora not found at {SHARED_DATA}"
        if _under_ci():
            pytest.fail(message + " (CI is set: the corpora are required)", pytrace=False)
        pytest.skip(message)
    return SHARED_DATA


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")
