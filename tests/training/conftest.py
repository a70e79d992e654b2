"""Fixtures for the trainer tests.

The fake feeder module is loaded under a unique module name so that it cannot
collide with helper modules of other test folders (tests run with
``--import-mode=importlib``, without package ``__init__`` files).
"""

import importlib.util
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
FAKES_MODULE = "seqcache_training_test_fakes"


def _load_fakes():
    if FAKES_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(FAKES_MODULE, HERE / "fakes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[FAKES_MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[FAKES_MODULE]


_load_fakes()
