"""seqcache.feeders.trainers: the feeder as other trainers take it, one module
each, importing its trainer only when used (docs/trainers.md):

  seqcache.feeders.trainers.t5x       a clu iterator for t5x's ``get_dataset_fn``
                                      (gin files in ``t5x_gin/``)
  seqcache.feeders.trainers.levanter  an ``AsyncDataset``
  seqcache.feeders.trainers.torch     ``Stateful`` loaders (PyTorch, torchdata, torchtitan)
  seqcache.feeders.trainers.export    ``seqcache export --format maxtext``

These modules import the feeder; the feeder never imports them. This file
imports nothing.
"""
