"""One portable pipeline: the same cache bytes on every runner (G1), and a
Dask worker killed in the middle of a build.

The runners: Beam's local engine (the default), its DirectRunner in
``multi_processing`` mode with 2 worker processes, and Beam's DaskRunner
against a ``dask.distributed`` cluster of 2 worker processes that the tests
start on 127.0.0.1 and stop again. The work is cut into many units (a small
``split_size``), so that every runner spreads it over its workers, and both
ways of moving examples to the shard writers (the runner's shuffle, spill
files) are used.
"""

from __future__ import annotations

import collections
import os
import textwrap

import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, BuildError, build_task
from testsupport import KILL_ONCE_TASK, MULTI_PROCESSING, dask_args

pytest.importorskip("distributed")

CORPUS_LINES = 10_000

@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpora):
    """The first 10,000 lines of tinyshakespeare (1,875 of them empty) in 3 files."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = corpora.shakespeare_lines(CORPUS_LINES)
    for k in range(3):
        part = lines[k * len(lines) // 3:(k + 1) * len(lines) // 3]
        (folder / f"part-{k}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
    return folder


def _task(folder, *, pack=False, duplicate="keep"):
    pre = [tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
           tasks.preprocessors.append_eos()]
    return tasks.Task(
        "runners" + ("_packed" if pack else ""),
        source=tasks.TextLineSource(str(folder / "*.txt"),
                                    on_error={"empty": "skip", "whitespace": "skip", "duplicate": duplicate}),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)},
        preprocessors=pre,
        packing="lm" if pack else None,
    )


def _shard_hashes(result):
    """(data shard sha256s, provenance shard sha256s) of a build, as its checksum
    file records them (``read_shard_checksums`` checks that file's own sha256)."""
    sums = fmt.read_shard_checksums(result.cache_dir, result.manifest)
    assert all(sums[0]) and all(sums[1])
    return sums


@pytest.mark.parametrize("pack", [False, True], ids=["examples", "packed"])
def test_every_runner_and_exchange_writes_the_same_shards(tmp_path, corpus, dask_cluster, pack):
    task = _task(corpus, pack=pack)
    config = BuildConfig(num_shards=3, sequence_length={"targets": 256} if pack else None)
    runs = {
        "local engine, spill files": dict(pipeline_args=[], split_size=None),
        "local engine, runner shuffle, tiny splits": dict(pipeline_args=[], split_size=12_000, exchange="runner"),
        "multi_processing x2": dict(pipeline_args=MULTI_PROCESSING, split_size=50_000),
        "dask x2": dict(pipeline_args=dask_args(dask_cluster), split_size=25_000),
    }
    results = {name: build_task(task, cache_dir=str(tmp_path / str(k)), config=config, **kw)
               for k, (name, kw) in enumerate(runs.items())}
    first_result = next(iter(results.values()))
    first = first_result.manifest
    assert first.num_examples > (70 if pack else 8_000)
    for name, result in results.items():
        m = result.manifest
        assert _shard_hashes(result) == _shard_hashes(first_result), name
        assert m.statistics.source_records == CORPUS_LINES, name
        assert m.statistics.skipped_records == 1_875, name
        assert m.statistics == first.statistics, name
        quarantine = fmt.file_sha256(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME))
        assert quarantine == first.quarantine_sha256, name


def test_every_runner_skips_the_same_duplicates(tmp_path, corpus, corpora, dask_cluster):
    """``on_error={"duplicate": "skip"}``: the same shards, quarantine and counts
    on every runner, however the work is cut (the copies are found in the shuffle)."""
    task = _task(corpus, duplicate="skip")
    runs = {
        "local engine, spill files": dict(pipeline_args=[], split_size=None),
        "local engine, runner shuffle, tiny splits": dict(pipeline_args=[], split_size=12_000, exchange="runner"),
        "multi_processing x2": dict(pipeline_args=MULTI_PROCESSING, split_size=50_000),
        "dask x2": dict(pipeline_args=dask_args(dask_cluster), split_size=25_000),
    }
    results = {name: build_task(task, cache_dir=str(tmp_path / str(k)), config=BuildConfig(num_shards=3), **kw)
               for k, (name, kw) in enumerate(runs.items())}
    lines = [line for line in corpora.shakespeare_lines(CORPUS_LINES) if line.strip()]
    copies = len(lines) - len(set(lines))
    first_result = next(iter(results.values()))
    first = first_result.manifest
    assert copies > 500 and first.num_examples == len(set(lines))
    assert first.statistics.bad_input_records.skipped["duplicate"] == copies
    assert first.statistics.skipped_records == 1_875 + copies
    for name, result in results.items():
        assert _shard_hashes(result) == _shard_hashes(first_result), name
        assert result.manifest.statistics == first.statistics, name
        quarantine = fmt.file_sha256(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME))
        assert quarantine == first.quarantine_sha256, name


