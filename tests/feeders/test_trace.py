"""Whole-step provenance (G6): ``Feeder.trace`` and ``seqcache which --steps``."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from seqcache.cli.main import main as cli
from seqcache.feeders import Feeder

B = 4


def _rows_of_which(f, steps):
    """The trace rows built from ``Feeder.which``, one (step, row) at a time."""
    out = []
    for s in steps:
        for r in range(B):
            w = f.which(s, r)
            if w["padding"]:
                out.append((s, r, True, w["task_index"], None, None, None, None))
                continue
            for seg in w["segments"]:
                out.append((s, r, False, w["task_index"], w["cache_index"], seg["segment"], seg["record_number"],
                            seg["token_offset"]))
    return out


def test_trace_agrees_with_which_on_every_row_of_a_scheduled_finite_mixture(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "a", n=30, task="a")
    fx.write_packed_cache(tmp_path / "p", n=20)
    a, p = str(tmp_path / "a"), str(tmp_path / "p")
    with Feeder(mixture={0: {a: 1, p: 1}, 3: {a: 3, p: 1}}, global_batch_size=B, sequence_length=12,
                host_index=0, host_count=2, num_epochs=1) as f:
        steps = range(f.num_steps)
        t = f.trace(steps, text=True)
        want = _rows_of_which(f, steps)
        whole = {(w["step"], w["row"], s["segment"]): (s["num_tokens"], s["source"], s["locator"])
                 for w in (f.which(st, r) for st in steps for r in range(B)) for s in w["segments"]}
    rows = t.to_pylist()
    got = [(x["step"], x["row"], x["padding"], x["task_index"], x["cache_index"], x["segment"], x["record_number"],
            x["token_offset"]) for x in rows]
    assert got == want  # every row of the global batch, not only this host's
    assert any(x["padding"] for x in rows) and {x["task"] for x in rows} == {"a", "packed"}
    for x in rows:
        if not x["padding"]:
            assert (x["num_tokens"], x["source"], x["locator"]) == whole[(x["step"], x["row"], x["segment"])]
    # Without text, only the provenance sidecars are read: no data shard is opened.
    with Feeder(cache=a, global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        t2 = f.trace(range(2, 5))
        assert f.readers[0]._data == [None] * len(f.readers[0]._data)
        assert t2.column("num_tokens").null_count == t2.num_rows
        ids = f.stream.locate(np.arange(2 * B, 5 * B)).cache_index
        assert t2.column("cache_index").to_pylist() == ids.tolist()
        assert t2.column("record_number").to_pylist() == (1000 + ids).tolist()


def test_trace_at_a_far_position_needs_no_replay(make_cache):
    path = make_cache(n=50)
    far = 10**12 // B
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1) as f:
        t = f.trace([far, far + 1])
        assert t.column("step").to_pylist() == [far] * B + [far + 1] * B
        assert t.column("cache_index").to_pylist() == [f.which(s, r)["cache_index"] for s in (far, far + 1)
                                                        for r in range(B)]
    with pytest.raises(ValueError, match="steps must be >= 0"):
        Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1).trace([-1])


def test_which_steps_writes_parquet_from_a_cache_and_from_a_saved_state(tmp_path, make_cache):
    path = make_cache(n=50)
    out = tmp_path / "rows.parquet"
    res = CliRunner().invoke(cli, ["which", path, "--steps", "3:6", "--batch-size", str(B), "--seed", "2",
                                   "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert "12 rows" in res.output
    with Feeder(cache=path, global_batch_size=B, sequence_length=4, host_index=0, host_count=1, seed=2) as f:
        want = f.trace(range(3, 6))
        f.step = 9
        state = f.state()
    got = pq.read_table(out)
    assert got.column("cache_index").to_pylist() == want.column("cache_index").to_pylist()
    assert got.column("source").to_pylist() == want.column("source").to_pylist()
    (tmp_path / "state.json").write_text(json.dumps(state))
    res = CliRunner().invoke(cli, ["which", str(tmp_path / "state.json"), "--steps", "3:6", "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert pq.read_table(out).column("cache_index").to_pylist() == want.column("cache_index").to_pylist()
    bad = CliRunner().invoke(cli, ["which", path, "--steps", "6:3", "--batch-size", str(B), "--output", str(out)])
    assert bad.exit_code == 2 and "--steps" in bad.output


def test_trace_of_steps_that_are_only_padding(tmp_path, fx):
    """A finite run's steps past its end hold only padding rows: one row of nulls
    each, as ``which`` reports them (a chunk without any segment)."""
    fx.write_fixture_cache(tmp_path / "a", n=6, task="a")
    with Feeder(cache=str(tmp_path / "a"), global_batch_size=B, sequence_length=8, host_index=0, host_count=1,
                num_epochs=1) as f:
        last = f.num_steps - 1
        t = f.trace([last + 1, last + 2], text=True)
        assert [f.which(s, r)["padding"] for s in (last + 1, last + 2) for r in range(B)] == [True] * (2 * B)
        mixed = f.trace([last, last + 1])
    rows = t.to_pylist()
    assert [(x["step"], x["row"], x["padding"]) for x in rows] == [(s, r, True) for s in (last + 1, last + 2)
                                                                   for r in range(B)]
    assert {x["segment"] for x in rows} == {None} and {x["cache_index"] for x in rows} == {None}
    assert {x["epoch"] for x in rows} == {None}  # the feeder's batches give padding rows epoch -1
    assert all(x["epoch"] is not None for x in mixed.to_pylist() if not x["padding"])
    kinds = [(x["step"], x["padding"]) for x in mixed.to_pylist()]
    assert (last, False) in kinds and (last + 1, True) in kinds
