"""The compatibility rules (seqcache.feeders.compat): each refuses with both values."""

from types import SimpleNamespace

import pytest

from seqcache import format as fmt
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


def _manifest(names, lengths):
    return SimpleNamespace(features=[fmt.FeatureSpec(n, "int32") for n in names], sequence_length=lengths)


def test_sequence_length_of_a_packed_cache():
    packed = _manifest(["targets", "targets_segment_ids", "inputs", "inputs_segment_ids"],
                       {"targets": 114, "inputs": 512})
    assert compat.packed_length(packed, "targets") == 114 and compat.recorded_length(packed, "inputs") == 512
    compat.check_sequence_length(packed, 114, feature="targets", cache="c/t/train")
    with pytest.raises(ValueError) as e:
        compat.check_sequence_length(packed, 256, feature="inputs", cache="c/t/train",
                                     setting="--set inputs_sequence_length=")
    assert str(e.value) == (
        "c/t/train: the cache is packed to sequence length 512 (feature 'inputs'), but --set inputs_sequence_length "
        "is 256: rows would cut packed segments. Use --set inputs_sequence_length=512 (or more), or rebuild the "
        "cache with --sequence-length inputs=256")
    # Unpacked caches are trimmed, never refused; a length not recorded is not checked.
    trimmed = _manifest(["targets"], {"targets": 512})
    assert compat.packed_length(trimmed, "targets") is None and compat.recorded_length(trimmed, "targets") == 512
    compat.check_sequence_length(trimmed, 8, feature="targets", cache="c")
    compat.check_sequence_length(_manifest(["targets", "targets_segment_ids"], None), 8, feature="targets", cache="c")


def _entry(path, fingerprint, task="t", n=10):
    return {"path": path, "task": task, "split": "train", "fingerprint": fingerprint, "num_examples": n}


def test_fingerprints():
    a, b = _entry("/c/a", "fa", task="a"), _entry("/c/b", "fb", task="b")
    assert compat.fingerprint_difference([a, b], [dict(a, path="/moved/a"), b]) is None  # paths are not compared
    with pytest.raises(FeederStateError, match="lists the state's caches in another order"):
        compat.check_fingerprints([a, b], [b, a])
    assert compat.fingerprint_difference([a], [_entry("/new/a", "fx", task="a")]) == (
        "the cache at /new/a was rebuilt (fingerprint fx, the state was saved with fingerprint fa at /c/a), so the "
        "saved position no longer denotes the same examples")
    assert compat.fingerprint_difference([a], [b]).startswith("mixture entry 0: this run reads /c/b (task 'b'")
    assert "has 11 examples, but the state records 10" in compat.fingerprint_difference([a], [dict(a, num_examples=11)])
