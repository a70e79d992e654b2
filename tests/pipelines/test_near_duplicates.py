"""Near-duplicate removal in the build: ``on_error={"near_duplicate": "skip"}``
with ``BuildConfig.near_duplicates`` (pipelines/near.py).

Vocabulary: a *near copy* is a document with some of its words changed; a
*cluster* is a connected component of the candidate pairs (two records that
share a band's bucket); the *kept* record of a cluster is its member with the
smallest shuffle key."""

from __future__ import annotations

import collections
import os
import random

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache import tasks
from seqcache.cli.verify import verify_cache
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import BuildConfig, BuildError, build_task, shuffle
from seqcache.tasks.near_duplicates import NearDuplicates
from testsupport import MULTI_PROCESSING, byte_task, dask_args, prism_missing

VOCABULARY = tasks.ByteVocabulary()
DOCUMENTS = 60


def _edit(text: str, count: int, rng: random.Random) -> str:
    """``text`` with ``count`` of its words (at random places) replaced by new words."""
    words = text.split()
    for i in rng.sample(range(len(words)), min(count, len(words))):
        words[i] = f"edit{rng.randrange(10**6)}"
    return " ".join(words)


def corpus_lines(corpora, documents: int = DOCUMENTS) -> list[str]:
    """The first C4 documents on one line each, and planted copies: every
    fifth document again with one word changed, every seventh exactly, and a
    chain (document 3, then 5 words changed, then 5 more of that)."""
    rng = random.Random(5)
    texts = [" ".join(t.split()) for t in corpora.c4_texts(documents).to_pylist()]
    lines = list(texts)
    lines += [_edit(t, 1, rng) for t in texts[::5]]
    lines += texts[::7]
    chain = random.Random(1)
    b = _edit(texts[3], 5, chain)
    lines += [b, _edit(b, 5, chain)]
    return lines


def _task(folder, *, duplicate="keep", near="skip"):
    source = tasks.TextLineSource(str(folder / "*.txt"),
                                  on_error={"empty": "skip", "duplicate": duplicate, "near_duplicate": near})
    return byte_task("near", source)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpora):
    folder = tmp_path_factory.mktemp("near")
    lines = corpus_lines(corpora)
    half = len(lines) // 2
    (folder / "a.txt").write_text("\n".join(lines[:half]) + "\n", encoding="utf-8")
    (folder / "b.txt").write_text("\n".join(lines[half:]) + "\n", encoding="utf-8")
    return folder, lines


def _expected(lines: list[str], params: NearDuplicates, seed: int = 0) -> dict[str, tuple[str, float]]:
    """The reference: removed line -> (kept line, estimated similarity), from
    every pair of distinct lines that share a band's bucket, joined by
    union-find in this process, each cluster keeping its smallest key."""
    distinct = sorted(set(lines))
    keys = {t: shuffle.record_key(t.encode(), shuffle.seed_key(seed)) for t in distinct}
    sigs = {t: params.signature(t) for t in distinct}
    parent = {t: t for t in distinct}

    def find(t):
        while parent[t] != t:
            parent[t] = parent[parent[t]]
            t = parent[t]
        return t

    buckets = collections.defaultdict(list)
    for t in distinct:
        if sigs[t] is not None:
            for h in params.band_hashes(sigs[t]):
                buckets[h].append(t)
    for members in buckets.values():
        for t in members[1:]:
            parent[find(t)] = find(members[0])
    clusters = collections.defaultdict(list)
    for t in distinct:
        clusters[find(t)].append(t)
    out = {}
    for members in clusters.values():
        kept = min(members, key=keys.__getitem__)
        for t in members:
            if t != kept:
                out[t] = (kept, round(float(np.mean(sigs[t] == sigs[kept])), 4))
    return out


def _texts(cache_dir) -> list[str]:
    with CacheReader(cache_dir) as r:
        return [VOCABULARY.decode(e["targets"].tolist()) for e in r.read_examples(range(len(r)))]


def _quarantine(result) -> list[dict]:
    return list(fmt.iter_json_lines(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME)))


def _line_at(folder, entry) -> str:
    with open(os.path.join(folder, os.path.basename(entry["path"])), "rb") as f:
        f.seek(entry["record_number"])
        return f.readline().decode().rstrip("\n")


