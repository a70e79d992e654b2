"""seqcache.feeders.trainers.torch: the Feeder's global stream as a Stateful PyTorch loader.

The rows a loader serves are the Feeder's rows (by cache index), its state is
the Feeder's JSON, and a state saved on one rank resumes on other world sizes in
a fresh process, in a plain loop, with torchdata's StatefulDataLoader and in a
real two-rank gloo training loop that checkpoints with torch.distributed.checkpoint.

PyTorch is not in the default suite's venv (PyPI's torch wheel for Linux is a
CUDA build of several GB): ``make test-trainers`` runs this module in the
torchtitan venv, which has torch and torchdata (tests/trainers/torchtitan/run.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="runs in make test-trainers' torchtitan venv, which installs PyTorch")
pytest.importorskip("torchdata", reason="runs in make test-trainers' torchtitan venv, which installs torchdata")
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from seqcache.feeders import Feeder, FeederStateError
from seqcache.feeders.trainers.torch import (IGNORE_INDEX, MICROBATCH_KEY, PLAIN_LOADER_ERROR, STATE_KEY, FeederDataset,
                                    FeederLoader, dataset_state_of, next_token_labels, torchtitan_global_batch_size)

B, L = 8, 12


@pytest.fixture
def packed(tmp_path, fx):
    path = tmp_path / "packed"
    fx.write_packed_cache(path, n=37, sequence_length=L, num_shards=3)
    return str(path)


def args(cache, **kw):
    return dict(cache=cache, global_batch_size=B, sequence_length=L, seed=3, num_threads=1, **kw)


def take(loader, n):
    """The first n microbatches of a loader: (inputs, positions, labels) as numpy."""
    out = []
    for _, (inputs, labels) in zip(range(n), loader):
        out.append((inputs["input"].numpy(), inputs["positions"].numpy(), labels.numpy()))
    return out


def test_next_token_labels_stay_inside_segments():
    tokens = np.array([[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 5, 6]])
    seg = np.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1]])
    weights = np.array([[1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], np.float32)  # second row: a padding row
    labels = next_token_labels(tokens, seg, weights)
    assert labels.dtype == np.int64
    assert labels.tolist() == [[6, 7, -100, 9, -100, -100], [-100] * 6]
    assert IGNORE_INDEX == -100


@pytest.mark.parametrize("world_size,local_batch_size", [(1, 8), (1, 4), (2, 2), (4, 2)])
def test_rows_are_the_feeders_rows(packed, world_size, local_batch_size):
    """Every microbatch of every rank holds the Feeder's rows of that step, in
    row order: the same cache indices, tokens, positions and next-token labels."""
    served = []
    loaders = [FeederLoader(**args(packed), rank=r, world_size=world_size, local_batch_size=local_batch_size,
                            on_rows=served.append) for r in range(world_size)]
    per_step = B // world_size // local_batch_size
    got = [take(lo, 5 * per_step) for lo in loaders]
    with Feeder(cache=packed, global_batch_size=B, sequence_length=L, seed=3, host_count=1, host_index=0) as f:
        for step in range(5):
            want = f.get_batch(step)
            mbs = [got[r][step * per_step + m] for r in range(world_size) for m in range(per_step)]
            assert np.array_equal(np.concatenate([m[0] for m in mbs]), want["targets"])
            assert np.array_equal(np.concatenate([m[1] for m in mbs]), want["targets_positions"])
            assert np.array_equal(np.concatenate([m[2] for m in mbs]),
                                  next_token_labels(want["targets"], want["targets_segment_ids"],
                                                    want["targets_loss_weights"]))
            rows = sorted((s for s in served if s["step"] == step), key=lambda s: (s["rank"], s["microbatch"]))
            assert np.array_equal(np.concatenate([s["cache_index"] for s in rows]), want["cache_index"])
    assert all(lo.step == 5 for lo in loaders)
    for lo in loaders:
        lo.close()


def test_a_loader_is_stateful_and_its_state_is_the_feeders_json(packed):
    with FeederLoader(**args(packed)) as loader:
        assert isinstance(loader, Stateful)
        take(loader, 3)
        sd = loader.state_dict()
        assert json.loads(json.dumps(sd)) == sd  # plain JSON types only
        assert sd[MICROBATCH_KEY] == 0
        state = json.loads(sd[STATE_KEY])
        assert state["position"] == 3 * B
        assert state == loader.feeder.state()


# Runs in a fresh interpreter: loads a saved state into one loader per rank of
# the given world size and prints, per step, the cache indices of the whole
# global batch and the microbatches' bytes (ranks concatenated in order).
RESUME_CHILD = r"""
import json, sys
import numpy as np
from seqcache.feeders.trainers.torch import FeederLoader
req = json.load(sys.stdin)
results = []
for world_size in req["world_sizes"]:
    rows = []
    loaders = [FeederLoader(**req["args"], rank=r, world_size=world_size, on_rows=rows.append)
               for r in range(world_size)]
    for lo in loaders:
        lo.load_state_dict(req["state"])
    its = [iter(lo) for lo in loaders]
    out = []
    for _ in range(req["steps"]):
        parts = [next(it) for it in its]
        out.append({"input": np.concatenate([p[0]["input"].numpy() for p in parts]).tolist(),
                    "labels": np.concatenate([p[1].numpy() for p in parts]).tolist()})
    steps = sorted({r["step"] for r in rows})
    index = [np.concatenate([r["cache_index"] for r in sorted(rows, key=lambda r: r["rank"]) if r["step"] == s])
             .tolist() for s in steps]
    results.append({"batches": out, "cache_index": index, "steps": steps, "state": loaders[0].state_dict()})
    for lo in loaders:
        lo.close()
