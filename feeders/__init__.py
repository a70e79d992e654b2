"""seqcache.feeders: exactly-once, resumable, host-sliced batches from seqcache caches.

    from seqcache.feeders import Feeder

    with Feeder(cache="caches/wiki/train", global_batch_size=256, sequence_length=512) as feeder:
        for batch in feeder:
            ...

The index vocabulary (global position, step, row, host, task, ordinal, epoch,
cache index) is defined at the top of ``seqcache.feeders.feeder``; the algorithms
and guarantees are in docs/feeder.md. This package imports neither Beam nor JAX:
``make_global_batch`` (JAX) and the Orbax helpers import them when called.

The trainers beyond seqcache's own (docs/trainers.md), each imported on its own
and importing its trainer only when used: ``seqcache.feeders.trainers.t5x``
(``get_deterministic_dataset``), ``seqcache.feeders.trainers.levanter``
(``cache_dataset``), ``seqcache.feeders.trainers.torch`` (``FeederLoader``) and
``seqcache.feeders.trainers.export`` (``seqcache export --format maxtext``). Where an
example was seen in a run: ``seqcache.feeders.inverse`` and ``Feeder.where``.
"""

from seqcache.feeders.checkpoint import feeder_restore_args, feeder_save_args, restore_feeder
from seqcache.feeders.converters import ConvertedFeeder, autoregressive_inputs
from seqcache.feeders.feeder import Feeder, check_hosts, default_hosts, positions_from_segment_ids
from seqcache.feeders.grain_source import CacheDataSource
from seqcache.feeders.jax_arrays import make_global_batch
from seqcache.feeders.mixing import Mixer, integer_weights, rate_num_examples
from seqcache.feeders.permutation import FeistelPermutation, epoch_permutation
from seqcache.feeders.provenance import which
from seqcache.feeders.reader import CacheReader
from seqcache.feeders.state import STATE_VERSION, FeederStateError
from seqcache.feeders.stream import IndexStream, Located

__all__ = [
    "ConvertedFeeder",
    "autoregressive_inputs",
    "STATE_VERSION",
    "CacheDataSource",
    "CacheReader",
    "Feeder",
    "FeederStateError",
    "FeistelPermutation",
    "IndexStream",
    "Located",
    "Mixer",
    "check_hosts",
    "default_hosts",
    "epoch_permutation",
    "feeder_restore_args",
    "feeder_save_args",
    "integer_weights",
    "make_global_batch",
    "positions_from_segment_ids",
    "rate_num_examples",
    "restore_feeder",
    "which",
]