def test_the_clusters_are_exact_and_keep_the_smallest_key(tmp_path, corpus):
    folder, lines = corpus
    result = build_task(_task(folder), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=3))
    expected = _expected(lines, NearDuplicates())
    copies = len(lines) - len(set(lines))
    assert len(expected) >= DOCUMENTS // 5  # most planted near copies, and the chain
    assert sorted(_texts(result.cache_dir)) == sorted(set(lines) - set(expected))

    entries = _quarantine(result)
    near = [e for e in entries if e["kind"] == "near_duplicate" and " is a near duplicate of " in e["error"]]
    exact = [e for e in entries if e["kind"] == "near_duplicate" and " is identical to " in e["error"]]
    assert len(near) + len(exact) == len(entries)
    assert len(exact) == copies and len(near) == len(expected)
    cached = set(_texts(result.cache_dir))
    for e in exact:  # an exact copy names the record the cache holds for it: its first copy, or that one's kept
        copy, kept = _line_at(folder, e), _line_at(folder, e["kept"])
        assert (kept, e["similarity"]) == (expected.get(copy) or (copy, 1.0)), e
    assert any(_line_at(folder, e) in expected for e in exact)  # the corpus has copies of a removed record
    assert all(_line_at(folder, e["kept"]) in cached for e in entries)
    for e in near:
        removed, kept = _line_at(folder, e), _line_at(folder, e["kept"])
        assert expected[removed] == (kept, e["similarity"])
        assert e["action"] == "skipped" and "is a near duplicate of" in e["error"]
        assert f"(estimated similarity {e['similarity']}), which is kept (on_error near_duplicate=skip)" in e["error"]
    stats = result.manifest.statistics.to_json()
    assert stats["bad_input_records"]["skipped"] == {"near_duplicate": copies + len(expected)}
    assert stats["examples"] == len(set(lines)) - len(expected)
    per_file = result.manifest.read_source_table().statistics
    assert sum(per_file["examples"]) == stats["examples"]
    assert sum(per_file["tokens"]["targets"]) == stats["tokens"]["targets"]
    assert verify_cache(result.cache_dir).problems == []

    # The report: clusters by size (each entry names its kept record), drawn on the page.
    from seqcache.cli.report import quarantine_summary
    from seqcache.cli.report_html import plot_cluster_sizes

    summary = quarantine_summary(result.cache_dir, result.manifest)
    assert sum((size - 1) * n for size, n in summary["cluster_sizes"]) == len(entries)
    assert summary["cluster_sizes"][0][0] == 2 and plot_cluster_sizes(summary) is not None


def test_a_chain_is_one_cluster_even_where_its_ends_share_no_bucket(tmp_path, corpus):
    folder, lines = corpus
    params = NearDuplicates()
    a, b, c = lines[3], lines[-2], lines[-1]
    ha, hb, hc = (set(params.band_hashes(params.signature(t))) for t in (a, b, c))
    assert ha & hb and hb & hc and not ha & hc  # A~B~C, and A, C share no bucket
    result = build_task(_task(folder), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    kept = [t for t in (a, b, c) if t in set(_texts(result.cache_dir))]
    assert len(kept) == 1


def test_exact_and_near_policies_together_count_each_copy_once(tmp_path, corpus):
    folder, lines = corpus
    result = build_task(_task(folder, duplicate="skip"), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=2))
    copies = len(lines) - len(set(lines))
    expected = _expected(lines, NearDuplicates())
    stats = result.manifest.statistics.to_json()
    assert stats["bad_input_records"]["skipped"] == {"duplicate": copies, "near_duplicate": len(expected)}
    assert stats["skipped_records"] == copies + len(expected)
    assert stats["source_records"] == len(lines)
    assert verify_cache(result.cache_dir).problems == []


def test_the_parameters_are_in_the_fingerprint_and_need_the_policy(tmp_path, corpus):
    folder, _ = corpus
    build_task(_task(folder), cache_dir=str(tmp_path), config=BuildConfig(num_shards=2))
    with pytest.raises(BuildError, match=r"near_duplicates\.bands: 14 -> 20"):
        build_task(_task(folder), cache_dir=str(tmp_path),
                   config=BuildConfig(num_shards=2, near_duplicates=NearDuplicates(bands=20)))
    with pytest.raises(BuildError, match="near-duplicate parameters were given, but its source keeps near duplicates"):
        build_task(_task(folder, near="keep"), cache_dir=str(tmp_path / "other"),
                   config=BuildConfig(num_shards=2, near_duplicates=NearDuplicates()))


