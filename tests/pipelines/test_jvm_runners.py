"""Beam's Flink and Spark runners: the same cache bytes as the local engine (G1),
a job server killed in the middle of a build, SDK workers that die or never
start, and a build killed with SIGKILL, whose job server goes with it.

The job servers are the ones ``make jars`` builds under build/jars (Beam's
runner libraries from Maven Central): Flink embedded in its job server
(``[local]``), Spark as ``local[2]``. The module starts one of each on
127.0.0.1 and stops them at its end; the builds reach them with
``--job_endpoint`` and run their Python steps in the test's own process
(Beam's LOOPBACK environment). The tests of dying workers and of SIGKILL let
the build start its own job server (stall.py, job_server.py), and the
former run the steps in Beam's worker pool (``worker_pool_main``'s service on
127.0.0.1, an EXTERNAL environment, as in docs/scaling.md's cluster
recipes), with a stall bound of a minute (STALL_S). Without the jars the module
skips, or fails under CI. The tests that kill a job server or a worker, or
whose workers never start, are marked slow; .ci/run runs them.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import select
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.pipelines import runner as runner_mod
from seqcache.pipelines import stall
from testsupport import KILL_ONCE_TASK, ended

REPO = pathlib.Path(__file__).resolve().parents[2]
JARS = pathlib.Path(os.environ.get(runner_mod.JARS_ENV) or REPO / runner_mod.DEFAULT_JARS)
# runner -> (its job server's jar under JARS, the driver's master argument)
SERVERS = {
    "flink": ("flink/flink-job-server.jar", ["--flink-master=[local]"]),
    "spark": ("spark/spark-job-server.jar", ["--spark-master-url=local[2]"]),
}
# What Beam's SparkRunner gives the JVM (Spark 3 on Java 17).
SPARK_JVM = ["--add-opens=java.base/sun.nio.ch=ALL-UNNAMED", "--add-opens=java.base/java.nio=ALL-UNNAMED",
             "--add-opens=java.base/java.util=ALL-UNNAMED", "--add-opens=java.base/java.lang.invoke=ALL-UNNAMED"]
START_TIMEOUT_S = 120


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _require(jar: pathlib.Path) -> None:
    missing = None if shutil.which("java") else "no `java` on the PATH"
    missing = missing or (None if jar.is_file() else f"no job server jar at {jar}; run `make jars`")
    if missing:
        if _under_ci():
            pytest.fail(missing + " (CI is set: the Flink and Spark job servers are required)", pytrace=False)
        pytest.skip(missing)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JobServer:
    """One Beam job server (``java -jar``) on 127.0.0.1, started and stopped by the tests."""

    def __init__(self, name: str, folder: pathlib.Path):
        jar, master = SERVERS[name]
        _require(JARS / jar)
        self.name, self.port = name, _free_port()
        self.log = folder / f"{name}-job-server.log"
        jvm = SPARK_JVM if name == "spark" else []
        command = ["java", *jvm, "-jar", str(JARS / jar), *master, f"--artifacts-dir={folder / 'artifacts'}",
                   f"--job-port={self.port}", "--artifact-port=0", "--expansion-port=0"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # bounded: the port answers, the JVM exits, or the deadline passes
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log.read_text(errors="replace")[-2000:]
                pytest.fail(f"{name} job server did not start on port {self.port}:\n{tail}", pytrace=False)
            time.sleep(0.2)

    def args(self, *extra: str) -> list[str]:
        return [f"--runner={self.name}", f"--job_endpoint=localhost:{self.port}", "--environment_type=LOOPBACK",
                *extra]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


@pytest.fixture(scope="module")
def job_servers(tmp_path_factory):
    """A Flink and a Spark job server for the whole module."""
    folder = tmp_path_factory.mktemp("job-servers")
    servers = {}
    try:
        for name in SERVERS:
            servers[name] = JobServer(name, folder)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpora):
    """The first 3,000 lines of tinyshakespeare in 2 files."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = corpora.shakespeare_lines(3000)
    for k in range(2):
        part = lines[k * len(lines) // 2:(k + 1) * len(lines) // 2]
        (folder / f"part-{k}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
    return folder


def _byte_task(folder, name="jvm_plain", **on_error):
    """Each line of ``folder``'s text files as bytes; empty and blank lines
    skipped, and the source's other ``on_error`` policies given by name."""
    return tasks.Task(
        name,
        source=tasks.TextLineSource(str(folder / "*.txt"),
                                    on_error={"empty": "skip", "whitespace": "skip", **on_error}),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.preprocessors.append_eos()],
    )


def _shard_hashes(result):
    """(data shard sha256s, provenance shard sha256s), as the build's checksum file records them."""
    sums = fmt.read_shard_checksums(result.cache_dir, result.manifest)
    assert all(sums[0]) and all(sums[1])
    return sums


# Slow (30 s): the first-fit SentencePiece test below runs both runners in the default suite.
@pytest.mark.slow
def test_flink_and_spark_write_the_local_engines_shards(tmp_path, corpus, job_servers):
    """G1 on a plain byte-vocabulary task, the work cut into several units,
    through the runner's shuffle and through spill files."""
    task, config = _byte_task(corpus), BuildConfig(num_shards=3)
    local = build_task(task, cache_dir=str(tmp_path / "local"), config=config)
    assert local.manifest.num_examples > 2_000
    for name, server in job_servers.items():
        for exchange in ("runner", "spill"):
            result = build_task(task, cache_dir=str(tmp_path / f"{name}-{exchange}"), config=config,
                                pipeline_args=server.args(), split_size=20_000, exchange=exchange)
            assert _shard_hashes(result) == _shard_hashes(local), (name, exchange)
            assert result.manifest.statistics == local.manifest.statistics, (name, exchange)


# Slow (four builds a runner): .ci/run runs the module's slow tests.
@pytest.mark.slow
def test_a_failed_build_resumes_on_flink_and_spark(tmp_path, corpus, job_servers, monkeypatch):
    """A read step raises at its 3rd batch (``$SEQCACHE_FAULT``; the Python
    steps run in this process, LOOPBACK, so the work folder is a folder every
    step shares); the same build run again reuses every unit completed and
    writes the local engine's bytes, through the runner's shuffle and through
    spill files."""
    from seqcache import process
    from seqcache.pipelines import work as work_mod

    task, config = _byte_task(corpus, "jvm_resumed"), BuildConfig(num_shards=3)
    local = build_task(task, cache_dir=str(tmp_path / "local"), config=config, resume=False)
    for name, server in job_servers.items():
        for exchange in ("runner", "spill"):
            kw = dict(cache_dir=str(tmp_path / f"{name}-{exchange}"), config=config, pipeline_args=server.args(),
                      split_size=20_000, exchange=exchange)
            monkeypatch.setenv(process.FAULT_VARIABLE, "read:batch:3:raise")
            process.reset_faults()
            with pytest.raises(Exception, match="fault injected at read:batch #3"):
                build_task(task, **kw)
            monkeypatch.delenv(process.FAULT_VARIABLE)
            units = tmp_path / f"{name}-{exchange}" / "jvm_resumed" / ".train.work" / work_mod.UNITS_DIR
            done = sum(1 for p in units.iterdir() if p.name.endswith(work_mod.DONE_SUFFIX))
            assert done >= 1, (name, exchange)
            again = build_task(task, **kw)
            assert again.manifest.work.units_reused == done, (name, exchange)
            assert _shard_hashes(again) == _shard_hashes(local), (name, exchange)
            assert again.manifest.statistics == local.manifest.statistics, (name, exchange)


@pytest.fixture(scope="module")
def span_task(tmp_path_factory, corpora):
    """T5's span corruption over 120 C4 documents (3 Parquet files of 10-row row
    groups), a SentencePiece vocabulary of 600 pieces with 100 sentinels,
    first-fit packed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("span")
    docs = corpora.c4_texts(120)
    for k in range(3):
        pq.write_table(pa.table({"text": docs[k * 40:(k + 1) * 40]}), folder / f"part-{k}.parquet", row_group_size=10)
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    tasks.train_sentencepiece(lines[:3000], output_path=str(folder / "spm.model"), vocab_size=600)
    vocab = tasks.SentencePieceVocabulary(str(folder / "spm.model"), extra_ids=100)
    return tasks.Task(
        "jvm_span",
        source=tasks.ParquetSource(str(folder / "*.parquet"), column="text", on_error={"control_characters": "keep"}),
        output_features={"inputs": tasks.Feature(vocab), "targets": tasks.Feature(vocab)},
        preprocessors=[tasks.preprocessors.rekey({"inputs": None, "targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.span_corruption(), tasks.preprocessors.append_eos_after_trim()],
        packing="first_fit",
    )


def test_span_corruption_first_fit_sentencepiece_is_the_same_on_flink_and_spark(tmp_path, span_task, job_servers):
    config = BuildConfig(num_shards=2, sequence_length={"inputs": 256, "targets": 58})
    local = build_task(span_task, cache_dir=str(tmp_path / "local"), config=config)
    assert local.manifest.statistics.segments == 120 and local.manifest.num_examples < 120
    for name, server in job_servers.items():
        result = build_task(span_task, cache_dir=str(tmp_path / name), config=config, pipeline_args=server.args(),
                            split_size=1)
        assert _shard_hashes(result) == _shard_hashes(local), name
        assert result.manifest.statistics == local.manifest.statistics, name


def _near_lines(corpora, documents: int = 240) -> list[str]:
    """The first C4 documents on one line each, and planted copies: every
    fifth document again with two words changed (a near copy), every seventh
    exactly (an exact copy)."""
    import random

    rng = random.Random(7)
    texts = [" ".join(t.split()) for t in corpora.c4_texts(documents).to_pylist()]

    def edit(text):
        words = text.split()
        for i in rng.sample(range(len(words)), min(2, len(words))):
            words[i] = f"edit{rng.randrange(10**6)}"
        return " ".join(words)

    return texts + [edit(t) for t in texts[::5]] + texts[::7]


def _cache_bytes(result) -> tuple:
    """Data and provenance shards (sha256s), quarantine.jsonl, the source
    table (bytes) and the manifest's statistics."""
    def read(name):
        return (pathlib.Path(result.cache_dir) / name).read_bytes()

    return (_shard_hashes(result), read(fmt.QUARANTINE_NAME), read(fmt.SOURCE_TABLE_NAME),
            result.manifest.statistics.to_json())


# Slow (70 s: two builds a runner): .ci/run runs the module's slow tests.
@pytest.mark.slow
def test_near_duplicates_are_removed_the_same_on_flink_and_spark(tmp_path, corpora, job_servers):
    """``near_duplicate=skip,duplicate=skip`` over 240 C4 documents with planted
    near and exact copies: the local engine, Flink and Spark write the same
    shards, quarantine, source table and statistics, through the runner's
    shuffle and through spill files, the work cut into 9 units."""
    folder = tmp_path / "near"
    folder.mkdir()
    lines = _near_lines(corpora)
    half = len(lines) // 2
    for k, part in enumerate((lines[:half], lines[half:])):
        (folder / f"part-{k}.txt").write_text("\n".join(part) + "\n", encoding="utf-8")
    task = _byte_task(folder, "jvm_near", near_duplicate="skip", duplicate="skip")
    config = BuildConfig(num_shards=3)
    local = build_task(task, cache_dir=str(tmp_path / "local"), config=config)
    want = _cache_bytes(local)

    # The policy removed something: every exact copy, and near copies, each naming a kept record.
    skipped = want[3]["bad_input_records"]["skipped"]
    assert skipped["duplicate"] == len(lines) - len(set(lines)) > 0
    near = [e for e in fmt.iter_json_lines(os.path.join(local.cache_dir, fmt.QUARANTINE_NAME))
            if e["kind"] == "near_duplicate"]
    assert len(near) == skipped["near_duplicate"] >= 30  # of the 48 planted

    def line_at(entry):  # a text line's record number is its byte offset
        with open(entry["path"], "rb") as f:
            f.seek(entry["record_number"])
            return f.readline().decode("utf-8").rstrip("\n")

    for e in near:  # another text than the record it names as kept, which is not removed
        assert " is a near duplicate of " in e["error"] and e["action"] == "skipped", e
        assert line_at(e) != line_at(e["kept"]) and line_at(e) in lines, e
    kept = {(e["kept"]["path"], e["kept"]["record_number"]) for e in near}
    assert not kept & {(e["path"], e["record_number"]) for e in near}

    for name, server in job_servers.items():
        for exchange in ("runner", "spill"):
            result = build_task(task, cache_dir=str(tmp_path / f"{name}-{exchange}"), config=config,
                                pipeline_args=server.args(), split_size=100_000, exchange=exchange)
            got = _cache_bytes(result)
            for what, a, b in zip(("shards", "quarantine", "source table", "statistics"), got, want):
                assert a == b, (name, exchange, what)


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_missing_job_server_jar_fails_in_one_line_naming_make_jars(tmp_path, corpus, monkeypatch, name):
    monkeypatch.setenv(runner_mod.JARS_ENV, str(tmp_path / "no-jars"))
    with pytest.raises(BuildError) as info:
        build_task(_byte_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2),
                   pipeline_args=[f"--runner={name}"])
    message = str(info.value)
    jar = tmp_path / "no-jars" / SERVERS[name][0]
    option = f"{name}_job_server_jar"
    assert message == (f"{name} runner: no job server jar at {jar}; run `make jars` in the checkout, "
                       f"or set {runner_mod.JARS_ENV} or --{option}")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_launcher_jar_without_its_libraries_fails_in_one_line(tmp_path, corpus, monkeypatch, name):
    """Half a ``make jars``: the launcher jar is there, the jars it names in lib/ are not."""
    jar = tmp_path / "jars" / SERVERS[name][0]
    jar.parent.mkdir(parents=True)
    jar.write_bytes(b"PK")
    monkeypatch.setenv(runner_mod.JARS_ENV, str(tmp_path / "jars"))
    with pytest.raises(BuildError) as info:
        build_task(_byte_task(corpus), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2),
                   pipeline_args=[f"--runner={name}"])
    assert str(info.value).startswith(f"{name} runner: no job server libraries (for {jar}) at {jar.parent / 'lib'}; "
                                      "run `make jars` in the checkout"), str(info.value)
    assert not (tmp_path / "c").exists()


