"""Feeder state (G4, G5): O(1) exact resume in a fresh process, elastic restore, refusals."""

import json
import re

import pytest

from seqcache.feeders import Feeder, FeederStateError
from seqcache.feeders import state as state_lib
from testsupport import batches_digest as _digest

N, B = 60, 4  # one epoch = 15 steps exactly


def test_state_is_small_json(make_cache):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, seed=3) as f:
        for _ in zip(range(5), f):
            pass
        state = f.state()
    assert json.loads(json.dumps(state)) == state
    assert len(json.dumps(state)) < 1024
    assert state["position"] == 5 * B
    assert state["seed"] == 3 and state["global_batch_size"] == B and state["num_epochs"] is None
    assert state["sequence_length"] == {"targets": 4} and state["version"] == 1 and state["cache_format_version"] == 1
    assert [(e["path"], e["rate"]) for e in state["mixture"]] == [(path, 1.0)]
    assert state["mixture"][0]["num_examples"] == N and len(state["mixture"][0]["fingerprint"]) == 64


def test_resume_in_a_fresh_process_with_other_host_counts(make_cache, restore_fresh):
    path = make_cache(n=N, num_shards=3, length=lambda i: 1 + i % 6)
    steps_after = 3
    # Steps: 0, 1, mid-epoch, one before the epoch boundary, exactly at it, one after.
    resume_steps = [0, 1, 7, 14, 15, 16]
    kw = dict(cache=path, global_batch_size=B, sequence_length=5, seed=2)
    # The uninterrupted run, on one host; the state saved after consuming s batches.
    with Feeder(**kw, host_index=0, host_count=1) as f:
        batches, states = [], {}
        for s in range(max(resume_steps) + steps_after):
            if s in resume_steps:
                states[s] = f.state()
            batches.append(next(f))
    far = 10**12 // B  # position 10^12
    with Feeder(**kw, host_index=0, host_count=1, start_step=far) as f:
        states[far] = f.state()
        assert states[far]["position"] == 10**12
        far_batches = [next(f) for _ in range(steps_after)]
    ordered = resume_steps + [far]
    for host_count in (2, 4):
        results = restore_fresh([states[s] for s in ordered], host_count=host_count, steps=steps_after)
        assert len(results) == len(ordered)
        for s, res in zip(ordered, results):
            want = far_batches if s == far else batches[s: s + steps_after]
            assert res["digest"] == _digest(want), (s, host_count)
            assert res["position"] == (s + steps_after) * B


def test_a_state_with_an_int_sequence_length_restores_in_a_fresh_process(make_cache, restore_fresh):
    """States written before the sequence length became {feature: L} hold an int
    L: one restores as the state of today, into a fresh process, and gives the
    same batches; every reader of a state sees the mapping."""
    path = make_cache(n=N, num_shards=3, length=lambda i: 1 + i % 6)
    with Feeder(cache=path, global_batch_size=B, sequence_length=5, seed=2, host_index=0, host_count=1,
                start_step=7) as f:
        assert f.sequence_length == {"targets": 5}
        state = f.state()
        want = [next(f) for _ in range(3)]
    old = dict(state, sequence_length=5)
    assert state_lib.read_state(old) == state and old["sequence_length"] == 5  # a copy: the caller's is kept
    for host_count in (1, 2):
        (res,) = restore_fresh([old], host_count=host_count, steps=3)
        assert res["digest"] == _digest(want) and res["position"] == 10 * B
        assert res["state"]["sequence_length"] == {"targets": 5}
    with Feeder.restore(old, host_index=0, host_count=1, sequence_length=5) as g:
        assert g.sequence_length == {"targets": 5} and g.step == 7
        g.set_state(old)
    with pytest.raises(FeederStateError, match="state has sequence_length=5, but this run has sequence_length=4 "
                                               "for feature 'targets'"):
        Feeder.restore(old, host_index=0, host_count=1, sequence_length={"targets": 4})


