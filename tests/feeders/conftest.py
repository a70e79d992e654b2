"""Fixture caches for the feeder tests, written with the real cache writer.

Example i of a fixture cache (its cache index) has tokens whose first element is
``i + 1`` (so a batch row identifies its example) followed by a deterministic
pattern, and a provenance entry (source 0, record number 1000 + i, offset 0).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from seqcache import format as fmt
from seqcache.pipelines.writer import write_cache

UNPACKED = (fmt.FeatureSpec("targets", "int32"),)
PACKED = (
    fmt.FeatureSpec("targets", "int32"),
    fmt.FeatureSpec("targets_segment_ids", "int32"),
)  # as the build writes packed caches: positions are not stored, the feeder derives them


def example_tokens(i: int, length: int) -> np.ndarray:
    """Tokens of fixture example i: [i + 1, then (i * 31 + j) % 250 + 3 ...]."""
    rest = (i * 31 + np.arange(1, length)) % 250 + 3
    return np.concatenate([[i + 1], rest]).astype(np.int32)


def write_fixture_cache(
    path,
    *,
    n: int,
    num_shards: int = 3,
    length=8,
    task: str = "fixture",
    split: str = "train",
    tag: str = "",
    vocabularies=None,
):
    """Writes an unpacked cache of ``n`` examples; ``length`` is an int or a
    function i -> length. ``tag`` changes the fingerprint (a "rebuilt" cache)."""
    length_of = length if callable(length) else (lambda i: length)
    per = [n // num_shards + (1 if s < n % num_shards else 0) for s in range(num_shards)]
    shards, i = [], 0
    for count in per:
        shard = []
        for _ in range(count):
            shard.append(({"targets": example_tokens(i, length_of(i))}, [(0, 1000 + i, 0)]))
            i += 1
        shards.append(shard)
    return write_cache(
        str(path),
        task=task,
        split=split,
        features=UNPACKED,
        shards=shards,
        sources=[{"path": f"corpus/{task}.txt"}],
        vocabularies=vocabularies,
        fingerprint_inputs={"task": task, "split": split, "n": n, "shards": num_shards, "tag": tag,
                            "length": None if callable(length) else length},
    )


def write_packed_cache(path, *, n: int, sequence_length: int = 12, num_shards: int = 2, task: str = "packed"):
    """A packed cache: record i holds segments of lengths (3 + i % 4) and the rest
    (at most 2 segments, zero-padded to the sequence length when short)."""
    shards = [[] for _ in range(num_shards)]
    for i in range(n):
        a = 3 + i % 4
        b = sequence_length - a - (i % 3)  # i % 3 padding tokens at the end
        toks = np.concatenate([example_tokens(i, a), example_tokens(10_000 + i, b), np.zeros(i % 3, np.int32)])
        seg = np.concatenate([np.full(a, 1), np.full(b, 2), np.zeros(i % 3)]).astype(np.int32)
        shards[i * num_shards // n].append(
            ({"targets": toks, "targets_segment_ids": seg},
             [(0, 2 * i, 0), (1, 2 * i + 1, 5)])
        )
    return write_cache(
        str(path),
        task=task,
        split="train",
        features=PACKED,
        shards=shards,
        sources=[{"path": "corpus/a.txt"}, {"path": "corpus/b.txt"}],
        sequence_length={"targets": sequence_length},
        packing="lm",
        fingerprint_inputs={"task": task, "n": n, "packed": sequence_length},
    )


@pytest.fixture
def make_cache(tmp_path):
    """make_cache(name, n=..., **kw) -> path of a fresh unpacked fixture cache."""

    def make(name: str = "c", **kw) -> str:
        path = tmp_path / name
        write_fixture_cache(path, **kw)
        return str(path)

    return make


def example_ids(batch) -> np.ndarray:
    """The fixture example (cache index) of each row, -1 on padding rows."""
    return np.where(batch["targets_loss_weights"][:, 0] > 0, batch["targets"][:, 0] - 1, -1)


@pytest.fixture
def fx():
    """The helpers of this module (test modules cannot import a conftest by name)."""
    import types

    return types.SimpleNamespace(
        example_tokens=example_tokens,
        write_fixture_cache=write_fixture_cache,
        write_packed_cache=write_packed_cache,
        example_ids=example_ids,
    )


# Runs in a fresh interpreter: restores each state on H hosts, reads `steps` global
# batches (the hosts' batches concatenated) and prints, per state, the position
# and state of host 0 after them and the digest of those batches.
RESTORE_CHILD = r"""
import hashlib, json, sys
import numpy as np
from seqcache.feeders import Feeder
req = json.load(sys.stdin)
out = []
for state in req["states"]:
    H = req["host_count"]
    feeders = [Feeder.restore(state, host_index=h, host_count=H, num_threads=2) for h in range(H)]
    h = hashlib.sha256()
    for _ in range(req["steps"]):
        parts = [next(f) for f in feeders]
        for k in sorted(parts[0]):
            h.update(np.concatenate([p[k] for p in parts]).tobytes())
    out.append({"position": feeders[0].position, "digest": h.hexdigest(), "state": feeders[0].state()})
    for f in feeders:
        f.close()
json.dump(out, sys.stdout)
"""


def restore_in_fresh_process(states, *, host_count: int, steps: int) -> list[dict]:
    """Restores each JSON-able feeder state in a new Python process on
    ``host_count`` hosts and reads ``steps`` global batches; returns, per state,
    ``{"position", "digest", "state"}`` (digest: ``testsupport.batches_digest`` of
    those global batches). Fails the test when the process fails."""
    proc = subprocess.run([sys.executable, "-c", RESTORE_CHILD], capture_output=True, text=True, timeout=120,
                          input=json.dumps({"states": states, "host_count": host_count, "steps": steps}))
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def restore_fresh():
    """``restore_in_fresh_process(states, host_count=..., steps=...)``."""
    return restore_in_fresh_process