json.dump(results, sys.stdout)
"""


def resume_in_fresh_process(state, loader_args, *, world_sizes, steps):
    """Per world size: the steps read, their global batches and cache indices,
    and rank 0's state after them, from loaders restored in a new process."""
    proc = subprocess.run([sys.executable, "-c", RESUME_CHILD], capture_output=True, text=True, timeout=180,
                          input=json.dumps({"state": state, "args": loader_args, "world_sizes": world_sizes,
                                            "steps": steps}))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_resume_in_a_fresh_process_on_other_world_sizes(packed):
    """A state saved at step k on 1 rank (one microbatch per step), passed
    through JSON, restores in a fresh process on 2 and on 4 ranks: the global
    batches from step k on are the uninterrupted run's, byte for byte."""
    k, n = 4, 3
    with Feeder(cache=packed, global_batch_size=B, sequence_length=L, seed=3, host_index=0, host_count=1) as f:
        want = [f.get_batch(s) for s in range(k, k + n)]
    with FeederLoader(**args(packed), rank=0, world_size=1) as loader:
        take(loader, k)
        state = json.loads(json.dumps(loader.state_dict()))
    for got in resume_in_fresh_process(state, args(packed), world_sizes=[2, 4], steps=n):
        assert got["steps"] == list(range(k, k + n))
        for s in range(n):
            assert got["cache_index"][s] == want[s]["cache_index"].tolist()
            assert got["batches"][s]["input"] == want[s]["targets"].tolist()
            assert got["batches"][s]["labels"] == next_token_labels(
                want[s]["targets"], want[s]["targets_segment_ids"], want[s]["targets_loss_weights"]).tolist()
        assert json.loads(got["state"][STATE_KEY])["position"] == (k + n) * B


def test_a_state_saved_between_microbatches_continues_on_the_same_slicing_only(packed):
    with FeederLoader(**args(packed), local_batch_size=4) as loader:
        want = take(loader, 5)
    with FeederLoader(**args(packed), local_batch_size=4) as loader:
        take(loader, 3)  # steps 0 and half of step 1
        sd = loader.state_dict()
    assert sd[MICROBATCH_KEY] == 1 and json.loads(sd[STATE_KEY])["position"] == B
    with FeederLoader(**args(packed), local_batch_size=4) as again:
        again.load_state_dict(sd)
        rest = take(again, 2)
    for a, b in zip(rest, want[3:]):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with FeederLoader(**args(packed), rank=0, world_size=2, local_batch_size=4) as other:
        with pytest.raises(FeederStateError, match="saved after microbatch 1 of a step, with world_size=1"):
            other.load_state_dict(sd)