def test_a_state_s_sequence_length_is_that_of_its_feature(make_cache):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    for bad in ({"targets": 4, "inputs": 4}, {}):
        with pytest.raises(FeederStateError, match=re.escape("expected {'targets': L}, the length of the state's")):
            Feeder.restore(dict(state, sequence_length=bad), host_index=0, host_count=1)
    with pytest.raises(FeederStateError, match="no sequence length for feature 'targets'"):  # the length is not
        Feeder.restore(dict(state, sequence_length={"inputs": 4}), host_index=0, host_count=1)  # targets'
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        with pytest.raises(FeederStateError, match=re.escape('state has sequence_length={"inputs": 4}, but this '
                                                             'run has sequence_length={"targets": 4}')):
            f.set_state(dict(state, sequence_length={"inputs": 4}))


def test_resume_at_the_far_position_costs_what_position_zero_costs(make_cache):
    # O(1): restoring at 10^12 performs the same index arithmetic as at 0 -- no
    # replay. Counted, not timed: the number of records read equals B either way.
    path = make_cache(n=N)
    for position in (0, 10**12):
        with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1,
                    start_step=position // B, prefetch=0) as f:
            calls = []
            reader = f.readers[0]
            original = reader._read_sorted  # every batched read (read, read_sorted) goes through it
            reader._read_sorted = lambda table, names, idx: calls.append(len(idx)) or original(table, names, idx)
            b = next(f)
            assert sum(calls) == B
            assert (b["epoch"] == position // N).all()


def test_restore_refuses_a_rebuilt_cache(make_cache):
    path = make_cache("c", n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    old = state["mixture"][0]["fingerprint"]
    make_cache("c", n=N, tag="rebuilt")  # same folder, new content
    with pytest.raises(FeederStateError) as e:
        Feeder.restore(state, host_index=0, host_count=1)
    msg = str(e.value)
    assert old in msg and path in msg and "rebuilt" in msg
    assert "fingerprint" in msg and msg.count("fingerprint ") >= 2


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"seed": 1}, "state has seed=0, but this run has seed=1"),
        # The global batch names both values and why it cannot change.
        ({"global_batch_size": 8}, r"state was saved with global batch size 4, this run has global_batch_size=8; "
                                   r"a global position is step \* B"),
        ({"sequence_length": 16}, "state has sequence_length=4, but this run has sequence_length=16"),
        ({"num_epochs": 2}, "state has num_epochs=null, but this run has num_epochs=2"),
    ],
)
def test_restore_refuses_another_configuration(make_cache, kwargs, message):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    with pytest.raises(FeederStateError, match=message):
        Feeder.restore(state, host_index=0, host_count=1, **kwargs)


