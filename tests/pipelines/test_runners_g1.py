"""G1 on every runner this machine has: the same data shard bytes as Beam's
local engine, for a plain task and for a packed span-corruption task.

The tasks, both on real text of ../shared/data, cut into many work units (a
small ``split_size``) so that every runner spreads them over its workers:

- **plain**: the first 6,000 lines of tinyshakespeare in 3 files, byte
  vocabulary, one example a line (3 shards);
- **span corruption, first-fit packed**: 240 C4 documents, every second one
  cut to its first 100 characters, in a Parquet file of 12 row groups, a
  SentencePiece vocabulary of 800 pieces trained on botchan with 100 sentinel
  ids, T5's ``span_corruption`` and first-fit packing to
  (inputs 128, targets 29) (2 shards).

``RUNNERS`` is the one table of runners: a name, the pipeline options that put
a build on it (given the test's ``request``, for fixtures such as a cluster),
and a check that says why the runner cannot run here (None: it can). A runner
that cannot run is skipped, or, with ``CI`` set, fails: CI installs every
runner of the table (``make prism`` builds Prism's binary). The reference
build is the local engine's, with its default exchange (spill files).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import runner as runner_mod
from seqcache.tasks import preprocessors as P
from testsupport import MULTI_PROCESSING, dask_args, prism_missing

PLAIN_LINES = 6_000
SPAN_DOCUMENTS = 240
SPAN_LENGTHS = {"inputs": 128, "targets": 29}  # T5's random_spans_helper(128): 142 raw tokens


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _missing_module(name: str) -> Callable[[], str | None]:
    def check():
        try:
            __import__(name)
        except ImportError as e:
            return f"{name} is not installed ({e})"
        return None
    return check


@dataclasses.dataclass(frozen=True)
class Runner:
    """A runner of the table: ``args(request)`` gives the build's pipeline
    options (``request`` reaches fixtures: ``request.getfixturevalue``), and
    ``missing()`` why it cannot run here, or None."""
    name: str
    args: Callable[[pytest.FixtureRequest], list[str]]
    missing: Callable[[], str | None] = lambda: None
    split_size: int = 40_000
    exchange: str = "auto"


RUNNERS = [
    Runner("local engine, runner shuffle", lambda request: [], exchange="runner"),
    Runner("multi_processing x2", lambda request: list(MULTI_PROCESSING)),
    Runner("dask x2", lambda request: dask_args(request.getfixturevalue("dask_cluster")),
           missing=_missing_module("distributed")),
    Runner("prism", lambda request: ["--runner=prism"], missing=prism_missing),  # spill files (auto)
    Runner("prism, runner shuffle", lambda request: ["--runner=prism"], missing=prism_missing, exchange="runner"),
]


@pytest.fixture(scope="module")
def plain_task(tmp_path_factory, corpora):
    folder = tmp_path_factory.mktemp("plain")
    lines = corpora.shakespeare_lines(PLAIN_LINES)
    for k in range(3):
        part = lines[k * len(lines) // 3:(k + 1) * len(lines) // 3]
        (folder / f"part-{k}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
    return tasks.Task(
        "g1_plain",
        source=tasks.TextLineSource(str(folder / "*.txt")),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)},
        preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()],
    ), BuildConfig(num_shards=3)


@pytest.fixture(scope="module")
def span_task(tmp_path_factory, corpora):
    folder = tmp_path_factory.mktemp("span")
    # Every second document cut to its first 100 characters: short examples, which first-fit packs several to a row.
    texts = [t if i % 2 else t[:100] for i, t in enumerate(corpora.c4_texts(SPAN_DOCUMENTS).to_pylist())]
    pq.write_table(pa.table({"text": texts}), folder / "c4.parquet", row_group_size=SPAN_DOCUMENTS // 12)
    lines = [s for s in corpora.botchan.read_text(encoding="utf-8").split("\n") if s.strip()]
    model = folder / "botchan.model"
    tasks.train_sentencepiece(lines[:3000], output_path=str(model), vocab_size=800)
    vocabulary = tasks.SentencePieceVocabulary(str(model), extra_ids=100)
    return tasks.Task(
        "g1_span",
        source=tasks.ParquetSource(str(folder / "*.parquet"), column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(vocabulary), "targets": tasks.Feature(vocabulary)},
        preprocessors=[P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), tasks.span_corruption(),
                       P.append_eos_after_trim()],
        packing="first_fit",
    ), BuildConfig(num_shards=2, sequence_length=SPAN_LENGTHS)


def _data_shards(result) -> list[str]:
    """The sha256 of every data shard file of a build, read from disk, in shard order."""
    return [hashlib.sha256(open(os.path.join(result.cache_dir, s.file), "rb").read()).hexdigest()
            for s in result.manifest.shards]


@pytest.fixture(scope="module")
def references(tmp_path_factory, plain_task, span_task):
    """The local engine's builds of both tasks (default options, spill files):
    {task name: (data shard sha256s, manifest statistics, rows)}."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for task, config in (plain_task, span_task):
        result = build_task(task, cache_dir=str(root), config=config)
        out[task.name] = (_data_shards(result), result.manifest.statistics, result.manifest.num_examples)
    return out


