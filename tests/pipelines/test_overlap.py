"""seqcache overlap: benchmark items planted into C4 documents are all found, the
ones below the threshold are not, nothing else is reported (NTREX against C4),
and the first read of each overlapping example agrees with the run's forward
order (the Feeder's batches and ``trace``)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from seqcache import tasks
from seqcache.cli.main import main
from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import overlap as ov
from seqcache.tasks.contamination import Benchmark, normalize_words
from testsupport import byte_task

N = 13
DOCS = 300
SEED, BATCH = 5, 8


def _long_items(lines, count):
    """The first ``count`` NTREX lines of at least 25 words whose 13-grams no
    other line shares (so that a planted copy overlaps that item alone)."""
    grams: dict[tuple, set] = {}
    for i, line in enumerate(lines):
        w = normalize_words(line)
        for k in range(len(w) - N + 1):
            grams.setdefault(tuple(w[k:k + N]), set()).add(i)
    out = []
    for i, line in enumerate(lines):
        w = normalize_words(line)
        if len(w) >= 25 and all(grams[tuple(w[k:k + N])] == {i} for k in range(len(w) - N + 1)):
            out.append(i)
        if len(out) == count:
            return out
    raise AssertionError("NTREX has too few long unique lines")


def _plant(docs, lines):
    """Plants NTREX items into C4 documents. Returns (docs, planted above the
    threshold {row: item}, planted below it {row: item})."""
    a = _long_items(lines, 8)
    w = {i: normalize_words(lines[i]) for i in a}  # partial copies count normalised words
    above = {3: a[0], 251: a[0], 50: a[1],  # exact copies, one item twice
             77: a[2], 120: a[3],  # case and whitespace changed
             150: a[4], 200: a[5]}  # partial: exactly n words, and 20 words
    below = {210: a[6], 260: a[7]}  # partial: n - 1 words, and 6 words
    inserts = {3: lines[a[0]], 251: lines[a[0]], 50: lines[a[1]],
               77: lines[a[2]].upper().replace(" ", " \n\t  "), 120: "  ".join(lines[a[3]].lower().split()),
               150: " ".join(w[a[4]][4:4 + N]), 200: " ".join(w[a[5]][:20]),
               210: " ".join(w[a[6]][3:3 + N - 1]), 260: " ".join(w[a[7]][:6])}
    docs = list(docs)
    for row, text in inserts.items():
        cut = len(docs[row]) // 2
        cut = docs[row].rfind(" ", 0, cut) + 1  # between two words of the document
        docs[row] = docs[row][:cut] + " zqx " + text + " zqy " + docs[row][cut:]
    return docs, above, below


def _oracle(docs, bench):
    """{(item, row)} by the rule itself, on sets of word tuples: an item of at
    least n words overlaps a document that shares an n-gram with it; a shorter
    one of at least min_words words, one that holds all its words in a row."""
    doc_grams = {}
    for row, doc in enumerate(docs):
        w = normalize_words(doc)
        for k in range(N, bench.min_words - 1, -1):
            for j in range(len(w) - k + 1):
                doc_grams.setdefault(tuple(w[j:j + k]), set()).add(row)
    out = set()
    for item in bench.items:
        w = normalize_words(item.text)
        k = min(N, len(w))
        if k < bench.min_words:
            continue
        for j in range(len(w) - k + 1):
            out |= {(item.number, row) for row in doc_grams.get(tuple(w[j:j + k]), ())}
    return out


@pytest.fixture(scope="module")
def planted(tmp_path_factory, corpora):
    """A 2-shard byte-level cache of 300 C4 documents with NTREX items planted,
    the benchmark spec (the whole NTREX English file) and what was planted."""
    folder = tmp_path_factory.mktemp("planted")
    lines = (corpora.ntrex / "newstest2019-src.eng.txt").read_text(encoding="utf-8").splitlines()
    docs, above, below = _plant(corpora.c4_texts(DOCS).to_pylist(), lines)
    pq.write_table(pa.table({"text": docs}), folder / "c4.parquet")
    task = byte_task("c4_planted", tasks.ParquetSource(str(folder / "c4.parquet"), column="text"))
    result = build_task(task, cache_dir=str(folder / "caches"), config=BuildConfig(num_shards=2))
    spec = f"text:{corpora.ntrex / 'newstest2019-src.eng.txt'}"
    return {"cache": result.cache_dir, "spec": spec, "docs": docs, "above": above, "below": below,
            "folder": folder}


def _scan(cache, spec, *, stream_args=None, unit_examples=None, pipeline_args=None, before_step=None):
    from seqcache.feeders.stream import open_mixture

    bench = Benchmark.load(spec)
    opened = open_mixture(cache=cache) if isinstance(cache, str) else open_mixture(mixture=cache)
    try:
        stream = run = None
        if stream_args:
            stream = opened.stream(seed=stream_args["seed"], num_epochs=None,
                                   global_batch_size=stream_args["global_batch_size"])
            run = dict(stream_args, hosts=stream_args.get("hosts", 1))
        return bench, ov.find_overlap(bench, opened, stream=stream, run=run, before_step=before_step,
                                      unit_examples=unit_examples, pipeline_args=pipeline_args)
    finally:
        opened.close()


def _row_of(match):
    assert match["locator"] == "row"
    return match["record_number"]


def test_every_planted_item_is_found_and_nothing_else(planted):
    bench, result = _scan(planted["cache"], planted["spec"])
    found = {(it["item"], _row_of(m)) for it in result["items"] for m in it["matches"]}
    # Recall on what was planted above the threshold: 100%.
    assert {(item, row) for row, item in planted["above"].items()} <= found
    # Below the threshold: not reported; and no other pair than the rule's (no false positive).
    assert not {item for item in planted["below"].values()} & {item for item, _ in found}
    assert found == _oracle(planted["docs"], bench) == {(item, row) for row, item in planted["above"].items()}
    s = result["summary"]
    assert s["items"] == len(bench.items) and s["items_with_overlap"] == len(set(planted["above"].values())) == 6
    assert s["overlapping_examples"] == len(planted["above"]) and s["scanned"]["examples"] == DOCS
    assert s["items_seen"] is None and result["run"] is None


def test_a_match_names_its_span_source_and_item(planted):
    bench, result = _scan(planted["cache"], planted["spec"])
    lines = (planted["spec"][len("text:"):])
    for it in result["items"]:
        item = bench.items[it["item"]]
        assert it["text"] == item.text and it["source"] == lines and it["location"] == f"line {it['item'] + 1:,}" \
            f" (byte {item.record_number:,})"
        for m in it["matches"]:
            assert m["source"] == str(planted["folder"] / "c4.parquet") and m["location"] == f"row {_row_of(m)}"
            assert m["feature"] == "targets" and m["segment"] == 1 and m["token_offset"] == 0
            # The span is that text of the document; its words are the matched words.
            doc = planted["docs"][_row_of(m)]
            assert m["span"] in doc and m["span"].startswith(m["span"].lstrip())
            words = normalize_words(m["span"])
            assert " ".join(words) in " ".join(normalize_words(item.text))
            assert len(words) >= N and m["ngrams"] == len(words) - N + 1
    by_row = {_row_of(m): m for it in result["items"] for m in it["matches"]}
    assert normalize_words(by_row[77]["span"]) == normalize_words(bench.items[planted["above"][77]].text)
    assert len(normalize_words(by_row[150]["span"])) == N and by_row[150]["ngrams"] == 1


def test_first_reads_agree_with_the_feeder_and_trace(planted):
    from seqcache.feeders import Feeder
    from seqcache.feeders.provenance import trace_rows

    steps = -(-DOCS // BATCH) + 1  # all of epoch 0 and the start of epoch 1
    first: dict[int, int] = {}
    with Feeder(cache=planted["cache"], global_batch_size=BATCH, sequence_length=64, seed=SEED) as f:
        for step in range(steps):
            for i in f.get_batch(step)["cache_index"].tolist():
                first.setdefault(int(i), step)
    table = trace_rows(cache=planted["cache"], global_batch_size=BATCH, steps=range(steps), seed=SEED)
    by_trace: dict[int, int] = {}
    for step, i in zip(table.column("step").to_pylist(), table.column("cache_index").to_pylist()):
        by_trace.setdefault(i, step)
    assert by_trace == first and len(first) == DOCS
    _, result = _scan(planted["cache"], planted["spec"], stream_args={"seed": SEED, "global_batch_size": BATCH})
    item_steps = {}
    for it in result["items"]:
        for m in it["matches"]:
            assert m["first_seen"]["step"] == first[m["cache_index"]]
            assert m["first_seen"]["epoch"] == 0 and m["first_seen"]["row"] == m["first_seen"]["host_row"]
        item_steps[it["item"]] = min(first[m["cache_index"]] for m in it["matches"])
        assert it["first_seen"]["step"] == item_steps[it["item"]]
    assert result["summary"]["items_seen"] == result["summary"]["items_with_overlap"] == len(item_steps)
    # N = the last item's first step (the permutation's key depends on the
    # cache's fingerprint, so on this build): the count is tested both ways.
    before = max(item_steps.values())
    _, result = _scan(planted["cache"], planted["spec"], stream_args={"seed": SEED, "global_batch_size": BATCH},
                      before_step=before)
    s = result["summary"]
    assert s["before_step"] == before
    assert s["items_seen_before_step"] == sum(1 for step in item_steps.values() if step < before)
    assert 0 < s["items_seen_before_step"] < len(item_steps)


def test_the_result_is_the_same_bytes_however_the_work_is_cut(planted):
    args = {"stream_args": {"seed": SEED, "global_batch_size": BATCH}, "before_step": 10}
    _, whole = _scan(planted["cache"], planted["spec"], **args)
    _, cut = _scan(planted["cache"], planted["spec"], unit_examples=7, **args)
    assert ov.to_json_bytes(whole) == ov.to_json_bytes(cut)


def test_parquet_output_holds_the_matches_and_the_summary(planted, tmp_path):
    _, result = _scan(planted["cache"], planted["spec"], stream_args={"seed": SEED, "global_batch_size": BATCH})
    ov.write_result(result, str(tmp_path / "o.parquet"))
    ov.write_result(result, str(tmp_path / "o.json"))
    table = pq.read_table(tmp_path / "o.parquet")
    assert table.num_rows == result["summary"]["matches"] == sum(len(it["matches"]) for it in result["items"])
    assert table.column_names == list(ov.PARQUET_COLUMNS)
    rows = table.to_pylist()
    assert [(r["item"], r["cache_index"], r["step"]) for r in rows] == [
        (it["item"], m["cache_index"], m["first_seen"]["step"]) for it in result["items"] for m in it["matches"]]
    # Read back, either file is the result.
    assert ov.read_result(str(tmp_path / "o.parquet")) == result == ov.read_result(str(tmp_path / "o.json"))
    with pytest.raises(ValueError, match="not an overlap result"):
        pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
        ov.read_result(str(tmp_path / "other.parquet"))


def test_cli_with_a_state_and_a_mixture(planted, tmp_path):
    from seqcache.feeders import Feeder

    second = tmp_path / "second.txt"
    item = planted["docs"][50]  # a document with a planted item, as a second task's line
    second.write_text("short line\n" + " ".join(item.split()) + "\nanother line\n", encoding="utf-8")
    runner = CliRunner()
    res = runner.invoke(main, ["build", "--source", f"text:{second}", "--name", "second",
                               "--cache-dir", str(tmp_path / "caches")])
    assert res.exit_code == 0, res.output
    second_cache = str(tmp_path / "caches" / "second" / "train")
    mixture = {planted["cache"]: 3.0, second_cache: 1.0}
    with Feeder(mixture=mixture, global_batch_size=BATCH, sequence_length=64, seed=2) as f:
        first: dict[tuple, int] = {}
        for step in range(60):
            b = f.get_batch(step)
            for t, i in zip(b["task_index"].tolist(), b["cache_index"].tolist()):
                first.setdefault((t, i), step)
        f.get_batch(12)
        state = f.state()
    (tmp_path / "state.json").write_text(json.dumps(state))
    out = tmp_path / "o.json"
    res = runner.invoke(main, ["overlap", planted["spec"], str(tmp_path / "state.json"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert [c["task"] for c in result["caches"]] == ["c4_planted", "second"]
    assert result["run"]["state_step"] == result["summary"]["before_step"] == state["position"] // BATCH
    in_second = [m for it in result["items"] for m in it["matches"] if m["task_index"] == 1]
    assert [m["cache_index"] for m in in_second] and all(m["location"] == "line 2 (byte 11)" for m in in_second)
    for it in result["items"]:
        for m in it["matches"]:
            assert m["first_seen"]["step"] == first[(m["task_index"], m["cache_index"])]
    # The same run by its rates, seed and batch: the same result but for the run's description.
    res = runner.invoke(main, ["overlap", planted["spec"], "/", "--mixture-rate", f"{planted['cache']}=3",
                               "--mixture-rate", f"{second_cache}=1", "--seed", "2", "--batch-size", str(BATCH),
                               "--before-step", str(result["summary"]["before_step"]), "-o", str(tmp_path / "r.json")])
    assert res.exit_code == 0, res.output
    by_rates = json.loads((tmp_path / "r.json").read_text())
    assert by_rates["items"] == result["items"] and by_rates["summary"] == result["summary"]


def test_cli_refuses_what_it_cannot_do(planted, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["overlap", planted["spec"], planted["cache"], "-o", str(tmp_path / "o.csv")])
    assert res.exit_code == 2 and "the output is a .json or a .parquet file" in res.output
    res = runner.invoke(main, ["overlap", planted["spec"], planted["cache"], "-o", str(tmp_path / "o.json"),
                               "--before-step", "3"])
    assert res.exit_code == 2 and "give --batch-size or --state too" in res.output
    res = runner.invoke(main, ["overlap", f"text:{tmp_path}/none*.txt", planted["cache"], "-o",
                               str(tmp_path / "o.json")])
    assert res.exit_code == 1 and "benchmark text:" in res.output
    res = runner.invoke(main, ["overlap", planted["spec"], planted["cache"], "-o", str(tmp_path / "o.json"),
                               "--runnr=dask"])
    assert res.exit_code == 2 and "no such option: --runnr=dask" in res.output
    res = runner.invoke(main, ["overlap", planted["spec"], planted["cache"], "-o", str(tmp_path / "o.json"),
                               "--workers", "2", "--direct_num_workers=3"])
    assert res.exit_code == 2 and "give --workers N or Beam's --direct_num_workers" in res.output


def test_cli_never_overwrites_what_it_reads(planted, tmp_path):
    # Copies: a refusal that failed would overwrite them.
    cache = tmp_path / "cache"
    shutil.copytree(planted["cache"], cache)
    lines = (pathlib.Path(planted["spec"][len("text:"):])).read_text(encoding="utf-8").splitlines()[:50]
    pq.write_table(pa.table({"text": lines}), tmp_path / "b.parquet")
    spec = f"parquet:{tmp_path / 'b.parquet'}#text"
    before = {p: p.read_bytes() for p in [tmp_path / "b.parquet", *sorted(cache.rglob("*"))] if p.is_file()}
    runner = CliRunner()
    for output, why in ((cache / "manifest.json", "inside the scanned cache"),
                        (cache / "new" / "o.json", "inside the scanned cache"),
                        (tmp_path / "b.parquet", "a file of the benchmark")):
        res = runner.invoke(main, ["overlap", spec, str(cache), "-o", str(output)])
        assert res.exit_code == 2, res.output
        assert len(res.output.strip().splitlines()) == 1 and str(output) in res.output and why in res.output
    assert {p: p.read_bytes() for p in before} == before and not (cache / "new").exists()
    # An upper-case suffix is the same output kind.
    res = runner.invoke(main, ["overlap", spec, str(cache), "-o", str(tmp_path / "o.JSON")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "o.JSON").read_text())["summary"]["items"] == 50
    res = runner.invoke(main, ["overlap", spec, str(cache), "-o", str(tmp_path / "o.PARQUET")])
    assert res.exit_code == 0, res.output
    assert ov.read_result(str(tmp_path / "o.PARQUET"))["summary"]["items"] == 50
    # A folder that cannot be written: the error names the output, not a scratch file.
    if os.path.isdir("/proc/self"):
        res = runner.invoke(main, ["overlap", spec, str(cache), "-o", "/proc/overlap-result.json"])
        assert res.exit_code == 1 and "cannot write --output /proc/overlap-result.json" in res.output
        assert ".overlap-" not in res.output


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_damaged_shard_is_one_line_under_any_number_of_workers(planted, tmp_path, workers):
    cache = tmp_path / "cache"
    shutil.copytree(planted["cache"], cache)
    (data,) = cache.glob("data.array_record-00000-of-*")
    with open(data, "r+b") as f:
        f.seek(100_000)
        f.write(bytes(5000))
    res = CliRunner().invoke(main, ["overlap", planted["spec"], str(cache), "-o", str(tmp_path / "o.json"),
                                    "--workers", workers])
    assert res.exit_code == 1
    (line,) = res.output.strip().splitlines()
    assert line.startswith(f"error: {data}: cannot read records ") and "run `seqcache verify" in line
    assert "Traceback" not in line and "[while running" not in line


def test_report_shows_the_overlap_section(planted, tmp_path):
    runner = CliRunner()
    out = tmp_path / "o.parquet"
    res = runner.invoke(main, ["overlap", planted["spec"], planted["cache"], "-o", str(out), "--batch-size",
                               str(BATCH), "--seed", str(SEED), "--before-step", "20"])
    assert res.exit_code == 0, res.output
    result = ov.read_result(str(out))
    res = runner.invoke(main, ["report", planted["cache"], "--overlap", str(out), "--json"])
    assert res.exit_code == 0, res.output
    (section,) = json.loads(res.output)["overlap"]
    assert section["summary"] == result["summary"] and section["problem"] is None
    assert section["first_reads"] == sorted(it["first_seen"]["step"] for it in result["items"])
    assert [r["first_seen"]["step"] for r in section["items"]] == section["first_reads"]
    row = section["items"][0]
    assert row["first_match"]["location"].startswith("row ") and row["first_match"]["span"]
    res = runner.invoke(main, ["report", planted["cache"], "--overlap", str(out), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 0, res.output
    page = (tmp_path / "r.html").read_text()
    assert f"<h2>Benchmark overlap: {planted['spec']}</h2>" in page
    assert page.count("<tr><td class=\"num\">") >= len(result["items"])
    # A result computed on other caches is flagged.
    other = dict(result, caches=[dict(c, fingerprint="0" * 64) for c in result["caches"]])
    from seqcache.cli import report as report_lib

    flagged = report_lib.build_report(caches=[planted["cache"]], overlaps=[other])["overlap"][0]
    assert flagged["problem"].startswith("computed on caches other than this report's")


def test_collect_refuses_a_scan_that_lost_work(tmp_path):
    with pytest.raises(RuntimeError, match="done.json is missing; the scan lost work"):
        ov.collect(str(tmp_path), 2)
    (tmp_path / ov.DONE_NAME).write_text(json.dumps({"units": [0, 2]}))
    with pytest.raises(RuntimeError, match="2 of 3 work units reported; the runner lost work"):
        ov.collect(str(tmp_path), 3)
    counts = {"examples": 1, "segments": 1, "tokens": 5, "characters": 5}
    match = dict.fromkeys(ov.MATCH_KEYS, 0)
    for unit, item in ((0, 4), (1, 2)):
        (tmp_path / f"unit-{unit:07d}.json").write_text(json.dumps({"counts": counts, "matches": [
            dict(match, item=item)]}))
    (tmp_path / ov.DONE_NAME).write_text(json.dumps({"units": [0, 1]}))
    matches, total = ov.collect(str(tmp_path), 2)
    assert [m["item"] for m in matches] == [2, 4] and total["tokens"] == 10


def test_first_reads_across_a_schedule_change_agree_with_trace(planted, tmp_path):
    from seqcache.feeders.provenance import trace_rows
    from seqcache.feeders.stream import open_mixture

    second = tmp_path / "second.txt"
    second.write_text("".join(" ".join(planted["docs"][row].split()) + "\n" for row in (3, 50, 77)), encoding="utf-8")
    res = CliRunner().invoke(main, ["build", "--source", f"text:{second}", "--name", "second",
                                    "--cache-dir", str(tmp_path / "caches")])
    assert res.exit_code == 0, res.output
    second_cache = str(tmp_path / "caches" / "second" / "train")
    # The second task joins at step 4: its examples are first read after the change.
    schedule = {0: {planted["cache"]: 1.0}, 4: {planted["cache"]: 1.0, second_cache: 2.0}}
    # 140 steps: all of the first task's epoch 0 (about 4 + 268 * 3 / 8 steps).
    table = trace_rows(mixture=schedule, global_batch_size=BATCH, steps=range(140), seed=1)
    first: dict[tuple, int] = {}
    for step, t, i in zip(*(table.column(c).to_pylist() for c in ("step", "task_index", "cache_index"))):
        first.setdefault((t, i), step)
    bench = Benchmark.load(planted["spec"])
    opened = open_mixture(mixture=schedule)
    try:
        stream = opened.stream(seed=1, num_epochs=None, global_batch_size=BATCH)
        result = ov.find_overlap(bench, opened, stream=stream, run={"global_batch_size": BATCH, "hosts": 2})
    finally:
        opened.close()
    in_second = [m for it in result["items"] for m in it["matches"] if m["task_index"] == 1]
    assert len(in_second) == 3
    for it in result["items"]:
        for m in it["matches"]:
            seen = m["first_seen"]
            assert seen["step"] == first[(m["task_index"], m["cache_index"])]
            assert seen["host"] == seen["row"] // (BATCH // 2) and seen["host_row"] == seen["row"] % (BATCH // 2)
    assert min(m["first_seen"]["step"] for m in in_second) >= 4
