"""Mixture schedules: rates that change at given steps, with exact accounting (G3, G4, G5)."""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest

from seqcache.feeders import Feeder, FeederStateError
from seqcache.feeders.mixing import Mixer
from seqcache.feeders.schedule import Schedule
from testsupport import batches_digest as _digest

B, L = 4, 4
CHANGE = 7  # the step at which the rates change


@pytest.fixture
def two(make_cache):
    return make_cache("a", n=30, num_shards=3, task="a"), make_cache("b", n=20, num_shards=2, task="b")


def _schedule(a, b):
    return {0: {a: 1, b: 1}, CHANGE: {a: 3, b: 1}}


def _feeder(mixture, **kw):
    kw.setdefault("host_index", 0)
    kw.setdefault("host_count", 1)
    return Feeder(mixture=mixture, global_batch_size=B, sequence_length=L, seed=5, **kw)


def test_ordinals_continue_across_a_change_and_every_example_is_read_once_per_epoch(two, fx):
    a, b = two
    steps = 60
    with _feeder(_schedule(a, b)) as f:
        loc = f.stream.locate(np.arange(steps * B))
        batches = [f.get_batch(s) for s in range(steps)]
    for t in (0, 1):
        k = loc.ordinal[loc.task == t]
        assert k.tolist() == list(range(k.size))  # nothing skipped or repeated, at the change or elsewhere
    # The rates did change: 1:1 before step 7, 3:1 after.
    before, after = loc.task[: CHANGE * B], loc.task[CHANGE * B:]
    assert (before == 0).sum() == (before == 1).sum() == CHANGE * B // 2
    assert abs((after == 0).sum() - 3 * (after == 1).sum()) <= 3
    seen = collections.defaultdict(list)
    for batch in batches:
        for t, e, i in zip(batch["task_index"], batch["epoch"], fx.example_ids(batch)):
            seen[(int(t), int(e))].append(int(i))
    sizes = {0: 30, 1: 20}
    complete = 0
    for (t, e), ids in seen.items():
        assert len(ids) == len(set(ids))  # never twice in one epoch
        if len(ids) == sizes[t]:
            assert sorted(ids) == list(range(sizes[t]))
            complete += 1
    assert complete >= 5


def test_a_finite_scheduled_run_reads_every_example_exactly_once(two, fx):
    a, b = two
    with _feeder(_schedule(a, b), num_epochs=1) as f:
        rows = [(int(t), int(i)) for batch in f for t, i in zip(batch["task_index"], fx.example_ids(batch)) if i >= 0]
    assert sorted(i for t, i in rows if t == 0) == list(range(30))
    assert sorted(i for t, i in rows if t == 1) == list(range(20))


def test_one_stage_at_step_zero_is_the_constant_mixture(two):
    a, b = two
    with _feeder({a: 2, b: 1}) as f, _feeder({0: {a: 2, b: 1}}) as g:
        assert _digest(f.get_batch(s) for s in range(20)) == _digest(g.get_batch(s) for s in range(20))


@pytest.mark.parametrize("weights", [[(1, 1), (3, 1)], [(2, 3, 5), (5, 0, 1), (1, 1, 1), (0, 7, 2)]])
def test_prefix_bound_inside_each_stage(weights):
    starts = [0, 1013, 5000, 5001][: len(weights)]
    sched = Schedule(list(zip(starts, weights)))
    ends = starts[1:] + [starts[-1] + 4000]
    for j, (lo, hi) in enumerate(zip(starts, ends)):
        ws = weights[j]
        total = sum(ws)
        counts = np.zeros(len(ws), np.int64)
        task, _ = sched.locate_many(np.arange(lo, hi))
        for q, t in enumerate(task.tolist(), start=1):
            counts[t] += 1
            for u, w in enumerate(ws):
                d = sched.depth(u, j)
                if w == 0:
                    assert counts[u] == 0
                else:
                    assert abs(counts[u] - q * w / total) < max(d, 1e-9) or (d == 0 and counts[u] == q)


def test_random_access_is_consistent_at_far_positions():
    sched = Schedule([(0, (1, 1, 0)), (10**6, (3, 1, 0)), (10**12, (1, 2, 5))])
    p = np.array([0, 1, 10**6 - 1, 10**6, 10**6 + 1, 10**12 - 1, 10**12, 10**12 + 12345, 2**61], np.int64)
    task, ordinal = sched.locate_many(p)
    for pos, t, k in zip(p.tolist(), task.tolist(), ordinal.tolist()):
        assert sched.locate(pos) == (t, k)
        assert sched.count_before(t, pos) == k  # the ordinal counts the earlier positions of its task
        assert sched.first_position_with_count(t, k + 1) == pos + 1 or sched.locate(
            sched.first_position_with_count(t, k + 1) - 1) == (t, k)
    # A task that first appears at 10^12 starts at ordinal 0.
    assert sched.locate(10**12 + int(np.flatnonzero(sched.locate_many(10**12 + np.arange(8))[0] == 2)[0]))[1] == 0
    with pytest.raises(ValueError, match="first stage of a schedule starts at position 0"):
        Schedule([(5, (1,))])


