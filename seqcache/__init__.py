"""seqcache: deterministic, globally shuffled, indexed token caches for training
language models, and feeders that read them exactly once with O(1) resume.

Areas (one import namespace):
  seqcache.tasks      Task, Mixture, registries, sources, preprocessors, vocabularies
  seqcache.pipelines  the Beam pipeline that builds caches
  seqcache.feeders    the reader trainers import
  seqcache.training   a small JAX trainer on top of the feeder
"""

__version__ = "0.1.0"
