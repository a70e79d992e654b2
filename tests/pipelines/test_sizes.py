"""Sizes: one text line of about 100 MB goes through the pipeline whole, exactly.

A corpus of two lines, a very long one and a short one, is built with ``trim`` to
the sequence length. The cache holds both examples; the long one is its line's
first L tokens; ``statistics.truncated_tokens`` is the exact number of tokens cut.
The build runs in a fresh process that reports its peak resident set size
(``ru_maxrss``), which must stay within a fixed multiple of the line's size.

Measured on the development machine (2 cores), build alone, L = 512:

  vocabulary      line     wall time   peak RSS   growth over the imports
  bytes           100 MB   3.5 s       0.79 GB    7.1 x line bytes (11.1 x before the
                                                   byte vocabulary added its offset in place)
  SentencePiece   100 MB   22.8 s      4.94 GB    50.5 x line bytes
  bytes           8 MB     1.2 s       0.22 GB    12.6 x (about 11 MiB fixed)
  SentencePiece   8 MB     2.3 s       0.54 GB    52 x

(SentencePiece: an 800-piece unigram model trained on botchan.txt.)

So the 100 MB line uses the byte vocabulary; SentencePiece is covered by an 8 MB
line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from seqcache import tasks
from seqcache.feeders.reader import CacheReader

L = 512
MIB = 1 << 20
SHORT = "a short line after the long one"

# Peak memory of the build, as growth over the child's RSS after its imports:
#   bytes:  the source record holds the line's raw bytes and its text (2 x n),
#           tokenizing makes a UTF-8 copy (n) and int32 tokens (4 x n):
#           7 x n, measured 7.1 x n. The limit, 9 x n, fails on one more int32
#           copy of the line, or on tokens held as Python ints (about 36 bytes
#           a token).
#   SentencePiece: its Python API returns token ids as a list of Python ints
#           (about 40 bytes a token, ~0.9 tokens a byte here): measured 52 x n.
# FIXED is what a build costs whatever the line (runner, buffers): about 11 MiB.
RATIO = {"bytes": 9, "sentencepiece": 64}
FIXED = 32 * MIB

_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    from seqcache import tasks
    from seqcache.pipelines import BuildConfig, build_task
    import apache_beam  # noqa: F401  (imported by the build; counted in the baseline)

    corpus, root, length, model = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    vocab = tasks.ByteVocabulary() if model == "bytes" else tasks.SentencePieceVocabulary(model)
    vocab.vocab_size  # loads the model
    task = tasks.Task(
        "long_line",
        source=tasks.TextLineSource(corpus),
        output_features={"targets": tasks.Feature(vocab)},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.preprocessors.trim()],
    )
    kib = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    before = kib()
    result = build_task(task, cache_dir=root, config=BuildConfig(num_shards=2, sequence_length={"targets": length}))
    out = {"baseline_bytes": before * 1024, "peak_bytes": kib() * 1024, "cache_dir": result.cache_dir}
    if model != "bytes":
        # Expected values straight from the vocabulary (after the measurement).
        with open(corpus, encoding="utf-8") as f:
            ids = vocab.encode(f.readline().rstrip("\\n"))
        out["num_tokens"] = len(ids)
        out["first_tokens"] = ids[:length]
    print(json.dumps(out))
    """
)


def _words(rng: np.random.Generator, count: int) -> list[str]:
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    return [bytes(rng.choice(letters, size=int(rng.integers(1, 11)))).decode("ascii") for _ in range(count)]


