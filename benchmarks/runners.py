"""The same build on every runner: CPU seconds per MB, wall time, peak memory,
the CPU of 2 workers against 1, a one-record build's start-up, and whether
the data shards equal the local engine's.

For each runner of ``--runners`` (default ``local,multi_processing,dask,prism``;
``RUNNERS`` below is the table, a runner is a name, the ``seqcache build``
options that put a build on it, and how many workers it can be given) the
benchmark runs ``seqcache build`` (the installed executable) of one
``--mb`` corpus in a child process (``--corpus scale``, the default: 100 MB
of C4 documents, ``scale.make_corpus``: half in 8 files, half in one large
file; byte vocabulary; ``--corpus documents``: pipeline.py's documents case,
the C4 sample repeated with a copy number in front of every document, 8
Parquet files, the 8,000-piece SentencePiece model pipeline.py trains, 51 MB
at ``--mb 50``) and reports:

  wall_s: start of the child to its exit;
  cpu_s: user + system CPU seconds of the child and every process it waited
      for (wait4: Beam's workers that seqcache starts, Prism's Go process),
      plus, on Dask, the CPU its worker processes used during the build
      (psutil; the scheduler, in this script's process, is not counted);
  cpu_s_per_mb: cpu_s / raw input MB;
  peak_tree_rss_mb: RSS summed over the child and all its descendants (and
      the Dask workers), sampled every 0.2 s (``scale.Sampler``);
  ru_maxrss_mb: the largest single process of the child's tree;
  same_bytes: every data shard's sha256 equals the local engine's.

``--ratio`` adds, for the runners that take a worker count (multi_processing:
``--direct_num_workers``, Dask: the cluster's worker processes), the build
with 1 worker, and reports CPU(2 workers) / CPU(1 worker). ``--startup N``
adds a one-record build on every runner, N times each (the median wall and
CPU seconds): a one-line file, ``--source text:FILE``, with the corpus's
vocabulary. Builds of the different runners alternate round after round
(``--repeat``), in the opposite order every other round, so that a change of
the machine's load falls on all of them and none always comes first; each
pair of runners is also compared round by round (``pairs``: the median of
one's CPU and wall seconds over the other's within a round, and their range).

Runners:
  local: Beam's local engine in the build's process (the default, spill files);
  multi_processing: the local engine with 2 of seqcache's worker processes;
  dask: Beam's DaskRunner on a ``distributed.LocalCluster`` of worker
      processes (1 thread each) on 127.0.0.1, started by this script;
  prism: Beam's PrismRunner with the binary ``make prism`` installs (its
      Python steps in the build's process: Beam's LOOPBACK environment;
      examples through spill files, as ``--exchange=auto`` picks there);
  prism_shuffle (not in the default list): the same, examples moved through
      Prism's own shuffle (``--exchange=runner``).

Usage (from any folder; the runs need the corpora of ../shared/data):
  python benchmarks/runners.py [--mb 100] [--corpus scale|documents]
                               [--runners local,multi_processing,dask,prism]
                               [--ratio] [--startup 5] [--repeat 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scale  # noqa: E402  (this folder's corpus maker and process-tree sampler)

SEQCACHE = os.path.join(os.path.dirname(sys.executable), "seqcache")
NAME = "runners"
# Each runner: the build's options for n workers (None: it takes no worker count).
RUNNERS = {
    "local": lambda n, ctx: [],
    "multi_processing": lambda n, ctx: ["--direct_running_mode=multi_processing", f"--direct_num_workers={n}"],
    "dask": lambda n, ctx: ["--runner=dask", f"--dask_client_address={ctx.dask(n)[0]}"],
    "prism": lambda n, ctx: ["--runner=prism"],
    "prism_shuffle": lambda n, ctx: ["--runner=prism", "--exchange=runner"],
}
TAKES_WORKERS = {"multi_processing", "dask"}


class Clusters:
    """The Dask clusters of a run, one per worker count, started on first use."""

    def __init__(self, work: pathlib.Path):
        self.work, self.open, self.stack = work, {}, contextlib.ExitStack()

    def dask(self, n: int):
        """(scheduler address, worker pids) of the cluster of ``n`` worker processes."""
        if n not in self.open:
            import distributed

            cluster = self.stack.enter_context(distributed.LocalCluster(
                n_workers=n, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address="127.0.0.1:0",
                local_directory=str(self.work / f"dask-{n}")))
            with distributed.Client(cluster) as client:
                pids = sorted(client.run(os.getpid).values())
            self.open[n] = (cluster.scheduler_address, pids)
        return self.open[n]

    def close(self):
        self.stack.close()


def _cpu(pids) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for p in [proc] + proc.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system
    return total


def _default_sigint() -> None:
    """The build starts with SIGINT's default action, as from a terminal: a
    benchmark started in the background of a script (``cmd &``) would pass
    SIGINT on ignored, and Prism, which then ignores Beam's SIGINT at the
    end of a build, would add 4 s to each (Beam sends it 5 times, 1 s apart,
    then kills it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def build(spec: str, cache_dir: pathlib.Path, extra_args, *, worker_pids=(), vocabulary: str = "byte") -> dict:
    """One ``seqcache build`` of ``spec`` in a child process, sampled; the
    measurements of the module docstring and the shards' sha256s."""
    args = [SEQCACHE, "build", "--source", spec, "--vocabulary", vocabulary, "--name", NAME,
            "--cache-dir", str(cache_dir), "--on-error", "empty=skip", "--on-error", "whitespace=skip",
            "--on-error", "control_characters=keep", *extra_args]
    out_dir = cache_dir / NAME / "train"
    before = _cpu(worker_pids)
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                preexec_fn=_default_sigint)
        sampler = scale.Sampler(proc.pid, {}, others=worker_pids)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        sampler.stop()
        if os.waitstatus_to_exitcode(status) != 0:
            log.seek(0)
            raise SystemExit(f"seqcache build {' '.join(extra_args)} failed:\n{log.read().decode()[-4000:]}")
    from seqcache import format as fmt

    manifest = fmt.read_manifest(str(out_dir))
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime + _cpu(worker_pids) - before, 2),
        "peak_tree_rss_mb": round((sampler.peak_tree + sampler.peak_others) / 2**20),
        "ru_maxrss_mb": round(usage.ru_maxrss / 1024),
        "examples": int(manifest.num_examples),
        "shard_sha256": fmt.read_shard_checksums(str(out_dir), manifest)[0],
    }


