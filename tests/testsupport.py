"""Plain helpers shared by the test modules (``from testsupport import ...``).

tests/conftest.py puts this folder on ``sys.path``; fixtures live in the conftest
files, and what a module calls itself (at import time, in its own helpers, or
with plain arguments) lives here. Package imports are made inside the functions,
so that importing this module costs nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import textwrap
import threading
import uuid


def byte_task(name: str, source, *, first=(), eos: bool = True, packing: str | None = None):
    """Task ``name`` whose one output feature ``targets`` is the record's text as
    UTF-8 bytes (``ByteVocabulary``): preprocessors ``first`` (a sequence of
    Preprocessor), then rekey(targets <- text), tokenize, and append_eos when
    ``eos``. ``source`` is a Source; ``packing`` is None or a packing mode."""
    from seqcache import tasks

    preprocessors = [*first, tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()]
    if eos:
        preprocessors.append(tasks.preprocessors.append_eos())
    return tasks.Task(name, source=source, output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=preprocessors, packing=packing)


def lines_task(pattern, name: str = "lines", *, on_error=None, eos: bool = True, packing: str | None = None):
    """``byte_task`` over ``TextLineSource(pattern, on_error)``: each line of the
    files matching ``pattern`` (a glob or a list of them) as bytes. ``on_error``
    None keeps empty lines (``{"empty": "keep"}``)."""
    from seqcache import tasks

    source = tasks.TextLineSource(pattern, on_error={"empty": "keep"} if on_error is None else on_error)
    return byte_task(name, source, eos=eos, packing=packing)


def shakespeare_lm_task(pattern):
    """The packed byte-level language-modelling task ``shakespeare_lm`` over the
    text files matching ``pattern`` (empty lines skipped, EOS after each line)."""
    return lines_task(pattern, "shakespeare_lm", on_error={"empty": "skip"}, packing="lm")


def write_lines(path, lines) -> pathlib.Path:
    """Writes ``lines`` (str, no line ends) to ``path`` as UTF-8, each ended by
    ``\\n``, creating its folder; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_files(folder, files) -> pathlib.Path:
    """Creates ``folder`` (which must not exist) and writes ``files``, a mapping of
    file name to bytes, into it; returns the folder."""
    folder = pathlib.Path(folder)
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def batches_digest(batches) -> str:
    """sha256 (hex) of an iterable of batches (dicts of numpy arrays), each
    batch's arrays in the order of their sorted keys."""
    import numpy as np

    h = hashlib.sha256()
    for b in batches:
        for k in sorted(b):
            h.update(np.ascontiguousarray(b[k]).tobytes())
    return h.hexdigest()


# A one-layer model small enough to train in seconds on the CPU devices.
SMALL_MODEL = "model.d_model=32 model.num_layers=1 model.num_heads=4 model.mlp_dim=64"


def train_shakespeare_lm(cache, ckpt, *extra, sequence_length: int):
    """Runs ``seqcache train`` in this process on task ``shakespeare_lm`` of the
    caches root ``cache`` (batch size 8, the tiny model shrunk by ``SMALL_MODEL``,
    no progress bar), checkpoints in ``ckpt``, then the arguments ``extra``; returns
    click's Result (exceptions propagate)."""
    from click.testing import CliRunner

    from seqcache.cli.commands.train import train

    args = ["--cache-dir", str(cache), "--task", "shakespeare_lm", "--batch-size", "8",
            "--sequence-length", str(sequence_length), "--checkpoint-dir", str(ckpt), "--model", "tiny",
            "--set", SMALL_MODEL, "--set", "progress=false", *extra]
    return CliRunner().invoke(train, args, catch_exceptions=False)


