"""Exact, random-access mixing: task and ordinal of a global position."""

import fractions

import numpy as np
import pytest

from seqcache.feeders.mixing import Mixer, integer_weights, rate_num_examples

RATE_SETS = [
    [1.0],
    [2, 1],
    [1, 1, 1],
    [0.5, 0.3, 0.2],
    [1, 2, 3, 4, 5, 6, 7],
    [1e-3, 1.0, 7.5, 2.25, 3.0],
    [0.1] * 10,
]


def _walk_counts(mixer, n):
    """Reference: counts per task over every prefix, by walking positions 0..n-1."""
    task, ordinal = mixer.locate_many(np.arange(n))
    counts = np.zeros((n + 1, mixer.num_tasks), np.int64)
    for p in range(n):
        counts[p + 1] = counts[p]
        counts[p + 1, task[p]] += 1
    return task, ordinal, counts


@pytest.mark.parametrize("rates", RATE_SETS)
def test_every_prefix_is_within_the_stated_bound(rates):
    w = integer_weights(rates)
    mixer = Mixer(w)
    n = 20_000
    task, ordinal, counts = _walk_counts(mixer, n)
    # The ordinal of p is the number of earlier positions of the same task.
    assert np.array_equal(ordinal, counts[np.arange(n), task])
    # |c_t(P) - P w_t / W| < depth_t for every prefix P (exact rationals).
    prefix = np.arange(n + 1)
    for t in range(len(w)):
        dev = np.abs(counts[:, t] * mixer.total - prefix * w[t])  # scaled by W
        if mixer.depth[t] == 0:
            assert dev.max() == 0
        else:
            assert dev.max() < mixer.depth[t] * mixer.total


@pytest.mark.parametrize("rates", RATE_SETS)
def test_far_prefixes_are_within_the_bound_and_random_access_is_consistent(rates):
    mixer = Mixer(integer_weights(rates))
    rng = np.random.default_rng(1)
    for start in rng.integers(0, 10**15, size=50).tolist() + [10**12, 2**61]:
        for p in (start, start + 1, start + 17):
            for t in range(mixer.num_tasks):
                c = mixer.count_before(t, p)
                target = fractions.Fraction(p * mixer.weights[t], mixer.total)
                if mixer.depth[t] == 0:
                    assert c == target
                else:
                    assert abs(c - target) < mixer.depth[t]
            # locate(p) = (t, c_t(p)), and p itself belongs to t.
            t, k = mixer.locate(p)
            assert k == mixer.count_before(t, p)
            assert mixer.count_before(t, p + 1) == k + 1
    # The vectorised walk agrees with the exact Python-integer walk.
    ps = np.concatenate([rng.integers(0, 2**61, size=2000), np.arange(100)])
    task, ordinal = mixer.locate_many(ps)
    for p, t, k in zip(ps.tolist()[::37], task.tolist()[::37], ordinal.tolist()[::37]):
        assert mixer.locate(p) == (t, k)


def test_first_position_with_count():
    mixer = Mixer(integer_weights([3, 1, 1]))
    for t in range(3):
        for count in (1, 2, 5, 100, 12345):
            p = mixer.first_position_with_count(t, count)
            assert mixer.count_before(t, p) >= count
            assert mixer.count_before(t, p - 1) < count


def test_integer_weights_rules():
    # Integer rates (or integral floats) are used as they are, reduced by their gcd.
    assert integer_weights([2, 1]) == [2, 1]
    assert integer_weights([4.0, 2.0]) == [2, 1]
    # Other rates: round_half_even(r * 2^30 / sum) from the exact binary value.
    w = integer_weights([0.5, 0.25, 0.25])
    assert w == [2, 1, 1]
    w = integer_weights([0.1, 0.2, 0.7])
    total = sum(fractions.Fraction(x) for x in (0.1, 0.2, 0.7))
    expect = [round(fractions.Fraction(x) * 2**30 / total) for x in (0.1, 0.2, 0.7)]
    assert w == expect
    # Deterministic: the same floats always give the same weights.
    assert integer_weights([1 / 3, 2 / 3]) == integer_weights([1 / 3, 2 / 3])


@pytest.mark.parametrize("bad", [[], [0.0, 1.0], [-1, 2], [float("nan")], [float("inf"), 1.0], [True, 1]])
def test_bad_rates_are_refused(bad):
    with pytest.raises(ValueError):
        integer_weights(bad)


def test_a_rate_too_small_to_represent_is_refused_with_a_fix():
    with pytest.raises(ValueError, match="never be sampled"):
        integer_weights([1e-12, 1.0])


def test_rate_num_examples_matches_seqio_formula():
    f = rate_num_examples(maximum=1000, temperature=2.0, scale=2.0)
    assert f(100) == pytest.approx(200**0.5)
    assert f(10_000) == pytest.approx(1000**0.5)
    assert rate_num_examples()(37) == 37.0
    with pytest.raises(ValueError, match="temperature"):
        rate_num_examples(temperature=0)


def test_one_rate_num_examples_for_tasks_and_feeders():
    from seqcache import rates, tasks
    from seqcache.feeders import mixing

    assert tasks.rate_num_examples is rates.rate_num_examples is mixing.rate_num_examples
    assert tasks.RateNumExamples is rates.RateNumExamples
    assert tasks.mixture.Rate is rates.Rate is mixing.Rate
    f = rate_num_examples(maximum=50, temperature=2.0)
    assert isinstance(f, rates.RateNumExamples) and f.params() == {"maximum": 50, "temperature": 2.0, "scale": 1.0}


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_rate_num_examples_of_no_examples_is_zero_and_of_a_negative_count_an_error(temperature):
    f = rate_num_examples(temperature=temperature, maximum=10)
    assert f(0) == 0.0 and isinstance(f(0), float)
    assert f(1) == pytest.approx(1.0) and f(20) == pytest.approx(10 ** (1 / temperature))
    with pytest.raises(ValueError, match=r"number of examples must be >= 0 \(got -3\)"):
        f(-3)


def test_a_task_whose_rate_is_zero_from_its_count_is_left_out_of_a_task_mixture():
    from seqcache.tasks import Mixture

    m = Mixture("m", [("a", rate_num_examples()), ("b", 2.0)])
    assert m.get_rates({"a": 0, "b": 5}) == {"a": 0.0, "b": 2.0}
    with pytest.raises(ValueError, match="at least one rate must be > 0"):
        Mixture("z", [("a", rate_num_examples())]).get_rates({"a": 0})


def test_golden_mixing_pattern():
    # Changing this pattern changes every mixture's stream: it needs a
    # STATE_VERSION bump (seqcache.feeders.state).
    task, ordinal = Mixer(integer_weights([2, 1, 1])).locate_many(np.arange(12))
    assert task.tolist() == [2, 1, 0, 0, 2, 1, 0, 0, 2, 1, 0, 0]
    assert ordinal.tolist() == [0, 0, 0, 1, 1, 1, 2, 3, 2, 2, 4, 5]