def measure(name: str, workers: int, spec: str, raw_mb: float, work: pathlib.Path, clusters: Clusters,
            vocabulary: str = "byte", round_: int = 0) -> dict:
    cache = work / f"cache-{name}-{workers}"
    shutil.rmtree(cache, ignore_errors=True)
    extra = RUNNERS[name](workers, clusters)
    pids = clusters.dask(workers)[1] if name == "dask" else ()
    row = build(spec, cache, extra, worker_pids=pids, vocabulary=vocabulary)
    shutil.rmtree(cache, ignore_errors=True)
    row = {"runner": name, "workers": workers if name in TAKES_WORKERS else 1, "round": round_,
           "mb": round(raw_mb, 1), **row, "cpu_s_per_mb": round(row["cpu_s"] / raw_mb, 4)}
    print(json.dumps({k: v for k, v in row.items() if k != "shard_sha256"}), flush=True)
    return row


def _median(rows, key):
    return round(statistics.median(r[key] for r in rows), 3)


def corpus(work: pathlib.Path, mb: float, kind: str) -> tuple[str, float, str]:
    """``(source spec, raw bytes, vocabulary)`` of the ``--corpus`` ``kind``."""
    if kind == "scale":
        spec, raw, _ = scale.make_corpus(work / "corpus", int(mb * 1e6), "documents")
        return spec, raw, "byte"
    import pipeline  # this folder's documents case and its vocabulary (pyarrow: not in the Dask workers' import)

    model, _ = pipeline.train_vocabularies(work, with_tokenizers=False)
    spec, records = pipeline.make_documents(work / "corpus", int(mb * 1e6))
    return spec, sum(len(r.encode()) for r in records), model