@pytest.mark.parametrize("microbatch,saved_slicing", [(2, (1, 4)), (5, (1, 4)), (2, (2, 2)), (9, (2, 4))])
def test_a_microbatch_outside_the_step_is_refused_with_its_range(packed, microbatch, saved_slicing):
    """B = 8 rows in microbatches of b over R ranks: B / (R * b) microbatches
    per step; microbatches_served names one of them, or the state is refused."""
    world_size, local_batch_size = saved_slicing
    per_step = B // (world_size * local_batch_size)
    with FeederLoader(**args(packed), local_batch_size=4) as loader:
        take(loader, 3)
        sd = {**loader.state_dict(), MICROBATCH_KEY: microbatch, "world_size": world_size,
              "local_batch_size": local_batch_size}
    with FeederLoader(**args(packed), local_batch_size=4) as again:
        with pytest.raises(FeederStateError) as e:
            again.load_state_dict(sd)
        assert str(e.value) == (
            f"dataloader state: microbatches_served = {microbatch}, expected an integer in [0, {per_step}) "
            f"(global_batch_size=8 over world_size={world_size} in microbatches of "
            f"local_batch_size={local_batch_size}: {per_step} per step); the state was edited or is not this loader's")
        assert again.step == 0  # nothing moved


@pytest.mark.parametrize("change,match", [({"seed": 4}, "seed"), ({"global_batch_size": 4}, "global_batch_size")])
def test_a_state_of_another_stream_is_refused(packed, change, match):
    with FeederLoader(**args(packed)) as loader:
        take(loader, 2)
        sd = loader.state_dict()
    with FeederLoader(**{**args(packed), **change}) as other:
        with pytest.raises(FeederStateError, match=match):
            other.load_state_dict(sd)


@pytest.mark.parametrize("sd,match", [
    ({"dp_rank_0": b"x", "world_size": 1}, "no 'seqcache_feeder_state'"),
    ({STATE_KEY: "{", MICROBATCH_KEY: 0}, "not valid JSON"),
    ({STATE_KEY: 7, MICROBATCH_KEY: 0}, "expected JSON text"),
])
def test_foreign_or_malformed_states_are_refused(packed, sd, match):
    with FeederLoader(**args(packed)) as loader:
        with pytest.raises(FeederStateError, match=match):
            loader.load_state_dict(sd)
        loader.load_state_dict({})  # torchtitan's "no data state": nothing changes
        assert loader.step == 0


def test_bad_slicing_is_refused(packed):
    with pytest.raises(ValueError, match="host_count=3"):
        FeederLoader(**args(packed), rank=0, world_size=3)
    with pytest.raises(ValueError, match="local_batch_size=3 does not divide the 4 rows per rank"):
        FeederLoader(**args(packed), rank=0, world_size=2, local_batch_size=3)


