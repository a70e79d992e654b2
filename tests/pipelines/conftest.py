"""Fixtures shared by the pipeline tests."""

import pytest


class _FlakyReader:
    """Wraps the pipeline's record reader: the first attempt fails after
    ``fail_after`` batches (None: only where the test makes it fail)."""

    def __init__(self, inner, fail_after):
        self.inner, self.fail_after, self.features = inner, fail_after, inner.features

    def read(self, file_index, path):
        for n, item in enumerate(self.inner.read(file_index, path)):
            if self.fail_after is not None and n == self.fail_after:
                raise RuntimeError("worker lost (first attempt)")
            yield item


@pytest.fixture
def flaky_reader():
    """The ``_FlakyReader`` class: a bundle's first attempt that fails mid-way."""
    return _FlakyReader