def pairs(rows, key_of) -> list[dict]:
    """For each two runs ``a`` before ``b`` (``key_of(row)``, in the order they
    first appear), ``b``'s CPU and wall seconds over ``a``'s within each round
    (the rows' ``round``): the median and the range over the rounds."""
    keys = list(dict.fromkeys(key_of(r) for r in rows))
    by = {(key_of(r), r["round"]): r for r in rows}
    rounds = sorted({r["round"] for r in rows})
    out = []
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            both = [(by[a, k], by[b, k]) for k in rounds if (a, k) in by and (b, k) in by]
            if not both:
                continue
            entry = {"a": a, "b": b, "rounds": len(both)}
            for what in ("cpu_s", "wall_s"):
                ratios = [y[what] / x[what] for x, y in both if x[what] > 0]
                entry[f"{what}_b_over_a"] = [round(statistics.median(ratios), 3), round(min(ratios), 3),
                                             round(max(ratios), 3)] if ratios else None
            out.append(entry)
    return out


def main(args) -> dict:
    names = [n.strip() for n in args.runners.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"--runners: unknown {', '.join(unknown)} (known: {', '.join(RUNNERS)})")
    work = pathlib.Path(tempfile.mkdtemp(prefix="seqcache-runners-", dir=args.work_dir))
    clusters = Clusters(work)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average": os.getloadavg()}, "mb": args.mb, "rows": [], "startup": []}
    try:
        spec, raw, vocabulary = corpus(work, args.mb, args.corpus)
        plan = [(n, 2 if n in TAKES_WORKERS else 1) for n in names]
        if args.ratio:
            plan += [(n, 1) for n in names if n in TAKES_WORKERS]
        for k in range(args.repeat):
            for name, workers in plan if k % 2 == 0 else plan[::-1]:
                result["rows"].append(measure(name, workers, spec, raw / 1e6, work, clusters, vocabulary, k))
        if args.startup:
            one = work / "one"
            one.mkdir()
            (one / "a.txt").write_text("one record\n")
            for k in range(args.startup):
                for name in names if k % 2 == 0 else names[::-1]:
                    row = build(f"text:{one}/a.txt", work / f"one-{name}", RUNNERS[name](1, clusters),
                                worker_pids=clusters.dask(1)[1] if name == "dask" else (), vocabulary=vocabulary)
                    shutil.rmtree(work / f"one-{name}", ignore_errors=True)
                    result["startup"].append({"runner": name, "round": k, "wall_s": row["wall_s"],
                                              "cpu_s": row["cpu_s"], "peak_tree_rss_mb": row["peak_tree_rss_mb"]})
    finally:
        clusters.close()
        shutil.rmtree(work, ignore_errors=True)
    rows = result["rows"]
    reference = next((r["shard_sha256"] for r in rows if r["runner"] == "local"), None)
    summary = []
    for name, workers in dict.fromkeys((r["runner"], r["workers"]) for r in rows):
        mine = [r for r in rows if (r["runner"], r["workers"]) == (name, workers)]
        summary.append({"runner": name, "workers": workers, "builds": len(mine),
                        **{k: _median(mine, k) for k in ("wall_s", "cpu_s", "cpu_s_per_mb", "peak_tree_rss_mb",
                                                         "ru_maxrss_mb")},
                        "same_bytes": None if reference is None else all(r["shard_sha256"] == reference for r in mine)})
    for s in summary:
        one = next((o for o in summary if o["runner"] == s["runner"] and o["workers"] == 1), None)
        s["cpu_2_over_1"] = round(s["cpu_s"] / one["cpu_s"], 3) if s["workers"] == 2 and one else None
    result["summary"] = summary
    result["pairs"] = pairs(rows, lambda r: f"{r['runner']}/{r['workers']}")
    result["startup_summary"] = [
        {"runner": n, "builds": len(mine), "wall_s": _median(mine, "wall_s"), "cpu_s": _median(mine, "cpu_s"),
         "peak_tree_rss_mb": _median(mine, "peak_tree_rss_mb")}
        for n in names if (mine := [r for r in result["startup"] if r["runner"] == n])]
    result["startup_pairs"] = pairs(result["startup"], lambda r: r["runner"])
    for r in rows:
        r.pop("shard_sha256")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(result, indent=2))
    vocabulary = "byte" if args.corpus == "scale" else "SentencePiece, 8,000 pieces"
    print(f"\n{args.mb:g} MB of documents ({args.corpus}), {vocabulary} vocabulary; "
          f"medians of {args.repeat} build(s) each")
    print(f"{'runner':>17} {'wk':>3} {'wall s':>7} {'CPU s':>7} {'CPU s/MB':>9} {'tree RSS MB':>12} "
          f"{'1-proc MB':>10} {'CPU 2/1':>8} {'same bytes':>10}")
    for s in summary:
        ratio = "-" if s["cpu_2_over_1"] is None else f"{s['cpu_2_over_1']:.2f}"
        print(f"{s['runner']:>17} {s['workers']:>3} {s['wall_s']:>7.1f} {s['cpu_s']:>7.1f} {s['cpu_s_per_mb']:>9.3f} "
              f"{s['peak_tree_rss_mb']:>12,.0f} {s['ru_maxrss_mb']:>10,.0f} {ratio:>8} {str(s['same_bytes']):>10}")
    if result["startup_summary"]:
        print("\none-record build (median):")
        for s in result["startup_summary"]:
            print(f"{s['runner']:>17}  wall {s['wall_s']:.2f} s  CPU {s['cpu_s']:.2f} s  "
                  f"tree RSS {s['peak_tree_rss_mb']:,.0f} MB  ({s['builds']} builds)")
    for title, found in (("builds", result["pairs"]), ("one-record builds", result["startup_pairs"])):
        if found:
            print(f"\npaired within a round, {title} (b / a: median [min, max] over the rounds):")
        for p in found:
            cpu, wall = p["cpu_s_b_over_a"], p["wall_s_b_over_a"]
            print(f"  {p['b']:>20} / {p['a']:<20} CPU {cpu[0]:.3f} [{cpu[1]:.3f}, {cpu[2]:.3f}]  "
                  f"wall {wall[0]:.3f} [{wall[1]:.3f}, {wall[2]:.3f}]  ({p['rounds']} rounds)")
    if any(s["same_bytes"] is False for s in summary):
        raise SystemExit("a runner's data shards differ from the local engine's")
    return result


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size, MB (1e6 bytes)")
    ap.add_argument("--corpus", choices=("scale", "documents"), default="scale",
                    help="scale.py's documents, byte vocabulary; or pipeline.py's documents case, SentencePiece")
    ap.add_argument("--runners", default="local,multi_processing,dask,prism",
                    help=f"comma-separated, from: {', '.join(RUNNERS)}")
    ap.add_argument("--ratio", action="store_true", help="also build with 1 worker where a runner takes a count")
    ap.add_argument("--startup", type=int, default=0, help="one-record builds per runner (0: none)")
    ap.add_argument("--repeat", type=int, default=1, help="builds per runner, alternating")
    ap.add_argument("--work-dir", help="where the corpus and caches go (default: a new folder in the temp dir)")
    ap.add_argument("--json", dest="json_out", help="also write the results to this file")
    return ap.parse_args(argv)


if __name__ == "__main__":  # the Dask clusters' worker processes import this module again
    main(parse_args())
