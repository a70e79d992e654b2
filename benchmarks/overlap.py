"""The benchmark-overlap scan against the build, on the same corpus, in the same run.

What it measures (docs/overlap.md):

  speed: ``seqcache build`` of a corpus of C4 documents (``--mb`` MB of JSON
      lines, as scale.py writes it; byte or SentencePiece vocabulary), then
      ``seqcache overlap`` of NTREX-128's English test set (1,997 items) against
      that cache; each command runs in a child process, timed from start to
      exit, ``--repeat`` rounds, build and scan alternating. MB/s is the
      corpus's bytes (its files) over each command's wall seconds, so the
      ratio scan / build says how long a scan takes next to the build it
      checks: above 1x, the scan is faster.
  memory: the scan's peak RSS (the child's process tree, sampled every
      ``--interval`` s with psutil, and ru_maxrss) against the benchmark's
      size: NTREX, then benchmarks of ``--bench-mb`` MB of WikiText-2 lines
      (copies with a number in front), all on the same cache; and NTREX on a
      corpus of ``--mb2`` MB, to show that the corpus's size does not move it.

Usage (from any folder, the repository root too: it imports the installed package):
  python benchmarks/overlap.py [--mb 100] [--mb2 20] [--repeat 3]
                               [--vocabulary byte|sentencepiece] [--bench-mb 2 8]
                               [--workers N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scale  # noqa: E402  (the corpus, the vocabulary, the sampler and the build of scale.py)

NTREX = scale.DATA / "ntrex128" / "newstest2019-src.eng.txt"
WIKITEXT = [scale.DATA / "wikitext2" / "wiki.test.tokens", scale.DATA / "wikitext2" / "wiki.valid.tokens"]


def write_benchmark(path: pathlib.Path, target_bytes: int) -> str:
    """A JSON-lines benchmark of about ``target_bytes``: WikiText-2 lines of at
    least 13 words, copied with a number in front until the size is reached.
    Returns its source spec."""
    lines = [line.strip() for p in WIKITEXT for line in p.read_text(encoding="utf-8").splitlines()]
    lines = [line for line in lines if len(line.split()) >= 13]
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_bytes:
            for line in lines:
                data = json.dumps({"text": f"{copy} {line}"}, ensure_ascii=False) + "\n"
                f.write(data)
                written += len(data.encode("utf-8"))
                if written >= target_bytes:
                    break
            copy += 1
    return f"jsonl:{path}#text"


def run_overlap(bench: str, cache: pathlib.Path, out: pathlib.Path, *, extra_args=(), interval: float = 0.2) -> dict:
    """``seqcache overlap BENCH CACHE -o OUT --json`` in a child process,
    sampled; its wall seconds, peak RSS and summary."""
    args = ["overlap", bench, str(cache), "-o", str(out), "--json", *extra_args]
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", scale.CLI, *args], stdout=stdout, stderr=stderr,
                            cwd=tempfile.gettempdir())
    sampler = scale.Sampler(proc.pid, {}, interval=interval)
    sampler.start()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    sampler.stop()
    stdout.seek(0)
    stderr.seek(0)
    text, log = stdout.read().decode(errors="replace"), stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"seqcache overlap failed:\n{log[-6000:]}\n{text[-2000:]}")
    summary = json.loads(text)
    return {"wall_s": round(seconds, 2), "peak_tree_rss_mb": round(sampler.peak_tree / 2**20),
            "ru_maxrss_mb": round(usage.ru_maxrss / 1024), "summary": summary}


def benchmark_size(spec: str) -> dict:
    """The benchmark's items, bytes and n-grams (its table), loaded here."""
    from seqcache.tasks.contamination import Benchmark

    b = Benchmark.load(spec)
    return {"items": len(b.items), "mb": round(b.size_bytes / 1e6, 2), "ngrams": b.num_ngrams}