def test_dask_builds_a_second_task_on_the_same_cluster_and_reuses_caches(tmp_path, corpus, dask_cluster):
    task = _task(corpus)
    a = build_task(task, cache_dir=str(tmp_path), config=BuildConfig(num_shards=2), pipeline_args=dask_args(dask_cluster))
    again = build_task(task, cache_dir=str(tmp_path), config=BuildConfig(num_shards=2),
                       pipeline_args=dask_args(dask_cluster))
    assert not a.reused and again.reused
    assert sorted(os.listdir(tmp_path / task.name)) == ["train"]  # no lock file, no staging left
    assert not os.path.exists(os.path.join(a.cache_dir, "_tmp"))


@pytest.fixture(scope="module")
def mixed_corpus(tmp_path_factory, corpora):
    """300 C4 documents as one JSON-lines file and as a Parquet file of 17 row
    groups (the same documents), and multilingual NTREX text with multi-byte
    characters (the first 500 lines of 3 languages)."""
    import json

    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("mixed")
    docs = corpora.c4_texts(300).to_pylist()
    with open(folder / "c4.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    import pyarrow as pa

    pq.write_table(pa.table({"text": docs}), folder / "c4.parquet", row_group_size=len(docs) // 16)
    for lang in ("jpn", "rus", "hin"):
        lines = (corpora.ntrex / f"newstest2019-ref.{lang}.txt").read_bytes().split(b"\n")
        (folder / f"ntrex.{lang}.txt").write_bytes(b"\n".join(lines[:500]) + b"\n")
    return folder, docs


def _docs_task(name, source):
    return tasks.Task(
        name, source=source,
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.preprocessors.append_eos()],
    )


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "text"])
def test_the_split_size_never_changes_the_cache(tmp_path, mixed_corpus, kind):
    """Large files read in many byte ranges (JSON lines, multi-byte text) or row
    groups (Parquet), down to tiny splits: the same data shards, provenance and
    quarantine as one unit per file, and the work really is cut (more units)."""
    from seqcache.pipelines import plan

    folder, docs = mixed_corpus
    policy = {"empty": "skip", "whitespace": "skip", "control_characters": "keep"}
    source = {
        "jsonl": lambda: tasks.JsonLinesSource(str(folder / "c4.jsonl"), on_error=policy),
        "parquet": lambda: tasks.ParquetSource(str(folder / "c4.parquet"), on_error=policy),
        "text": lambda: tasks.TextLineSource(str(folder / "ntrex.*.txt"), on_error=policy),
    }[kind]()
    task = _docs_task(f"split_{kind}", source)
    files = source.list_files()
    sizes = {"whole": 1 << 40, "small": max(f.num_bytes for f in files) // 7, "tiny": 4096}
    results = {}
    for name, size in sizes.items():
        units = plan.plan_units(source, files, size)
        if name != "whole":
            assert len(units) > len(files) * (5 if name == "small" else 1), (name, len(units))
        results[name] = build_task(task, cache_dir=str(tmp_path / name), config=BuildConfig(num_shards=3),
                                   split_size=size, exchange="runner" if name == "tiny" else "auto")
    whole = results["whole"].manifest
    if kind != "text":
        assert whole.num_examples == len(docs)
    for name, result in results.items():
        m = result.manifest
        assert _shard_hashes(result) == _shard_hashes(results["whole"]), name
        assert m.statistics == whole.statistics, name
        assert m.quarantine_sha256 == whole.quarantine_sha256, name


@pytest.fixture(scope="module")
def span_corpus(tmp_path_factory, corpora):
    """150 C4 documents in 3 Parquet files of 10-row row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("span")
    docs = corpora.c4_texts(150)
    for k in range(3):
        pq.write_table(pa.table({"text": docs[k * 50:(k + 1) * 50]}), folder / f"part-{k}.parquet", row_group_size=10)
    return folder


def test_span_corruption_first_fit_writes_the_same_shards_on_every_runner(tmp_path, span_corpus, dask_cluster):
    """G1 for T5's span corruption, first-fit packed: the noise of a record is
    drawn from (seed, record key) only, so the local engine, DirectRunner's
    worker processes and a Dask cluster, each with many small reading units,
    write byte-identical data and provenance shards."""
    vocab = tasks.ByteVocabulary(extra_ids=100)
    task = tasks.Task(
        "runners_span",
        source=tasks.ParquetSource(str(span_corpus / "*.parquet"), column="text",
                                   on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[tasks.preprocessors.rekey({"inputs": None, "targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.span_corruption(), tasks.preprocessors.append_eos_after_trim()],
        packing="first_fit",
    )
    config = BuildConfig(num_shards=2, sequence_length={"inputs": 256, "targets": 58})
    runs = {
        "local engine": dict(pipeline_args=[]),
        "local engine, runner shuffle, row-group splits": dict(pipeline_args=[], split_size=1, exchange="runner"),
        "multi_processing x2": dict(pipeline_args=MULTI_PROCESSING, split_size=1),
        "dask x2": dict(pipeline_args=dask_args(dask_cluster), split_size=1),
    }
    built = {name: build_task(task, cache_dir=str(tmp_path / str(k)), config=config, **kw)
             for k, (name, kw) in enumerate(runs.items())}
    results = {name: b.manifest for name, b in built.items()}
    first = results["local engine"]
    assert first.statistics.segments == 150 and first.num_examples < 150
    for name, m in results.items():
        assert _shard_hashes(built[name]) == _shard_hashes(built["local engine"]), name
        assert m.statistics == first.statistics, name


# Last in the module, as they leave the cluster restarting a worker.
def _killer_task(tmp_path, corpus):
    marker = tmp_path / "killed"
    module = tmp_path / f"killer_{os.urandom(4).hex()}.py"
    module.write_text(textwrap.dedent(KILL_ONCE_TASK).format(marker=str(marker), line="MENENIUS:", name="killer",
                                                             pattern=str(corpus / "*.txt")))
    tasks.TaskRegistry.remove("killer") if "killer" in tasks.TaskRegistry.names() else None
    tasks.import_definitions(str(module))
    return tasks.TaskRegistry.get("killer"), marker


def _decoded(cache_dir):
    from seqcache.feeders.reader import CacheReader

    with CacheReader(cache_dir) as r:
        return collections.Counter(bytes(x - 3 for x in e["targets"].tolist()[:-1]).decode("utf-8")
                                   for e in r.read_examples(range(len(r))))


def test_a_killed_dask_worker_is_replaced_and_the_cache_holds_every_record_once(tmp_path, corpus, dask_cluster):
    task, marker = _killer_task(tmp_path, corpus)
    result = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2),
                        pipeline_args=dask_args(dask_cluster), split_size=25_000)
    assert marker.exists()  # a worker did die in the middle of the build
    want = collections.Counter(line for p in sorted(corpus.glob("*.txt"))
                               for line in p.read_text(encoding="utf-8").split("\n")[:-1] if line.strip())
    assert _decoded(result.cache_dir) == want
    assert result.manifest.statistics.source_records == CORPUS_LINES


def test_a_build_that_loses_its_worker_for_good_fails_in_one_line_and_leaves_no_manifest(tmp_path, corpus,
                                                                                          dask_cluster):
    """The same cluster with no retry allowed (the scheduler's ``allowed_failures``,
    the ``distributed.scheduler.allowed-failures`` setting, set to 0 for this build)."""
    task, marker = _killer_task(tmp_path, corpus)
    allowed = dask_cluster.scheduler.allowed_failures
    dask_cluster.scheduler.allowed_failures = 0
    try:
        with pytest.raises(BuildError) as info:
            build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2),
                       pipeline_args=dask_args(dask_cluster), split_size=25_000)
    finally:
        dask_cluster.scheduler.allowed_failures = allowed
    message = str(info.value)
    assert "\n" not in message and "a worker died" in message and "nothing was published" in message
    assert marker.exists()
    # No manifest and no lock file; the work folder keeps what was read, for the same build run again,
    # which finishes it with every record once.
    assert not os.path.exists(tmp_path / "c" / "killer" / "train" / fmt.MANIFEST_NAME)
    assert sorted(os.listdir(tmp_path / "c" / "killer")) == [".train.work", "train"]
    again = build_task(task, cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2),
                       pipeline_args=dask_args(dask_cluster), split_size=25_000)
    want = collections.Counter(line for p in sorted(corpus.glob("*.txt"))
                               for line in p.read_text(encoding="utf-8").split("\n")[:-1] if line.strip())
    assert _decoded(again.cache_dir) == want and not again.reused and again.manifest.work is not None
