"""Faults while building: a full disk gives a clear error, publishes nothing, and
a re-run with space succeeds with the bytes of an undisturbed build."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, BuildError, build_task


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real file system that fills up (needs root)."""
    mount_point = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=False)


def _task(pattern):
    return tasks.Task(
        "lines",
        source=tasks.TextLineSource(pattern),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )


def test_full_disk_is_a_clear_error_and_a_rerun_succeeds(tmp_path, small_disk, shared_data):
    corpus = str(shared_data / "tinyshakespeare" / "input.txt")  # 1.1 MB of text: ~4.5 MB of int32 tokens
    with pytest.raises(BuildError, match="no space left on the device.*nothing was published"):
        build_task(_task(corpus), cache_dir=str(small_disk), config=BuildConfig(num_shards=2))
    out_dir = small_disk / "lines" / "train"
    assert not (out_dir / fmt.MANIFEST_NAME).exists()
    assert not (out_dir / "_tmp").exists()  # the spill files were freed
    # Space freed (the file system grown), the same build in the same place succeeds,
    # with the bytes of a build that never failed.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = build_task(_task(corpus), cache_dir=str(small_disk), config=BuildConfig(num_shards=2))
    assert not again.reused
    fresh = build_task(_task(corpus), cache_dir=str(tmp_path / "fresh"), config=BuildConfig(num_shards=2))
    assert [s.sha256 for s in again.manifest.shards] == [s.sha256 for s in fresh.manifest.shards]
    assert again.manifest.num_examples == 40000
