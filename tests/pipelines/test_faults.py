"""Faults while building: a full disk gives a clear error, publishes nothing, and
a re-run with space succeeds with the bytes of an undisturbed build."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import pytest

from seqcache import format as fmt
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.pipelines import work as work_mod
from testsupport import lines_task


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
    return lines_task(pattern, eos=False)


def test_full_disk_is_a_clear_error_and_a_rerun_succeeds(tmp_path, small_disk, corpora):
    corpus = str(corpora.shakespeare)  # 1.1 MB of text: ~4.5 MB of int32 tokens
    with pytest.raises(BuildError, match="no space left on the device.*nothing was published"):
        build_task(_task(corpus), cache_dir=str(small_disk), config=BuildConfig(num_shards=2))
    out_dir = small_disk / "lines" / "train"
    assert not (out_dir / fmt.MANIFEST_NAME).exists()
    assert not (out_dir / "_tmp" / "spill").exists()  # the build's scratch was freed
    # What was read before the disk filled up is kept for the rerun: each unit's committed checkpoints.
    ledgers = [json.loads(work_mod.unseal(p.read_bytes(), str(p)))
               for p in (small_disk / "lines" / ".train.work" / "units").iterdir()]
    committed = sum(len(ledger["checkpoints"]) for ledger in ledgers)
    # Space freed (the file system grown), the same build in the same place succeeds,
    # with the bytes of a build that never failed.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = build_task(_task(corpus), cache_dir=str(small_disk), config=BuildConfig(num_shards=2))
    assert not again.reused
    assert again.manifest.work.checkpoints_reused == committed and again.manifest.work.checkpoints_rejected == 0
    assert not (small_disk / "lines" / ".train.work").exists()  # removed once the cache is complete
    fresh = build_task(_task(corpus), cache_dir=str(tmp_path / "fresh"), config=BuildConfig(num_shards=2))
    assert (fmt.read_shard_checksums(again.cache_dir, again.manifest)
            == fmt.read_shard_checksums(fresh.cache_dir, fresh.manifest))
    assert again.manifest.num_examples == 40000


@pytest.mark.parametrize("exchange", ["runner", "spill"])
def test_a_retried_unit_gives_exactly_the_input_multiset(tmp_path, corpora, exchange, flaky_reader, attempt, group):
    """A runner retries a failed work unit and discards the failed attempt's
    outputs. The spill files a failed attempt wrote are never named by an
    output, so the shards hold exactly the input records, once each (the local
    engine does not retry, so the retry is played here, step by step, on the
    real steps)."""
    import collections

    from seqcache.feeders.reader import CacheReader
    from seqcache.manifest import Manifest
    from seqcache.pipelines import transforms

    path = str(corpora.shakespeare)
    task = _task(path)
    out_dir = tmp_path / "cache"
    spill_dir = out_dir / "_tmp" / "spill"
    spill_dir.mkdir(parents=True)
    reader = transforms.ReadPreprocess(task, seed=0, sequence_length=None, num_shards=2)
    unit = (0, ((0, 0, None),))

    def step(r):  # several flushes per unit: outputs are emitted before the failure
        return transforms.ReadUnit(r, paths=[path], spill_dir=str(spill_dir), exchange=exchange, flush_bytes=200_000)

    assert attempt(step(flaky_reader(reader, fail_after=40)), unit) is None
    orphans = set(os.listdir(spill_dir))
    assert bool(orphans) == (exchange == "spill")  # the failed attempt left files behind
    outputs = attempt(step(reader), unit)
    named = {os.path.basename(v[0]) for k, v in outputs if isinstance(v, tuple) and isinstance(v[0], str) and k >= 0}
    assert not orphans & named
    groups = group(outputs)
    assert sum(1 for k in groups if k >= 0) == 2 and len(groups[transforms.COUNTS_KEY]) == 1
    spread = transforms.SpreadCopies(seed=0, num_features=1, spill_dir=str(spill_dir), exchange=exchange, num_shards=2)
    groups = group([kv for k in sorted(groups) for kv in attempt(spread, (k, groups[k]))])

    write = transforms.WriteGroup(task, out_dir=str(out_dir), scratch_dir=str(spill_dir), num_shards=2,
                                  sequence_length=None)
    results = {}
    for key in sorted(groups):
        ((_, result),) = attempt(write, (key, groups[key]))
        results[result.get("shard", result["kind"])] = result
    assert results["counts"]["records"] == 40000
    entries = [results[shard]["entry"] for shard in range(2)]
    Manifest.create(task="lines", split="train", fingerprint=fmt.fingerprint_of({}), fingerprint_inputs={}, features=[
        {"name": f.name, "dtype": f.dtype} for f in transforms.features_out(task)], shards=entries,
        sources=[{"path": path}], statistics={}, seed=0, sequence_length=None, packing=None,
        vocabularies={}).write(str(out_dir))
    with CacheReader(str(out_dir)) as r:
        got = collections.Counter(tuple(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
    lines = open(path, encoding="utf-8").read().split("\n")[:-1]
    want = collections.Counter(tuple(x + 3 for x in line.encode()) for line in lines)
    assert got == want and sum(got.values()) == 40000
