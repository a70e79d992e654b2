"""Fixtures shared by the pipeline tests."""

import pytest

from testsupport import write_lines


class _FlakyReader:
    """Wraps the pipeline's record reader: the first attempt fails after
    ``fail_after`` batches (None: only where the test makes it fail)."""

    def __init__(self, inner, fail_after):
        self.inner, self.fail_after, self.features = inner, fail_after, inner.features

    def read(self, split):
        for n, item in enumerate(self.inner.read(split)):
            if self.fail_after is not None and n == self.fail_after:
                raise RuntimeError("worker lost (first attempt)")
            yield item


@pytest.fixture
def flaky_reader():
    """The ``_FlakyReader`` class: a work unit's first attempt that fails mid-way."""
    return _FlakyReader


def _attempt(step, element):
    """Runs one attempt of a step (``ReadUnit``, ``WriteGroup``) on one element
    the way a runner does; returns its outputs, or None when the attempt failed
    (a runner then discards everything it emitted)."""
    out = []
    try:
        for item in step(element):
            out.append(item)
    except RuntimeError:
        return None
    return out


def _group(outputs):
    """What GroupByKey makes of a step's ``(key, value)`` outputs."""
    import collections

    groups = collections.defaultdict(list)
    for key, value in outputs:
        groups[key].append(value)
    return dict(groups)


@pytest.fixture
def attempt():
    """``attempt(step, element)``: one attempt of a step, its outputs or None."""
    return _attempt


@pytest.fixture
def group():
    """``group(outputs)``: GroupByKey of ``(key, value)`` outputs."""
    return _group


@pytest.fixture
def shakespeare_halves(tmp_path, corpora):
    """``make(num_lines)``: the new folder ``tmp_path/in`` holding the first
    ``num_lines`` lines of tinyshakespeare, the first half in ``a.txt`` and the
    rest in ``b.txt``; returns the folder."""

    def make(num_lines: int):
        lines = corpora.shakespeare_lines(num_lines)
        folder = tmp_path / "in"
        folder.mkdir()
        write_lines(folder / "a.txt", lines[:num_lines // 2])
        write_lines(folder / "b.txt", lines[num_lines // 2:])
        return folder

    return make
