"""seqcache: deterministic, globally shuffled, indexed token caches for training
language models, and feeders that read them exactly once with O(1) resume.

Areas (one import namespace):
  seqcache.tasks      Task, Mixture, registries, sources, preprocessors, vocabularies
  seqcache.pipelines  the Beam pipeline that builds caches
  seqcache.feeders    the reader trainers import
  seqcache.training   a small JAX trainer on top of the feeder
"""

__version__ = "0.2.0"

# From a source checkout (the repository root on sys.path, e.g. a script or
# ``python -c`` run there), this folder holds only the package's face: the areas
# live beside it (tasks/, pipelines/, feeders/, training/, mapped to
# seqcache.tasks ... by package-dir in pyproject.toml). Looking for subpackages
# in the checkout's root too gives the whole package there, as installed.
def _cover_source_checkout() -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if not os.path.isdir(os.path.join(here, "pipelines")) and os.path.isfile(
            os.path.join(root, "pipelines", "__init__.py")) and root not in __path__:
        __path__.append(root)


_cover_source_checkout()
del _cover_source_checkout
