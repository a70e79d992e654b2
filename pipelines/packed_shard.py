"""Language-model packing of one sorted shard, from its encoded examples to
the writer's encoded rows (``seqcache.tasks.packing.pack_lm_encoded``), with
the shard's statistics counted a batch of rows at a time.

The bytes written are those of ``pack_lm`` over the decoded examples, each
row encoded by ``writer.write_shard`` (``format.encode_example`` and
``format.encode_provenance``), data file group size included; only the cost
differs: array operations per chunk of examples (``spill.CHUNK_BYTES``)
instead of Python per example and per row.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache.pipelines import spill, stats as stats_mod, writer
from seqcache.tasks.packing import pack_lm_encoded


def pack_lm_shard(entries: spill.ShardEntries, *, features_in: Sequence[fmt.FeatureSpec],
                  features_out: Sequence[fmt.FeatureSpec], sequence_length: int,
                  stats: stats_mod.ShardStats) -> tuple[writer.EncodedChunks, int | None]:
    """The rows of an ``lm``-packed shard, for ``writer.write_shard``.

    Args:
      entries: the shard's examples, sorted (their example bytes encoded with
        ``features_in``; ``lengths`` ``(n, 1)`` tokens).
      features_in: the one token feature ``[f]`` of the examples.
      features_out: the rows' features, ``[f, f + "_segment_ids"]``.
      sequence_length: tokens per row (>= 1).
      stats: counts every row (``ShardStats.add_many``) as the chunks are
        consumed, as ``add(row, segments)`` on each row would.

    Returns:
      ``(chunks, group_size)``: the rows and their provenance records (one
      segment ``(file index, record number, token offset)`` per example part
      in the row), as ``writer.EncodedChunks`` of at most
      ``packing.ENCODED_ROWS`` rows; and the data file's group size, that of
      the writer's rule on these rows (``lm_group_size``), None for no rows.

    Raises:
      ValueError: features that are not one token feature and its segment
        ids; (while consumed) ``pack_lm_encoded``'s errors.
    """
    token, segment_ids = _packed_features(features_in, features_out)
    lengths = np.asarray(entries.lengths).reshape(len(entries), 1)[:, 0]

    def batches():
        for lo, hi, data in entries.example_chunks():
            yield data, entries.file_index[lo:hi], entries.record_number[lo:hi], lengths[lo:hi]

    def chunks() -> Iterator[tuple[list[bytes], list[bytes]]]:
        for rows in pack_lm_encoded(batches(), sequence_length=sequence_length, dtype=token.dtype,
                                    segment_dtype=segment_ids.dtype):
            stats.add_many(rows.lengths[:, None], rows.segments)
            yield rows.records, rows.provenances

    total = int(lengths.sum(dtype=np.int64))
    return writer.EncodedChunks(chunks()), lm_group_size(total, sequence_length=sequence_length,
                                                         features=features_out)


def lm_group_size(total_tokens: int, *, sequence_length: int, features: Sequence[fmt.FeatureSpec]) -> int | None:
    """The data file's group size of an ``lm``-packed shard of ``total_tokens``
    tokens: ``format.group_size_for`` the mean size (bytes) of its first
    ``writer.FIRST_CHUNK`` rows, the rule ``writer.write_shard`` applies to rows
    given one by one; None for no rows (the writer's choice for an empty file).

    A row of ``n`` tokens is ``4 + n * itemsize`` bytes per feature of
    ``features`` (the tokens, their segment ids); every row holds
    ``sequence_length`` tokens but the last.
    """
    rows = -(-int(total_tokens) // int(sequence_length))
    if rows == 0:
        return None
    first = min(rows, writer.FIRST_CHUNK)
    tokens = min(int(total_tokens), first * int(sequence_length))
    size = first * 4 * len(features) + tokens * sum(f.np_dtype.itemsize for f in features)
    return fmt.group_size_for(size / first)


def _packed_features(features_in, features_out) -> tuple[fmt.FeatureSpec, fmt.FeatureSpec]:
    """(the token feature, its segment ids), checked."""
    features_in, features_out = list(features_in), list(features_out)
    if len(features_in) != 1 or len(features_out) != 2 or features_out[0] != features_in[0] \
            or features_out[1].name != f"{features_in[0].name}_segment_ids":
        raise ValueError(f"lm packing needs one token feature f in and [f, f_segment_ids] out "
                         f"(got {features_in} in, {features_out} out)")
    return features_out[0], features_out[1]