def speed_rounds(spec: str, raw_bytes: int, work: pathlib.Path, args) -> dict:
    """``--repeat`` rounds of build then scan on the corpus ``spec``; the cache
    of the last round is kept in ``work / "cache"`` for the memory runs."""
    mb = raw_bytes / 1e6
    extra = ["--direct_num_workers=%d" % args.workers, "--direct_running_mode=multi_processing"] \
        if args.workers > 1 else []
    rounds = []
    for r in range(args.repeat):
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        built = scale.build(spec, cache, work / "systmp", vocabulary=args.vocabulary_arg, extra_args=extra,
                            interval=args.interval)
        scanned = run_overlap(f"text:{NTREX}", cache / scale.NAME / "train", work / "overlap.json",
                              extra_args=extra, interval=args.interval)
        rounds.append({"build_s": built["wall_s"], "scan_s": scanned["wall_s"],
                       "build_mb_s": round(mb / built["wall_s"], 2), "scan_mb_s": round(mb / scanned["wall_s"], 2),
                       "ratio": round(built["wall_s"] / scanned["wall_s"], 3),
                       "build_rss_mb": built["peak_tree_rss_mb"], "scan_rss_mb": scanned["peak_tree_rss_mb"],
                       "scanned_examples": scanned["summary"]["scanned"]["examples"]})
        print(f"round {r + 1}: build {built['wall_s']:.1f} s ({mb / built['wall_s']:.2f} MB/s), scan "
              f"{scanned['wall_s']:.1f} s ({mb / scanned['wall_s']:.2f} MB/s): scan/build speed "
              f"{rounds[-1]['ratio']:.2f}x", flush=True)
    ratios = [x["ratio"] for x in rounds]
    return {"mb": round(mb, 1), "rounds": rounds, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def memory_rows(cache: pathlib.Path, work: pathlib.Path, args) -> list[dict]:
    """The scan's peak RSS for NTREX and for the ``--bench-mb`` benchmarks, on one cache."""
    specs = [("ntrex", f"text:{NTREX}")]
    for mb in args.bench_mb:
        specs.append((f"wikitext {mb:g} MB", write_benchmark(work / f"bench-{mb:g}.jsonl", int(mb * 1e6))))
    rows = []
    for name, spec in specs:
        size = benchmark_size(spec)
        run = run_overlap(spec, cache, work / "memory.json", interval=args.interval)
        rows.append({"benchmark": name, **size, "scan_s": run["wall_s"], "peak_tree_rss_mb": run["peak_tree_rss_mb"],
                     "ru_maxrss_mb": run["ru_maxrss_mb"]})
        print(f"memory: {name}: {size['mb']} MB, {size['ngrams']:,} n-grams: peak RSS {run['peak_tree_rss_mb']} MB "
              f"(scan {run['wall_s']:.1f} s)", flush=True)
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="corpus size of the speed rounds, MB (1e6 bytes)")
    ap.add_argument("--mb2", type=float, default=20.0, help="a second corpus size for the memory runs (0: none)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of build then scan")
    ap.add_argument("--vocabulary", default="byte", choices=["byte", "sentencepiece"])
    ap.add_argument("--vocab-size", type=int, default=8000, help="pieces of the SentencePiece model")
    ap.add_argument("--bench-mb", type=float, nargs="*", default=[2.0, 8.0], help="sizes of the larger benchmarks, MB")
    ap.add_argument("--workers", type=int, default=1, help="local engine workers of both commands (multi_processing)")
    ap.add_argument("--interval", type=float, default=0.2, help="RSS sampling interval, seconds")
    ap.add_argument("--work-dir", help="where corpora and caches go (default: a new folder in the temp dir)")
    ap.add_argument("--json", dest="json_out", help="also write the results to this file")
    return ap.parse_args(argv)


def main(args) -> dict:
    work = pathlib.Path(tempfile.mkdtemp(prefix="seqcache-overlap-", dir=args.work_dir))
    try:
        args.vocabulary_arg, _ = scale.make_vocabulary(work / "vocabulary", "documents", args.vocabulary,
                                                       args.vocab_size)
        spec, raw, _ = scale.make_corpus(work / "corpus", int(args.mb * 1e6), "documents")
        speed = speed_rounds(spec, raw, work, args)
        memory = memory_rows(work / "cache" / scale.NAME / "train", work, args)
        corpus2 = None
        if args.mb2:
            spec2, raw2, _ = scale.make_corpus(work / "corpus2", int(args.mb2 * 1e6), "documents")
            scale.build(spec2, work / "cache2", work / "systmp", vocabulary=args.vocabulary_arg)
            run = run_overlap(f"text:{NTREX}", work / "cache2" / scale.NAME / "train", work / "o2.json")
            corpus2 = {"mb": round(raw2 / 1e6, 1), "peak_tree_rss_mb": run["peak_tree_rss_mb"], "scan_s": run["wall_s"]}
            print(f"memory: ntrex on a {corpus2['mb']} MB corpus: peak RSS {run['peak_tree_rss_mb']} MB (against "
                  f"{memory[0]['peak_tree_rss_mb']} MB on {speed['mb']} MB)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "vocabulary": args.vocabulary, "workers": args.workers, "speed": speed, "memory": memory,
              "memory_other_corpus": corpus2}
    print(f"\nscan / build speed on {speed['mb']} MB ({args.vocabulary}, {args.workers} worker(s)): median "
          f"{speed['ratio_median']:.2f}x [{speed['ratio_min']:.2f}, {speed['ratio_max']:.2f}] over {args.repeat} round(s)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(parse_args())
