"""Interop: grain data source, Orbax checkpoint round trip, global jax.Arrays."""

import subprocess
import sys

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.feeders import (CacheDataSource, Feeder, feeder_restore_args, feeder_save_args, make_global_batch,
                              restore_feeder)


def test_core_imports_without_jax_grain_orbax_or_beam():
    code = ("import sys, seqcache.feeders; "
            "print(sorted(m for m in ('jax', 'grain', 'orbax', 'apache_beam') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_grain_source_reads_decoded_examples(make_cache, fx):
    path = make_cache(n=17, num_shards=3, length=lambda i: 1 + i % 4)
    src = CacheDataSource(path)
    assert len(src) == 17
    ex = src[5]
    assert ex["targets"].tolist() == fx.example_tokens(5, 2).tolist()
    batch = src._getitems([16, 0, 9, 0])
    assert [b["targets"][0] for b in batch] == [17, 1, 10, 1]
    assert [b["targets"].tolist() for b in src.__getitems__([3])] == [src[3]["targets"].tolist()]
    with pytest.raises(IndexError, match=r"cache index 17 out of range \[0, 17\)"):
        src[17]
    src.close()


def test_grain_data_loader_over_the_source(make_cache, fx):
    grain = pytest.importorskip("grain.python")
    path = make_cache(n=24, num_shards=2, length=6)
    src = CacheDataSource(path)
    sampler = grain.IndexSampler(num_records=len(src), shard_options=grain.NoSharding(), shuffle=True, num_epochs=1,
                                 seed=0)
    loader = grain.DataLoader(data_source=src, sampler=sampler, operations=[grain.Batch(batch_size=8)], worker_count=0)
    firsts = sorted(int(x) for b in loader for x in b["targets"][:, 0])
    assert firsts == list(range(1, 25))  # every example once
    src.close()


def test_orbax_checkpoint_round_trip_next_to_params(tmp_path, make_cache):
    ocp = pytest.importorskip("orbax.checkpoint")
    path = make_cache(n=40, num_shards=2)
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.float32)}
    kw = dict(cache=path, global_batch_size=4, sequence_length=8, seed=1)
    with Feeder(**kw, host_index=0, host_count=1) as f:
        for _ in zip(range(13), f):
            pass
        want = [next(f) for _ in range(3)]
        f.step = 13
        with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
            mngr.save(13, args=ocp.args.Composite(params=ocp.args.StandardSave(params), feeder=feeder_save_args(f)))
            mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path / "ckpt") as mngr:
        restored = mngr.restore(13, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                            feeder=feeder_restore_args()))
    np.testing.assert_array_equal(restored["params"]["w"], params["w"])
    assert restored["feeder"]["position"] == 13 * 4
    # Restore on two hosts: the concatenated host batches are the saved run's batches.
    hosts = [restore_feeder(restored["feeder"], host_index=h, host_count=2, seed=1, global_batch_size=4)
             for h in range(2)]
    try:
        for expect in want:
            parts = [next(h) for h in hosts]
            for k in expect:
                np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), expect[k])
    finally:
        for h in hosts:
            h.close()
    with pytest.raises(ValueError, match="no feeder state"):
        restore_feeder(None)


def test_make_global_batch_on_eight_devices(make_cache):
    jax = pytest.importorskip("jax")
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py forces 8 CPU devices)")
    path = make_cache(n=40)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with Feeder(cache=path, global_batch_size=8, sequence_length=6, host_index=0, host_count=1) as f:
        host = f.get_batch(2)
    out = make_global_batch(host, mesh)
    assert set(out) == set(host)
    arr = out["targets"]
    assert arr.shape == (8, 6) and arr.dtype == np.int32
    assert arr.sharding.spec == jax.sharding.PartitionSpec(("data",))
    # Each 'data' shard holds 2 consecutive rows, replicated over 'model'.
    assert {s.data.shape for s in arr.addressable_shards} == {(2, 6)}
    np.testing.assert_array_equal(np.asarray(arr), host["targets"])
    np.testing.assert_array_equal(np.asarray(out["cache_index"]), host["cache_index"])
    with pytest.raises(ValueError, match="batch axis 'fsdp' is not an axis"):
        make_global_batch(host, mesh, batch_axes=("fsdp",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "model")))
    out = make_global_batch({"targets": host["targets"]}, sharding)
    assert {s.data.shape for s in out["targets"].addressable_shards} == {(1, 6)}


def test_cache_errors_name_the_file(tmp_path, make_cache):
    path = make_cache(n=10, num_shards=2)
    shard = tmp_path / "c" / "data.array_record-00001-of-00002"
    shard.write_bytes(shard.read_bytes()[:-10])
    # Refused at the shard's first read (opening the cache reads the manifest only).
    with Feeder(cache=path, global_batch_size=2, sequence_length=2, host_index=0, host_count=1, num_epochs=1) as f:
        with pytest.raises(fmt.CacheError, match="data.array_record-00001-of-00002: shard file has"):
            list(f)


def test_host_defaults_come_from_jax(make_cache):
    jax = pytest.importorskip("jax")
    path = make_cache(n=10)
    with Feeder(cache=path, global_batch_size=4, sequence_length=2) as f:
        assert (f.host_index, f.host_count) == (jax.process_index(), jax.process_count())
