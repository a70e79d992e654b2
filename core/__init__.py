"""seqcache: deterministic, globally shuffled, indexed token caches for training
language models, and feeders that read them exactly once with O(1) resume.

Areas (one import namespace):
  seqcache.tasks      Task, Mixture, registries, sources, preprocessors, vocabularies
  seqcache.pipelines  the Beam pipeline that builds caches
  seqcache.feeders    the reader trainers import
  seqcache.training   a small JAX trainer on top of the feeder
  seqcache.cli        the application: the ``seqcache`` executable and its commands

The core (this folder, core/ in the repository: the cache format, the file
system, bounded JSON, the process's settings) sits under them all.
"""

__version__ = "0.2.0"
