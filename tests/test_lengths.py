"""Sequence lengths (seqcache.lengths): one type, and the one rule a reader of caches follows."""

from types import SimpleNamespace

import pytest

from seqcache import format as fmt
from seqcache import lengths as L


def _manifest(names, lengths=None, max_length=None):
    return SimpleNamespace(features=[fmt.FeatureSpec(n, "int32") for n in names], sequence_length=lengths,
                           statistics=SimpleNamespace(max_length=max_length))


def test_an_int_a_mapping_or_none_become_one_mapping():
    assert L.sequence_lengths(512, ["inputs", "targets"]) == {"inputs": 512, "targets": 512}
    assert L.sequence_lengths({"targets": 114, "inputs": 512}, ["inputs", "targets"]) == {"targets": 114,
                                                                                           "inputs": 512}
    assert L.sequence_lengths({"targets": 7, "inputs": None}, ["inputs", "targets"]) == {"targets": 7}
    assert L.sequence_lengths(None, ["targets"]) == {}
    assert type(L.sequence_lengths(__import__("numpy").int64(3), ["targets"])["targets"]) is int


@pytest.mark.parametrize("value, message", [
    (0, "sequence_length must be an integer in [1, 2^24) tokens (got 0)"),
    (True, "(got True)"),
    (2**24, "(got 16777216)"),
    ("512", "must be an integer or a mapping feature -> integer (got '512')"),
    (8.0, "(got 8.0)"),
    ({"targets": -1}, "sequence_length of feature 'targets' must be an integer in [1, 2^24) tokens (got -1)"),
    ({"inputs": 8}, "sequence length given for ['inputs'], which are not among the features ['targets']"),
])
def test_malformed_lengths_are_refused_naming_the_value(value, message):
    with pytest.raises(ValueError) as e:
        L.sequence_lengths(value, ["targets"])
    assert message in str(e.value)
    assert not isinstance(e.value, L.SequenceLengthError)


def test_the_cache_s_own_lengths():
    packed = _manifest(["inputs", "inputs_segment_ids", "targets", "targets_segment_ids"],
                       {"inputs": 512, "targets": 114}, max_length={"inputs": 900, "targets": 300})
    assert L.built_lengths(packed) == {"inputs": 512, "targets": 114}
    assert L.cache_lengths(packed) == {"inputs": 512, "targets": 114}
    # An int is every feature's; a feature without a recorded length falls back to its longest example.
    assert L.built_lengths(_manifest(["targets"], 64)) == {"targets": 64}
    unpacked = _manifest(["inputs", "targets"], {"inputs": 100, "targets": None}, max_length={"targets": 37})
    assert L.built_lengths(unpacked) == {"inputs": 100}
    assert L.cache_lengths(unpacked) == {"inputs": 100, "targets": 37}
    assert L.cache_lengths(_manifest(["targets"], None, max_length={"targets": 0})) == {}
    assert L.cache_lengths(_manifest(["targets"])) == {}


def test_the_default_is_the_cache_s_and_a_given_length_only_cuts():
    caches = {"c/a": _manifest(["targets", "targets_segment_ids"], {"targets": 64})}
    assert L.fit_lengths(None, caches, ["targets"]) == {"targets": 64}
    assert L.fit_lengths(32, caches, ["targets"]) == {"targets": 32}
    assert L.fit_lengths({"targets": 64}, caches, ["targets"]) == {"targets": 64}
    with pytest.raises(L.SequenceLengthError) as e:
        L.fit_lengths(128, caches, ["targets"], setting="--sequence-length ")
    assert str(e.value) == ("c/a: sequence length 128 for feature 'targets' is longer than the cache's, 64 tokens; "
                            "leave --sequence-length out to read rows of 64, or give at most 64")
    assert isinstance(e.value, ValueError)


def test_a_mixture_reads_rows_of_its_longest_cache():
    caches = {"c/a": _manifest(["targets"], {"targets": 64}), "c/b": _manifest(["targets"], {"targets": 128})}
    assert L.fit_lengths(None, caches, ["targets"]) == {"targets": 128}
    assert L.fit_lengths(100, caches, ["targets"]) == {"targets": 100}
    with pytest.raises(L.SequenceLengthError, match="^c/b: sequence length 129 for feature 'targets' is longer "):
        L.fit_lengths(129, caches, ["targets"])


def test_a_cache_built_to_no_length_sets_no_limit_and_one_with_no_length_needs_one():
    longest = {"c/u": _manifest(["targets"], None, max_length={"targets": 37})}
    assert L.fit_lengths(None, longest, ["targets"]) == {"targets": 37}
    assert L.fit_lengths(128, longest, ["targets"]) == {"targets": 128}  # rows pad its examples
    unknown = {"c/a": _manifest(["targets"], {"targets": 8}), "c/x": _manifest(["targets"])}
    assert L.fit_lengths(16, unknown, ["targets"]) == {"targets": 16}
    with pytest.raises(L.SequenceLengthError) as e:
        L.fit_lengths(None, unknown, ["targets"])
    assert str(e.value) == ("c/x: the cache records no sequence length for feature 'targets'; give its length "
                            "(sequence_length)")
    # Per feature: a mapping may leave one to the cache.
    both = {"c/t5": _manifest(["inputs", "targets"], {"inputs": 512, "targets": 114})}
    assert L.fit_lengths({"targets": 100}, both, ["inputs", "targets"]) == {"inputs": 512, "targets": 100}
    with pytest.raises(L.SequenceLengthError, match="feature 'inputs' is longer than the cache's, 512 tokens"):
        L.fit_lengths(513, both, ["inputs", "targets"])


@pytest.mark.parametrize("texts, expected", [
    (("1024",), {"*": 1024}),
    (("inputs=512,targets=114",), {"inputs": 512, "targets": 114}),
    (("8", "inputs=4"), {"*": 8, "inputs": 4}),
    ((), {}),
])
def test_the_command_line_form(texts, expected):
    assert L.parse_sequence_length(texts) == expected


def test_a_length_for_every_feature_is_expanded_to_the_features_read():
    """A bare N (``ALL_FEATURES``) means every feature, whoever reads it: a
    build's task features, a converter's; a named feature keeps its own."""
    assert L.ALL_FEATURES == "*"
    assert L.sequence_lengths({"*": 8}, ["targets"]) == {"targets": 8}
    assert L.sequence_lengths({"*": 8}, ["inputs", "targets"]) == {"inputs": 8, "targets": 8}
    assert L.sequence_lengths({"targets": 4, "*": 8}, ["inputs", "targets"]) == {"inputs": 8, "targets": 4}
    assert L.sequence_lengths(L.parse_sequence_length(("8", "inputs=4")), ["inputs", "targets"]) == \
        {"inputs": 4, "targets": 8}
    with pytest.raises(ValueError, match=r"sequence length given for \['bogus'\]"):
        L.sequence_lengths({"*": 8, "bogus": 1}, ["targets"])


@pytest.mark.parametrize("text, message", [("x", "'x': expected N or FEATURE=N"),
                                           ("targets=0", "'targets=0': a sequence length must be >= 1")])
def test_the_command_line_form_refuses_what_is_not_a_length(text, message):
    with pytest.raises(ValueError, match=message):
        L.parse_sequence_length((text,))
