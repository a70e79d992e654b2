"""Peak memory of a build that skips many records, against the same build keeping them.

The corpus is one text file of N lines "word" and N blank lines, alternating
(N = 1,000,000: a 6 MB file). It is built twice, each in a child process, with
``TextLineSource(..., on_error={"empty": ACTION})``:
  keep: the blank lines become empty examples (2N examples);
  skip: they are skipped, counted and listed in quarantine.jsonl (N examples).
For each the benchmark reports the peak RSS of the build process (ru_maxrss,
DirectRunner in_memory), the wall time and the quarantine file's size. Skipped
records should cost no more memory than kept ones: they travel as quarantine
chunk files, not as one runner element each.

Measured on the development machine (2 cores, N = 1,000,000):
  keep 439 MB; skip 431 MB, quarantine.jsonl 147 MB
  (before quarantine chunks: skip 1,316 MB, quarantine.jsonl 166 MB)

Usage: python benchmarks/quarantine.py [--lines 1000000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

_CHILD = textwrap.dedent(
    """
    import json, os, resource, sys, time
    from seqcache import tasks
    from seqcache.pipelines import BuildConfig, build_task

    corpus, action, cache_dir = sys.argv[1:]
    task = tasks.Task(
        "blank",
        source=tasks.TextLineSource(corpus, on_error={"empty": action}),
        output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
    )
    start = time.monotonic()
    result = build_task(task, cache_dir=cache_dir, config=BuildConfig(num_shards=2))
    quarantine = os.path.join(result.cache_dir, "quarantine.jsonl")
    print(json.dumps({
        "action": action,
        "examples": result.manifest.num_examples,
        "skipped_records": result.manifest.statistics.skipped_records,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "seconds": round(time.monotonic() - start, 1),
        "quarantine_mb": round(os.path.getsize(quarantine) / 1e6, 1) if os.path.exists(quarantine) else 0.0,
    }))
    """
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000, help="N: lines of text and blank lines each")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = f"{tmp}/blank.txt"
        with open(corpus, "wb") as f:
            f.write(b"word\n\n" * args.lines)
        for action in ("keep", "skip"):
            done = subprocess.run([sys.executable, "-c", _CHILD, corpus, action, f"{tmp}/{action}"],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"skip/keep peak RSS: {rows[1]['peak_rss_mb'] / rows[0]['peak_rss_mb']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