def _fingerprint(result) -> tuple:
    with open(os.path.join(result.cache_dir, fmt.QUARANTINE_NAME), "rb") as f:
        quarantine = f.read()
    return fmt.read_shard_checksums(result.cache_dir, result.manifest), quarantine, result.manifest.statistics.to_json()


def test_the_same_bytes_on_every_run_runner_and_split(tmp_path, corpus, dask_cluster):
    folder, _ = corpus
    runs = {
        "local engine, spill files": dict(),
        "local engine, runner shuffle, tiny splits": dict(split_size=20_000, exchange="runner"),
        "multi_processing x2": dict(pipeline_args=MULTI_PROCESSING, split_size=40_000),
        "dask x2": dict(pipeline_args=dask_args(dask_cluster), split_size=25_000),
    }
    if prism_missing() is None:
        runs["prism"] = dict(pipeline_args=["--runner=prism"], split_size=30_000)
    results = {name: _fingerprint(build_task(_task(folder), cache_dir=str(tmp_path / str(k)),
                                             config=BuildConfig(num_shards=3), **kw))
               for k, (name, kw) in enumerate(runs.items())}
    first = results["local engine, spill files"]
    assert first[2]["bad_input_records"]["skipped"]["near_duplicate"] > 10
    for name, got in results.items():
        assert got == first, name


def test_a_resumed_build_with_near_duplicates_gives_the_same_bytes(tmp_path, corpus):
    """A build that keeps its work, then the same build reusing every unit:
    the signatures travel in the units' outputs, so the rerun reads nothing
    and writes the same cache."""
    folder, _ = corpus
    first = build_task(_task(folder), cache_dir=str(tmp_path / "a"), config=BuildConfig(num_shards=2),
                       keep_work=True, split_size=30_000)
    again = build_task(_task(folder), cache_dir=str(tmp_path / "a"), config=BuildConfig(num_shards=3),
                       keep_work=True, split_size=30_000, overwrite=True)
    fresh = build_task(_task(folder), cache_dir=str(tmp_path / "b"), config=BuildConfig(num_shards=3),
                       split_size=30_000)
    assert again.manifest.work.units_reused == again.manifest.work.units > 1
    assert _fingerprint(again) == _fingerprint(fresh)
    assert first.manifest.statistics.skipped_records == fresh.manifest.statistics.skipped_records


RATES = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.4)


@pytest.mark.slow
def test_recall_follows_the_lsh_curve_on_planted_near_copies(tmp_path, corpora):
    """Every C4 document of the sample planted again with a share of its words
    replaced (``RATES`` in turn): pairs at true Jaccard >= 0.8 are removed at
    least as often as the curve predicts, less 2 points; pairs at <= 0.5 at
    most as often, plus 1 point."""
    from seqcache.tasks.near_duplicates import jaccard

    rng = random.Random(11)
    lines = [" ".join(t.split()) for t in corpora.c4_texts().to_pylist()]
    pairs = []
    for i, text in enumerate(list(lines)):
        rate = RATES[i % len(RATES)]
        pairs.append((i, len(lines)))
        lines.append(" ".join(f"planted{rng.randrange(10**9)}" if rng.random() < rate else w for w in text.split()))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = build_task(_task(tmp_path / "in"), cache_dir=str(tmp_path / "c"), config=BuildConfig(num_shards=4))
    cached = collections.Counter(_texts(result.cache_dir))
    params = NearDuplicates()
    high, low = [], []
    for a, b in pairs:
        j = jaccard(lines[a], lines[b])
        # Removed: the cache holds fewer than the two (a planted copy may be identical: 0 words changed).
        held = cached[lines[a]] + cached[lines[b]] if lines[a] != lines[b] else cached[lines[a]]
        removed = held < 2
        if j >= 0.8:
            high.append((params.candidate_probability(j), removed))
        elif j <= 0.5:
            low.append((params.candidate_probability(j), removed))
    assert len(high) > 500 and len(low) > 500
    for name, group, slack in (("J >= 0.8", high, -0.02), ("J <= 0.5", low, 0.01)):
        predicted = float(np.mean([p for p, _ in group]))
        measured = float(np.mean([r for _, r in group]))
        if slack < 0:
            assert measured >= predicted + slack, (name, measured, predicted)
        else:
            assert measured <= predicted + slack, (name, measured, predicted)
