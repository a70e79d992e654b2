"""Build throughput, memory and temporary files from 10 MB to 1 GB, and the
DaskRunner against the local engine, measured in one run.

For each corpus size (``--mb``, default 10 100 1000) the benchmark runs
``seqcache build`` in a child process on Beam's local engine (the default
runner, one worker, spill-file exchange) and reports:

  wall time and MB/s: raw input bytes (the corpus files' sizes) / wall seconds,
      start of the child to its exit (planning, the pipeline, verification and
      the manifest included);
  peak RSS: the whole process tree of the child, sampled every ``--interval``
      seconds (psutil: RSS summed over the child and all its descendants), and
      ru_maxrss from wait4 (the largest single process of that tree);
  temporary files: the most files and the most bytes seen at once under the
      cache's ``_tmp/`` folder (the summary, quarantine merges; spill files with
      ``--work off``) and its work folder (``.<split>.work``: the units' spill
      files and ledgers, docs/scaling.md),
      the shard writers' ``.tmp-*`` files in the cache folder, and what the
      build created under its system temp folder (the child's TMPDIR points at
      an empty folder of its own, so everything there is the build's);
  shards (manifest), examples (manifest) and work units (the build's own
      ``-v`` log line "N work units").

Then the ``--dask-mb`` corpus (default 100 MB) is built again with
``--runner=dask`` against a ``distributed.LocalCluster`` of 2 worker processes
(1 thread each) on loopback, which this script starts and closes, and compared
with the local engine's build of the same files: the ratio of wall times and
of MB/s, the workers' peak RSS, and whether every data shard's sha256
(the shard checksum file ``shard-checksums.json``) equals the local build's (it must: a cache does
not depend on the runner).

Corpus (from ../shared/data, repeated to the requested size with a copy number
prefixed to every record, so that copies are distinct records):
  documents (default): the C4 validation sample, one JSON line per document
      (``jsonl:...#text``), about 2 KB a record;
  lines: tinyshakespeare, one record per line (``text:...``), about 40 bytes
      a record: the per-record cost dominates.
Half the bytes are in 8 files of equal size and half in one large file, so
that small files are grouped into units and the large one is cut into byte
ranges where the source reads byte ranges (the work unit count shows which).

Vocabulary (``--vocabulary``):
  byte (default): one token a UTF-8 byte, so that the tokenizer is not the
      bottleneck;
  sentencepiece: a unigram SentencePiece model of ``--vocab-size`` pieces
      (default 8,000), trained once, before the builds, on one copy of the
      corpus's records (tasks.train_sentencepiece); every build of the run
      uses it. The training is not part of any build's figures.

Machines here are noisy (shared cores): compare ratios within one run, not
absolute numbers across runs. What should hold: MB/s stays flat as the corpus
grows, and peak RSS is bounded by the shard size (``--shard-size``, default
128 MiB of raw input), not the corpus size, once a corpus has more than one
shard. The spill files are an exception by design: they hold every example
until the shards are written, so their bytes grow with the corpus (about 2
bytes a token for the byte vocabulary) while their count grows with corpus /
flush size.

One run on a 2-core machine shared with other work (documents, load average
5 to 7 on its 2 cores):
  10 MB: 4.6 s, 2.2 MB/s, peak RSS 251 MB, _tmp 13 files / 20 MB, 1 shard
  100 MB: 11.9 s, 8.4 MB/s, peak RSS 462 MB, _tmp 68 files / 201 MB, 1 shard
  1 GB: 110.5 s, 9.0 MB/s, peak RSS 531 MB, _tmp 67 files / 2,005 MB, 8 shards
  Dask, 2 workers, 100 MB: 50.7 s against 11.9 s (0.23x), shard sha256s equal
  --vocabulary sentencepiece (8,000 pieces, separate run): peak RSS 322 MB at
  100 MB, 377 MB at 1 GB (x1.17; byte: x1.15)

Usage (from any folder, the repository root too: it imports the installed package):
  python benchmarks/scale.py [--mb 10 100 1000] [--dask-mb 100] [--corpus documents]
                             [--vocabulary byte|sentencepiece] [--vocab-size 8000]
                             [--shard-size 128MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
NAME = "scale"
CLI = "import sys; from seqcache.cli.main import run; sys.argv = ['seqcache'] + sys.argv[1:]; run()"


# ---------------------------------------------------------------------------
# Corpus

def base_records(kind: str) -> list[str]:
    """The records one copy of the corpus holds (one line each once written)."""
    if kind == "lines":
        return (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n")
    if kind == "documents":
        import pyarrow.parquet as pq

        return pq.read_table(DATA / "c4" / "c4_validation_2k.parquet", columns=["text"]).column("text").to_pylist()
    raise SystemExit(f"--corpus must be lines or documents (got {kind!r})")


def make_corpus(folder: pathlib.Path, target_bytes: int, kind: str, num_files: int = 8) -> tuple[str, int, int]:
    """Writes about ``target_bytes`` of corpus into ``folder``: half in
    ``num_files`` files of equal size, half in one large file. Streams the
    records (memory does not grow with the size).

    Returns:
      ``(source spec, bytes written, records written)``.
    """
    base = base_records(kind)
    ext = "jsonl" if kind == "documents" else "txt"
    folder.mkdir(parents=True)
    quotas = [target_bytes // (2 * num_files)] * num_files + [target_bytes - num_files * (target_bytes // (2 * num_files))]
    names = [f"part-{k:03d}.{ext}" for k in range(num_files)] + [f"large.{ext}"]
    total = records = copy = 0
    i = 0
    f, written = open(folder / names[0], "wb"), 0
    while True:
        for r in base:
            text = f"{copy} {r}"
            line = (json.dumps({"text": text}, ensure_ascii=False) if kind == "documents" else text).encode("utf-8") + b"\n"
            f.write(line)
            written += len(line)
            total += len(line)
            records += 1
            if written >= quotas[i]:
                f.close()
                i += 1
                if i == len(names):
                    spec = f"jsonl:{folder}/*.jsonl#text" if kind == "documents" else f"text:{folder}/*.txt"
                    return spec, total, records
                f, written = open(folder / names[i], "wb"), 0
        copy += 1


def make_vocabulary(folder: pathlib.Path, kind: str, vocabulary: str, vocab_size: int) -> tuple[str, float]:
    """The ``--vocabulary`` argument of the builds: ``"byte"``, or the path of
    a SentencePiece model of ``vocab_size`` pieces trained on one copy of the
    ``kind`` corpus's records (written under ``folder``).

    Returns:
      ``(vocabulary argument, training wall seconds)``; 0.0 for ``byte``.

    Raises:
      SystemExit: an unknown ``vocabulary``.
    """
    if vocabulary == "byte":
        return "byte", 0.0
    if vocabulary != "sentencepiece":
        raise SystemExit(f"--vocabulary must be byte or sentencepiece (got {vocabulary!r})")
    from seqcache import tasks

    folder.mkdir(parents=True, exist_ok=True)
    model = folder / f"spm-{vocab_size}.model"
    start = time.perf_counter()
    tasks.train_sentencepiece(base_records(kind), output_path=str(model), vocab_size=vocab_size)
    return str(model), round(time.perf_counter() - start, 2)


# ---------------------------------------------------------------------------
# Sampling a running build

def _tree_usage(folder: pathlib.Path, prefix: str | None = None) -> tuple[int, int]:
    """(files, bytes) under ``folder`` (only top-level names starting with
    ``prefix`` when given); files that vanish while walking are skipped."""
    files = size = 0
    if prefix is not None:
        try:
            entries = [e for e in os.scandir(folder) if e.name.startswith(prefix)]
        except OSError:
            return 0, 0
        for e in entries:
            try:
                size += e.stat().st_size
                files += 1
            except OSError:
                pass
        return files, size
    for dirpath, _, names in os.walk(folder):
        for n in names:
            try:
                size += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return files, size


class Sampler(threading.Thread):
    """Samples, every ``interval`` seconds until stopped: the RSS of a process
    tree (the root and all its descendants, summed), of some other processes
    (the Dask workers), and the files and bytes under some folders. Keeps the
    maximum of each."""

    def __init__(self, pid: int, folders: dict, *, others=(), interval: float = 0.2):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.others = [psutil.Process(p) for p in others]
        self.folders = folders  # name -> (path, prefix or None)
        self.interval = interval
        self.peak_tree = self.peak_others = self.peak_single = 0
        self.peak_files = {k: 0 for k in folders}
        self.peak_bytes = {k: 0 for k in folders}
        self.samples = 0
        self._done = threading.Event()

    @staticmethod
    def _rss(procs) -> tuple[int, int]:
        total = single = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total += rss
            single = max(single, rss)
        return total, single

    def sample(self) -> None:
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            procs = []
        tree, single = self._rss(procs)
        others, _ = self._rss(self.others)
        self.peak_tree = max(self.peak_tree, tree)
        self.peak_single = max(self.peak_single, single)
        self.peak_others = max(self.peak_others, others)
        for name, (path, prefix) in self.folders.items():
            files, size = _tree_usage(path, prefix)
            self.peak_files[name] = max(self.peak_files[name], files)
            self.peak_bytes[name] = max(self.peak_bytes[name], size)
        self.samples += 1

    def run(self) -> None:
        while True:
            self.sample()
            if self._done.wait(self.interval):
                return

    def stop(self) -> None:
        self._done.set()
        self.join()


# ---------------------------------------------------------------------------
# One build

def build(spec: str, cache_dir: pathlib.Path, sys_tmp: pathlib.Path, *, vocabulary: str = "byte", extra_args=(),
          shard_size=None, interval=0.2, worker_pids=(), dask_dir: pathlib.Path | None = None) -> dict:
    """Runs ``seqcache build`` of ``spec`` in a child process while sampling it;
    ``vocabulary`` is the build's ``--vocabulary`` (``byte`` or a model path).

    Returns a dict of the measurements (see the module docstring); the cache
    itself is left in ``cache_dir`` (the caller reads the manifest and removes it).
    """
    args = ["build", "--source", spec, "--vocabulary", vocabulary, "--name", NAME, "--cache-dir", str(cache_dir),
            "--json", "-v", "--on-error", "empty=skip", "--on-error", "whitespace=skip",
            "--on-error", "control_characters=keep", *extra_args]  # C4 holds a few (U+001B): kept, as records
    if shard_size:
        args += ["--shard-size", shard_size]
    sys_tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(sys_tmp), TEMP=str(sys_tmp), TMP=str(sys_tmp))
    out_dir = cache_dir / NAME / "train"
    folders = {"tmp": (out_dir / "_tmp", None), "shard_tmp": (out_dir, ".tmp-"), "sys_tmp": (sys_tmp, None),
               "work": (out_dir.parent / f".{out_dir.name}.work", None)}
    if dask_dir is not None:
        folders["dask"] = (dask_dir, None)
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], stdout=stdout, stderr=stderr,
                            cwd=tempfile.gettempdir(), env=env)
    sampler = Sampler(proc.pid, folders, others=worker_pids, interval=interval)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss: the largest single process of the child's tree
    seconds = time.perf_counter() - start
    sampler.stop()
    proc.returncode = os.waitstatus_to_exitcode(status)
    stdout.seek(0)
    stderr.seek(0)
    out, log = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"seqcache build failed (exit {proc.returncode}):\n{log[-6000:]}\n{out[-2000:]}")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    from seqcache import format as fmt

    table_manifest = fmt.read_manifest(str(out_dir))
    table = table_manifest.shards
    units = re.search(r"(\d+) work units", log)
    leftover = _tree_usage(sys_tmp)
    return {
        "wall_s": round(seconds, 2),
        "peak_tree_rss_mb": round(sampler.peak_tree / 2**20),
        "peak_single_rss_mb": round(sampler.peak_single / 2**20),  # from the samples
        "ru_maxrss_mb": round(usage.ru_maxrss / 1024),  # KiB on Linux
        "peak_workers_rss_mb": round(sampler.peak_others / 2**20) if worker_pids else None,
        "rss_samples": sampler.samples,
        "tmp_files_max": sampler.peak_files["tmp"],
        "tmp_mb_max": round(sampler.peak_bytes["tmp"] / 1e6, 1),
        "shard_tmp_files_max": sampler.peak_files["shard_tmp"],
        "shard_tmp_mb_max": round(sampler.peak_bytes["shard_tmp"] / 1e6, 1),
        "sys_tmp_files_max": sampler.peak_files["sys_tmp"],
        "sys_tmp_mb_max": round(sampler.peak_bytes["sys_tmp"] / 1e6, 1),
        "sys_tmp_files_left": leftover[0],
        "work_files_max": sampler.peak_files["work"],
        "work_mb_max": round(sampler.peak_bytes["work"] / 1e6, 1),
        **({"dask_dir_files_max": sampler.peak_files["dask"],
            "dask_dir_mb_max": round(sampler.peak_bytes["dask"] / 1e6, 1)} if dask_dir is not None else {}),
        "tmp_left": (out_dir / "_tmp").exists(),
        "shards": len(table),
        "examples": int(manifest["num_examples"]),
        "work_units": int(units.group(1)) if units else None,
        "shard_sha256": fmt.read_shard_checksums(str(out_dir), table_manifest)[0],
        "cache_mb": round(sum(s.num_bytes for s in table) / 1e6, 1),
    }


def run_local(spec: str, raw_bytes: int, records: int, mb: float, work: pathlib.Path, args) -> dict:
    cache = work / f"cache-{mb:g}"
    row = build(spec, cache, work / f"systmp-{mb:g}", vocabulary=args.vocabulary_arg, shard_size=args.shard_size,
                interval=args.interval)
    shutil.rmtree(cache, ignore_errors=True)
    raw_mb = raw_bytes / 1e6
    row = {"runner": "local", "workers": 1, "mb": round(raw_mb, 1), "records": records,
           "mb_s": round(raw_mb / row["wall_s"], 2), **row}
    if row["examples"] != records:
        raise SystemExit(f"{mb:g} MB: the build has {row['examples']} examples, the corpus {records} records")
    print(json.dumps({k: v for k, v in row.items() if k != "shard_sha256"}), flush=True)
    return row


def run_dask(spec: str, raw_bytes: int, local: dict, work: pathlib.Path, args, *, address: str,
             worker_pids, dask_dir: pathlib.Path) -> dict:
    cache = work / "cache-dask"
    row = build(spec, cache, work / "systmp-dask", vocabulary=args.vocabulary_arg, shard_size=args.shard_size,
                interval=args.interval,
                extra_args=["--runner=dask", f"--dask_client_address={address}"], worker_pids=worker_pids,
                dask_dir=dask_dir)
    shutil.rmtree(cache, ignore_errors=True)
    raw_mb = raw_bytes / 1e6
    row = {"runner": "dask", "workers": len(worker_pids), "mb": round(raw_mb, 1), "records": local["records"],
           "mb_s": round(raw_mb / row["wall_s"], 2), **row}
    if row["examples"] != local["examples"]:
        raise SystemExit(f"Dask build: {row['examples']} examples, the local engine's {local['examples']}")
    print(json.dumps({k: v for k, v in row.items() if k != "shard_sha256"}), flush=True)
    return row


# ---------------------------------------------------------------------------
# Report

COLUMNS = [  # (header, key, format spec)
    ("runner", "runner", ""), ("wk", "workers", "d"), ("MB", "mb", ".1f"), ("wall s", "wall_s", ".1f"),
    ("MB/s", "mb_s", ".2f"), ("tree RSS MB", "peak_tree_rss_mb", ",d"), ("1-proc MB", "ru_maxrss_mb", ",d"),
    ("workers RSS MB", "peak_workers_rss_mb", ",d"),
    ("_tmp files", "tmp_files_max", ",d"), ("_tmp MB", "tmp_mb_max", ",.1f"),
    ("work files", "work_files_max", ",d"), ("work MB", "work_mb_max", ",.1f"),
    ("sys tmp files", "sys_tmp_files_max", ",d"), ("shards", "shards", ",d"), ("examples", "examples", ",d"),
    ("units", "work_units", "d"),
]


def print_table(rows: list[dict], dask: dict | None) -> None:
    widths = [max(len(h), 7) for h, _, _ in COLUMNS]
    print()
    print(" ".join(f"{h:>{w}}" for (h, _, _), w in zip(COLUMNS, widths)))
    for r in rows:
        print(" ".join(f"{'-' if r.get(key) is None else format(r[key], spec):>{w}}"
                       for (_, key, spec), w in zip(COLUMNS, widths)))
    local = [r for r in rows if r["runner"] == "local"]
    if len(local) > 1:
        first = local[0]
        print("\nagainst the smallest corpus: " + "; ".join(
            f"{r['mb']:g} MB: MB/s x{r['mb_s'] / first['mb_s']:.2f}, tree RSS x{r['peak_tree_rss_mb'] / max(first['peak_tree_rss_mb'], 1):.2f}"
            for r in local[1:]))
    if dask:
        print(f"\nDask ({dask['dask_workers']} worker processes) against the local engine (1 worker), "
              f"{dask['mb']:g} MB: wall {dask['dask_wall_s']:.1f} s / {dask['local_wall_s']:.1f} s = "
              f"{dask['wall_ratio']:.2f} (speed-up {dask['speedup']:.2f}x; MB/s {dask['dask_mb_s']:.2f} against "
              f"{dask['local_mb_s']:.2f}); data shard sha256s equal: {dask['sha256_equal']} "
              f"({dask['shards']} shards)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, nargs="+", default=[10.0, 100.0, 1000.0], help="corpus sizes, MB (1e6 bytes)")
    ap.add_argument("--dask-mb", type=float, default=100.0,
                    help="corpus size of the Dask comparison, MB (0: no Dask comparison)")
    ap.add_argument("--dask-workers", type=int, default=2, help="Dask worker processes (1 thread each)")
    ap.add_argument("--corpus", default="documents", choices=["documents", "lines"])
    ap.add_argument("--vocabulary", default="byte", choices=["byte", "sentencepiece"],
                    help="the builds' vocabulary: byte, or a SentencePiece model trained on the corpus first")
    ap.add_argument("--vocab-size", type=int, default=8000, help="pieces of the SentencePiece model")
    ap.add_argument("--shard-size", help="passed to seqcache build --shard-size (default: the build's, 128 MiB)")
    ap.add_argument("--interval", type=float, default=0.2, help="sampling interval, seconds")
    ap.add_argument("--work-dir", help="where corpora and caches go (default: a new folder in the temp dir)")
    ap.add_argument("--json", dest="json_out", help="also write the results to this file")
    return ap.parse_args(argv)


def main(args, start_cluster=None) -> dict:
    """Runs the local builds and, when ``start_cluster`` is given (a callable
    returning a context manager of ``(scheduler address, worker pids, dask
    local directory)``), the Dask comparison. Returns the results."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="seqcache-scale-", dir=args.work_dir))
    rows, dask = [], None
    sizes = sorted(set(args.mb))
    try:
        args.vocabulary_arg, train_s = make_vocabulary(work / "vocabulary", args.corpus, args.vocabulary,
                                                       args.vocab_size)
        kept = None  # the corpus of the Dask comparison, built locally already
        for mb in sizes:
            folder = work / f"corpus-{mb:g}"
            spec, raw, records = make_corpus(folder, int(mb * 1e6), args.corpus)
            rows.append(run_local(spec, raw, records, mb, work, args))
            if start_cluster is not None and mb == args.dask_mb:
                kept = (spec, raw, records, rows[-1])
            else:
                shutil.rmtree(folder, ignore_errors=True)
        if start_cluster is not None:
            if kept is None:
                spec, raw, records = make_corpus(work / f"corpus-{args.dask_mb:g}", int(args.dask_mb * 1e6), args.corpus)
                kept = (spec, raw, records, run_local(spec, raw, records, args.dask_mb, work, args))
                rows.append(kept[3])
            spec, raw, records, local = kept
            with start_cluster(work) as (address, pids, dask_dir):
                row = run_dask(spec, raw, local, work, args, address=address, worker_pids=pids, dask_dir=dask_dir)
            rows.append(row)
            dask = {
                "mb": local["mb"], "shards": local["shards"], "dask_workers": row["workers"],
                "local_wall_s": local["wall_s"], "dask_wall_s": row["wall_s"],
                "wall_ratio": round(row["wall_s"] / local["wall_s"], 3),
                "speedup": round(local["wall_s"] / row["wall_s"], 3),
                "local_mb_s": local["mb_s"], "dask_mb_s": row["mb_s"],
                "sha256_equal": row["shard_sha256"] == local["shard_sha256"],
            }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "corpus": args.corpus, "vocabulary": args.vocabulary,
        "vocab_size": args.vocab_size if args.vocabulary == "sentencepiece" else None,
        "vocabulary_train_s": train_s, "shard_size": args.shard_size or "128MiB", "rows": rows, "dask": dask,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    print(f"\nvocabulary: {args.vocabulary}" + (f" ({args.vocab_size} pieces, trained in {train_s:.1f} s)"
                                                if args.vocabulary == "sentencepiece" else ""))
    print_table(rows, dask)
    if dask is not None and not dask["sha256_equal"]:
        raise SystemExit("the Dask build's data shards differ from the local engine's")
    return result


if __name__ == "__main__":
    import contextlib

    cli_args = parse_args()
    cluster_factory = None
    if cli_args.dask_mb:
        @contextlib.contextmanager
        def cluster_factory(work: pathlib.Path):
            # A cluster of worker processes: started here, under the __main__
            # guard, because its workers are new interpreters that import this
            # module again.
            import distributed

            dask_dir = work / "dask-scratch"
            with distributed.LocalCluster(n_workers=cli_args.dask_workers, threads_per_worker=1, processes=True,
                                          host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                          local_directory=str(dask_dir)) as cluster:
                with distributed.Client(cluster) as client:
                    pids = sorted(client.run(os.getpid).values())
                yield cluster.scheduler_address, pids, dask_dir

    main(cli_args, cluster_factory)