def test_embedded_flink_exchanges_through_spill_files_by_default():
    """``--exchange=auto``: spill files on Flink embedded in the job server the
    build starts; the runner's shuffle for a job server or master elsewhere."""
    def exchange(*args):
        options, runner = runner_mod.pipeline_options(list(args))
        return runner_mod.choose_exchange("auto", runner, options)

    assert exchange("--runner=flink") == "spill"
    assert exchange("--runner=flink", "--flink_master=[local]") == "spill"
    assert exchange("--runner=flink", "--flink_master=jobmanager:8081") == "runner"
    assert exchange("--runner=flink", "--job_endpoint=localhost:8099") == "runner"
    assert exchange("--runner=spark") == "runner"
    assert exchange() == "spill"


def test_the_cli_names_make_jars_and_writes_nothing(tmp_path, corpus):
    """``seqcache build --runner=flink`` without the jars: exit status 1, one line, no folder."""
    import sys

    env = {**os.environ, runner_mod.JARS_ENV: str(tmp_path / "no-jars")}
    exe = pathlib.Path(sys.executable).with_name("seqcache")
    proc = subprocess.run([str(exe), "build", "--source", f"text:{corpus}/*.txt", "--name", "plain",
                           "--cache-dir", str(tmp_path / "c"), "--runner=flink"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "flink runner: no job server jar at" in lines[0] and "make jars" in lines[0], lines
    assert not (tmp_path / "c").exists()


# A task module whose preprocessor, on reaching a marked line, kills the job
# server's JVM (SIGKILL: the Flink or Spark cluster embedded in it goes with it),
# once; LOOPBACK runs the preprocessor in this process, which is left running.
_KILLER = '''
import os, signal
from seqcache import tasks

MARKER, PID = {marker!r}, {pid}

def _kill_job_server(example, ctx):
    if example["text"] == {line!r} and not os.path.exists(MARKER):
        with open(MARKER, "w") as f:
            f.write(str(PID))
        os.kill(PID, signal.SIGKILL)
    return example

tasks.TaskRegistry.add(
    {name!r},
    source=tasks.TextLineSource({pattern!r}, on_error={{"empty": "skip", "whitespace": "skip"}}),
    output_features={{"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)}},
    preprocessors=[tasks.preprocessors.FunctionPreprocessor(_kill_job_server, "kill_job_server"),
                   tasks.preprocessors.rekey({{"targets": "text"}}), tasks.preprocessors.tokenize(),
                   tasks.preprocessors.append_eos()],
)
'''


def _decoded(cache_dir):
    from seqcache.feeders.reader import CacheReader

    with CacheReader(cache_dir) as r:
        return collections.Counter(bytes(x - 3 for x in e["targets"].tolist()[:-1]).decode("utf-8")
                                   for e in r.read_examples(range(len(r))))


# Slow (a job server of its own for each runner): .ci/run runs them by name.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_job_server_killed_mid_build_fails_in_one_line_or_leaves_every_record_once(tmp_path, corpus, name):
    """The job server (its own, not the module's) is killed while a work unit is
    being read: the build either holds every input line exactly once or fails
    with one line and leaves no manifest, no folder and no lock file."""
    server = JobServer(name, tmp_path)
    try:
        marker, task_name = tmp_path / "killed", f"killer_{name}_{os.urandom(4).hex()}"
        module = tmp_path / f"{task_name}.py"
        module.write_text(textwrap.dedent(_KILLER).format(marker=str(marker), pid=server.proc.pid, line="MENENIUS:",
                                                          name=task_name, pattern=str(corpus / "*.txt")))
        tasks.import_definitions(str(module))
        task = tasks.TaskRegistry.get(task_name)
        cache = tmp_path / "c"
        try:
            result = build_task(task, cache_dir=str(cache), config=BuildConfig(num_shards=2),
                                pipeline_args=server.args(), split_size=20_000)
        except BuildError as e:
            message = str(e)
            assert "\n" not in message and len(message) < 600, message
            assert "job server" in message and "nothing was published" in message, message
            # No manifest and no lock file; the work folder keeps what was read, for the same build run again.
            assert not (cache / task_name / "train" / fmt.MANIFEST_NAME).exists()
            assert sorted(p.name for p in (cache / task_name).iterdir()) == [".train.work", "train"]
        else:
            want = collections.Counter(line for p in sorted(corpus.glob("*.txt"))
                                       for line in p.read_text(encoding="utf-8").split("\n")[:-1] if line.strip())
            assert _decoded(result.cache_dir) == want
        assert marker.exists()  # the job server was killed in the middle of the build
        assert server.proc.wait(timeout=30) == -9
    finally:
        server.stop()
        tasks.TaskRegistry.remove(task_name) if task_name in tasks.TaskRegistry.names() else None


# Beam's worker pool (the service of worker_pool_main, in process mode: each
# worker is `python -c ...SdkHarness...`, `python` from the PATH) on 127.0.0.1;
# it prints its port.
_POOL = """
import sys
from concurrent import futures
import grpc
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer
server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
port = server.add_insecure_port("127.0.0.1:0")
beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(BeamFnExternalWorkerPoolServicer(use_process=True),
                                                                   server)
server.start()
print(port, flush=True)
server.wait_for_termination()
"""
# A worker's `python` that cannot start one: it notes that it was asked, and exits.
_NO_BEAM = '#!/bin/sh\necho asked >> "{marker}"\necho "No module named apache_beam" >&2\nexit 1\n'
# A worker's `python` that is this test's interpreter (Beam, seqcache).
_THIS_PYTHON = '#!/bin/sh\nexec "{python}" "$@"\n'
# The master of each runner's own job server: Spark local[2], as the users who saw it hang; Flink embedded.
MASTERS = {"flink": [], "spark": ["--spark_master_url=local[2]"]}
RUNNER_NAMES = {"flink": "FlinkRunner", "spark": "SparkRunner"}
# Seconds without progress after which these tests' builds give up (stall.py): several times the longest
# quiet moment of a healthy build here, the start of the first SDK worker after the job's state became RUNNING
# (9 s on Spark local[2] on the 2-core machine; a 30 s bound once gave up before it under load).
STALL_S = "60"


class WorkerPool:
    """Beam's worker pool for an EXTERNAL environment, whose workers run
    ``python_script`` as ``python`` (``env``: what its workers inherit besides)."""

    def __init__(self, folder: pathlib.Path, python_script: str, env: dict | None = None):
        bin_dir = folder / "pool-bin"
        bin_dir.mkdir()
        (bin_dir / "python").write_text(python_script)
        (bin_dir / "python").chmod(0o755)
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-c", _POOL], stdout=subprocess.PIPE, text=True, env=env,
                                     stdin=subprocess.DEVNULL)
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            self.stop()
            pytest.fail(f"the worker pool did not start in {START_TIMEOUT_S} s", pytrace=False)
        self.port = int(line)

    def args(self) -> list[str]:
        return ["--environment_type=EXTERNAL", f"--environment_config=127.0.0.1:{self.port}"]

    def stop(self) -> None:
        """Kills the pool and the workers it started."""
        with contextlib.suppress(psutil.Error):
            for worker in psutil.Process(self.proc.pid).children(recursive=True):
                worker.kill()
        self.proc.kill()
        self.proc.wait(timeout=30)


def _java_children() -> set[int]:
    """The pids of this process's ``java`` descendants (the module's job servers, a build's)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.name() == "java":
                found.add(p.pid)
    return found


def _assert_left_for_the_rerun_only(cache: pathlib.Path, task_name: str, java_before: set[int]) -> None:
    """A build that died: no manifest, no lock file, no heartbeats; its work
    folder and its build folder's record stay for the rerun; the job server
    it started is gone."""
    assert sorted(p.name for p in (cache / task_name).iterdir()) == [".train.work", "train"]
    assert not (cache / task_name / "train" / fmt.MANIFEST_NAME).exists()
    assert not (cache / task_name / "train" / "_tmp" / stall.BEATS_DIR).exists()
    assert _java_children() <= java_before


@pytest.fixture
def own_job_server(monkeypatch):
    """A build that starts its own job server (the jars of ``make jars``),
    giving up after ``STALL_S`` seconds without progress."""
    def args(name: str) -> list[str]:
        _require(JARS / SERVERS[name][0])
        return [f"--runner={name}", *MASTERS[name]]

    monkeypatch.setenv(runner_mod.JARS_ENV, str(JARS))
    monkeypatch.setenv(stall.TIMEOUT_VARIABLE, STALL_S)
    return args


# Slow (the job server's start, then the bound): .ci/run runs it.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SERVERS))
def test_workers_that_cannot_start_fail_the_build_in_one_line_after_the_bound(tmp_path, corpus, name,
                                                                              own_job_server):
    """The pool's ``python`` lacks Beam: each worker it starts exits at once,
    and Beam's runner waits for its connection without end. The build gives
    up after the bound, in one line naming the runner and the cause, and
    leaves only its work folder, for the rerun; the job server it started
    is stopped."""
    args, marker = own_job_server(name), tmp_path / "asked"
    pool = WorkerPool(tmp_path, _NO_BEAM.format(marker=marker))
    cache, java_before = tmp_path / "c", _java_children()
    try:
        with pytest.raises(BuildError) as info:
            build_task(_byte_task(corpus, "jvm_no_worker"), cache_dir=str(cache), config=BuildConfig(num_shards=2),
                       pipeline_args=[*args, *pool.args()], split_size=20_000)
    finally:
        pool.stop()
    message = str(info.value)
    assert message.startswith(f"runner {RUNNER_NAMES[name]}: the job made no progress for {STALL_S} s "), message
    assert "an SDK worker died or never connected" in message and "nothing was published" in message, message
    assert "\n" not in message and len(message) < 600, message
    assert marker.read_text().split()[0] == "asked"  # the runner asked the pool for a worker, which did not start
    _assert_left_for_the_rerun_only(cache, "jvm_no_worker", java_before)


# Slow (the job server's start, the build, then the bound): .ci/run runs it.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SERVERS))
def test_a_worker_killed_mid_build_fails_in_one_line_or_leaves_every_record_once(tmp_path, corpus, name,
                                                                                 own_job_server):
    """A worker of the pool is killed while it reads a work unit: the build
    either fails in one line naming the runner and a worker that died (Spark
    waits for it without end, until the bound; Flink fails the job) and
    leaves only its work folder, or (a runner that starts another worker)
    holds every input line exactly once."""
    args = own_job_server(name)
    marker, task_name = tmp_path / "killed", f"worker_killer_{name}_{os.urandom(4).hex()}"
    module = tmp_path / f"{task_name}.py"
    module.write_text(textwrap.dedent(KILL_ONCE_TASK).format(marker=str(marker), line="MENENIUS:", name=task_name,
                                                              pattern=str(corpus / "*.txt")))
    tasks.import_definitions(str(module))
    pool = WorkerPool(tmp_path, _THIS_PYTHON.format(python=sys.executable))
    cache, java_before = tmp_path / "c", _java_children()
    try:
        result = build_task(tasks.TaskRegistry.get(task_name), cache_dir=str(cache), config=BuildConfig(num_shards=2),
                            pipeline_args=[*args, *pool.args()], split_size=20_000)
    except BuildError as e:
        message = str(e)
        # A worker of the pool was killed (not this process), and the build failed for that.
        assert marker.exists() and int(marker.read_text()) != os.getpid(), f"no worker was killed: {message}"
        assert message.startswith(f"runner {RUNNER_NAMES[name]}: "), message
        assert "an SDK worker died or never connected" in message or "a worker that died" in message, message
        assert "nothing was published" in message and "\n" not in message and len(message) < 700, message
        _assert_left_for_the_rerun_only(cache, task_name, java_before)
    else:
        assert marker.exists() and int(marker.read_text()) != os.getpid(), "no worker was killed, and the build ended"
        want = collections.Counter(line for p in sorted(corpus.glob("*.txt"))
                                   for line in p.read_text(encoding="utf-8").split("\n")[:-1] if line.strip())
        assert _decoded(result.cache_dir) == want
    finally:
        pool.stop()
        tasks.TaskRegistry.remove(task_name) if task_name in tasks.TaskRegistry.names() else None


def _listening_java_child(proc: subprocess.Popen) -> psutil.Process:
    """The ``java`` child of ``proc`` once it listens on a port (its job
    server serving); fails when ``proc`` exits first or after ``START_TIMEOUT_S``."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:  # bounded: the deadline, or the build's exit
        for child in psutil.Process(proc.pid).children():
            with contextlib.suppress(psutil.Error):
                connections = getattr(child, "net_connections", None) or child.connections
                if child.name() == "java" and any(c.status == psutil.CONN_LISTEN for c in connections("tcp")):
                    return child
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no job server listening under the build (exit status {proc.poll()})", pytrace=False)
        time.sleep(0.2)


# Slow (a job server's start): .ci/run runs it; test_job_server.py has the fast one, with a fake job server.
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SERVERS))
def test_the_job_server_of_a_build_killed_with_sigkill_dies_with_it(tmp_path, corpus, name):
    """``seqcache build --runner=flink`` (or spark) starts its own job server;
    the build killed with SIGKILL once it serves, the job server is gone
    within 60 s (Linux's parent-death signal: job_server.py), where Beam's
    stayed under init. The build's workers never start (a worker pool whose
    ``python`` lacks Beam, and a bound far above the test's length), so the
    build is surely running when it is killed."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the parent-death signal is Linux's")
    _require(JARS / SERVERS[name][0])
    env = {**os.environ, runner_mod.JARS_ENV: str(JARS), stall.TIMEOUT_VARIABLE: "3600"}
    exe = pathlib.Path(sys.executable).with_name("seqcache")
    pool = WorkerPool(tmp_path, _NO_BEAM.format(marker=tmp_path / "asked"))
    build = subprocess.Popen([str(exe), "build", "--source", f"text:{corpus}/*.txt", "--name", "plain",
                              "--cache-dir", str(tmp_path / "c"), f"--runner={name}", *MASTERS[name], *pool.args()],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    server = None
    try:
        server = _listening_java_child(build)
        build.kill()
        assert build.wait(timeout=30) == -9
        assert ended(server.pid, timeout_s=60), f"the {name} job server outlived the build killed with SIGKILL"
    finally:
        if build.poll() is None:
            build.kill()
            build.wait(timeout=30)
        with contextlib.suppress(psutil.Error):
            if server is not None and server.is_running():  # the test failed: leave no job server behind
                server.kill()
        pool.stop()