def test_elastic_host_counts_across_a_change(two):
    a, b = two
    steps = range(CHANGE - 3, CHANGE + 4)
    digests = set()
    for hosts in (1, 2, 4):
        fs = [_feeder(_schedule(a, b), host_index=h, host_count=hosts) for h in range(hosts)]
        glob = []
        for s in steps:
            parts = [f.get_batch(s) for f in fs]
            glob.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
        digests.add(_digest(glob))
        for f in fs:
            f.close()
    assert len(digests) == 1


def test_resume_at_just_before_and_just_after_a_change_in_a_fresh_process(two, restore_fresh):
    a, b = two
    after = 3
    resume = [CHANGE - 1, CHANGE, CHANGE + 1]
    with _feeder(_schedule(a, b)) as f:
        batches, states = [], {}
        for s in range(max(resume) + after):
            if s in resume:
                states[s] = json.loads(json.dumps(f.state()))
            batches.append(next(f))
    assert all(st["version"] == 2 and len(st["schedule"]) == 2 for st in states.values())
    want = [_digest(batches[s:s + after]) for s in resume]
    for hosts in (1, 2, 4):
        results = restore_fresh([states[s] for s in resume], host_count=hosts, steps=after)
        assert [r["digest"] for r in results] == want, hosts


def test_a_running_job_extends_its_schedule_at_restore(two, make_cache):
    a, b = two
    c = make_cache("c", n=12, num_shards=2, task="c")
    with _feeder({a: 1, b: 1}) as f:  # a constant mixture: the schedule is added at restore
        f.step = 10
        saved = json.loads(json.dumps(f.state()))
        plain = [f.get_batch(s) for s in range(10, 16)]
    longer = {0: {a: 1, b: 1}, 12: {a: 1, b: 1, c: 2}}
    with Feeder.restore(saved, mixture=longer, host_index=0, host_count=1) as g:
        assert g.step == 10
        got = [g.get_batch(s) for s in range(10, 16)]
        state = g.state()
        loc = g.stream.locate(np.arange(12 * B, 16 * B))
    # Before the new stage nothing changed; after it, the new task is read from ordinal 0.
    assert _digest(got[:2]) == _digest(plain[:2]) and _digest(got[2:]) != _digest(plain[2:])
    k = loc.ordinal[loc.task == 2]
    assert k.tolist() == list(range(k.size)) and k.size > 0
    # The state records the whole schedule, and a fresh restore from it continues it.
    assert state["version"] == 2 and [st["step"] for st in state["schedule"]] == [0, 12]
    assert state["schedule"][1]["rates"] == [1.0, 1.0, 2.0] and len(state["mixture"]) == 3
    with Feeder.restore(json.loads(json.dumps(state)), host_index=0, host_count=1) as h:
        assert _digest(h.get_batch(s) for s in range(10, 16)) == _digest(got)
    # Appending another stage after the saved step, and a stage at the saved step itself, are accepted.
    for extra in ({0: {a: 1, b: 1}, 12: {a: 1, b: 1, c: 2}, 40: {c: 1}}, {0: {a: 1, b: 1}, 10: {a: 5, b: 1}}):
        Feeder.restore(saved, mixture=extra, host_index=0, host_count=1).close()


def test_rewriting_the_past_is_refused_naming_the_step(two, make_cache):
    a, b = two
    c = make_cache("c", n=12, num_shards=2, task="c")
    with _feeder(_schedule(a, b)) as f:
        f.step = 10
        saved = json.loads(json.dumps(f.state()))
    cases = {
        "a stage moved": ({0: {a: 1, b: 1}, 6: {a: 3, b: 1}}, "rewrites the past at step 6"),
        "past rates changed": ({0: {a: 1, b: 1}, CHANGE: {a: 2, b: 1}}, f"rewrites the past at step {CHANGE}"),
        "a stage inserted": ({0: {a: 1, b: 1}, 3: {a: 1, b: 2}, CHANGE: {a: 3, b: 1}}, "rewrites the past at step 3"),
        "a stage removed": ({0: {a: 1, b: 1}}, f"rewrites the past at step {CHANGE}"),
        "a new task in the past": ({0: {a: 1, b: 1}, CHANGE: {a: 3, b: 1, c: 1}}, f"rewrites the past at step {CHANGE}"),
        "a task removed": ({0: {a: 1}}, "a schedule can add caches, not remove them"),
    }
    for what, (mixture, match) in cases.items():
        with pytest.raises(FeederStateError, match=match):
            Feeder.restore(saved, mixture=mixture, host_index=0, host_count=1)
    with pytest.raises(FeederStateError, match="the state is at step 10"):
        Feeder.restore(saved, mixture={0: {a: 1, b: 1}, 6: {a: 3, b: 1}}, host_index=0, host_count=1)


