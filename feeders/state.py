"""Feeder state: a small JSON object, and the checks run when it is restored.

Example (one task, position 4096 = step 16 of a global batch of 256)::

    {"kind": "seqcache.feeders.Feeder", "version": 1, "cache_format_version": 1,
     "mixture": [{"path": "caches/wiki/train", "rate": 1.0, "weight": 1,
                  "task": "wiki", "split": "train", "num_examples": 36718,
                  "fingerprint": "9f2c..."}],
     "seed": 0, "global_batch_size": 256, "sequence_length": 512,
     "feature": "targets", "num_epochs": null, "position": 4096}

``position`` is the global position of the next example to read (step * B): the
state does not depend on the number of hosts (G5). Nothing else is needed to resume
(G4): the stream is a pure function of the other fields and the caches.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from seqcache import format as fmt

STATE_KIND = "seqcache.feeders.Feeder"
# Bump when the stream a state denotes changes: the mixing algorithm, the
# permutation (rounds, round function, key derivation), the end-of-run rule.
STATE_VERSION = 1

_FIELDS = ("kind", "version", "cache_format_version", "mixture", "seed", "global_batch_size",
           "sequence_length", "feature", "num_epochs", "position")


class FeederStateError(ValueError):
    """A feeder state is malformed, from another version, or does not match the
    caches or the configuration it is restored into."""


def check_state(state: Mapping[str, Any]) -> None:
    """Validates the structure and version of a state dict.

    Raises:
      FeederStateError: not a feeder state, another state or cache format version,
        a missing field, or a position that is not a multiple of the global batch.
    """
    if not isinstance(state, Mapping):
        raise FeederStateError(f"a feeder state is a JSON object (got {type(state).__name__})")
    if state.get("kind") != STATE_KIND:
        raise FeederStateError(f"not a feeder state: kind is {state.get('kind')!r}, expected {STATE_KIND!r}")
    if state.get("version") != STATE_VERSION:
        raise FeederStateError(
            f"feeder state version is {state.get('version')!r}, this seqcache reads version {STATE_VERSION}: "
            "the state was written by another seqcache release; restore it with that release"
        )
    if state.get("cache_format_version") != fmt.FORMAT_VERSION:
        raise FeederStateError(
            f"feeder state was saved for cache format version {state.get('cache_format_version')!r}, "
            f"this seqcache reads version {fmt.FORMAT_VERSION}"
        )
    missing = [f for f in _FIELDS if f not in state]
    if missing:
        raise FeederStateError(f"feeder state is missing fields {missing}")
    mixture = state["mixture"]
    if not isinstance(mixture, list) or not mixture:
        raise FeederStateError(f"feeder state has no mixture entries (got {mixture!r})")
    for entry in mixture:
        for key in ("path", "rate", "weight", "fingerprint", "num_examples"):
            if key not in entry:
                raise FeederStateError(f"feeder state mixture entry {entry!r} has no {key!r}")
    b, p = state["global_batch_size"], state["position"]
    if not isinstance(b, int) or b < 1:
        raise FeederStateError(f"feeder state has global_batch_size={b!r}, expected an integer >= 1")
    if not isinstance(p, int) or p < 0 or p % b:
        raise FeederStateError(
            f"feeder state has position={p!r}: expected a non-negative multiple of global_batch_size={b}"
        )


def mixture_pairs(state: Mapping[str, Any]) -> list[tuple[str, float]]:
    """[(cache path, rate)] in mixture order."""
    return [(str(e["path"]), float(e["rate"])) for e in state["mixture"]]


def compare(state: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """Refuses a state whose configuration differs from ``expected``.

    Args:
      state: a checked state.
      expected: a subset of {"mixture": [(path, rate)], "seed", "global_batch_size",
        "sequence_length", "feature", "num_epochs"}; entries whose value is None
        are not compared, except num_epochs (None means forever).

    Raises:
      FeederStateError: naming the field, the state's value and the expected one.
    """
    for key, want in expected.items():
        if key == "mixture":
            have = mixture_pairs(state)
            want = [(str(p), float(r)) for p, r in want]
        else:
            have = state[key]
        if have != want:
            raise FeederStateError(
                f"feeder state has {key}={json.dumps(have)}, but this run has {key}={json.dumps(want)}; "
                "a state restores only into the configuration that saved it (or start a new run from step 0)"
            )