def test_restore_refuses_another_mixture(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "a", n=10, task="a")
    fx.write_fixture_cache(tmp_path / "b", n=10, task="b")
    mixture = {str(tmp_path / "a"): 2.0, str(tmp_path / "b"): 1.0}
    with Feeder(mixture=mixture, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    changed = {str(tmp_path / "a"): 1.0, str(tmp_path / "b"): 1.0}
    rate_msg = f"saved with rate 2.0 for the cache at {tmp_path / 'a'} (mixture entry 0), but this run has rate 1.0"
    with pytest.raises(FeederStateError, match=re.escape(rate_msg)):
        Feeder.restore(state, host_index=0, host_count=1, mixture=changed)
    with Feeder(mixture=changed, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as g:
        with pytest.raises(FeederStateError, match=re.escape(rate_msg)):
            g.set_state(state)
    swapped = {str(tmp_path / "b"): 1.0, str(tmp_path / "a"): 2.0}
    with pytest.raises(FeederStateError, match="in another order"):
        Feeder.restore(state, host_index=0, host_count=1, mixture=swapped)
    with pytest.raises(FeederStateError, match=r"mixture of 2 cache\(s\).*this run reads 1"):
        Feeder.restore(state, host_index=0, host_count=1, cache=str(tmp_path / "a"))
    restored = Feeder.restore(state, host_index=0, host_count=1, mixture=mixture)
    restored.close()


def test_state_names_caches_by_absolute_path(tmp_path, monkeypatch, fx):
    fx.write_fixture_cache(tmp_path / "c", n=N)
    monkeypatch.chdir(tmp_path)
    with Feeder(cache="c", global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        assert f.state()["mixture"][0]["path"] == str(tmp_path / "c")


def test_restore_onto_moved_caches_matched_by_fingerprint(tmp_path, monkeypatch, fx):
    # A run started with relative cache paths, resumed from another working
    # directory, with absolute paths, and after the caches were moved: the caches
    # are the state's (same fingerprints), so the stream continues unchanged.
    fx.write_fixture_cache(tmp_path / "caches" / "a", n=N, task="a")
    fx.write_fixture_cache(tmp_path / "caches" / "b", n=17, task="b")
    monkeypatch.chdir(tmp_path)
    relative = {"caches/a": 2.0, "caches/b": 1.0}
    with Feeder(mixture=relative, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        f.step = 5
        state = f.state()
        want = _digest([f.get_batch(5), f.get_batch(6)])
    # A state written with the relative paths (as earlier releases did).
    old_style = json.loads(json.dumps(state))
    for entry, path in zip(old_style["mixture"], relative):
        entry["path"] = path
    absolute = {str(tmp_path / p): r for p, r in relative.items()}
    for s in (state, old_style):
        with Feeder.restore(s, host_index=0, host_count=1, mixture=absolute) as g:
            assert g.step == 5 and _digest([next(g), next(g)]) == want
    (tmp_path / "moved").mkdir()
    (tmp_path / "caches").rename(tmp_path / "moved" / "caches")
    monkeypatch.chdir(tmp_path / "moved")
    with pytest.raises(Exception, match="pass their current locations with cache= or mixture="):
        Feeder.restore(state, host_index=0, host_count=1)
    moved = [(str(tmp_path / "moved" / p), r) for p, r in relative.items()]
    with Feeder.restore(state, host_index=0, host_count=1, mixture=moved) as g:
        assert _digest([next(g), next(g)]) == want
        assert [e["path"] for e in g.state()["mixture"]] == [p for p, _ in moved]
    with Feeder.restore(old_style, host_index=0, host_count=1) as g:  # relative to the new directory
        assert _digest([next(g), next(g)]) == want


def test_restore_onto_a_rebuilt_cache_at_another_path_names_both_fingerprints(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "old", n=N)
    with Feeder(cache=str(tmp_path / "old"), global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    new = fx.write_fixture_cache(tmp_path / "new", n=N, tag="rebuilt")
    with pytest.raises(FeederStateError) as e:
        Feeder.restore(state, host_index=0, host_count=1, cache=str(tmp_path / "new"))
    msg = str(e.value)
    old_fp = state["mixture"][0]["fingerprint"]
    assert msg.startswith(f"the cache at {tmp_path / 'new'} was rebuilt (fingerprint {new.fingerprint}, the state was "
                          f"saved with fingerprint {old_fp} at {tmp_path / 'old'})")
    assert "'path'" not in msg and "mixture=" not in msg


def test_set_state_checks_the_feeder_configuration(make_cache):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        f.step = 9
        state = f.state()
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, seed=5) as g:
        with pytest.raises(FeederStateError, match="seed=0, but this run has seed=5"):
            g.set_state(state)
    with Feeder(cache=path, global_batch_size=2 * B, sequence_length=4, host_index=0, host_count=1) as g:
        with pytest.raises(FeederStateError, match=f"saved with global batch size {B}, this run has global_batch_size={2 * B}"):
            g.set_state(state)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=1, host_count=2) as g:
        g.set_state(state)  # another host count is fine (G5)
        assert g.step == 9


def test_restore_refuses_a_host_count_that_does_not_divide_the_batch(make_cache):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    # The global batch cannot change on restore: the message lists the host counts
    # that work instead of suggesting another global batch.
    for hosts in (3, 8):
        with pytest.raises(FeederStateError) as e:
            Feeder.restore(state, host_index=0, host_count=hosts)
        msg = str(e.value)
        assert f"saved with global_batch_size={B}, which host_count={hosts} does not divide" in msg
        assert msg.endswith(f"restore on a host count that divides {B}: 1, 2, 4") and "multiple of" not in msg


def test_host_counts_that_divide_a_large_global_batch():
    from seqcache.feeders.feeder import divisors, host_counts_for

    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert host_counts_for(12, 5) == "1, 2, 3, 4, 6, 12"
    assert host_counts_for(1536, 100) == "1, 2, 3, 4, 6, 8, 12, 16, ..., 1536 (nearest to 100: 96, 128)"
    assert host_counts_for(1536, 5) == "1, 2, 3, 4, 6, 8, 12, 16, ..., 1536"


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("version", 2, "feeder state version is 2"),
        ("cache_format_version", 2, "cache format version 2"),
        ("kind", "grain", "not a feeder state"),
        ("position", 5, "multiple of global_batch_size"),
    ],
)
def test_malformed_or_foreign_states_are_refused(make_cache, field, value, match):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = f.state()
    state[field] = value
    with pytest.raises(FeederStateError, match=match):
        Feeder.restore(state, host_index=0, host_count=1)


def _refusals(state, path, **feeder):
    """The errors restoring ``state`` raises: ``Feeder.restore`` at the stored
    paths and with ``cache=``, and ``set_state`` on a feeder of ``path``
    built with ``feeder``'s arguments."""
    errors = []
    for restore in (lambda: Feeder.restore(state, host_index=0, host_count=1),
                    lambda: Feeder.restore(state, cache=path, host_index=0, host_count=1)):
        with pytest.raises(Exception) as e:
            restore().close()
        errors.append(e.value)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, **feeder) as g:
        with pytest.raises(Exception) as e:
            g.set_state(state)
        errors.append(e.value)
        assert g.step == 0  # a refused state leaves the feeder where it was
    return errors


