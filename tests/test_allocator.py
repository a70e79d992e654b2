"""``seqcache build`` and the local engine's workers fix glibc malloc's
thresholds (``process.tune_allocator``): memory a heap frees at its top stays with
the process for the next batch instead of going back to the system and being
faulted in again. Other commands, and a process whose environment chose
malloc's settings, keep the allocator as it was. Each check in a fresh
interpreter; the page faults are the kernel's count for that process."""

import json
import os
import subprocess
import sys

import pytest


def _glibc():
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version
    except (OSError, AttributeError):
        return False
    return sys.platform.startswith("linux")


pytestmark = pytest.mark.skipif(not _glibc(), reason="glibc's malloc")

PATTERN = r'''
import json, os, resource, sys
import numpy as np
from seqcache import process
process.own_process()  # as every seqcache command is
if sys.argv[1] == "tune":
    process.tune_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [np.ones(100_000, np.uint8) for _ in range(200)]  # 20 MB in heap blocks (below 128 KiB each)
del blocks  # the heap's top is now 20 MB of free memory
before = faults()
blocks = [np.ones(100_000, np.uint8) for _ in range(200)]  # the same again
print(json.dumps(faults() - before))
'''


def _environment(**env):
    """This process's environment without malloc settings, with ``env`` added."""
    return {k: v for k, v in os.environ.items() if not (k.startswith("MALLOC_") or k == "GLIBC_TUNABLES")} | env


def _faults(*argv, **env):
    done = subprocess.run([sys.executable, "-c", PATTERN, *argv], capture_output=True, text=True, timeout=300,
                          env=_environment(**env))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tuned_process_keeps_freed_heap_memory_for_the_next_batch():
    plain = _faults("plain")  # seqcache's own process, no build: not tuned
    tuned = _faults("tune")
    # 20 MB is about 4,900 pages: faulted in again by default (fewer where the
    # kernel maps part of the heap in larger pages), kept when tuned.
    assert plain > 1000, plain
    assert tuned < plain / 10, (tuned, plain)


COMMANDS = r'''
import json, sys
from click.testing import CliRunner
from seqcache import process
from seqcache.cli.main import main
tuned, real = [], process.tune_allocator
process.tune_allocator = lambda: tuned.append(real()) or tuned[-1]
out = {}
for name, args in (("build", ["build", "--source", "text:" + sys.argv[1], "--vocabulary", "byte", "--name", "t",
                              "--cache-dir", sys.argv[2]]),
                   ("info", ["info", sys.argv[2] + "/t/train"])):
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    out[name], tuned[:] = list(tuned), []
print(json.dumps(out))
'''


def test_the_build_command_tunes_its_process_and_other_commands_do_not(tmp_path):
    corpus = tmp_path / "lines.txt"
    corpus.write_text("".join(f"line {i}\n" for i in range(200)))
    done = subprocess.run([sys.executable, "-c", COMMANDS, str(corpus), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300, env=_environment())
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"build": [True], "info": []}


@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, {"MALLOC_ARENA_MAX": "2"},
                                 {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_malloc_settings_in_the_environment_are_left_alone(env):
    left_alone, plain = _faults("tune", **env), _faults("plain")
    assert plain > 1000 and left_alone > plain / 2, (left_alone, plain)


def test_own_processes_collect_the_young_generation_less_often_and_library_users_keep_theirs():
    code = ("import gc, json; before = gc.get_threshold(); import seqcache.pipelines, seqcache.feeders; "
            "from seqcache import process; library = gc.get_threshold(); process.own_process(); "
            "print(json.dumps([before, library, gc.get_threshold()]))")
    before, library, own = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                     check=True).stdout)
    assert library == before  # importing the package changes nothing
    from seqcache import process

    assert own == list(process.GC_THRESHOLDS) and own[0] > before[0]