def default_signals() -> None:
    """``preexec_fn`` of a child process that a test stops with a signal: it
    starts with SIGINT and SIGTERM at their defaults and unblocked, as a command
    started from a terminal does, whatever the test process's own state."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


# --- The seqcache command in a subprocess, stopped at a moment the test finds --------

def marked_env() -> tuple[dict, str]:
    """``(environment, marker)``: this process's environment with a marker
    ``SEQCACHE_TEST_RUN=<random hex>`` added, which a command's worker processes
    inherit, so that ``processes_with(marker)`` finds them (and the command)."""
    marker = f"SEQCACHE_TEST_RUN={uuid.uuid4().hex}"
    key, value = marker.split("=")
    return {**os.environ, key: value}, marker


def processes_with(marker: str) -> dict[int, str]:
    """pid -> command line of every live process whose environment holds
    ``marker`` (from /proc: Linux only; a zombie's environment reads empty)."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker.encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                found[int(name)] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


# The module ``gated_task`` (write it to the command's working folder, beside a
# FIFO named ``gate``): a registered task ``gated`` whose only record waits until
# the test opens the gate's write end (``gate_opened``), so that the build is surely
# running its pipeline (in a worker process, with worker processes), and then
# until the test closes it.
GATED_TASK = textwrap.dedent(
    """
    import os

    from seqcache import tasks

    GATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate")


    def records():
        with open(GATE) as f:
            f.read()
        yield {"text": "after the gate"}


    tasks.TaskRegistry.add(
        "gated",
        source=tasks.FunctionSource(records, name="gated"),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )
    """
)


@contextlib.contextmanager
def gate_opened(gate, *, timeout_s: float):
    """Opens the FIFO ``gate`` for writing, which returns once a reader has opened
    it (``GATED_TASK``'s record, in a running build), and holds it open while the
    block runs; the reader reads to its end when the block ends.

    Raises:
      AssertionError: no reader came within ``timeout_s`` seconds.
    """
    held = {}

    def open_gate():  # returns once the reader has opened the read end
        held["gate"] = open(gate, "w")

    opener = threading.Thread(target=open_gate, daemon=True)
    opener.start()
    opener.join(timeout=timeout_s)
    if "gate" not in held:
        os.close(os.open(gate, os.O_RDONLY | os.O_NONBLOCK))  # a reader of our own: the opener returns
        opener.join()
        held["gate"].close()
        raise AssertionError(f"no build reached the gate in {timeout_s} s")
    try:
        yield
    finally:
        held["gate"].close()


# --- Beam's runners: 2 local worker processes, a dask.distributed cluster -----------

MULTI_PROCESSING = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]


def interrupt(proc, signum, *, to_group: bool, timeout_s: float) -> tuple[str, str]:
    """Sends ``signum`` to ``proc`` (with ``to_group``, to its process group, as
    a terminal's Ctrl-C does) and waits for it: its (stdout, stderr)."""
    if to_group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    return proc.communicate(timeout=timeout_s)


def ended(pid: int, *, timeout_s: float) -> bool:
    """Whether the process ``pid`` has ended within ``timeout_s`` seconds:
    gone, or a zombie (dead, not yet reaped by whatever adopted it: a
    container's first process may never reap). Linux's /proc; polled every
    0.05 s, bounded by the timeout."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:  # bounded: the deadline
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in (b"Z", b"X"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def kill_if_running(proc) -> None:
    """Kills and reaps ``proc`` if a test left it running."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def start_gated_build(tmp_path, command: list, *, build_args=(), **popen):
    """Writes ``GATED_TASK`` to ``tmp_path`` and starts ``command`` (the
    interpreter and the CLI module) ``build --cache-dir tmp_path/c --module
    gated_task gated`` plus ``build_args`` there, output piped as text;
    ``popen``: more ``subprocess.Popen`` arguments. Returns (process, the gate
    FIFO that ``gate_opened`` waits on)."""
    import subprocess

    (tmp_path / "gated_task.py").write_text(GATED_TASK)
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    args = [*command, "build", "--cache-dir", str(tmp_path / "c"), "--module", "gated_task", "gated", *build_args]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    return proc, gate


# A test cluster's housekeeping, slowed down: the stack sampling profiler, the
# event-loop tick check and the system monitor serve the dashboard and its
# warnings, and at their default rates they cost an idle cluster about a tenth
# of a core.
QUIET_DASK = {"distributed.worker.profile.enabled": False, "distributed.admin.tick.interval": "1s",
              "distributed.admin.system-monitor.interval": "2s"}


def local_dask_cluster(**config):
    """A ``dask.distributed`` scheduler and 2 worker processes on 127.0.0.1
    (``config``: dask settings for its start, over ``QUIET_DASK``); close it when done."""
    import dask
    import distributed

    with dask.config.set({**QUIET_DASK, **config}):
        return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                                        dashboard_address="127.0.0.1:0", protocol="tcp")


def prism_missing() -> str | None:
    """Why Prism cannot run here (the build's own check, on the binary it would use), or None."""
    from seqcache.pipelines import runner as runner_mod

    options, runner = runner_mod.pipeline_options(["--runner=prism"])
    try:
        runner_mod.check_runner_available(runner, options)
    except runner_mod.RunnerError as e:
        return str(e)
    return None


S3_BUCKET = "seqcache-test"
S3_KEY_ID, S3_SECRET, S3_REGION = "testing-key", "testing-secret", "us-east-1"


