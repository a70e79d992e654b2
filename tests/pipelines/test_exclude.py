"""Decontamination at build (``BuildConfig.exclude_benchmarks``, ``seqcache
build --exclude-benchmark``): planted benchmark items are found, nothing else is.

The benchmark is a set of English NTREX-128 sentences; the corpus is the first
300 documents of the C4 validation sample, written as JSON lines, with
sentences planted into some documents: exact copies, copies with case and
whitespace changed, and runs of the sentence's words of n (13), more than n,
and fewer than n words. Every planted document at or above n words must be
quarantined (100% recall) with the right benchmark, item and n-gram; every
other document must be cached, byte for byte. NTREX against the unplanted
documents quarantines nothing (no false positive on a disjoint pair).
"""

from __future__ import annotations

import collections
import json
import os

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache import tasks
from seqcache.cli.main import main
from seqcache.pipelines import BuildConfig, BuildError, build_task
from seqcache.tasks.contamination import normalize_words
from seqcache.cli.verify import verify_cache
from testsupport import byte_task, dask_args, local_dask_cluster

NUM_DOCS = 300
N = 13

# (document, kind, item): what is planted where. Kinds at or above n words are
# excluded, the others kept. Each planted document holds a different item.
PLANTS = [
    (3, "exact", 0), (4, "exact", 1),
    (7, "case_and_whitespace", 2), (8, "case_and_whitespace", 3),
    (11, "n_words", 4), (12, "more_than_n_words", 5),
    (15, "n_minus_1_words", 6), (16, "n_minus_1_words", 7),
    (17, "two_runs_of_n_minus_1", 8),
]
EXCLUDED_KINDS = ("exact", "case_and_whitespace", "n_words", "more_than_n_words")


def _planted_text(kind: str, item: str) -> str:
    words = normalize_words(item)
    if kind == "exact":
        return item
    if kind == "case_and_whitespace":
        gaps = ["\n", "  ", "\t", " \n "]
        return "".join(w + gaps[i % len(gaps)] for i, w in enumerate(item.upper().split()))
    if kind == "n_words":
        return " ".join(words[3:3 + N])
    if kind == "more_than_n_words":
        return " ".join(words[2:2 + N + 5])
    if kind == "n_minus_1_words":
        return " ".join(words[1:N])
    assert kind == "two_runs_of_n_minus_1"
    return " ".join(words[:N - 1]) + " | and then something else entirely | " + " ".join(words[N - 1:2 * (N - 1)])


