"""seqcache: deterministic, globally shuffled, indexed token caches for training
language models, and feeders that read them exactly once with O(1) resume.

Areas (one import namespace):
  seqcache.tasks      Task, Mixture, registries, sources, preprocessors, vocabularies
  seqcache.pipelines  the Beam pipeline that builds caches
  seqcache.feeders    the reader trainers import
  seqcache.training   a small JAX trainer on top of the feeder
"""

import os

__version__ = "0.2.0"

# From a source checkout (the repository root on sys.path), this folder holds
# only the package's face: the areas live beside it (tasks/, pipelines/, ...,
# mapped by package-dir in pyproject.toml). Looking for subpackages in the
# checkout's root too gives the whole package there, as installed.
_here = os.path.dirname(os.path.abspath(__file__))
_root = os.path.dirname(_here)
if not os.path.isdir(os.path.join(_here, "pipelines")) and os.path.isfile(
        os.path.join(_root, "pipelines", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
del _here, _root
