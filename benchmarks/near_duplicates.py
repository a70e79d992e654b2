"""Near-duplicate removal (``--on-error near_duplicate=skip``): its cost against
the same build without it, and its recall against the LSH curve.

Cost: pipeline.py's documents case (the C4 validation sample repeated to
``--mb`` with a copy number in front of every document, 8 Parquet files, an
8,000-piece SentencePiece model), built by ``seqcache build`` in a child
process with and without the policy, alternating, ``--repeat`` times each:
CPU seconds (user + system of the build and its workers), wall seconds and
peak RSS. Every copy of a document differs from the others by its first word
only, so the policy keeps about one copy of each: the build with it writes
far fewer examples.

Quality: ``--quality N`` documents of the C4 sample, each planted again with
a share of its words replaced (the rates of ``RATES``); the true Jaccard
similarity of each pair (word 5-grams after the normalisation) against
whether the build removed one of the two. Printed per band of similarity:
pairs, removed, and the curve's mean prediction over those pairs.

Usage: python benchmarks/near_duplicates.py [--mb 50] [--repeat 2] [--quality 1000] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import statistics
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pipeline as bench  # noqa: E402  (this folder's corpus maker, vocabulary and child builds)

RATES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)
BANDS = ((0.0, 0.3), (0.3, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.0001))


def cost(tmp: pathlib.Path, mb: float, repeat: int) -> dict:
    """The documents case built with and without the policy, ``repeat`` times each."""
    model, _ = bench.train_vocabularies(tmp, with_tokenizers=False)
    spec, records = bench.make_documents(tmp / "docs", int(mb * 1e6))
    runs = {"without": [], "with": []}
    for k in range(repeat):
        for case, extra in (("without", ()), ("with", ("--on-error", "near_duplicate=skip"))):
            details = {}
            seconds, stats, peak = bench.build(spec, model, str(tmp / f"c-{case}-{k}"), 1, "docs", num_shards=8,
                                               details=details, extra=extra)
            runs[case].append({"cpu_s": details["cpu_s"], "wall_s": seconds, "peak_rss_mb": peak,
                               "examples": stats["examples"],
                               "near_duplicates": stats["bad_input_records"]["skipped"].get("near_duplicate", 0)})
    out = {"mb": mb, "documents": len(records), "runs": runs}
    for case in runs:
        out[f"{case}_cpu_s"] = statistics.median(r["cpu_s"] for r in runs[case])
    out["cpu_ratio"] = out["with_cpu_s"] / out["without_cpu_s"]
    return out


def planted(texts: list[str], seed: int = 11) -> tuple[list[str], list[tuple[int, int, float]]]:
    """The documents and a copy of each with words replaced at one of ``RATES``
    in turn: (lines, [(original line, copy line, rate)])."""
    rng = random.Random(seed)
    lines = [" ".join(t.split()) for t in texts]
    pairs = []
    for i, text in enumerate(list(lines)):
        rate = RATES[i % len(RATES)]
        words = text.split()
        copy = " ".join(f"planted{rng.randrange(10**9)}" if rng.random() < rate else w for w in words)
        pairs.append((i, len(lines), rate))
        lines.append(copy)
    return lines, pairs


def quality(tmp: pathlib.Path, documents: int) -> dict:
    """Recall per band of true Jaccard similarity against the curve's prediction."""
    import pyarrow.parquet as pq

    from seqcache import tasks
    from seqcache.feeders.reader import CacheReader
    from seqcache.pipelines import BuildConfig, build_task
    from seqcache.tasks.near_duplicates import NearDuplicates, jaccard

    texts = pq.read_table(bench.DATA / "c4" / "c4_validation_2k.parquet", columns=["text"]).column("text")
    lines, pairs = planted(texts[:documents].to_pylist())
    folder = tmp / "planted"
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    source = tasks.TextLineSource(str(folder / "a.txt"), on_error={"near_duplicate": "skip", "duplicate": "keep"})
    task = tasks.Task("planted", source=source, output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    result = build_task(task, cache_dir=str(tmp / "q"), config=BuildConfig(num_shards=4))
    with CacheReader(result.cache_dir) as r:
        vocabulary = tasks.ByteVocabulary()
        cached = collections.Counter(vocabulary.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r))))
    params = NearDuplicates()
    rows = []
    for lo, hi in BANDS:
        band = [(a, b) for a, b, _ in pairs if lo <= jaccard(lines[a], lines[b]) < hi]
        js = [jaccard(lines[a], lines[b]) for a, b in band]
        # Removed: the cache holds fewer than the two (a planted copy may be identical: no word changed).
        removed = sum(1 for a, b in band
                      if (cached[lines[a]] + cached[lines[b]] if lines[a] != lines[b] else cached[lines[a]]) < 2)
        rows.append({"jaccard": [lo, min(hi, 1.0)], "pairs": len(band), "removed": removed,
                     "recall": removed / len(band) if band else None,
                     "predicted": float(params.candidate_probability(js).mean()) if js else None})
    return {"documents": documents, "bands": rows}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=50.0, help="size of the documents corpus (MB)")
    parser.add_argument("--repeat", type=int, default=2, help="builds with and without the policy, each")
    parser.add_argument("--quality", type=int, default=1000, help="C4 documents planted again (0: no quality run)")
    parser.add_argument("--no-cost", action="store_true", help="only the quality run")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="seqcache-near-") as tmp:
        tmp = pathlib.Path(tmp)
        if args.quality:
            results["quality"] = quality(tmp, args.quality)
            print("jaccard      pairs  removed  recall  curve")
            for row in results["quality"]["bands"]:
                lo, hi = row["jaccard"]
                if row["pairs"]:
                    print(f"[{lo:.1f}, {hi:.1f})  {row['pairs']:5d}  {row['removed']:7d}  {row['recall']:.3f}   "
                          f"{row['predicted']:.3f}")
        if not args.no_cost:
            results["cost"] = cost(tmp, args.mb, args.repeat)
            c = results["cost"]
            print(f"{c['mb']} MB, {c['documents']:,} documents: CPU {c['without_cpu_s']:.1f} s without, "
                  f"{c['with_cpu_s']:.1f} s with the policy: {c['cpu_ratio']:.2f}x")
            for case, runs in c["runs"].items():
                for r in runs:
                    print(f"  {case}: {r['cpu_s']:.1f} CPU s, {r['wall_s']:.1f} s, {r['peak_rss_mb']:.0f} MB peak, "
                          f"{r['examples']:,} examples, {r['near_duplicates']:,} near duplicates")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
