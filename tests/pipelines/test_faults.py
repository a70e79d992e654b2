"""Faults while building: a full disk gives a clear error, publishes nothing, and
a re-run with space succeeds with the bytes of an undisturbed build."""

from __future__ import annotations

import json
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
        source=tasks.TextLineSource(pattern, on_error={"empty": "keep"}),
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


def _attempt(dofn, file_entry, *, fail_in_finish=False):
    """Runs one bundle attempt the way a runner does; returns its main outputs, or
    None when the attempt failed (a runner then discards everything it emitted)."""
    import apache_beam as beam

    outputs = []
    dofn.start_bundle()
    try:
        for out in dofn.process(file_entry):
            if not isinstance(out, beam.pvalue.TaggedOutput):
                outputs.append(out)
        if fail_in_finish:
            list(dofn.finish_bundle())  # writes its spill files ...
            raise RuntimeError("worker lost in finish_bundle")  # ... then dies
        outputs.extend(w.value for w in dofn.finish_bundle())
    except RuntimeError:
        return None
    return outputs


@pytest.mark.parametrize("where", ["process", "finish_bundle"])
def test_a_retried_bundle_gives_exactly_the_input_multiset(tmp_path, shared_data, where, flaky_reader):
    """Beam retries a failed bundle and discards the failed attempt's outputs. The
    spill files a failed attempt wrote are never named by an output, so the shards
    hold exactly the input records, once each (the DirectRunner does not retry, so
    the retry is played here, step by step, on the real DoFns)."""
    import collections

    import apache_beam as beam

    from seqcache.feeders.reader import CacheReader
    from seqcache.pipelines import build as b
    from seqcache.pipelines import writer

    path = str(shared_data / "tinyshakespeare" / "input.txt")
    task = _task(path)
    out_dir = tmp_path / "cache"
    spill_dir = out_dir / "_tmp" / "spill"
    spill_dir.mkdir(parents=True)
    reader = b._ReadAndPreprocess(task, seed=0, sequence_length=None, num_shards=2)
    spill_bytes = 200_000  # several spills per bundle: outputs are emitted before the failure
    dofn_class = b._make_spill_dofn(beam)

    failed = dofn_class(flaky_reader(reader, fail_after=40 if where == "process" else None), str(spill_dir), spill_bytes)
    assert _attempt(failed, (0, path), fail_in_finish=(where == "finish_bundle")) is None
    orphans = set(os.listdir(spill_dir))
    assert orphans  # the failed attempt did leave files behind
    retried = dofn_class(reader, str(spill_dir), spill_bytes)
    outputs = _attempt(retried, (0, path))
    assert not orphans & {os.path.basename(p) for _, p in outputs}

    groups = collections.defaultdict(list)
    for shard, p in outputs:
        groups[shard].append(p)
    write = b._WriteShard(task, out_dir=str(out_dir), stats_dir=str(out_dir / "_tmp"), num_shards=2, sequence_length=None)
    entries = []
    for shard in range(2):
        list(write((shard, groups[shard])))
        entries.append(json.loads((out_dir / "_tmp" / f"{b.STATS_PREFIX}{shard:05d}.json").read_text())["shard"])
    raw = writer.build_manifest(task="lines", split="train", fingerprint="f", fingerprint_inputs={}, features=[
        {"name": f.name, "dtype": f.dtype} for f in b._features_out(task)], shards=entries, sources=[{"path": path}], statistics={}, seed=0,
        sequence_length=None, packing=None, vocabularies={})
    writer.write_manifest(str(out_dir), raw)
    with CacheReader(str(out_dir)) as r:
        got = collections.Counter(tuple(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
    lines = open(path, encoding="utf-8").read().split("\n")[:-1]
    want = collections.Counter(tuple(x + 3 for x in line.encode()) for line in lines)
    assert got == want and sum(got.values()) == 40000