def test_the_reference_builds_are_real(references):
    plain, plain_stats, _ = references["g1_plain"]
    span, span_stats, span_num_rows = references["g1_span"]
    plain_stats, span_stats = plain_stats.to_json(), span_stats.to_json()
    assert len(plain) == 3 and len(span) == 2 and len(set(plain + span)) == 5
    assert plain_stats["source_records"] == PLAIN_LINES
    assert plain_stats["examples"] > 4_000
    assert span_stats["source_records"] == SPAN_DOCUMENTS
    assert span_stats["source_examples"] > 200, span_stats["source_examples"]
    # First-fit put several examples in a row.
    assert span_num_rows == span_stats["examples"] < span_stats["source_examples"] - 40, span_stats["examples"]


def _require(runner: Runner) -> None:
    """Skips the test when ``runner`` cannot run here, or fails it under CI."""
    why = runner.missing()
    if why:
        if _under_ci():
            pytest.fail(f"{runner.name}: {why} (CI is set: every runner of the table is required)", pytrace=False)
        pytest.skip(f"{runner.name}: {why}")


@pytest.mark.parametrize("runner", RUNNERS, ids=[r.name for r in RUNNERS])
def test_every_runner_writes_the_local_engines_bytes(runner, request, tmp_path, plain_task, span_task, references):
    _require(runner)
    args = runner.args(request)
    for task, config in (plain_task, span_task):
        result = build_task(task, cache_dir=str(tmp_path), config=config, pipeline_args=args,
                            split_size=runner.split_size, exchange=runner.exchange)
        shards, statistics, _ = references[task.name]
        assert _data_shards(result) == shards, (runner.name, task.name)
        assert result.manifest.statistics == statistics, (runner.name, task.name)


@pytest.mark.parametrize("ci", ["true", ""])
def test_a_missing_prism_binary_fails_under_ci_and_skips_elsewhere(monkeypatch, tmp_path, ci):
    monkeypatch.setenv("CI", ci)
    monkeypatch.setenv(runner_mod.PRISM_VARIABLE, str(tmp_path / "absent" / "prism"))
    prism = next(r for r in RUNNERS if r.name == "prism")
    outcome = pytest.fail.Exception if ci else pytest.skip.Exception
    with pytest.raises(outcome, match=r"prism: prism runner: no prism binary at .*absent/prism; run `make prism`"):
        _require(prism)


def test_a_build_on_prism_without_its_binary_says_so_in_one_line_and_writes_nothing(tmp_path, corpora):
    (tmp_path / "a.txt").write_text("\n".join(corpora.shakespeare_lines(100)) + "\n", encoding="utf-8")
    seqcache = os.path.join(os.path.dirname(sys.executable), "seqcache")
    env = {**os.environ, runner_mod.PRISM_VARIABLE: str(tmp_path / "absent")}
    proc = subprocess.run([seqcache, "build", "--cache-dir", str(tmp_path / "caches"), "--source", f"text:{tmp_path}/a.txt",
                           "--vocabulary", "byte", "--name", "lines", "--runner=prism"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        f"error: prism runner: no prism binary at {tmp_path / 'absent'}; run `make prism` in the seqcache checkout, "
        f"or set {runner_mod.PRISM_VARIABLE} or --prism_location to one"], proc.stderr
    assert not (tmp_path / "caches").exists()


@pytest.mark.parametrize("args,expected", [
    (["--runner=prism"], "spill"),  # its steps run in the build's process (LOOPBACK)
    (["--runner=prism", "--environment_type=LOOPBACK"], "spill"),
    (["--runner=prism", "--environment_type=DOCKER"], "runner"),
    (["--runner=prism", "--job_endpoint=localhost:8073"], "runner"),  # a Prism started elsewhere
    ([], "spill"),  # the local engine
    (["--runner=dask"], "runner"),
])
def test_auto_moves_examples_through_spill_files_where_every_step_runs_here(args, expected):
    options, runner = runner_mod.pipeline_options(args)
    assert runner_mod.choose_exchange("auto", runner, options) == expected
    assert runner_mod.choose_exchange("runner", runner, options) == "runner"


def test_prism_gets_the_installed_binary_from_arguments_and_from_options(monkeypatch, tmp_path):
    binary = tmp_path / "prism"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    monkeypatch.setenv(runner_mod.PRISM_VARIABLE, str(binary))
    from apache_beam.options import pipeline_options as po

    for given in (["--runner=prism"], po.PipelineOptions(["--runner=prism"])):
        options, runner = runner_mod.pipeline_options(given)
        assert runner == runner_mod.PRISM_RUNNER
        assert options.view_as(po.PrismRunnerOptions).prism_location == str(binary)
        runner_mod.check_runner_available(runner, options)  # an executable file: accepted
    options, _ = runner_mod.pipeline_options(["--runner=prism", "--prism_location=/elsewhere/prism"])
    assert options.view_as(po.PrismRunnerOptions).prism_location == "/elsewhere/prism"  # the user's wins
    with pytest.raises(runner_mod.RunnerError, match="no prism binary at /elsewhere/prism"):
        runner_mod.check_runner_available(runner_mod.PRISM_RUNNER, options)
