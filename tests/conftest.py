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


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """The real corpora in ../shared/data (never copied into the repository)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared corpora not found at {SHARED_DATA}")
    return SHARED_DATA
