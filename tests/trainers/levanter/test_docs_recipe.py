"""The `train_lm` recipe of docs/trainers/levanter.md, run as written: its
tokenizer stub and its script, taken from the page, train levanter's
``train_lm`` on the packed LM cache with no network (HF_HUB_OFFLINE, an empty
Hugging Face cache, proxies that refuse every connection), then resume from
the step-3 checkpoint on two processes with the uninterrupted run's losses.

Skipped where levanter is not installed (its venv of run.sh has it)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys

import pytest

pytest.importorskip("levanter")

HERE = pathlib.Path(__file__).resolve().parent
DOC = HERE.parents[2] / "docs" / "trainers" / "levanter.md"
WORK = pathlib.Path(os.environ.get("SEQCACHE_TRAINER_WORK", "build/trainers")).resolve()
TIMEOUT = 900  # seconds for one run (compiling on a shared 2-core machine)
DEAD = "http://127.0.0.1:9"  # nothing listens there: any download fails


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), flags=re.S | re.M)


def _script() -> str:
    found = [b for b in _blocks("python") if b.startswith("# train_seqcache.py")]
    assert len(found) == 1, f"{DOC}: no single ```python block starting '# train_seqcache.py'"
    return found[0]


def _tokenizer_stub() -> str:
    """The Python of the page's `python - <<'EOF'` block that writes hf-tokenizer."""
    for block in _blocks("sh"):
        m = re.search(r"<<'EOF'\n(.*?)^EOF$", block, flags=re.S | re.M)
        if m and "hf-tokenizer" in m.group(1):
            return m.group(1)
    raise AssertionError(f"{DOC}: no ```sh block with a <<'EOF' script writing hf-tokenizer")


def _lm_cache() -> str:
    return next(line for line in (WORK / "caches.txt").read_text().split() if "shakespeare_lm" in line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: pathlib.Path, devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               HF_HUB_OFFLINE="1", HF_HOME=str(tmp / "hf-home"))
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env[k] = DEAD
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"  # jax.distributed's coordinator
    return env


def _run(tmp: pathlib.Path, run_dir: str, processes: int) -> list[str]:
    """Runs the page's script on ``processes`` processes (2 CPU devices in all);
    returns each process's output."""
    port = _free_port()
    procs = []
    for p in range(processes):
        args = [sys.executable, "train_seqcache.py", _lm_cache(), run_dir]
        if processes > 1:
            args += [str(processes), str(p), f"127.0.0.1:{port}"]
        log = open(tmp / f"{run_dir}-{p}.log", "w")
        procs.append((subprocess.Popen(args, cwd=tmp, stdout=log, stderr=subprocess.STDOUT,
                                       env=_env(tmp, 2 // processes)), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=TIMEOUT)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    outs = [(tmp / f"{run_dir}-{p}.log").read_text() for p in range(processes)]
    for (proc, _), out in zip(procs, outs):
        assert proc.returncode == 0, out[-4000:]
    return outs


def _losses(out: str) -> dict[int, float]:
    """step -> train/loss from levanter's JSON logger lines."""
    losses = {}
    for line in out.splitlines():
        _, sep, rest = line.partition("levanter.json_logger ")
        if not sep:
            continue
        record = json.loads(rest)
        if record.get("event") == "log" and "train/loss" in record.get("metrics", {}):
            losses[record["step"]] = record["metrics"]["train/loss"]
    return losses


def test_train_lm_recipe_runs_offline_and_resumes_on_two_processes(tmp_path):
    (tmp_path / "train_seqcache.py").write_text(_script())
    subprocess.run([sys.executable, "-c", _tokenizer_stub()], cwd=tmp_path, env=_env(tmp_path, 1), check=True,
                   timeout=TIMEOUT)
    assert (tmp_path / "hf-tokenizer" / "tokenizer.json").is_file()

    a, = _run(tmp_path, "a", 1)
    assert "No checkpoint found. Starting from scratch." in a
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step-3", "step-5"]
    la = _losses(a)
    assert sorted(la) == [2, 3, 4, 5], la  # levanter's hooks log from step 2 on

    # A job preempted after step 3: only that checkpoint, resumed on 2 processes.
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step-3", tmp_path / "b" / "checkpoints" / "step-3")
    outs = _run(tmp_path, "b", 2)
    print("\nstep  1 process            resumed on 2 processes")
    for out in outs:
        assert "Resuming training from step 4" in out
        lb = _losses(out)
        assert sorted(lb) == [4, 5], lb
        for s in (4, 5):
            print(f"{s:4d}  {la[s]!r:20}  {lb[s]!r}")
            assert lb[s] == la[s], f"step {s}: resumed loss {lb[s]!r} != uninterrupted {la[s]!r}"
