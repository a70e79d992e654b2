"""The recipe of docs/trainers/t5x.md, as written: its gin block is the shipped
seqcache_common.gin, and its command line (environment and flags taken from
the page) trains T5.1.1 tiny on the span-corruption cache with RANDOM_SEED 0;
a checkpoint written with ``save_dataset=True`` on one process cannot be
resumed on two with ``save_dataset=True`` (the missing per-process file the
page quotes) and resumes with ``save_dataset=False`` on the Feeder's rows.

Skipped where t5x is not importable (its venv of run.sh has it)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("t5x")

from seqcache.feeders import Feeder  # noqa: E402
from seqcache.feeders.trainers import t5x as seqcache_t5x  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "trainers" / "t5x.md"
WORK = os.environ["SEQCACHE_TRAINER_WORK"]
DOC_CACHE = "build/trainers/caches/c4_span/train"  # the cache the page's command names
DOC_MODEL_DIR = "runs/t5"
TIMEOUT = 600  # seconds, per t5x process


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def _gin_lines(text: str) -> list[str]:
    """Non-empty lines without comments or surrounding spaces."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return [re.sub(r"\s+", " ", line) for line in lines if line]


def _cache() -> str:
    with open(os.path.join(WORK, "caches.txt")) as f:
        return next(line.strip() for line in f if "/c4_span/" in line)


def _doc_command() -> tuple[dict[str, str], list[str]]:
    """(environment, argv after the interpreter) of the page's t5x.train command."""
    found = [b for b in _blocks("sh") if "-m t5x.train" in b]
    assert len(found) == 1, f"{DOC}: no single ```sh block running -m t5x.train"
    env, argv = {}, None
    for line in found[0].replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            env.update(w.split("=", 1) for w in words[1:])
        elif "t5x.train" in words:
            argv = words[words.index("-m"):]
    assert argv is not None
    return env, argv


def _train(tmp: Path, name: str, model_dir: Path, processes: int, extra: list[str]) -> tuple[list[int], list[str]]:
    """Runs the page's command (its cache and model folder replaced by this test's)
    with ``extra`` flags on ``processes`` processes; returns exit codes and logs."""
    env, argv = _doc_command()
    gin_dir = seqcache_t5x.gin_dir()
    argv = [a.replace("$GIN", gin_dir).replace(f"'{DOC_CACHE}'", f"'{_cache()}'")
            .replace(f"'{DOC_MODEL_DIR}'", f"'{model_dir}'") for a in argv]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for i in range(processes):
        multi = [] if processes == 1 else [
            "--multiprocess_gpu", f"--coordinator_address=127.0.0.1:{port}",
            f"--process_count={processes}", f"--process_index={i}"]
        log = tmp / f"{name}.{i}.log"
        logs.append(log)
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, *argv, *extra, *multi, "--alsologtostderr"],
                                          stdout=out, stderr=subprocess.STDOUT,
                                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **env)))
    codes = []
    try:
        for p in procs:
            try:
                codes.append(p.wait(timeout=TIMEOUT))
            except subprocess.TimeoutExpired:
                codes.append("timeout")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, [log.read_text() for log in logs]


def _rows(record: Path) -> dict[int, list[int]]:
    by_step: dict[int, dict[int, list[int]]] = {}
    for line in record.read_text().splitlines():
        r = json.loads(line)
        by_step.setdefault(r["step"], {})[r["shard_id"]] = r["cache_index"]
    return {s: sum((h[i] for i in sorted(h)), []) for s, h in sorted(by_step.items())}


def test_gin_block_is_the_shipped_seqcache_common_gin():
    found = [b for b in _blocks("gin") if "get_deterministic_dataset" in b]
    assert len(found) == 1, f"{DOC}: no single ```gin block binding get_deterministic_dataset"
    shipped = Path(seqcache_t5x.gin_dir(), "seqcache_common.gin").read_text()
    assert _gin_lines(found[0]) == _gin_lines(shipped)


def test_doc_command_and_save_dataset_resume(tmp_path):
    env, argv = _doc_command()
    assert env.get("JAX_PLATFORMS") == "cpu" and "--gin.RANDOM_SEED=0" in argv
    lengths = next(a for a in argv if a.startswith("--gin.TASK_FEATURE_LENGTHS="))
    targets_length = int(re.search(r"'targets':\s*(\d+)", lengths).group(1))
    batch = int(next(a for a in argv if a.startswith("--gin.BATCH_SIZE=")).split("=")[1])
    seed = int(next(a for a in argv if a.startswith("--gin.SEED=")).split("=")[1])
    model_dir = tmp_path / "t5"

    def record(name: str) -> list[str]:
        return [f"--gin.get_deterministic_dataset.record_path='{tmp_path / name}'"]

    # One process to step 3, with t5x's dataset checkpoint on.
    codes, logs = _train(tmp_path, "first", model_dir, 1, ["--gin.TRAIN_STEPS=3",
                         "--gin.utils.SaveCheckpointConfig.save_dataset=True", *record("first.jsonl")])
    assert codes == [0], logs[0][-4000:]
    assert "Using seed for initialization and dropout RNG: 0" in logs[0]
    assert (model_dir / "checkpoint_3" / "dataset" / "train_ds-000-of-001").is_file()
    resumable = tmp_path / "t5-copy"
    shutil.copytree(model_dir, resumable)

    # Two processes with save_dataset=True: t5x asks for a file one process never wrote.
    codes, logs = _train(tmp_path, "true", model_dir, 2, ["--gin.utils.SaveCheckpointConfig.save_dataset=True"])
    assert 0 not in codes, codes
    assert "checkpoint_3/dataset/process_0-of-2/train_ds-000-of-002: cannot read the t5x dataset state" in logs[0]

    # Two processes with save_dataset=False: the position comes from the step.
    codes, logs = _train(tmp_path, "false", resumable, 2, ["--gin.utils.SaveCheckpointConfig.save_dataset=False",
                                                          *record("resumed.jsonl")])
    assert codes == [0, 0], "\n".join(log[-4000:] for log in logs)
    with Feeder(cache=_cache(), global_batch_size=batch, sequence_length=targets_length, seed=seed,
                host_index=0, host_count=1) as feeder:
        want = {s: feeder.get_batch(s)["cache_index"].tolist() for s in range(6)}
    assert _rows(tmp_path / "first.jsonl") == {s: want[s] for s in range(3)}
    assert _rows(tmp_path / "resumed.jsonl") == {s: want[s] for s in range(3, 6)}