def test_schedule_arguments_are_checked(two):
    a, b = two
    with pytest.raises(ValueError, match="starts at step 0"):
        _feeder({5: {a: 1}})
    with pytest.raises(ValueError, match="step 3: every rate is 0"):
        _feeder({0: {a: 1}, 3: {a: 0}})
    with pytest.raises(ValueError, match="not read in the last stage"):
        _feeder({0: {a: 1, b: 1}, 3: {a: 1}}, num_epochs=1)


def test_which_with_a_mixture_schedule_file_and_from_a_scheduled_state(two, tmp_path):
    from click.testing import CliRunner

    from seqcache.cli.main import main as cli

    a, b = two
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps({"0": {"a": 1, "b": 1}, str(CHANGE): {"a": 3, "b": 1}}))
    root = str(tmp_path)
    with _feeder(_schedule(a, b)) as f:
        want = [f.which(s, r)["cache_index"] for s in (CHANGE - 1, CHANGE, CHANGE + 1) for r in range(B)]
        f.step = 20
        (tmp_path / "state.json").write_text(json.dumps(f.state()))
    for target, extra in ((root, ["--mixture-schedule", str(sched), "--batch-size", str(B), "--seed", "5"]),
                          (str(tmp_path / "state.json"), [])):
        got = []
        for s in (CHANGE - 1, CHANGE, CHANGE + 1):
            for r in range(B):
                res = CliRunner().invoke(cli, ["which", target, "--step", str(s), "--row", str(r), "--json",
                                               "--no-tokens", *extra])
                assert res.exit_code == 0, res.output
                got.append(json.loads(res.output)["cache_index"])
        assert got == want, target


def test_a_task_mixture_with_a_schedule_is_the_same_stream_as_its_cache_schedule(tmp_path, fx):
    from seqcache.tasks import Mixture, rate_num_examples

    root = tmp_path / "caches"
    fx.write_fixture_cache(root / "a" / "train", n=30, num_shards=3, task="a")
    fx.write_fixture_cache(root / "b" / "train", n=20, num_shards=2, task="b")
    fx.write_fixture_cache(root / "c" / "train", n=10, num_shards=1, task="c")
    # c starts at step 9 (rate 0 before); b's rate follows its example count (20).
    mix = Mixture("m", [("a", 1.0), ("b", rate_num_examples()), ("c", 0.0)],
                  schedule={CHANGE: {"a": 3, "b": 1}, 9: {"a": 1, "c": 1}})
    assert mix.get_schedule({"a": 30, "b": 20, "c": 10}) == {
        0: {"a": 1.0, "b": 20.0, "c": 0.0}, CHANGE: {"a": 3.0, "b": 1.0, "c": 0.0}, 9: {"a": 1.0, "b": 0.0, "c": 1.0}}
    a, b, c = (str(root / t / "train") for t in "abc")
    with _feeder(mix, caches_root=root) as f, _feeder({0: {a: 1, b: 20}, CHANGE: {a: 3, b: 1}, 9: {a: 1, c: 1}}) as g:
        assert f.mixture_name == "m" and f.paths == [a, b, c]
        assert _digest(f.get_batch(s) for s in range(14)) == _digest(g.get_batch(s) for s in range(14))
        assert f.state()["schedule"] == g.state()["schedule"]
        assert {int(t) for s in range(9, 14) for t in f.get_batch(s)["task_index"]} == {0, 2}
    with pytest.raises(ValueError, match="names task 'd', which is not in the mixture"):
        Mixture("m", [("a", 1.0)], schedule={5: {"d": 1}})
    with pytest.raises(ValueError, match="schedule steps are integers >= 1"):
        Mixture("m", [("a", 1.0)], schedule={0: {"a": 1}})
    assert Mixture("m", [("a", 1.0)], schedule={5: {"a": 2}}).fingerprint() != Mixture("m", [("a", 1.0)]).fingerprint()