def test_rank_and_world_size_come_from_torch_distributed(packed, tmp_path, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with FeederLoader(**args(packed)) as loader:
            assert (loader.rank, loader.world_size) == (0, 1)
        with FeederLoader(**args(packed), rank=1, world_size=2) as loader:  # arguments win
            assert (loader.rank, loader.world_size, loader.feeder.host_index) == (1, 2, 1)
    finally:
        dist.destroy_process_group()


def test_stateful_dataloader_carries_the_feeders_state(packed):
    """torchdata's StatefulDataLoader over FeederDataset: its state_dict holds the
    Feeder's JSON under "dataset_state", and a new loader restored from it (in
    another world size) continues the stream."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with Feeder(cache=packed, global_batch_size=B, sequence_length=L, seed=3, host_index=0, host_count=1) as f:
        want = [f.get_batch(s)["targets"] for s in range(5)]
    ds = FeederDataset(**args(packed))
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    it = iter(dl)
    for s in range(2):
        inputs, labels = next(it)
        assert inputs["input"].dtype == torch.int64 and labels.shape == (B, L)
        assert np.array_equal(inputs["input"].numpy(), want[s])
    sd = json.loads(json.dumps(dl.state_dict()))
    assert json.loads(sd["dataset_state"][STATE_KEY])["position"] == 2 * B
    ds.close()
    halves = []
    for rank in range(2):
        ds2 = FeederDataset(**args(packed), rank=rank, world_size=2)
        dl2 = StatefulDataLoader(ds2, batch_size=None, num_workers=0)
        dl2.load_state_dict(sd)
        halves.append([inputs["input"].numpy() for _, (inputs, _) in zip(range(3), dl2)])
        ds2.close()
    for s in range(3):
        assert np.array_equal(np.concatenate([halves[0][s], halves[1][s]]), want[2 + s])


def loader_items(loader, n=None):
    """The first n items of a loader (all when n is None): (inputs, positions, labels) as numpy."""
    out = []
    for inputs, labels in loader:
        out.append((inputs["input"].numpy(), inputs["positions"].numpy(), labels.numpy()))
        if len(out) == n:
            break
    return out


def rank_rows(cache, *, global_batch_size, rank, world_size, local_batch_size):
    """This rank's microbatches of the whole finite epoch, from the Feeder itself:
    (tokens, positions, next-token labels) as numpy."""
    out = []
    with Feeder(cache=cache, global_batch_size=global_batch_size, sequence_length=L, seed=3, num_epochs=1,
                host_index=rank, host_count=world_size) as f:
        for step in range(f.num_steps):
            batch = f.get_batch(step)
            for m in range(f.rows_per_host // local_batch_size):
                rows = slice(m * local_batch_size, (m + 1) * local_batch_size)
                out.append((batch["targets"][rows], batch["targets_positions"][rows],
                            next_token_labels(batch["targets"][rows], batch["targets_segment_ids"][rows],
                                              batch["targets_loss_weights"][rows])))
    return out


def assert_same_items(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert all(np.array_equal(a, b) for a, b in zip(g, w))


# 3 workers: a stride that does not divide the 2 microbatches per step (torch warns
# that 3 workers exceed the 2 cores of CI's machines).
@pytest.mark.parametrize("num_workers", [0, 1, 2, pytest.param(3, marks=pytest.mark.filterwarnings(
    "ignore:This DataLoader will create 3 worker processes"))])
def test_stateful_dataloader_workers_serve_the_feeders_order(packed, num_workers):
    """With W worker processes, worker w makes microbatches w, w + W, ... and
    torchdata fetches from the workers in turn: every item of rank 1 of 2
    (two microbatches of 2 rows per step) is the Feeder's, in the order of
    num_workers=0, over the whole finite epoch, and the loader's state after it
    is the end of the epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    slicing = dict(rank=1, world_size=2, local_batch_size=2)
    want = rank_rows(packed, global_batch_size=B, **slicing)
    assert len(want) == 10  # 37 examples, B = 8: 5 steps of 2 microbatches
    ds = FeederDataset(**args(packed), num_epochs=1, **slicing)
    try:
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=num_workers)
        assert_same_items(loader_items(loader), want)
        state = json.loads(json.dumps(dataset_state_of(loader.state_dict())))
        assert (json.loads(state[STATE_KEY])["position"], state[MICROBATCH_KEY]) == (5 * B, 0)
    finally:
        ds.close()


# Runs in a fresh interpreter: builds one StatefulDataLoader of 1 worker per rank
# of 3 over a FeederDataset restored from a saved loader state (of 2 workers),
# reads every rank to the end of the epoch and prints, per step, the tokens of
# the whole global batch (ranks concatenated in order).
WORKERS_RESUME_CHILD = r"""
import json, sys
import numpy as np
from torchdata.stateful_dataloader import StatefulDataLoader
from seqcache.feeders.trainers.torch import FeederDataset
req = json.load(sys.stdin)
per_rank = []
for rank in range(3):
    ds = FeederDataset(**req["args"], rank=rank, world_size=3)
    ds.load_state_dict(req["state"])
    per_rank.append([inputs["input"].numpy() for inputs, _ in StatefulDataLoader(ds, batch_size=None, num_workers=1)])
    ds.close()
assert len({len(r) for r in per_rank}) == 1, [len(r) for r in per_rank]
print(json.dumps([np.concatenate(parts).tolist() for parts in zip(*per_rank)]))
"""