def _insert(doc: str, text: str) -> str:
    """``text`` in the middle of ``doc``, at a space, between two words that no
    item holds: the document's own neighbouring words could extend a run of
    n - 1 words to n (a document word ``the`` after a 12-word run that the item
    continues with ``the`` is a 13-word overlap)."""
    cut = doc.find(" ", len(doc) // 2)
    cut = len(doc) if cut < 0 else cut
    return f"{doc[:cut]} plantedbefore {text} plantedafter {doc[cut:]}"


@pytest.fixture(scope="module")
def planted(tmp_path_factory, corpora):
    """(folder, documents as written, benchmark items, {record number: document index},
    the JSON-lines corpus with plants, the one without)."""
    folder = tmp_path_factory.mktemp("exclude")
    sentences = (corpora.ntrex / "newstest2019-src.eng.txt").read_text(encoding="utf-8").splitlines()
    items = [s for s in sentences if len(normalize_words(s)) >= 2 * N][:40]
    (folder / "ntrex.txt").write_text("\n".join(items) + "\n", encoding="utf-8")
    # A second benchmark that holds two of the planted items (an exact and a case-changed copy).
    (folder / "subset.txt").write_text(items[0] + "\n" + items[2] + "\n", encoding="utf-8")
    clean = corpora.c4_texts(NUM_DOCS).to_pylist()
    docs = list(clean)
    for doc, kind, item in PLANTS:
        docs[doc] = _insert(docs[doc], _planted_text(kind, items[item]))
    offsets = {}
    for name, texts in (("c4.jsonl", docs), ("c4_clean.jsonl", clean)):
        with open(folder / name, "wb") as f:
            for i, text in enumerate(texts):
                if name == "c4.jsonl":
                    offsets[f.tell()] = i
                f.write(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") + b"\n")
    return folder, docs, items, offsets


def _task(folder, name="c4", file="c4.jsonl"):
    return byte_task(name, tasks.JsonLinesSource(str(folder / file)))


def _bench(folder, name="ntrex"):
    return f"{name}=text:{folder / f'{name}.txt'}"


def _decoded(cache_dir) -> collections.Counter:
    from seqcache.feeders.reader import CacheReader

    with CacheReader(cache_dir) as r:
        return collections.Counter(bytes(x - 3 for x in e["targets"].tolist()[:-1]).decode("utf-8")
                                   for e in r.read_examples(range(len(r))))


def _quarantine(cache_dir) -> list[dict]:
    with open(os.path.join(cache_dir, fmt.QUARANTINE_NAME), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_planted_items_are_all_excluded_with_their_benchmark_item_and_ngram(tmp_path, planted):
    folder, docs, items, offsets = planted
    config = BuildConfig(num_shards=3, exclude_benchmarks=(_bench(folder), _bench(folder, "subset")))
    result = build_task(_task(folder), cache_dir=str(tmp_path / "c"), config=config)
    excluded = {doc: item for doc, kind, item in PLANTS if kind in EXCLUDED_KINDS}
    entries = _quarantine(result.cache_dir)
    found = {offsets[e["record_number"]]: e for e in entries}
    assert len(entries) == len(found) == len(excluded)
    assert set(found) == set(excluded)  # 100% recall, and the kept plants (below n words) are not there
    for doc, e in found.items():
        item = excluded[doc]
        assert e["action"] == "excluded" and e["kind"] == "benchmark" and e["field"] == "text"
        assert e["benchmark"] == "ntrex" and e["item"]["number"] == item
        assert e["item"]["path"] == str(folder / "ntrex.txt")
        assert e["benchmarks"] == (["ntrex", "subset"] if item in (0, 2) else ["ntrex"])
        ngram = e["ngram"].split()
        assert len(ngram) == N
        item_words = " ".join(normalize_words(items[item]))
        assert f" {e['ngram']} " in f" {item_words} "
        span = docs[doc][e["start"]:e["end"]]
        assert f" {e['ngram']} " in " " + " ".join(normalize_words(span)) + " "
    stats = result.manifest.statistics.to_json()
    assert stats["excluded_records"] == len(excluded) == 6
    assert stats["excluded_by_benchmark"] == {"ntrex": 6, "subset": 2}
    assert stats["source_records"] == NUM_DOCS
    # Everything else is cached as it was written, the documents planted below n words included.
    kept = collections.Counter(d for i, d in enumerate(docs) if i not in excluded)
    assert _decoded(result.cache_dir) == kept
    assert verify_cache(result.cache_dir).ok
    _verify_names_a_changed_quarantine(result.cache_dir)


def _verify_names_a_changed_quarantine(cache_dir):
    """verify counts the excluded entries, in all and per benchmark, against the manifest."""
    path = os.path.join(cache_dir, fmt.QUARANTINE_NAME)
    manifest = os.path.join(cache_dir, fmt.MANIFEST_NAME)
    raw = json.load(open(manifest))
    for key in ("quarantine_sha256", "quarantine_num_bytes"):  # as in caches that did not record them
        raw.pop(key)
    json.dump(raw, open(manifest, "w"))
    lines = open(path, "rb").readlines()
    first = json.loads(lines[0])
    assert first["benchmarks"] == ["ntrex", "subset"]
    open(path, "wb").write(b"".join(lines[1:]))
    assert verify_cache(cache_dir).problems == [
        f"{path}: 5 entries with action 'excluded', the manifest's statistics.excluded_records is 6",
        f"{path}: excluded entries per benchmark {{'ntrex': 5, 'subset': 1}}, the manifest's "
        "statistics.excluded_by_benchmark is {'ntrex': 6, 'subset': 2}",
    ]


def _grams(words, n=N) -> set:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_exclusion_agrees_with_a_set_oracle_on_random_plants(tmp_path, planted, corpora):
    """Runs of 9 to 17 whitespace-separated tokens of random items (punctuation
    and case as written) planted at random places in 150 documents: a document
    is excluded exactly when its normalised words and an item's share a
    13-gram, computed here with Python sets, and each entry's n-gram is one of
    the item's."""
    import random

    folder, _, items, _ = planted
    rng = random.Random(0)
    docs = corpora.c4_texts(150).to_pylist()
    for i in rng.sample(range(len(docs)), 60):
        tokens = items[rng.randrange(len(items))].split()
        length = rng.randint(9, 17)
        start = rng.randrange(len(tokens) - length + 1)
        cut = rng.randrange(len(docs[i]) + 1)
        docs[i] = f"{docs[i][:cut]} {' '.join(tokens[start:start + length])} {docs[i][cut:]}"
    path = tmp_path / "random.jsonl"
    offsets = {}
    with open(path, "wb") as f:
        for i, text in enumerate(docs):
            offsets[f.tell()] = i
            f.write(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") + b"\n")
    item_grams = [_grams(normalize_words(item)) for item in items]
    every = set().union(*item_grams)
    oracle = {i for i, d in enumerate(docs) if _grams(normalize_words(d)) & every}
    config = BuildConfig(num_shards=2, exclude_benchmarks=(_bench(folder),))
    result = build_task(byte_task("random", tasks.JsonLinesSource(str(path))), cache_dir=str(tmp_path / "c"),
                        config=config)
    entries = _quarantine(result.cache_dir) if result.manifest.quarantine else []
    assert {offsets[e["record_number"]] for e in entries} == oracle
    assert 20 < len(oracle) < 60  # both outcomes occur
    for e in entries:
        assert tuple(e["ngram"].split()) in item_grams[e["item"]["number"]]
        assert tuple(e["ngram"].split()) in _grams(normalize_words(docs[offsets[e["record_number"]]]))
    assert result.manifest.num_examples == len(docs) - len(oracle)


def test_a_disjoint_pair_excludes_nothing(tmp_path, planted):
    folder, _, _, _ = planted
    config = BuildConfig(num_shards=2, exclude_benchmarks=(f"ntrex=text:{planted[0] / 'ntrex.txt'}",))
    result = build_task(_task(folder, "c4_clean", "c4_clean.jsonl"), cache_dir=str(tmp_path / "c"), config=config)
    stats = result.manifest.statistics.to_json()
    assert stats["excluded_records"] == 0 and stats["excluded_by_benchmark"] == {"ntrex": 0}
    assert result.manifest.num_examples == NUM_DOCS
    assert result.manifest.quarantine is None


def _shard_sums(result):
    return fmt.read_shard_checksums(result.cache_dir, result.manifest)


def _runs_agree(results: dict) -> None:
    first = next(iter(results.values()))
    for name, result in results.items():
        assert _shard_sums(result) == _shard_sums(first), name
        assert result.manifest.statistics == first.manifest.statistics, name
        assert result.manifest.quarantine_sha256 == first.manifest.quarantine_sha256, name
        assert result.manifest.fingerprint == first.manifest.fingerprint, name


def test_the_cache_does_not_depend_on_the_work_split_the_exchange_or_the_benchmark_order(tmp_path, planted):
    folder = planted[0]
    task = _task(folder)
    both = (_bench(folder), _bench(folder, "subset"))
    runs = {
        "spill files, one unit": dict(config=BuildConfig(num_shards=3, exclude_benchmarks=both)),
        "runner shuffle, tiny splits": dict(config=BuildConfig(num_shards=3, exclude_benchmarks=both),
                                            split_size=20_000, exchange="runner"),
        "benchmarks in the other order": dict(config=BuildConfig(num_shards=3, exclude_benchmarks=both[::-1]),
                                              split_size=50_000),
    }
    results = {name: build_task(task, cache_dir=str(tmp_path / str(k)), **kw)
               for k, (name, kw) in enumerate(runs.items())}
    assert next(iter(results.values())).manifest.statistics.excluded_records == 6
    _runs_agree(results)


def test_dask_writes_the_same_cache_as_the_local_engine(tmp_path, planted):
    """Beam's DaskRunner on 2 worker processes (the benchmarks travel to them
    pickled with the read step) against the local engine."""
    pytest.importorskip("distributed")
    folder = planted[0]
    task = _task(folder)
    config = BuildConfig(num_shards=3, exclude_benchmarks=(_bench(folder), _bench(folder, "subset")))
    cluster = local_dask_cluster()
    try:
        runs = {
            "local engine": dict(pipeline_args=[]),
            "dask x2": dict(pipeline_args=dask_args(cluster), split_size=30_000),
        }
        results = {name: build_task(task, cache_dir=str(tmp_path / str(k)), config=config, **kw)
                   for k, (name, kw) in enumerate(runs.items())}
    finally:
        cluster.close()
    assert next(iter(results.values())).manifest.statistics.excluded_by_benchmark == {"ntrex": 6, "subset": 2}
    _runs_agree(results)


def test_the_benchmark_enters_the_fingerprint_and_a_change_is_named(tmp_path, planted):
    folder = planted[0]
    task = _task(folder, "c4_fp")
    cache = str(tmp_path / "c")
    bench = tmp_path / "bench.txt"
    bench.write_text((folder / "ntrex.txt").read_text(encoding="utf-8"), encoding="utf-8")
    spec = (f"ntrex=text:{bench}",)
    plain = build_task(task, cache_dir=str(tmp_path / "plain"), config=BuildConfig(num_shards=2))
    first = build_task(task, cache_dir=cache, config=BuildConfig(num_shards=2, exclude_benchmarks=spec))
    assert first.manifest.fingerprint != plain.manifest.fingerprint
    assert "exclude_benchmarks" not in plain.manifest.fingerprint_inputs
    recorded = first.manifest.fingerprint_inputs["exclude_benchmarks"]
    assert [(b["name"], b["n"], b["items"]) for b in recorded] == [("ntrex", N, 40)]
    again = build_task(task, cache_dir=cache, config=BuildConfig(num_shards=2, exclude_benchmarks=spec))
    assert again.reused and again.manifest.fingerprint == first.manifest.fingerprint
    # One more item: another fingerprint, and the refusal says what changed.
    bench.write_text(bench.read_text(encoding="utf-8") + "One more test item that was not there before.\n",
                     encoding="utf-8")
    with pytest.raises(BuildError, match=r"what changed: exclude_benchmarks\[0\]\.fingerprint: \"[0-9a-f]+\" -> "):
        build_task(task, cache_dir=cache, config=BuildConfig(num_shards=2, exclude_benchmarks=spec))
    with pytest.raises(BuildError, match=r"exclude_benchmarks\[0\]\.n: 13 -> 8"):
        build_task(task, cache_dir=cache, config=BuildConfig(num_shards=2, exclude_benchmarks=spec, exclude_ngram=8))
    with pytest.raises(BuildError, match=r"what changed: exclude_benchmarks: removed"):
        build_task(task, cache_dir=cache, config=BuildConfig(num_shards=2))


def test_the_command_line_excludes_counts_and_refuses_what_does_not_fit(tmp_path, planted):
    folder = planted[0]
    runner = CliRunner()
    args = ["build", "--source", f"jsonl:{folder / 'c4.jsonl'}#text", "--name", "c4_cli", "--num-shards", "2",
            "--cache-dir", str(tmp_path / "c"), "--exclude-benchmark", _bench(folder), "--json"]
    result = runner.invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    built = json.loads(result.stdout)[0]
    assert built["excluded_records"] == 6 and built["excluded_by_benchmark"] == {"ntrex": 6}
    assert "excluding benchmark ntrex: 40 items" in result.stderr
    text = runner.invoke(main, args[:-1], catch_exceptions=False)  # reused: the summary still counts them
    assert "excluded 6 records that overlap benchmarks (ntrex 6)" in text.stderr
    assert "quarantine.jsonl" in text.stderr

    info = runner.invoke(main, ["info", str(tmp_path / "c" / "c4_cli" / "train")], env={"COLUMNS": "200"})
    assert "6 records overlapping benchmark ntrex (quarantine.jsonl)" in info.output
    # which --source on an excluded record says so, by byte offset and by line.
    cache = tmp_path / "c" / "c4_cli" / "train"
    entry = _quarantine(cache)[0]
    line = (folder / "c4.jsonl").read_bytes()[:entry["record_number"]].count(b"\n") + 1
    for where in (f"byte={entry['record_number']}", str(line)):
        which = runner.invoke(main, ["which", str(cache), "--source", f"{folder / 'c4.jsonl'}:{where}",
                                     "--batch-size", "4"])
        assert which.exit_code == 0, which.output
        assert f"excluded from the cache of task c4_cli ({cache})" in which.output
        assert f"item {entry['item']['number']} of benchmark 'ntrex'" in which.output and entry["ngram"] in which.output

    usage = runner.invoke(main, args[:-3] + ["--exclude", f"text:{folder / 'ntrex.txt'}"])
    assert usage.exit_code == 2 and "--exclude-benchmark text:" in usage.output
    usage = runner.invoke(main, args[:-3] + ["--exclude-ngram", "8"])
    assert usage.exit_code == 2 and "--exclude-ngram applies to --exclude-benchmark" in usage.output
    missing = runner.invoke(main, args[:-2] + ["text:/nonexistent/bench-*.txt"])
    assert missing.exit_code == 2 and "--exclude-benchmark" in missing.output and "bench-*.txt" in missing.output


def test_a_build_that_excludes_nothing_names_no_quarantine_file(tmp_path, planted):
    # Two workers of the local engine (--workers 2) write the cache one worker writes.
    folder = planted[0]
    runner = CliRunner()
    args = ["build", "--source", f"jsonl:{folder / 'c4_clean.jsonl'}#text", "--name", "c4_clean", "--num-shards",
            "2", "--exclude-benchmark", _bench(folder)]
    one = runner.invoke(main, [*args, "--cache-dir", str(tmp_path / "one")], catch_exceptions=False)
    assert one.exit_code == 0, one.output
    assert "excluded 0 records that overlap benchmarks (ntrex 0)" in one.stderr
    assert "quarantine" not in one.stderr
    cache = tmp_path / "one" / "c4_clean" / "train"
    assert not (cache / "quarantine.jsonl").exists()
    info = runner.invoke(main, ["info", str(cache)], env={"COLUMNS": "200"})
    assert "0 records overlapping benchmark ntrex" in info.output and "quarantine" not in info.output
    two = runner.invoke(main, [*args, "--cache-dir", str(tmp_path / "two"), "--workers", "2"],
                        catch_exceptions=False)
    assert two.exit_code == 0, two.output
    data = sorted(p.name for p in cache.glob("*.array_record-*"))
    assert data and all((cache / n).read_bytes() == (tmp_path / "two" / "c4_clean" / "train" / n).read_bytes()
                        for n in data)
    both = runner.invoke(main, [*args, "--cache-dir", str(tmp_path / "three"), "--workers", "2",
                                "--direct_num_workers=3"])
    assert both.exit_code == 2 and "give --workers N or Beam's --direct_num_workers" in both.output


def test_a_build_whose_every_record_overlaps_says_so(tmp_path, planted):
    folder = planted[0]
    corpus = tmp_path / "items.txt"
    corpus.write_text((folder / "subset.txt").read_text(encoding="utf-8"), encoding="utf-8")
    config = BuildConfig(num_shards=1, exclude_benchmarks=(_bench(folder),))
    with pytest.raises(BuildError, match=r"zero examples from 2 source records .*2 excluded for overlapping "
                                         r"\{'ntrex': 2\}"):
        build_task(byte_task("all_out", tasks.TextLineSource(str(corpus))), cache_dir=str(tmp_path / "c"),
                   config=config)