def write_long_line_corpus(path, num_bytes: int) -> bytes:
    """Writes line 0: ``num_bytes`` bytes of space-separated lowercase ASCII words
    (a ~1 MiB block of 5,000 distinct words drawn by a seeded generator, repeated,
    the last repeat cut at a word boundary and padded with "x" to the exact size),
    then line 1: SHORT. Streams the file; returns the line's first 64 KiB."""
    rng = np.random.default_rng(2024)
    words = _words(rng, 5000)
    block = (" ".join(rng.choice(words, size=180_000).tolist()) + " ").encode("ascii")
    left = num_bytes
    with open(path, "wb") as f:
        while left > len(block):
            f.write(block)
            left -= len(block)
        tail = block[:left]
        tail = tail[: tail.rindex(b" ") + 1] if b" " in tail[:-1] else b""
        f.write(tail + b"x" * (left - len(tail)))  # ends in a word ("x...x"), never a space
        f.write(b"\n" + SHORT.encode("ascii") + b"\n")
    return block[: 64 * 1024]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory, corpora):
    lines = corpora.botchan.read_text(encoding="utf-8").split("\n")
    path = tmp_path_factory.mktemp("spm") / "botchan.model"
    tasks.train_sentencepiece([s for s in lines if s.strip()][:3000], output_path=str(path), vocab_size=800)
    return str(path)


def _build(corpus, root, model) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(corpus), str(root), str(L), model],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The peak-RSS limit is linear in the line's length (RATIO), so 30 MB tells a bounded
# build from one that holds the line's tokens as well as 100 MB does (slow tests).
@pytest.mark.parametrize("kind, num_bytes", [
    ("bytes", 30_000_000), pytest.param("bytes", 100_000_000, marks=pytest.mark.slow), ("sentencepiece", 8_000_000)])
def test_one_very_long_line_is_truncated_exactly_in_bounded_memory(tmp_path, request, kind, num_bytes):
    corpus = tmp_path / "long.txt"
    head = write_long_line_corpus(corpus, num_bytes)
    assert corpus.stat().st_size == num_bytes + 1 + len(SHORT) + 1
    model = "bytes" if kind == "bytes" else request.getfixturevalue("spm_model")
    vocab = tasks.ByteVocabulary() if kind == "bytes" else tasks.SentencePieceVocabulary(model)
    try:
        out = _build(corpus, tmp_path / "cache", model)
    finally:
        corpus.unlink()  # 100 MB: not left behind in pytest's kept temporary folders

    # The line's first L tokens: the encoding of a prefix that ends at a word
    # boundary and is much longer than L tokens (pieces never cross a space).
    prefix = head[: head.rindex(b" ", 0, 16 * L)].decode("ascii")
    want_long = vocab.encode(prefix)[:L]
    assert len(want_long) == L
    if kind == "bytes":
        num_tokens = num_bytes  # one token a byte
        assert want_long == [b + 3 for b in head[:L]]
    else:
        num_tokens = out["num_tokens"]
        assert out["first_tokens"] == want_long  # encoding the whole line agrees
        assert 0.5 * num_bytes < num_tokens < num_bytes
    want_short = vocab.encode(SHORT)
    assert 0 < len(want_short) < L

    with CacheReader(out["cache_dir"]) as r:
        stats = r.manifest.statistics.to_json()
        assert r.num_examples == 2
        examples = r.read_examples([0, 1])
        sources = r.read_sources([0, 1])
    by_line = {segs[0]["record_number"]: ex["targets"].tolist() for ex, segs in zip(examples, sources)}
    # Keyed by record number, the byte offset of a line's first byte: SHORT starts after the long line's newline.
    assert by_line == {0: want_long, num_bytes + 1: want_short}
    assert stats["examples"] == 2 and stats["source_records"] == 2 and stats["skipped_records"] == 0
    assert stats["truncated_tokens"] == num_tokens - L
    assert stats["tokens"] == {"targets": L + len(want_short)}
    assert stats["max_length"] == {"targets": L}

    growth = out["peak_bytes"] - out["baseline_bytes"]
    limit = RATIO[kind] * num_bytes + FIXED
    assert growth < limit, (
        f"building one {num_bytes}-byte line raised peak RSS by {growth / MIB:.0f} MiB "
        f"({growth / num_bytes:.1f} x the line), over the limit {limit / MIB:.0f} MiB"
    )
