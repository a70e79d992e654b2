"""Build statistics: what each shard writer counts, and their merge into the
manifest's ``statistics`` (units: examples and segments in records; tokens and
lengths in tokens)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np


class ShardStats:
    """Statistics of one written shard: examples and segments (records), tokens
    and the longest example per feature (tokens), tokens trimmed away."""

    def __init__(self, features):
        self.names = [f.name for f in features if not f.name.endswith(("_segment_ids", "_positions"))]
        self.examples = 0
        self.segments = 0
        self.source_examples = 0
        self.truncated_tokens = 0
        self.tokens = dict.fromkeys(self.names, 0)
        self.max_length = dict.fromkeys(self.names, 0)

    def add(self, example, segments):
        self.add_lengths([int(example[name].size) for name in self.names], segments)

    def add_many(self, lengths):
        """Unpacked examples, one segment each; ``lengths`` (n, F) in ``self.names`` order."""
        n = int(lengths.shape[0])
        self.examples += n
        self.segments += n
        for k, name in enumerate(self.names):
            if n:
                self.tokens[name] += int(lengths[:, k].sum(dtype=np.int64))
                self.max_length[name] = max(self.max_length[name], int(lengths[:, k].max()))

    def add_lengths(self, lengths, segments):
        """``lengths``: tokens per feature, in ``self.names`` order."""
        self.examples += 1
        self.segments += segments
        for name, n in zip(self.names, lengths):
            self.tokens[name] += n
            if n > self.max_length[name]:
                self.max_length[name] = n

    def to_json(self):
        return {
            "examples": self.examples,
            "segments": self.segments,
            "source_examples": self.source_examples,
            "truncated_tokens": self.truncated_tokens,
            "tokens": self.tokens,
            "max_length": self.max_length,
        }


def merge_stats(per_shard: Sequence[Mapping[str, Any]], records_read: int | None) -> dict:
    names = sorted({n for s in per_shard for n in s["tokens"]})
    examples = sum(s["examples"] for s in per_shard)
    tokens = {n: sum(s["tokens"].get(n, 0) for s in per_shard) for n in names}
    out = {
        "examples": examples,
        "segments": sum(s["segments"] for s in per_shard),
        "source_examples": sum(s["source_examples"] for s in per_shard),
        "tokens": tokens,
        "max_length": {n: max((s["max_length"].get(n, 0) for s in per_shard), default=0) for n in names},
        "mean_length": {n: (tokens[n] / examples if examples else 0.0) for n in names},
        "truncated_tokens": sum(s["truncated_tokens"] for s in per_shard),
        "skipped_records": 0,
        "units": "examples and segments in records; tokens, lengths in tokens",
    }
    if records_read is not None:
        out["source_records"] = records_read
    return out
