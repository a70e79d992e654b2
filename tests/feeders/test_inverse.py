"""Inverse lookups: where an example (or a source record) appears in a run.

Every answer is checked against forward enumeration: ``IndexStream.locate`` over
all positions of the steps looked at, and the batches ``Feeder.get_batch`` gives
each host, for plain caches, constant mixtures and a schedule whose rates change
mid-run, on 1, 2 and 4 hosts."""

import collections
import json
import os
import random

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from seqcache.cli.main import main
from seqcache.feeders import Feeder
from seqcache.feeders import inverse
from seqcache.feeders.mixing import MAX_POSITION, Mixer
from seqcache.feeders.schedule import Schedule

B = 16
SIZES = {"a": 1009, "b": 523, "c": 37}  # c runs through many epochs


def forward(stream, *, steps: int, b: int, host_count: int) -> dict:
    """{(task, cache index): [(epoch, step, row, host, host_row, position)]} over
    steps [0, steps), from ``IndexStream.locate`` (valid rows only)."""
    p = np.arange(steps * b, dtype=np.int64)
    loc = stream.locate(p)
    valid = loc.valid if stream.end_position is None else loc.valid & (p < stream.end_position)
    per = b // host_count
    out = collections.defaultdict(list)
    for pos, t, i, e in zip(p[valid].tolist(), loc.task[valid].tolist(), loc.cache_index[valid].tolist(),
                            loc.epoch[valid].tolist()):
        step, row = divmod(pos, b)
        out[(t, i)].append((e, step, row, row // per, row % per, pos))
    return out


def as_tuples(found: dict) -> list:
    return [(o["epoch"], o["step"], o["row"], o["host"], o["host_row"], o["position"]) for o in found["occurrences"]]


def _feeder_conftest():
    """tests/feeders/conftest.py as a module, for its cache writers in a
    module-scoped fixture (the ``fx`` fixture is per test)."""
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("_feeder_conftest", pathlib.Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    feeder_fixtures = _feeder_conftest()
    root = tmp_path_factory.mktemp("inverse")
    out = {}
    for name, n in SIZES.items():
        feeder_fixtures.write_fixture_cache(root / name, n=n, num_shards=3, length=4, task=name)
        out[name] = str(root / name)
    packed = root / "packed"
    feeder_fixtures.write_packed_cache(packed, n=40, sequence_length=12)
    out["packed"] = str(packed)
    return out


def schedule_of(caches):
    # The rates change at steps 9 and 40; c is left out of the first stage and b of the second.
    a, b, c = caches["a"], caches["b"], caches["c"]
    return {0: {a: 1, b: 2}, 9: {a: 3, c: 1}, 40: {a: 1, b: 1, c: 2}}


# --- the mixing's inverse --------------------------------------------------------


def test_beatty_split_closed_forms_against_enumeration():
    # The two closed forms of Mixer.position_of, one node at a time: the c-th
    # left and right local positions of a node with left weight a and total b.
    rng = random.Random(7)
    for _ in range(300):
        b = rng.randint(2, 60)
        a = rng.randint(1, b - 1)
        m = Mixer([a, b - a])  # one node: task 0 left, task 1 right
        lefts = [q for q in range(600) if (q + 1) * a // b > q * a // b]
        rights = [q for q in range(600) if (q + 1) * a // b == q * a // b]
        assert [m.position_of(0, c) for c in range(len(lefts))] == lefts
        assert [m.position_of(1, c) for c in range(len(rights))] == rights


@settings(max_examples=200, deadline=None)
@given(weights=st.lists(st.integers(1, 2**20), min_size=1, max_size=9),
       positions=st.lists(st.integers(0, MAX_POSITION - 1), min_size=1, max_size=20))
def test_mixer_position_of_inverts_locate_up_to_2_62(weights, positions):
    m = Mixer(weights)
    for p in positions:
        t, k = m.locate(p)
        assert m.position_of(t, k) == p
    task, ordinal = m.locate_many(np.array(positions, np.int64))
    assert [m.position_of(int(t), int(k)) for t, k in zip(task, ordinal)] == positions


def test_mixer_position_of_every_position_of_a_prefix():
    m = Mixer([5, 1, 3, 2, 7])
    task, ordinal = m.locate_many(np.arange(5000, dtype=np.int64))
    assert [m.position_of(int(t), int(k)) for t, k in zip(task, ordinal)] == list(range(5000))
    with pytest.raises(ValueError, match=r"task must be in \[0, 5\)"):
        m.position_of(5, 0)


def test_schedule_position_of_inverts_locate_across_changes():
    s = Schedule([(0, [1, 2, 0]), (50, [0, 3, 1]), (120, [5, 0, 2]), (300, [1, 1, 0])])
    task, ordinal = s.locate_many(np.arange(1000, dtype=np.int64))
    assert [s.position_of(int(t), int(k)) for t, k in zip(task, ordinal)] == list(range(1000))
    # Task 2 is not in the last stage: its ordinals end with stage [120, 300).
    last = s.bases[3][2]
    assert s.position_of(2, last - 1) is not None and s.position_of(2, last) is None
    # A stage starting near 10^12.
    far = Schedule([(0, [2, 1]), (10**12 + 3, [1, 4])])
    for p in (10**12 - 1, 10**12 + 3, 10**12 + 4, 2 * 10**12 + 12345):
        assert far.position_of(*far.locate(p)) == p


# --- against forward enumeration ---------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "mixture", "schedule"])
def test_every_example_matches_forward_enumeration(caches, kind):
    # Every example of every task, on 1, 2 and 4 hosts: the inverse of the whole
    # stream of 150 steps equals its forward enumeration (3 x 1569 examples).
    mixture = {"plain": None, "mixture": {caches["a"]: 2, caches["b"]: 1, caches["c"]: 1},
               "schedule": schedule_of(caches)}[kind]
    cache = caches["c"] if kind == "plain" else None
    steps = 150
    with Feeder(cache=cache, mixture=mixture, global_batch_size=B, sequence_length=4, host_index=0, host_count=1,
                seed=5, prefetch=0) as f:
        for hosts in (1, 2, 4):
            want = forward(f.stream, steps=steps, b=B, host_count=hosts)
            for t, n in enumerate(f.stream.sizes):
                for i in range(n):
                    (d,) = inverse.where(f.stream, f.paths, global_batch_size=B, host_count=hosts,
                                         until_step=steps, cache_index=i, task=t)
                    assert as_tuples(d) == want.get((t, i), []), (kind, hosts, t, i)
            assert sum(len(v) for v in want.values()) == steps * B


@pytest.fixture(scope="module")
def scheduled_forward(caches):
    """The scheduled run's forward map for steps [0, 120) on 1, 2 and 4 hosts."""
    f = Feeder(mixture=schedule_of(caches), global_batch_size=B, sequence_length=4, host_index=0, host_count=1,
               seed=11, prefetch=0)
    maps = {h: forward(f.stream, steps=120, b=B, host_count=h) for h in (1, 2, 4)}
    yield f, maps
    f.close()


@settings(max_examples=400, deadline=None, derandomize=True)
@given(data=st.data())
def test_random_examples_and_horizons_match_forward_enumeration(scheduled_forward, data):
    # Random (task, cache index, until_step, hosts): what the inverse reports is
    # exactly the forward map's occurrences in steps [0, until_step).
    f, maps = scheduled_forward
    t = data.draw(st.integers(0, 2))
    i = data.draw(st.integers(0, f.stream.sizes[t] - 1))
    until = data.draw(st.integers(0, 120))
    hosts = data.draw(st.sampled_from([1, 2, 4]))
    (d,) = inverse.where(f.stream, f.paths, global_batch_size=B, host_count=hosts, until_step=until,
                         cache_index=i, task=t)
    assert as_tuples(d) == [o for o in maps[hosts].get((t, i), []) if o[1] < until]


@pytest.mark.parametrize("hosts", [1, 2, 4])
def test_feeder_where_finds_the_row_in_each_hosts_batches(caches, hosts):
    # The batches every host reads (Feeder.get_batch) over a schedule change at
    # step 9: each (task, cache index, epoch) row is where Feeder.where says.
    steps = 30
    seen = {}
    for h in range(hosts):
        with Feeder(mixture=schedule_of(caches), global_batch_size=B, sequence_length=4, host_index=h,
                    host_count=hosts, seed=3, prefetch=0) as f:
            for s in range(steps):
                batch = f.get_batch(s)
                for r, (t, i, e) in enumerate(zip(batch["task_index"].tolist(), batch["cache_index"].tolist(),
                                                  batch["epoch"].tolist())):
                    seen.setdefault((t, i), []).append((e, s, h, r))
    assert sum(map(len, seen.values())) == steps * B
    with Feeder(mixture=schedule_of(caches), global_batch_size=B, sequence_length=4, host_index=0,
                host_count=hosts, seed=3, prefetch=0) as f:
        for (t, i), rows in seen.items():
            (d,) = f.where(cache_index=i, task=t, until_step=steps)
            got = [(o["epoch"], o["step"], o["host"], o["host_row"]) for o in d["occurrences"]]
            assert got == sorted(rows)
        # An example of c, which is read from step 9 on, is never before it.
        (d,) = f.where(cache_index=0, task=caches["c"], until_step=9)
        assert d["occurrences"] == [] and d["epochs_started"] == 0


def test_finite_run_reports_every_epoch_and_forever_needs_a_horizon(caches):
    mixture = {caches["b"]: 1, caches["c"]: 3}
    with Feeder(mixture=mixture, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, seed=2,
                num_epochs=3, prefetch=0) as f:
        want = forward(f.stream, steps=f.num_steps, b=B, host_count=1)
        for t, n in enumerate(f.stream.sizes):
            for i in range(n):
                (d,) = f.where(cache_index=i, task=t)
                assert [o["epoch"] for o in d["occurrences"]] == [0, 1, 2]
                assert as_tuples(d) == want[(t, i)]
    with Feeder(cache=caches["c"], global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        with pytest.raises(ValueError, match="repeats forever.*give until_step"):
            f.where(cache_index=3)
        with pytest.raises(ValueError, match=r"cache index must be in \[0, 37\)"):
            f.where(cache_index=37, until_step=5)
        assert f.where(cache_index=3, until_step=0)[0]["occurrences"] == []
    with Feeder(mixture=mixture, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        with pytest.raises(ValueError, match="mixes 2 caches: say which task"):
            f.where(cache_index=3, until_step=5)
        with pytest.raises(ValueError, match="no task 'nope'"):
            f.where(cache_index=3, task="nope", until_step=5)


def test_round_trip_near_position_10_12(caches):
    # Forward-locate positions around 10^12 (and a stage starting at step
    # 6.25 * 10^10, position 10^12), then invert: the same position comes back.
    a, b, c = caches["a"], caches["b"], caches["c"]
    far = 10**12 // B
    for mixture in ({a: 5, b: 2, c: 1}, {0: {a: 1, b: 1}, far: {a: 1, c: 3}}):
        with Feeder(mixture=mixture, global_batch_size=B, sequence_length=4, host_index=0, host_count=4,
                    seed=2**63 + 5, prefetch=0) as f:
            rng = random.Random(1)
            for p in [10**12 - 1, 10**12, 10**12 + 1] + [10**12 + rng.randrange(10**9) for _ in range(40)]:
                loc = f.stream.locate_one(p)
                t, i, e = loc["task"], loc["cache_index"], loc["epoch"]
                k, q = inverse.position_in_epoch(f.stream, task=t, cache_index=i, epoch=e)
                assert (k, q) == (loc["ordinal"], p)
                (d,) = f.where(cache_index=i, task=t, until_step=p // B + 1, epochs=[e, e + 1])
                (o,) = d["occurrences"]  # epoch e + 1 starts later
                assert (o["position"], o["step"], o["row"], o["host"], o["host_row"]) == (
                    p, p // B, p % B, (p % B) // 4, p % 4)
                # The batch itself: this host's row is that example.
                batch = f.get_batch(p // B) if o["host"] == 0 else None
                if batch is not None:
                    assert int(batch["cache_index"][o["host_row"]]) == i
        with pytest.raises(ValueError, match="epochs.*start before step"):
            with Feeder(cache=c, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
                f.where(cache_index=0, until_step=far)


# --- source locations ------------------------------------------------------------------


def test_source_records_of_fixture_caches(caches):
    with Feeder(mixture={caches["a"]: 1, caches["c"]: 1}, global_batch_size=B, sequence_length=4, host_index=0,
                host_count=2, seed=9, prefetch=0) as f:
        (d,) = f.where(source="corpus/c.txt:record=1005", until_step=50)
        assert (d["task"], d["cache_index"], d["segment"], d["record_number"]) == ("c", 5, 1, 1005)
        (e,) = f.where(cache_index=5, task="c", until_step=50)
        assert d["occurrences"] == e["occurrences"] and len(d["occurrences"]) >= 2
        assert f.where(source="corpus/c.txt:record=999", until_step=50) == []  # no such record
        with pytest.raises(ValueError, match="no cache of this run lists it as a source"):
            f.where(source="corpus/zzz.txt:record=3", until_step=5)
        with pytest.raises(ValueError, match="counted as 'record'.*FILE:record=N"):
            f.where(source="corpus/c.txt:12", until_step=5)
    with Feeder(cache=caches["packed"], global_batch_size=4, sequence_length=12, host_index=0, host_count=1,
                num_epochs=1) as f:
        # Record i holds segment 1 = record 2i of a.txt and segment 2 = record 2i+1 of b.txt (offset 5).
        (d,) = f.where(source="corpus/b.txt:record=15")
        assert (d["cache_index"], d["segment"], d["token_offset"]) == (7, 2, 5)
        (o,) = d["occurrences"]
        assert int(f.get_batch(o["step"])["cache_index"][o["row"]]) == 7


def test_parse_source():
    assert inverse.parse_source("/d/x.txt:12") == inverse.SourceLocation("/d/x.txt", "line", 12)
    assert inverse.parse_source("c:/x.parquet:row=0") == inverse.SourceLocation("c:/x.parquet", "row", 0)
    for bad in ("x.txt", "x.txt:0", "x.txt:page=3", "x.txt:-1", ":4"):
        with pytest.raises(ValueError, match="source location"):
            inverse.parse_source(bad)


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory, corpora, shakespeare_lm_cache):
    pytest.importorskip("seqcache.pipelines")
    root = shakespeare_lm_cache(tmp_path_factory, num_lines=400, sequence_length=48, num_shards=2)
    return str(root / "shakespeare_lm" / "train"), corpora.shakespeare_lines(400)


def test_source_line_of_real_text_agrees_with_trace(shakespeare):
    # A packed cache built from tinyshakespeare: FILE:LINE finds the examples
    # holding that line, and every step `trace` shows the line at is reported.
    cache, lines = shakespeare
    with Feeder(cache=cache, global_batch_size=8, sequence_length=48, host_index=0, host_count=2, seed=4,
                prefetch=0) as f:
        src = f.readers[0].sources[0]["path"]
        steps = 60
        table = f.trace(range(steps)).to_pydict()
        starts, offset = [], 0
        for line in lines:
            starts.append(offset)
            offset += len(line.encode("utf-8")) + 1
        checked = 0
        for number in (1, 2, 17, 100, 250, 399):
            want = sorted((s, r) for s, r, rec in zip(table["step"], table["row"], table["record_number"])
                          if rec == starts[number - 1])
            found = f.where(source=f"{src}:{number}", until_step=steps)
            by_name = f.where(source=f"play.txt:{number}", until_step=steps)  # the file's last path component
            assert found == by_name
            got = sorted((o["step"], o["row"]) for d in found for o in d["occurrences"])
            assert got == want and all(d["record_number"] == starts[number - 1] for d in found)
            checked += len(got)
        assert checked >= 6
        with pytest.raises(ValueError, match="fewer than 100000 lines"):
            f.where(source=f"{src}:100000", until_step=steps)


# --- the command line --------------------------------------------------------------------


def test_cli_example_and_source(caches, tmp_path):
    runner = CliRunner()
    c = caches["c"]
    with Feeder(cache=c, global_batch_size=B, sequence_length=4, host_index=0, host_count=2, seed=2) as f:
        (want,) = f.where(cache_index=11, until_step=20)
    args = ["which", c, "--example", "11", "--batch-size", str(B), "--seed", "2", "--until-step", "20",
            "--hosts", "2"]
    res = runner.invoke(main, args + ["--json"])
    assert res.exit_code == 0, res.output
    (d,) = json.loads(res.output)
    assert d["occurrences"] == want["occurrences"] and len(d["occurrences"]) == 8  # 320 rows, 37 examples
    res = runner.invoke(main, args)
    assert res.exit_code == 0, res.output
    o = want["occurrences"][2]
    assert (f"epoch 2: step {o['step']}, row {o['row']} (host {o['host']}, row {o['host_row']}), "
            f"global position {o['position']}") in res.output
    # --source over a mixture, and a saved state: until_step defaults to its step.
    res = runner.invoke(main, ["which", os.path.dirname(caches["a"]), "--mixture-rate", "a=1", "--mixture-rate", "c=2",
                               "--source", "corpus/c.txt:record=1011", "--batch-size", str(B), "--seed", "2",
                               "--until-step", "20", "--json"])
    assert res.exit_code == 0, res.output
    (s,) = json.loads(res.output)
    assert (s["task"], s["cache_index"]) == ("c", 11)
    with Feeder(mixture={caches["a"]: 1, caches["c"]: 2}, global_batch_size=B, sequence_length=4, host_index=0,
                host_count=1, seed=2, start_step=20) as f:
        state = f.state()
        (e,) = f.where(cache_index=11, task=1, until_step=20)
    assert s["occurrences"] == e["occurrences"]
    (tmp_path / "state.json").write_text(json.dumps(state))
    res = runner.invoke(main, ["which", str(tmp_path / "state.json"), "--example", "11", "--task", "c", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)[0]["occurrences"] == e["occurrences"]
    res = runner.invoke(main, ["which", c, "--example", "11", "--batch-size", str(B)])
    assert res.exit_code == 1 and "repeats forever" in res.output and "--until-step" in res.output
    res = runner.invoke(main, ["which", c, "--example", "1", "--step", "3", "--batch-size", str(B)])
    assert res.exit_code == 2 and "leave out --step" in res.output
    res = runner.invoke(main, ["which", c, "--example", "1", "--hosts", "3", "--until-step", "2",
                               "--batch-size", str(B)])
    assert res.exit_code == 2 and "--hosts 3 does not divide" in res.output


def test_inverse_each_is_the_inverse_of_each_epochs_permutation():
    from seqcache.feeders.permutation import epoch_permutation, inverse_each, round_keys, round_keys_many

    for n in (1, 2, 37, 1000, 1001, 2**40 + 7):  # square, not square, walked, large (no tables)
        epochs = [0, 1, 5, 10**9, 2**40]
        keys = round_keys_many(seed=2**64 - 1, task_key="fp", epochs=epochs)
        assert all(np.array_equal(keys[j], round_keys(seed=2**64 - 1, task_key="fp", epoch=e))
                   for j, e in enumerate(epochs))
        rng = np.random.default_rng(n % 1000)
        y = rng.integers(0, n, size=len(epochs), dtype=np.int64)
        got = inverse_each(n, keys, y)
        for j, e in enumerate(epochs):
            perm = epoch_permutation(n=n, seed=2**64 - 1, task_key="fp", epoch=e)
            assert int(got[j]) == int(perm.inverse(y[j:j + 1])[0])
            assert int(perm.permute(got[j:j + 1].astype(np.int64))[0]) == int(y[j])
