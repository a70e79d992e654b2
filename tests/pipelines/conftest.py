"""Fixtures shared by the pipeline tests."""

import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

from testsupport import local_dask_cluster, write_lines

TESTS = pathlib.Path(__file__).resolve().parents[1]


class _FlakyReader:
    """Wraps the pipeline's record reader: the first attempt fails after
    ``fail_after`` batches (None: only where the test makes it fail)."""

    def __init__(self, inner, fail_after):
        self.inner, self.fail_after, self.features, self.num_shards = inner, fail_after, inner.features, inner.num_shards

    def read(self, split, skip=0):
        for n, item in enumerate(self.inner.read(split, skip=skip)):
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


# Runs in a fresh interpreter: builds ``lines_task(pattern)`` into the caches root
# (3 shards), and blocks, saying so, when it is about to write shard 2.
_BLOCKED_BUILD = textwrap.dedent(
    """
    import sys, threading
    tests, pattern, root, seed, overwrite = sys.argv[1:]
    sys.path.insert(0, tests)
    from seqcache.pipelines import BuildConfig, build_task, writer
    from testsupport import lines_task

    real = writer.write_shard
    def write_shard(cache_dir, *, index, **kw):
        if index == 2:
            print("BLOCKED", flush=True)
            threading.Event().wait()  # killed here, after shards 0 and 1 are in place
        return real(cache_dir, index=index, **kw)
    writer.write_shard = write_shard

    build_task(lines_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3, seed=int(seed)),
               overwrite=overwrite == "overwrite")
    """
)


def _kill_a_build_at_shard_2(pattern: str, root: str, *, seed: int = 0, overwrite: bool = False):
    """Builds ``testsupport.lines_task(pattern)`` into ``root`` (3 shards, ``seed``,
    ``overwrite``) in a child process and kills it (SIGKILL) once shards 0 and 1
    are written."""
    args = [str(TESTS), pattern, root, str(seed), "overwrite" if overwrite else "no"]
    proc = subprocess.Popen([sys.executable, "-c", _BLOCKED_BUILD, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "BLOCKED"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()


@pytest.fixture
def kill_a_build_at_shard_2():
    """``kill(pattern, root, seed=0, overwrite=False)``: a build killed after it
    has written shards 0 and 1 of 3."""
    return _kill_a_build_at_shard_2



@pytest.fixture(scope="module")
def dask_cluster():
    """``testsupport.local_dask_cluster()`` for a module's tests (skipped without dask.distributed)."""
    pytest.importorskip("distributed")
    cluster = local_dask_cluster()
    try:
        yield cluster
    finally:
        cluster.close()