def test_a_feature_the_cache_lacks_is_a_feeder_state_error(make_cache):
    path = make_cache(n=N)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        state = dict(f.state(), feature="")
    restore, moved, set_state = _refusals(state, path)
    for e in (restore, moved):
        assert type(e) is FeederStateError, repr(e)
        assert "the cache has no feature ''" in str(e) and path in str(e)
    # set_state compares first: the feeder has another feature than the state.
    assert type(set_state) is FeederStateError and 'feeder state has feature="", but this run has feature="targets"' \
        in str(set_state)


def test_a_position_past_the_end_of_a_finite_run_is_a_feeder_state_error(make_cache):
    path = make_cache(n=N)  # one epoch = 15 steps: the run ends at step 15 (position 60)
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, num_epochs=1) as f:
        state = f.state()
    at_end = dict(state, position=15 * B)
    with Feeder.restore(at_end, host_index=0, host_count=1) as f:
        assert f.step == 15 and f.num_steps == 15 and list(f) == []  # the end itself: the position after the last batch
    for position in (16 * B, 10**12 * B):
        errors = _refusals(dict(state, position=position), path, num_epochs=1)
        for e in errors:
            assert type(e) is FeederStateError, repr(e)
            assert str(e).startswith(f"feeder state has position={position} (global_batch_size={B}): step "
                                     f"{position // B} is past the end of this finite run: 1 epoch(s) take 15 steps")


def test_a_checkpoint_step_without_its_feeder_state_says_which_part_is_missing(tmp_path):
    step = tmp_path / "6"
    step.mkdir()
    with pytest.raises(FeederStateError) as e:
        state_lib.load_checkpoint_state(str(step))
    assert str(e.value) == (f"checkpoint step 6: {step / 'feeder' / 'metadata'}: no feeder state here (the "
                            "checkpoint was saved without its 'feeder' item)")
    (step / "feeder").mkdir()
    with pytest.raises(FeederStateError) as e:
        state_lib.load_checkpoint_state(str(step))
    assert str(e.value).endswith("no feeder state here (its 'feeder' item has no state file)")
