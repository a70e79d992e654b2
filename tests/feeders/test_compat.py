"""The compatibility rules (seqcache.feeders.compat): each refuses with both values."""

import pytest

from seqcache.feeders import FeederStateError, compat
from seqcache.feeders import state as state_lib


def test_global_batch_names_both_values_and_why():
    assert compat.global_batch_difference(8, 8) is None
    with pytest.raises(FeederStateError) as e:
        compat.check_global_batch(8, 16, restored_from="checkpoint was saved with", current_from="the config has")
    assert str(e.value) == ("checkpoint was saved with global batch size 8, the config has global_batch_size=16; "
                            "a global position is step * B, so another B gives every later step other examples")
    # The state comparison uses the same rule.
    assert state_lib.FeederStateError is FeederStateError
    assert state_lib._scalar_difference("global_batch_size", 4, 8) == compat.global_batch_difference(4, 8)


@pytest.mark.parametrize("b,h,n,saved,message", [
    (6, 0, 4, False, "global_batch_size=6 is not divisible by host_count=4: every host reads B / H rows; use a "
                     "global batch that is a multiple of 4 (e.g. 4 or 8)"),
    (4, 0, 8, False, "host_count=8 is larger than global_batch_size=4"),
    (4, 0, 8, True, "the feeder state was saved with global_batch_size=4, which host_count=8 does not divide"),
    (12, 0, 5, True, "restore on a host count that divides 12: 1, 2, 3, 4, 6, 12"),
    (8, 2, 2, False, r"host_index must be in [0, 2) for host_count=2 (got 2)"),
    (8, 0, 0, True, "host_count must be an integer >= 1 (got 0)"),
])
def test_hosts(b, h, n, saved, message):
    with pytest.raises(ValueError) as e:
        compat.check_hosts(b, h, n, saved=saved)
    assert message in str(e.value)
    compat.check_hosts(b, 0, 1, saved=saved)  # one host always divides


def _entry(path, fingerprint, task="t", n=10):
    return {"path": path, "task": task, "split": "train", "fingerprint": fingerprint, "num_examples": n}


def test_fingerprints():
    a, b = _entry("/c/a", "fa", task="a"), _entry("/c/b", "fb", task="b")
    assert compat.fingerprint_difference([a, b], [dict(a, path="/moved/a"), b]) is None  # paths are not compared
    assert "lists the state's caches in another order" in compat.fingerprint_difference([a, b], [b, a])
    assert compat.fingerprint_difference([a], [_entry("/new/a", "fx", task="a")]) == (
        "the cache at /new/a was rebuilt (fingerprint fx, the state was saved with fingerprint fa at /c/a), so the "
        "saved position no longer denotes the same examples")
    assert compat.fingerprint_difference([a], [b]).startswith("mixture entry 0: this run reads /c/b (task 'b'")
    assert "has 11 examples, but the state records 10" in compat.fingerprint_difference([a], [dict(a, num_examples=11)])