def test_two_ranks_of_two_workers_resume_on_three_ranks_of_one_worker_exactly_once(packed):
    """2 ranks x 2 workers read k steps of a finite epoch (B = 6) and save their
    loaders' states (the same position on both ranks); a fresh process restores
    rank 0's, passed through JSON, into 3 ranks x 1 worker and reads to the end:
    the first run's steps then the resumed run's are the Feeder's epoch, step by
    step, every example exactly once. torchdata's own restore into as many
    workers continues the same way."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    b6, k = 6, 3
    with Feeder(cache=packed, global_batch_size=b6, sequence_length=L, seed=3, num_epochs=1, host_index=0,
                host_count=1) as f:
        epoch = [f.get_batch(s) for s in range(f.num_steps)]
    assert len(epoch) == 7
    ids = np.concatenate([b["cache_index"] for b in epoch])
    assert sorted(ids[ids >= 0].tolist()) == list(range(37))  # the epoch holds every example once
    run_args = {**args(packed), "global_batch_size": b6, "num_epochs": 1}
    datasets = [FeederDataset(**run_args, rank=r, world_size=2) for r in range(2)]
    loaders = [StatefulDataLoader(ds, batch_size=None, num_workers=2) for ds in datasets]
    first = [loader_items(lo, k) for lo in loaders]
    states = [json.loads(json.dumps(lo.state_dict())) for lo in loaders]
    for ds in datasets:
        ds.close()
    assert dataset_state_of(states[0]) == dataset_state_of(states[1])
    assert json.loads(dataset_state_of(states[0])[STATE_KEY])["position"] == k * b6
    proc = subprocess.run([sys.executable, "-c", WORKERS_RESUME_CHILD], capture_output=True, text=True, timeout=120,
                          input=json.dumps({"args": run_args, "state": states[0]}))
    assert proc.returncode == 0, proc.stderr
    resumed = json.loads(proc.stdout)
    served = [np.concatenate([first[0][s][0], first[1][s][0]]).tolist() for s in range(k)] + resumed
    assert served == [b["targets"].tolist() for b in epoch]
    # torchdata's restore, into a loader of as many workers (each worker its own state):
    again = FeederDataset(**run_args, rank=1, world_size=2)
    try:
        loader = StatefulDataLoader(again, batch_size=None, num_workers=2)
        loader.load_state_dict(states[1])
        assert [x[0].tolist() for x in loader_items(loader)] == [b["targets"][3:].tolist() for b in epoch[k:]]
    finally:
        again.close()


def test_a_state_between_torchdata_snapshots_resumes_exactly(packed):
    """snapshot_every_n_steps=3: torchdata's state is its workers' states at the
    last snapshot plus the microbatches yielded since; the position counts
    both, on 0 workers and on torchdata's own restore into 2."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    want = rank_rows(packed, global_batch_size=B, rank=0, world_size=1, local_batch_size=4)
    ds = FeederDataset(**args(packed), num_epochs=1, local_batch_size=4)
    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, snapshot_every_n_steps=3)
    head = loader_items(loader, 5)
    sd = json.loads(json.dumps(loader.state_dict()))
    ds.close()
    assert sd["_steps_since_snapshot"] == 2
    state = dataset_state_of(sd)
    assert (json.loads(state[STATE_KEY])["position"], state[MICROBATCH_KEY]) == (2 * B, 1)  # 5 of 2 per step
    for num_workers, restore_into in [(0, "dataset"), (2, "loader")]:
        again = FeederDataset(**args(packed), num_epochs=1, local_batch_size=4)
        loader = StatefulDataLoader(again, batch_size=None, num_workers=num_workers)
        (again if restore_into == "dataset" else loader).load_state_dict(sd)
        assert_same_items(head + loader_items(loader), want)
        again.close()


def test_a_plain_dataloader_with_workers_is_refused_in_one_line(packed):
    """torch's DataLoader keeps no state: with workers the position could not be
    saved, so the workers refuse; with num_workers=0 it serves the stream."""
    ds = FeederDataset(**args(packed))
    try:
        it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))
        with pytest.raises(RuntimeError) as e:
            next(it)
        it._shutdown_workers()  # else torch's shutdown from the garbage collector waits 5 s for the worker
        line = PLAIN_LOADER_ERROR.format(num_workers=1)
        assert "\n" not in line and line in str(e.value)
        assert "use torchdata's StatefulDataLoader" in line
        inputs, _ = next(iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)))
        with Feeder(cache=packed, global_batch_size=B, sequence_length=L, seed=3, host_index=0, host_count=1) as f:
            assert np.array_equal(inputs["input"].numpy(), f.get_batch(0)["targets"])
    finally:
        ds.close()


