"""Beam's Flink and Spark runners against the local engine: the 100 MB build of
benchmarks/scale.py, and the start-up cost of a one-record build.

Each build is ``seqcache build`` in a child process (scale.py's ``build``
arguments: the ``documents`` corpus of scale.py, C4 repeated to ``--mb`` MB,
byte vocabulary), measured as:

  wall: start of the child to its exit;
  CPU: user + system seconds of the child and every process it started and
      reaped (RUSAGE_CHILDREN: the job server's JVM included, which Beam stops
      and reaps before the build exits), and, as a check, the sum over the
      process tree's processes of their CPU times as last sampled (a lower bound);
  peak RSS: the process tree's RSS summed (driver + JVM), sampled every
      ``--interval`` seconds (scale.py's Sampler);
  shard sha256s: equal to the local engine's, or the benchmark fails.

Runs: the local engine (spill files); Flink embedded in its job server
(``[local]``) with ``--parallelism=1`` and ``2``; Spark ``local[1]`` and
``local[2]``; each JVM runner with Beam's LOOPBACK environment (the Python
steps run in the driver's process). Then one record on each runner: start-up.
The job servers are the jars ``make jars`` builds (``--jars``).

Usage (from a folder other than the repository root):
  python benchmarks/jvm_runners.py [--mb 100] [--jars build/jars] [--runs 'flink p2' ...]
                                   [--extra=--shard-size=32MiB] [--no-startup] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scale  # noqa: E402  (benchmarks/scale.py: its corpus and sampler)

ROOT = scale.ROOT
NAME = "jvm"


class CpuSampler(scale.Sampler):
    """scale.Sampler that also keeps each process's last CPU times (user + system)."""

    def __init__(self, pid, folders, **kw):
        super().__init__(pid, folders, **kw)
        self.cpu = {}

    def sample(self):
        super().sample()
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return
        for p in procs:
            try:
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            self.cpu[p.pid] = t.user + t.system


def build(spec: str, work: pathlib.Path, label: str, runner_args: list[str], interval: float) -> dict:
    cache = work / f"cache-{label}"
    args = ["build", "--source", spec, "--vocabulary", "byte", "--name", NAME, "--cache-dir", str(cache),
            "--on-error", "empty=skip", "--on-error", "whitespace=skip", "--on-error", "control_characters=keep",
            *runner_args]
    out_dir = cache / NAME / "train"
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", scale.CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=tempfile.gettempdir())
    sampler = CpuSampler(proc.pid, {}, interval=interval)
    sampler.start()
    _, err = proc.communicate()  # reaps the child: its CPU (and its reaped children's) joins RUSAGE_CHILDREN
    seconds = time.perf_counter() - start
    sampler.stop()
    if proc.returncode:
        raise SystemExit(f"{label}: seqcache build failed (exit {proc.returncode}):\n{err.decode()[-4000:]}")
    from seqcache import format as fmt

    manifest = fmt.read_manifest(str(out_dir))
    row = {
        "run": label, "wall_s": round(seconds, 2),
        "peak_tree_rss_mb": round(sampler.peak_tree / 2**20),
        "cpu_sampled_s": round(sum(sampler.cpu.values()), 1),
        "processes": len(sampler.cpu),
        "examples": manifest.num_examples,
        "shard_sha256": fmt.read_shard_checksums(str(out_dir), manifest)[0],
    }
    shutil.rmtree(cache, ignore_errors=True)
    return row


def _cpu_of(fn):
    """``fn()``'s result with ``cpu_s``: CPU seconds of the children it started and reaped (RUSAGE_CHILDREN)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    row["cpu_s"] = round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size, MB (1e6 bytes)")
    ap.add_argument("--jars", default=str(ROOT / "build" / "jars"), help="where `make jars` put the job servers")
    ap.add_argument("--interval", type=float, default=0.2, help="sampling interval, seconds")
    ap.add_argument("--runs", nargs="*", help="only these runs (the local one always runs): "
                    "'flink p1' 'flink p2' 'spark local[1]' 'spark local[2]'")
    ap.add_argument("--extra", action="append", default=[],
                    help="one more seqcache build argument for every build (--extra=--shard-size=32MiB)")
    ap.add_argument("--no-startup", action="store_true", help="skip the one-record builds")
    ap.add_argument("--json", dest="json_out", help="also write the results to this file")
    args = ap.parse_args(argv)
    jars = pathlib.Path(args.jars).resolve()
    flink = ["--runner=flink", f"--flink_job_server_jar={jars / 'flink' / 'flink-job-server.jar'}",
             "--flink_master=[local]", "--environment_type=LOOPBACK"]
    spark = ["--runner=spark", f"--spark_job_server_jar={jars / 'spark' / 'spark-job-server.jar'}",
             "--environment_type=LOOPBACK"]
    runs = {
        "local": [],
        "flink p1": [*flink, "--parallelism=1"], "flink p2": [*flink, "--parallelism=2"],
        "spark local[1]": [*spark, "--spark_master_url=local[1]"],
        "spark local[2]": [*spark, "--spark_master_url=local[2]"],
    }
    work = pathlib.Path(tempfile.mkdtemp(prefix="seqcache-jvm-"))
    rows, startup = [], []
    try:
        spec, raw, records = scale.make_corpus(work / "corpus", int(args.mb * 1e6), "documents")
        for label, extra in runs.items():
            if args.runs and label not in args.runs and label != "local":
                continue
            try:
                row = _cpu_of(lambda: build(spec, work, label, extra + args.extra, args.interval))
            except SystemExit as e:  # a runner that fails: its error, and the others go on
                rows.append({"run": label, "error": str(e).splitlines()[1][:300] if "\n" in str(e) else str(e)})
                print(json.dumps(rows[-1]), flush=True)
                continue
            row["mb_s"] = round(raw / 1e6 / row["wall_s"], 2)
            row["sha256_equal_local"] = row["shard_sha256"] == rows[0]["shard_sha256"] if rows else True
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "shard_sha256"}), flush=True)
        one = work / "one"
        one.mkdir()
        (one / "one.jsonl").write_text(json.dumps({"text": "one record"}) + "\n")
        for label, extra in {} if args.no_startup else {"local": [], "flink p1": runs["flink p1"], "spark local[1]": runs["spark local[1]"]}.items():
            row = _cpu_of(lambda: build(f"jsonl:{one}/one.jsonl#text", work, "one-" + label, extra, args.interval))
            startup.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "shard_sha256"}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"mb": round(raw / 1e6, 1), "records": records, "rows": rows, "startup": startup}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    if not all(r.get("sha256_equal_local", True) for r in rows):
        raise SystemExit("a JVM runner's data shards differ from the local engine's")
    return result


if __name__ == "__main__":
    main()
