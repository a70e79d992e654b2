"""End to end on real text: a packed cache built by the Beam pipeline from
tinyshakespeare, fed by the Feeder, traced back to source lines by `which`
(a line's record number is the byte offset of its first byte)."""

import numpy as np
import pytest

from seqcache.feeders import Feeder

L = 64


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory, corpora, shakespeare_lm_cache):
    pytest.importorskip("seqcache.tasks")
    pytest.importorskip("seqcache.pipelines")
    lines = corpora.shakespeare_lines(1500)
    root = shakespeare_lm_cache(tmp_path_factory, num_lines=1500, sequence_length=L, num_shards=3)
    # A text line's record number is the byte offset of its first byte: map it back to the line.
    line_at, start = {}, 0
    for k, line in enumerate(lines):
        line_at[start] = k
        start += len(line.encode("utf-8")) + 1
    return str(root / "shakespeare_lm" / "train"), lines, line_at


def test_every_packed_example_once_and_traced_to_its_source_line(shakespeare_cache):
    cache_dir, lines, line_at = shakespeare_cache
    with Feeder(cache=cache_dir, global_batch_size=8, sequence_length=L, host_index=0, host_count=2,
                num_epochs=1, seed=1) as f:
        n = f.readers[0].num_examples
        seen = [int(i) for b in f for i in b["cache_index"] if i >= 0]  # host 0's half of every step
    with Feeder(cache=cache_dir, global_batch_size=8, sequence_length=L, host_index=1, host_count=2,
                num_epochs=1, seed=1) as g:
        other = [int(i) for b in g for i in b["cache_index"] if i >= 0]
    assert n > 100 and not set(seen) & set(other)
    assert sorted(seen + other) == list(range(n))  # every example exactly once over the two hosts

    with Feeder(cache=cache_dir, global_batch_size=8, sequence_length=L, host_index=0, host_count=1, seed=1) as f:
        batch = f.get_batch(3)
        texts = 0
        for row in range(8):
            d = f.which(3, row)
            assert d["cache_index"] == int(batch["cache_index"][row])
            seg_ids = batch["targets_segment_ids"][row]
            assert len(d["segments"]) == len(set(seg_ids[seg_ids > 0].tolist()))
            for seg in d["segments"]:
                assert seg["source"].endswith("play.txt")
                assert seg["record_number"] in line_at  # the first byte of a line
                line = lines[line_at[seg["record_number"]]]
                # The segment's text is the source line (from its token offset; the
                # byte vocabulary drops the EOS id), possibly cut by packing.
                text = seg["text"]
                assert line and line.encode()[seg["token_offset"]:].decode("utf-8", "replace").startswith(text)
                texts += len(text) > 3
            # The batch row holds exactly the tokens `which` reports, segment by segment.
            tokens = np.concatenate([np.array(s["token_ids"], np.int32) for s in d["segments"]])
            assert np.array_equal(batch["targets"][row][: tokens.size], tokens)
        assert texts >= 8  # real text was traced, not only end-of-line remnants
