"""seqcache's own processes fix glibc malloc's thresholds (``fs.tune_allocator``):
memory a heap frees at its top stays with the process for the next batch
instead of going back to the system and being faulted in again. A process
whose environment chose malloc's settings keeps them. Each check in a fresh
interpreter; the page faults are the kernel's count for that process."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

PATTERN = r'''
import json, resource, sys
import numpy as np
from seqcache import fs
if sys.argv[1] == "own":
    fs.own_process()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [np.ones(100_000, np.uint8) for _ in range(200)]  # 20 MB in heap blocks (below 128 KiB each)
del blocks  # the heap's top is now 20 MB of free memory
before = faults()
blocks = [np.ones(100_000, np.uint8) for _ in range(200)]  # the same again
print(json.dumps(faults() - before))
'''


def _faults(kind, **env):
    environ = {k: v for k, v in os.environ.items()
               if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")} | env
    done = subprocess.run([sys.executable, "-c", PATTERN, kind], capture_output=True, text=True, timeout=120,
                          env=environ)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _glibc():
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except AttributeError:
        return False
    return True


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_own_process_keeps_freed_heap_memory_for_the_next_batch():
    plain = _faults("plain")
    own = _faults("own")
    # 20 MB is about 4,900 pages: faulted in again by default, kept when tuned.
    assert plain > 3000, plain
    assert own < plain / 10, (own, plain)


@pytest.mark.skipif(not _glibc(), reason="glibc's malloc")
def test_malloc_settings_in_the_environment_are_left_alone():
    chosen = _faults("own", GLIBC_TUNABLES="glibc.malloc.perturb=0")
    assert chosen > 3000, chosen
    from seqcache import fs

    saved = dict(os.environ)
    try:
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "131072"
        assert fs.tune_allocator() is False
    finally:
        os.environ.clear()
        os.environ.update(saved)