@contextlib.contextmanager
def moto_s3():
    """An S3 server (moto's ``ThreadedMotoServer``) on 127.0.0.1, on a free
    port, with one bucket, ``S3_BUCKET``: yields {"endpoint", "client"
    (boto3), "options" (the Beam pipeline options for it)}; stopped after."""
    import logging

    import boto3
    from moto import server as moto_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's request log
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_KEY_ID,
                              aws_secret_access_key=S3_SECRET, region_name=S3_REGION)
        client.create_bucket(Bucket=S3_BUCKET)
        yield {"endpoint": endpoint, "client": client,
               "options": [f"--s3_endpoint_url={endpoint}", f"--s3_access_key_id={S3_KEY_ID}",
                           f"--s3_secret_access_key={S3_SECRET}", f"--s3_region_name={S3_REGION}"]}
    finally:
        server.stop()
        from seqcache import fs

        fs.set_options(None)  # the builds set them for this process: leave none behind


@contextlib.contextmanager
def one_botocore_loader():
    """One botocore data loader for every session of this process. Beam makes a
    new boto3 session, so a new loader, for each file operation, and each parses
    botocore's service-model files again (about 0.1 s of CPU per operation); a
    shared loader is what botocore itself does for the clients of one session."""
    import functools

    import botocore.session

    create = botocore.session.create_loader
    botocore.session.create_loader = functools.lru_cache(maxsize=None)(create)
    try:
        yield
    finally:
        botocore.session.create_loader = create


def dask_args(cluster) -> list[str]:
    """The pipeline options that run a build or a scan on ``cluster`` with Beam's DaskRunner."""
    return ["--runner=DaskRunner", f"--dask_client_address={cluster.scheduler_address}",
            "--dask_connection_timeout=30"]


def format_2_manifest(cache_dir) -> dict:
    """The manifest.json a format-2 seqcache would have written for the cache
    at ``cache_dir`` (built by this one, format 3): the per-file source table
    inline (``sources``, ``statistics.source_files``, and the fingerprint
    inputs' file list back in ``fingerprint_inputs``), no ``source_table``,
    ``format_version`` 2. The fingerprint is unchanged."""
    from seqcache import format as fmt

    m = fmt.read_manifest(str(cache_dir))
    table = m.read_source_table()
    with open(os.path.join(str(cache_dir), fmt.MANIFEST_NAME), encoding="utf-8") as f:
        raw = {k: v for k, v in json.load(f).items() if k != "source_table"}
    raw["format_version"] = 2
    raw["fingerprint_inputs"] = m.full_fingerprint_inputs()
    statistics = dict(raw.get("statistics") or {})
    if table.statistics is not None:
        statistics["source_files"] = {**table.statistics, "units": "examples in records (source examples, before packing); tokens in tokens"}
    raw["statistics"] = statistics
    order = list(raw)
    raw["sources"] = [dict(e) for e in table]
    at = order.index("statistics") + 1  # where format 2 wrote it: after statistics
    return {k: raw[k] for k in order[:at] + ["sources"] + order[at:]}


def rewrite_as_format_2(cache_dir) -> dict:
    """Rewrites the cache at ``cache_dir`` (format 3) as format 2 wrote it:
    ``format_2_manifest`` as its manifest.json (indented, as written then),
    and no source table file. Returns that manifest."""
    from seqcache import format as fmt

    raw = format_2_manifest(cache_dir)
    folder = pathlib.Path(cache_dir)
    (folder / fmt.MANIFEST_NAME).write_text(json.dumps(raw, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (folder / fmt.SOURCE_TABLE_NAME).unlink()
    return raw


# A task module (str.format: marker, line, name, pattern) whose preprocessor
# kills the worker process it runs in (SIGKILL, no clean-up, as a preempted
# machine dies) on reaching the marked line, once: the marker file, written
# first, lets the retried attempt go on.
KILL_ONCE_TASK = '''
import os, signal
from seqcache import tasks

MARKER = {marker!r}

def _kill_once(example, ctx):
    if example["text"] == {line!r} and not os.path.exists(MARKER):
        with open(MARKER, "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return example

tasks.TaskRegistry.add(
    {name!r},
    source=tasks.TextLineSource({pattern!r}, on_error={{"empty": "skip", "whitespace": "skip"}}),
    output_features={{"targets": tasks.Feature(tasks.ByteVocabulary(), add_eos=True)}},
    preprocessors=[tasks.preprocessors.FunctionPreprocessor(_kill_once, "kill_once"),
                   tasks.preprocessors.rekey({{"targets": "text"}}), tasks.preprocessors.tokenize(),
                   tasks.preprocessors.append_eos()],
)
'''
