"""A build that dies resumes on every runner: the local engine (both ways of
moving examples), 2 local worker processes, Prism, and Dask with the cache and
its work folder on S3 (moto's server on 127.0.0.1). The build fails mid-way
(a read step raises at its 4th batch, ``$SEQCACHE_FAULT``, which the steps
carry to Dask's workers); the same build run again reuses every unit the
first one completed, as its work folder records them, and gives the bytes of
a build that never failed (G1). Then a corpus grown by a file, built over the
cache with --overwrite, reads only the new file's units and gives the bytes
of a fresh build of the grown corpus, here too.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from typing import Callable

import pytest

from seqcache import format as fmt
from seqcache import fs, process, tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import work as work_mod
from testsupport import MULTI_PROCESSING, S3_BUCKET, dask_args, moto_s3, one_botocore_loader, prism_missing

LINES = 9_000
SPLIT_SIZE = 40_000
FAULT = "read:batch:4:raise"


@dataclasses.dataclass(frozen=True)
class Runner:
    """A runner: the build's pipeline options (given the test's ``request``),
    whether the cache goes to S3, and why it cannot run here (None: it can)."""
    name: str
    args: Callable[[pytest.FixtureRequest], list[str]]
    s3: bool = False
    exchange: str = "auto"
    missing: Callable[[], str | None] = lambda: None
    slow: bool = False


def _dask(request) -> list[str]:
    pytest.importorskip("distributed")
    return dask_args(request.getfixturevalue("dask_cluster")) + request.getfixturevalue("s3")["options"]


RUNNERS = [
    Runner("local engine, spill files", lambda request: []),
    Runner("local engine, runner shuffle", lambda request: [], exchange="runner"),
    Runner("prism", lambda request: ["--runner=prism"], missing=prism_missing),
    # Slow (worker processes, a Dask cluster and an S3 server: 10-40 s each): .ci/run runs them.
    Runner("multi_processing x2", lambda request: list(MULTI_PROCESSING), slow=True),
    Runner("dask x2, cache on s3", _dask, s3=True, slow=True),
]


@pytest.fixture(scope="module")
def s3():
    with one_botocore_loader(), moto_s3() as server:
        yield server


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpora):
    folder = tmp_path_factory.mktemp("corpus")
    lines = corpora.shakespeare_lines(LINES)
    for k in range(3):
        (folder / f"part-{k}.txt").write_text("\n".join(lines[k * LINES // 3:(k + 1) * LINES // 3]) + "\n")
    return folder


def _task(folder):
    P = tasks.preprocessors
    return tasks.Task("resumed", source=tasks.TextLineSource(str(folder / "*.txt"), on_error={"empty": "skip"}),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()])


def _complete_units(work_dir: str) -> int:
    return sum(1 for name in fs.sizes_in(fs.join(work_dir, work_mod.UNITS_DIR)) if name.endswith(work_mod.DONE_SUFFIX))


@pytest.mark.parametrize("runner", [pytest.param(r, marks=pytest.mark.slow) if r.slow else r for r in RUNNERS],
                         ids=[r.name for r in RUNNERS])
def test_a_failed_build_resumes_and_a_grown_corpus_reads_only_its_new_file_on_every_runner(
        runner, request, corpus, tmp_path, monkeypatch):
    why = runner.missing()
    if why is not None:
        pytest.skip(why)
    args = runner.args(request)
    folder = tmp_path / "in"
    shutil.copytree(corpus, folder)
    reference = build_task(_task(folder), cache_dir=str(tmp_path / "reference"), config=BuildConfig(num_shards=2),
                           resume=False)
    root = f"s3://{S3_BUCKET}/{tmp_path.name}" if runner.s3 else str(tmp_path / "c")
    kw = dict(cache_dir=root, pipeline_args=args, split_size=SPLIT_SIZE, exchange=runner.exchange)
    monkeypatch.setenv(process.FAULT_VARIABLE, FAULT)
    process.reset_faults()
    with pytest.raises(Exception, match="fault injected at read:batch #4"):
        build_task(_task(folder), config=BuildConfig(num_shards=2), **kw)
    monkeypatch.delenv(process.FAULT_VARIABLE)
    work_dir = work_mod.work_path(f"{root}/resumed/train")
    done_before = _complete_units(work_dir)
    assert done_before >= 1  # three batches or more were read, and checkpointed with their units
    reports = []  # the progress of work units: (found done when the build started, done, in all)
    again = build_task(_task(folder), config=BuildConfig(num_shards=2), keep_work=True,
                       unit_progress=lambda *r: reports.append(r), **kw)
    assert not again.reused and _bytes(again) == _bytes(reference)
    work = again.manifest.work
    assert work.units_reused == done_before and work.checkpoints_rejected == 0
    assert work.units_reused + work.units_resumed < work.units
    if not runner.s3:  # progress polls local work folders
        assert reports[0] == (done_before, done_before, work.units) and reports[-1] == (done_before, work.units,
                                                                                        work.units)

    # The corpus grows by a file; built over the cache, with another shard count: only its units are read.
    (folder / "part-3.txt").write_text("\n".join(f"a new line, number {i}" for i in range(300)) + "\n")
    grown = build_task(_task(folder), config=BuildConfig(num_shards=3), overwrite=True, **kw)
    grown_bytes = _bytes(grown)
    assert grown.manifest.work.units_reused == work.units == grown.manifest.work.units - 1
    assert not fs.exists(fs.join(work_dir, work_mod.UNITS_DIR))  # removed: this build did not ask to keep it
    fresh = build_task(_task(folder), cache_dir=str(tmp_path / "fresh"), config=BuildConfig(num_shards=3),
                       resume=False)
    assert grown_bytes == _bytes(fresh)


def _bytes(result) -> tuple:
    """What a build's bytes are: the shard checksum file's sums, the quarantine's, the statistics."""
    manifest = result.manifest
    return (fmt.read_shard_checksums(result.cache_dir, manifest), manifest.quarantine_sha256,
            json.dumps(manifest.statistics.to_json(), sort_keys=True))
