"""A build that survives its own death, measured: a rerun after a kill, a
corpus grown by 3%, one of 8 files changed, each as a ratio to a full build
in the same round, and the CPU an uninterrupted build pays for keeping its work.

The corpus: --mb of documents (the C4 validation sample repeated, a copy
number in front of each document so that copies are distinct records) in
--files Parquet files, and a byte-level BPE tokenizer.json of 8,000 ids
trained on a sample of them (``benchmarks/pipeline.py``'s corpus and
tokenizer). Every build is the command a user types, in a child process::

    seqcache build --source 'parquet:DIR/*.parquet#text' --vocabulary bpe.json --name docs \\
        --sequence-length 1024 --pack --cache-dir D [--work keep|off] [--overwrite]

A round (--repeat rounds; figures are medians with [min, max]):

  full:     a build from nothing (the default --work auto): wall, CPU;
  off:      the same with --work off: the CPU ratio full / off is what
            keeping the work folder costs an uninterrupted build;
  killed:   the same build SIGKILLed (its whole process group) at --kill-at
            of full's wall time, then run again: rerun / full;
  grown:    a build with --work keep, then a file of --grow more documents
            (new ones) added and the build run again with --overwrite:
            against a full build of the grown corpus, in the same round;
  changed:  then one of the files rewritten (its documents in another order,
            one replaced) and the build run again with --overwrite: against
            a full build of the changed corpus.

Every rebuilt cache must have the data shards, provenance shards, quarantine
and statistics of the full build of the same corpus (guarantee G1); the run
fails otherwise. The corpus files are put back (bytes and mtime) after each
round.

Usage: python benchmarks/resume.py [--mb 51] [--files 8] [--grow 0.03] [--kill-at 0.7] [--repeat 3]
                                   [--work-dir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pipeline as corpus_tools  # noqa: E402  (benchmarks/pipeline.py: the documents and the tokenizer)

from seqcache import format as fmt  # noqa: E402

# The ``seqcache`` command, as its console script runs it.
CLI = "import sys; from seqcache.cli.main import run; sys.argv[0] = 'seqcache'; sys.exit(run())"


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _command(folder: pathlib.Path, vocab: str, cache_dir: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", CLI, "build", "--source", f"parquet:{folder}/*.parquet#text", "--vocabulary", vocab,
            "--name", "docs", "--sequence-length", "1024", "--pack", "--cache-dir", str(cache_dir), "--json", *extra]


def build(folder, vocab, cache_dir, *extra, kill_after: float | None = None) -> dict:
    """One ``seqcache build`` in a child process of its own process group:
    ``{"wall_s", "cpu_s", "work": the manifest's work or None}``; with
    ``kill_after`` (seconds), the group is SIGKILLed then and ``{"killed_at_s"}``,
    or ``{"ended_before_s"}`` when the build ended first."""
    before = _cpu_children()
    start = time.perf_counter()
    proc = subprocess.Popen(_command(folder, vocab, cache_dir, *extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=tempfile.gettempdir(), start_new_session=True)
    if kill_after is not None:
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return {"killed_at_s": time.perf_counter() - start}
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"seqcache build failed:\n{err.decode(errors='replace')[-3000:]}")
    if kill_after is not None:
        return {"ended_before_s": wall}
    (report,) = json.loads(out)
    return {"wall_s": wall, "cpu_s": _cpu_children() - before, "work": report.get("work")}


def cache_bytes(cache_dir: pathlib.Path) -> dict:
    """sha256 of every file of the cache but the manifest, and its statistics."""
    folder = cache_dir / "docs" / "train"
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
           if p.is_file() and p.name != fmt.MANIFEST_NAME}
    out["statistics"] = json.loads((folder / fmt.MANIFEST_NAME).read_text())["statistics"]
    return out


def _same(a: pathlib.Path, b: pathlib.Path, what: str) -> None:
    if cache_bytes(a) != cache_bytes(b):
        raise SystemExit(f"{what}: the cache differs from a full build of the same corpus ({a} against {b})")


def make_corpus(work: pathlib.Path, mb: float, files: int, grow: float) -> tuple[pathlib.Path, str, list[str]]:
    """(the corpus folder, the tokenizer, the documents of the file that grows it)."""
    folder = work / "docs"
    _, records = corpus_tools.make_documents(folder, int(mb * 1e6), num_files=files)
    vocab = corpus_tools.train_bpe_like_spm(records[:20000], work)
    extra = [f"grown {i} {d}" for i, d in enumerate(records[:max(1, int(len(records) * grow))])]
    return folder, vocab, extra


def _killed(folder, vocab, cache_dir: pathlib.Path, kill_at: float, full_s: float, attempts: int = 4) -> dict:
    """The build killed at ``kill_at`` of a full build's wall time. On a busy
    machine the full build's time is a poor guess: a build that ends before
    its kill is a full build too, so its own time sets the next attempt's
    kill (its cache removed first), at most ``attempts`` times."""
    for _ in range(attempts):
        row = build(folder, vocab, cache_dir, kill_after=kill_at * full_s)
        if "killed_at_s" in row:
            return row
        shutil.rmtree(cache_dir, ignore_errors=True)
        full_s = row["ended_before_s"]
    raise SystemExit(f"the build ended before its kill {attempts} times: lower --kill-at")


def one_round(work: pathlib.Path, folder: pathlib.Path, vocab: str, extra: list[str], kill_at: float,
              index: int = 0) -> dict:
    row: dict = {}
    shutil.rmtree(work / "round", ignore_errors=True)
    r = work / "round"
    # The pair whose CPU is compared runs in turns, first one then the other
    # first, so that neither always meets a cold page cache.
    for name in (("full", "off") if index % 2 == 0 else ("off", "full")):
        row[name] = build(folder, vocab, r / name, *(("--work", "off") if name == "off" else ()))
    _same(r / "off", r / "full", "--work off")
    row["killed"] = _killed(folder, vocab, r / "killed", kill_at, row["full"]["wall_s"])
    row["rerun"] = build(folder, vocab, r / "killed")
    _same(r / "killed", r / "full", "the rerun after a kill")
    build(folder, vocab, r / "kept", "--work", "keep")
    kept = r / "kept" / "docs" / ".train.work"
    row["work_bytes"] = sum(p.stat().st_size for p in kept.rglob("*") if p.is_file())
    new_file = folder / "part-999.parquet"
    pq.write_table(pa.table({"text": extra}), new_file)
    try:
        row["grown"] = build(folder, vocab, r / "kept", "--work", "keep", "--overwrite")
        row["grown_full"] = build(folder, vocab, r / "grown_full")
        _same(r / "kept", r / "grown_full", "the grown corpus")
    finally:
        new_file.unlink()
    changed = sorted(folder.glob("*.parquet"))[len(list(folder.glob("*.parquet"))) // 2]
    original, stat = changed.read_bytes(), changed.stat()
    texts = pq.read_table(changed).column("text").to_pylist()
    pq.write_table(pa.table({"text": [f"changed {texts[0]}"] + texts[1:][::-1]}), changed)
    try:
        row["changed"] = build(folder, vocab, r / "kept", "--work", "keep", "--overwrite")
        row["changed_full"] = build(folder, vocab, r / "changed_full")
        _same(r / "kept", r / "changed_full", "the changed corpus")
    finally:
        changed.write_bytes(original)
        os.utime(changed, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return row


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def measure(work: pathlib.Path, *, mb: float, files: int, grow: float, kill_at: float, repeat: int) -> dict:
    folder, vocab, extra = make_corpus(work, mb, files, grow)
    rounds = [one_round(work, folder, vocab, extra, kill_at, k) for k in range(repeat)]
    ratios = {
        "rerun_after_kill": [x["rerun"]["wall_s"] / x["full"]["wall_s"] for x in rounds],
        "grown": [x["grown"]["wall_s"] / x["grown_full"]["wall_s"] for x in rounds],
        "one_file_changed": [x["changed"]["wall_s"] / x["changed_full"]["wall_s"] for x in rounds],
        "cpu_keeping_work": [x["full"]["cpu_s"] / x["off"]["cpu_s"] for x in rounds],
    }
    size = sum(p.stat().st_size for p in folder.glob("*.parquet"))
    text = sum(len(t.encode()) for p in folder.glob("*.parquet") for t in pq.read_table(p).column("text").to_pylist())
    work_bytes = [x["work_bytes"] for x in rounds]
    return {"mb": mb, "files": files, "corpus_bytes": size, "text_bytes": text, "work_bytes": statistics.median(work_bytes),
            "grow": grow, "kill_at": kill_at, "repeat": repeat,
            "bytes_equal": True, "ratios": {k: _summary(v) for k, v in ratios.items()},
            "full_wall_s": _summary([x["full"]["wall_s"] for x in rounds]), "rounds": rounds}


TARGETS = {"rerun_after_kill": 0.40, "grown": 0.20, "one_file_changed": 0.25, "cpu_keeping_work": 1.05}
LABELS = {"rerun_after_kill": "rerun after a kill at {kill:.0%}, wall / full",
          "grown": "{grow:.0%} more documents, wall / full build of the grown corpus",
          "one_file_changed": "one of {files} files changed, wall / full build of the changed corpus",
          "cpu_keeping_work": "an uninterrupted build's CPU, --work auto / --work off"}


def print_report(res: dict) -> None:
    full = res["full_wall_s"]
    print(f"{res['text_bytes'] / 1e6:.1f} MB of documents ({res['corpus_bytes'] / 1e6:.1f} MB of Parquet) in "
          f"{res['files']} files, BPE 8,000, 1 worker; full build {full['median']:.1f} s "
          f"[{full['min']:.1f}, {full['max']:.1f}], {res['repeat']} rounds; identical bytes in every case; "
          f"the kept work folder {res['work_bytes'] / 1e6:.1f} MB")
    print("| case | ratio | target |\n|---|---|---|")
    for key, s in res["ratios"].items():
        label = LABELS[key].format(kill=res["kill_at"], grow=res["grow"], files=res["files"])
        print(f"| {label} | {s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}] | <= {TARGETS[key]:.2f} |")
    for k, row in enumerate(res["rounds"]):
        work = {name: row[name]["work"] for name in ("rerun", "grown", "changed")}
        print(f"round {k + 1}: killed at {row['killed']['killed_at_s']:.1f} s; " + "; ".join(
            f"{name}: {w['units_reused']} of {w['units']} units reused, {w['units_resumed']} resumed"
            for name, w in work.items() if w))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=51, help="MB of documents (default 51)")
    ap.add_argument("--files", type=int, default=8, help="Parquet files (default 8)")
    ap.add_argument("--grow", type=float, default=0.03, help="the corpus grows by this fraction (default 0.03)")
    ap.add_argument("--kill-at", type=float, default=0.7, help="the kill, as a fraction of a full build's wall time")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--work-dir", help="folder for the corpus and caches (default: a temporary one, removed)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="seqcache-resume-"))
    try:
        res = measure(work, mb=args.mb, files=args.files, grow=args.grow, kill_at=args.kill_at, repeat=args.repeat)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print_report(res)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