def test_spawned_workers_get_the_arguments_and_the_position(packed):
    """With spawn (the default start method on macOS) each worker gets the
    dataset pickled: its arguments and its position (here step 2), not the
    open Feeder."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    want = rank_rows(packed, global_batch_size=B, rank=0, world_size=2, local_batch_size=4)
    ds = FeederDataset(**args(packed), num_epochs=1, rank=0, world_size=2)
    try:
        ds.loader.feeder.step = 2
        loader = StatefulDataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn")
        assert_same_items(loader_items(loader), want[2:])
    finally:
        ds.close()


AT_STEP_0 = '{"global_batch_size": 8, "position": 0}'  # the fields of a Feeder state that _position reads


def worker_snapshot(feeder_json: str, **fields) -> dict:
    """A StatefulDataLoader state of one worker whose FeederDataset state has
    the Feeder state ``feeder_json`` and the other ``fields``."""
    state = {STATE_KEY: feeder_json, **fields}
    return {"_snapshot": {"_worker_snapshots": {"worker_0": {"dataset_state": state}}}, "_steps_since_snapshot": 0}


@pytest.mark.parametrize("sd,match", [
    ({"_snapshot": {"_worker_snapshots": {"worker_0": {"dataset_state": None}}}, "_steps_since_snapshot": 0},
     "worker snapshot 'worker_0' holds no FeederDataset state"),
    ({"_snapshot": {"_worker_snapshots": {}}, "_steps_since_snapshot": 0}, "no worker snapshots"),
    ({"_snapshot": {"_worker_snapshots": {"worker_0": {"dataset_state": {STATE_KEY: "{"}}}}},
     "not valid JSON"),
    (worker_snapshot('{"global_batch_size": 0, "position": 0}', world_size=1, local_batch_size=1),
     r"seqcache_feeder_state.global_batch_size: expected `int` >= 1 \(got 0\)"),
    (worker_snapshot(AT_STEP_0, world_size=1), "missing required field `local_batch_size`"),
    (worker_snapshot(AT_STEP_0, world_size=16, local_batch_size=1),
     "world_size=16 and local_batch_size=1 do not slice global_batch_size=8"),
    (worker_snapshot(AT_STEP_0, world_size=1, local_batch_size=4, microbatches_served=2),
     r"microbatches_served = 2, expected an integer in \[0, 2\)"),
    ({**worker_snapshot(AT_STEP_0, world_size=1, local_batch_size=8),
      "_steps_since_snapshot": -1}, r"_steps_since_snapshot: expected `int` >= 0 \(got -1\)"),
])
def test_foreign_worker_states_are_refused(packed, sd, match):
    ds = FeederDataset(**args(packed))
    try:
        with pytest.raises(FeederStateError, match=match):
            ds.load_state_dict(sd)
        assert ds.loader.step == 0
    finally:
        ds.close()


def test_torchtitan_loader_requires_a_global_batch_consistent_with_the_trainers():
    """torchtitan passes its loader R, b and snapshot_every_n_steps (checkpoint
    interval x gradient accumulation), not training.global_batch_size."""
    # B = 8, b = 4, R = 1: 2 microbatches per step; checkpoints every 3 steps of torchtitan's B = 8.
    assert torchtitan_global_batch_size(8, local_batch_size=4, dp_world_size=1, snapshot_every_n_steps=6) == 8
    assert torchtitan_global_batch_size(8, local_batch_size=2, dp_world_size=2, snapshot_every_n_steps=None) == 8
    with pytest.raises(ValueError, match=r"^dataloader.global_batch_size = -1: set it to training.global_batch_size"):
        torchtitan_global_batch_size(-1, local_batch_size=4, dp_world_size=2, snapshot_every_n_steps=None)
    with pytest.raises(ValueError, match="dataloader.global_batch_size = 16 is 4 microbatches of 4 rows per step on 1 "
                                         "rank.s., but torchtitan checkpoints every 6 microbatches"):
        torchtitan_global_batch_size(16, local_batch_size=4, dp_world_size=1, snapshot_every_n_steps=6)


# A plain torch training loop over gloo: a deterministic float64 model, loss =
# sum of token losses / the global batch's tokens, gradients summed over ranks
# with all_reduce, AdamW (whose moments are state tensors that a resume must
# restore). `CACHE N K OUT`: rank r of WORLD_SIZE loads the DCP checkpoint in
# OUT/ckpt when there is one, trains steps from there to N, saves a DCP
# checkpoint after step K - 1 (model, optimizer and the loader's state under
# "dataloader"), and writes per step the global loss and this rank's cache
# indices to OUT/rank<r>.json. The checkpoint lines are the recipe of
# docs/trainers/torchtitan.md ("A plain loop with DCP"): get_state_dict /
# set_state_dict, which give a fresh optimizer its state tensors before DCP
# loads into them.
GLOO_LOOP = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from seqcache.feeders.trainers.torch import FeederLoader

cache, n_steps, k, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(10_050, 8), torch.nn.Tanh(), torch.nn.Linear(8, 10_050)).double()
opt = torch.optim.AdamW(model.parameters(), lr=0.05)
rows = []
loader = FeederLoader(cache=cache, global_batch_size=8, sequence_length=12, seed=5, num_threads=1,
                      on_rows=rows.append)
assert (loader.rank, loader.world_size) == (rank, world)
ckpt = f"{out}/ckpt"
if os.path.isdir(ckpt):
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "dataloader": loader}
    dcp.load(state, checkpoint_id=ckpt)             # the loader is Stateful: DCP calls load_state_dict
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
log = []
for inputs, labels in loader:
    step = rows[-1]["step"]
    if step >= n_steps:
        break
    logits = model(inputs["input"])
    tok = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum",
                                            ignore_index=-100)
    count = torch.tensor([(labels != -100).sum().item()], dtype=torch.float64)
    dist.all_reduce(count)
    loss = tok / count
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    log.append({"step": step, "loss": total.item(), "cache_index": rows[-1]["cache_index"].tolist()})
    if step + 1 == k:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd, "dataloader": loader}, checkpoint_id=ckpt)
loader.close()
json.dump(log, open(f"{out}/rank{rank}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def run_gloo(tmp_path, name, cache, *, world, n_steps, k, ckpt_from=None):
    """Runs GLOO_LOOP on ``world`` ranks (processes on loopback, 180 s at most);
    returns its folder and each rank's log."""
    out = tmp_path / name
    out.mkdir()
    if ckpt_from is not None:
        os.symlink(ckpt_from / "ckpt", out / "ckpt")
    env = {**os.environ, "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_LOOP, cache, str(n_steps), str(k), str(out)],
                              env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        results = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


# Slow (two torch.distributed processes): the default suite keeps the rule through
# test_resume_in_a_fresh_process_on_other_world_sizes, and `make test-trainers` resumes
# torchtitan's own two-process run.
@pytest.mark.slow
def test_two_rank_gloo_loop_resumes_a_one_rank_checkpoint_exactly(tmp_path, packed):
    """A 1-rank run saves a DCP checkpoint after step k; 2 fresh ranks resume
    from it: from step k on, the rows of each global batch (rank 0's then rank
    1's) are the 1-rank run's and the Feeder's, and the losses are equal."""
    n, k = 6, 3
    first, (whole,) = run_gloo(tmp_path, "first", packed, world=1, n_steps=n, k=k)
    _, (r0, r1) = run_gloo(tmp_path, "resumed", packed, world=2, n_steps=n, k=-1, ckpt_from=first)
    with Feeder(cache=packed, global_batch_size=8, sequence_length=12, seed=5, host_index=0, host_count=1) as f:
        feeder_rows = [f.get_batch(s)["cache_index"].tolist() for s in range(n)]
    assert [e["cache_index"] for e in whole] == feeder_rows
    assert [e["step"] for e in r0] == [e["step"] for e in r1] == list(range(k, n))
    assert [a["cache_index"] + b["cache_index"] for a, b in zip(r0, r1)] == feeder_rows[k:]
    # Two ranks sum the same float64 terms in another order: equal to rounding.
    np.testing.assert_allclose([e["loss"] for e in r0], [e["loss"] for e in whole[k:]], rtol=1e-12, atol=0)
    assert [e["loss"] for e in r0] == [e["loss"] for e in r1]
    assert len({round(e["loss"], 6) for e in whole}) == n  # the model learns: losses differ per step


def test_importing_the_feeders_does_not_import_torch():
    code = "import sys, seqcache, seqcache.feeders; print('torch' in sys.modules, 'torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
    code = "import sys, seqcache.feeders.trainers.torch; print('torchtitan' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False"]

