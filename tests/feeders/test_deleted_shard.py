"""A shard file deleted while a feeder has the cache open (G7).

Opening a cache reads only its manifest; each shard file is checked (byte size,
record count) and opened at its first read. An open feeder keeps reading the
shards it has read (on POSIX an open file outlives its name), so the run goes on
with exactly the batches of an undisturbed cache. A shard deleted before its first
read, in an open feeder or in anything that opens the damaged cache afresh (a new
feeder, a restore from a saved state, ``which`` without a feeder), fails at that
read, before any record of it is returned, with a CacheError that names the
missing file and says to run ``seqcache verify``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main as cli
from seqcache.feeders import Feeder
from seqcache.feeders.reader import CacheReader
from seqcache.feeders.provenance import locate_row, locate_row_in_state

N, SHARDS, B, L = 41, 3, 8, 8
STEPS = -(-N // B)  # 6 steps, the last one with 7 padding rows


def _feeder(path, **kw):
    return Feeder(cache=str(path), global_batch_size=B, sequence_length=L, host_index=0, host_count=1,
                  seed=3, num_epochs=1, **kw)


def _digest(batch) -> str:
    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode())
        h.update(np.ascontiguousarray(batch[k]).tobytes())
    return h.hexdigest()


@pytest.fixture
def caches(tmp_path, fx):
    """(damaged, intact): two byte-identical copies of one cache; tests damage the first."""
    fx.write_fixture_cache(tmp_path / "damaged", n=N, num_shards=SHARDS, length=lambda i: 3 + i % 9)
    shutil.copytree(tmp_path / "damaged", tmp_path / "intact")
    return tmp_path / "damaged", tmp_path / "intact"


def _shard_files(path, shard):
    info = fmt.read_manifest(str(path)).shards[shard]
    return path / info.file, path / info.provenance_file


def _missing_message_checks(message, path, cache):
    assert str(path) in message and "missing" in message
    assert f"run `seqcache verify {cache}`" in message


@pytest.mark.parametrize("deleted", ["data", "provenance", "both"])
def test_an_open_feeder_reads_a_full_epoch_unchanged(caches, deleted):
    damaged, intact = caches
    data, prov = _shard_files(damaged, 1)
    with _feeder(damaged, prefetch=0) as f:
        starts = f.readers[0].shard_starts
        first = [_digest(b) for b in f]  # every data shard has been read (and opened) once
        for p in {"data": [data], "provenance": [prov], "both": [data, prov]}[deleted]:
            os.remove(p)
            assert not p.exists()
        f.step = 0
        got = [_digest(b) for b in f]
        seen = [int(i) for s in range(STEPS) for i in f.get_batch(s)["cache_index"] if i >= 0]
    with _feeder(intact) as g:
        want = [_digest(b) for b in g]
    assert len(got) == STEPS and got == want == first
    # The epoch did read the deleted shard's examples, each exactly once.
    assert sorted(seen) == list(range(N))
    assert sum(starts[1] <= i < starts[2] for i in seen) == starts[2] - starts[1] == 14


def _first_step_touching(feeder, lo, hi) -> int:
    for step in range(STEPS):
        ci = feeder.get_batch(step)["cache_index"]
        if ((ci >= lo) & (ci < hi)).any():
            return step
    raise AssertionError(f"no example in [{lo}, {hi})")


def test_an_open_feeder_refuses_a_shard_deleted_before_its_first_read(caches):
    damaged, intact = caches
    data, _ = _shard_files(damaged, 1)
    size = data.stat().st_size
    with _feeder(intact, prefetch=0) as g:
        starts = g.readers[0].shard_starts
        bad = _first_step_touching(g, starts[1], starts[2])
    with _feeder(damaged, prefetch=0) as f:  # opening reads the manifest only
        assert f.readers[0]._data == [None] * SHARDS
        os.remove(data)
        for _ in range(bad):
            next(f)
        with pytest.raises(fmt.CacheError) as e:
            next(f)
        msg = str(e.value)
        assert msg.startswith(f"{data}: shard file is missing (the manifest lists it with {size} bytes)")
        _missing_message_checks(msg, data, damaged)
        assert f.step == bad  # nothing of that step was returned


def test_an_open_feeder_answers_which_from_an_opened_shard(caches, fx):
    damaged, _ = caches
    data, prov = _shard_files(damaged, 2)
    with _feeder(damaged) as f:
        starts = f.readers[0].shard_starts
        step, row = _row_in_shard(f, starts[2], starts[3])
        before = f.which(step, row)  # opens provenance shard 2
        os.remove(data)
        os.remove(prov)
        after = f.which(step, row)
    assert after == before
    i = before["cache_index"]
    (seg,) = after["segments"]
    assert after["shard"] == data.name and seg["record_number"] == 1000 + i
    assert seg["token_ids"] == fx.example_tokens(i, 3 + i % 9).tolist()


def _row_in_shard(feeder, lo, hi):
    """The first (step, row) whose example lies in cache indices [lo, hi)."""
    for step in range(STEPS):
        for row, i in enumerate(feeder.get_batch(step)["cache_index"].tolist()):
            if lo <= i < hi:
                return step, row
    raise AssertionError(f"no example in [{lo}, {hi})")


def test_which_names_a_provenance_shard_deleted_after_opening(caches):
    damaged, _ = caches
    _, prov = _shard_files(damaged, 0)
    with _feeder(damaged) as f:
        starts = f.readers[0].shard_starts
        step, row = _row_in_shard(f, starts[0], starts[1])
        other = _row_in_shard(f, starts[1], starts[2])
        os.remove(prov)
        with pytest.raises(fmt.CacheError) as e:
            f.which(step, row)
        msg = str(e.value)
        assert msg.startswith(f"{prov}: shard file is missing (the manifest lists it with")
        _missing_message_checks(msg, prov, damaged)
        # The same lookup fails the same way again (nothing half-opened is kept) ...
        with pytest.raises(fmt.CacheError, match="shard file is missing"):
            f.which(step, row)
        # ... while rows of intact shards, and the batches, are unaffected.
        d = f.which(*other)
        assert d["segments"][0]["record_number"] == 1000 + d["cache_index"]
        assert f.get_batch(step)["cache_index"][row] >= 0


def test_a_lazily_opened_data_shard_deleted_before_its_first_read_is_named(caches, fx):
    # Readers opened without checking every shard (open_shards=False; an unpickled
    # reader in a multiprocess loader reopens its shards the same way).
    damaged, _ = caches
    data, _ = _shard_files(damaged, 2)
    with CacheReader(str(damaged), open_shards=False) as r:
        assert r.read_examples([0])[0]["targets"].tolist() == fx.example_tokens(0, 3).tolist()
        os.remove(data)
        with pytest.raises(fmt.CacheError) as e:
            r.read([int(r.shard_starts[2])])
        _missing_message_checks(str(e.value), data, damaged)
        assert r.read_examples([1])[0]["targets"].tolist() == fx.example_tokens(1, 4).tolist()  # shard 0 still reads


@pytest.mark.parametrize("deleted", ["data", "provenance"])
def test_a_new_or_restored_feeder_on_the_damaged_cache_names_the_missing_file(caches, deleted):
    damaged, intact = caches
    data, prov = _shard_files(damaged, 1)
    path = data if deleted == "data" else prov
    size = path.stat().st_size
    with _feeder(intact) as g:
        starts = g.readers[0].shard_starts
        step, row = _row_in_shard(g, starts[1], starts[2])
    with _feeder(damaged) as f:
        f.step = 2
        state = json.loads(json.dumps(f.state()))
        os.remove(path)

    def read_all(feeder):
        with feeder:
            for _ in feeder:
                pass
            feeder.which(step, row)

    attempts = {
        "new feeder": lambda: read_all(_feeder(damaged)),
        "restore at the state's path": lambda: read_all(Feeder.restore(state, host_index=0, host_count=1)),
        "restore with cache=": lambda: read_all(Feeder.restore(state, host_index=0, host_count=1,
                                                               cache=str(damaged))),
        "which without a feeder": lambda: locate_row(cache=str(damaged), global_batch_size=B, step=step, row=row,
                                                     seed=3, num_epochs=1),
        "which from the state": lambda: locate_row_in_state(state, step=step, row=row),
    }
    for what, attempt in attempts.items():
        with pytest.raises(fmt.CacheError) as e:
            attempt()
        msg = str(e.value)
        assert msg.startswith(f"{path}: shard file is missing (the manifest lists it with {size} bytes)"), what
        _missing_message_checks(msg, path, damaged)
        assert "if they moved" not in msg, what  # the cache is where the state says; a file in it is gone
    res = CliRunner().invoke(cli, ["which", str(damaged), "--step", str(step), "--row", str(row),
                                   "--batch-size", str(B), "--seed", "3", "--num-epochs", "1"])
    assert res.exit_code == 1
    assert f"{path}: shard file is missing" in res.output and f"seqcache verify {damaged}" in res.output
