"""Preprocessors: seqio semantics, batch fast path, and per-example RNG seeding."""

import hashlib

import numpy as np
import pytest

from seqcache.tasks import ByteVocabulary, Feature
from seqcache.tasks import preprocessors as P

BYTES = ByteVocabulary()
FEATURES = {"inputs": Feature(BYTES), "targets": Feature(BYTES, add_eos=False)}


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _ctx(n, *, seed=0, sequence_length=None, keys=None):
    return P.PreprocessContext(output_features=FEATURES, sequence_length=sequence_length, seed=seed,
                               keys=keys if keys is not None else [_key(i) for i in range(n)])


def test_rng_depends_only_on_seed_and_key():
    keys = [_key(i) for i in range(5)]
    a = _ctx(5, seed=3, keys=keys)
    b = _ctx(3, seed=3, keys=[keys[4], _key(99), keys[1]])  # other batch, other positions
    assert a.rng(4).integers(0, 2**31, 8).tolist() == b.rng(0).integers(0, 2**31, 8).tolist()
    assert a.rng(1).random(4).tolist() == b.rng(2).random(4).tolist()
    assert a.rng(1).random(4).tolist() != a.rng(2).random(4).tolist()
    assert _ctx(5, seed=4, keys=keys).rng(1).random(4).tolist() != a.rng(1).random(4).tolist()
    assert a.rng(1, salt="x").random(4).tolist() != a.rng(1).random(4).tolist()
    # The per-example context used by __call__ draws what the batch context draws.
    assert a.example(3).rng(0).random(3).tolist() == a.rng(3).random(3).tolist()
    # Global numpy state plays no part.
    np.random.seed(0)
    first = a.rng(0).random()
    np.random.seed(1)
    assert a.rng(0).random() == first


def test_rekey():
    out = P.rekey({"inputs": "question", "targets": "answer", "empty": None}).process_batch(
        [{"question": "q", "answer": "a", "other": 1}], _ctx(1))
    assert out == [{"inputs": "q", "targets": "a", "empty": ""}]
    with pytest.raises(ValueError, match=r"rekey: the example has no key 'answer' \(keys: \['question'\]\)"):
        P.rekey({"targets": "answer"}).process_batch([{"question": "q"}], _ctx(1))
    assert P.rekey({"b": "a"}).params() == {"key_map": {"b": "a"}}


class _CountingVocab(ByteVocabulary):
    def __init__(self):
        super().__init__()
        self.calls = []

    def encode_batch(self, texts):
        self.calls.append(len(texts))
        return super().encode_batch(texts)


def test_tokenize_one_call_per_feature():
    vocab = _CountingVocab()
    ctx = P.PreprocessContext(output_features={"inputs": Feature(vocab), "targets": Feature(vocab)},
                              sequence_length=None, seed=0, keys=[_key(i) for i in range(300)])
    examples = [{"inputs": f"in {i}", "targets": f"t{i}", "id": i} for i in range(300)]
    out = P.tokenize(copy_pretokenized=True).process_batch(examples, ctx)
    assert vocab.calls == [300, 300]
    assert out[5]["inputs"].tolist() == [x + 3 for x in b"in 5"] and out[5]["inputs"].dtype == np.int32
    assert out[5]["inputs_pretokenized"] == "in 5" and out[5]["id"] == 5
    assert examples[5]["inputs"] == "in 5"  # inputs are not mutated


def test_append_eos_and_trim():
    ex = [{"inputs": np.array([5, 6, 7], np.int32), "targets": np.array([8, 9], np.int32)}]
    out = P.append_eos().process_batch(ex, _ctx(1))
    assert out[0]["inputs"].tolist() == [5, 6, 7, 1] and out[0]["targets"].tolist() == [8, 9]  # add_eos=False
    trimmed = P.trim().process_batch(out, _ctx(1, sequence_length={"inputs": 2, "targets": 5}))
    assert trimmed[0]["inputs"].tolist() == [5, 6] and trimmed[0]["targets"].tolist() == [8, 9]
    assert trimmed[0]["_truncated_tokens"] == 2
    # Explicit lengths win over the context's; nothing to cut counts 0.
    kept = P.trim({"inputs": 10}).process_batch(out, _ctx(1, sequence_length={"inputs": 1}))
    assert kept[0]["inputs"].tolist() == [5, 6, 7, 1] and kept[0]["_truncated_tokens"] == 0
    # No lengths anywhere: a no-op.
    assert P.trim().process_batch(out, _ctx(1))[0]["inputs"].tolist() == [5, 6, 7, 1]


def test_append_eos_after_trim_keeps_eos():
    ex = [{"inputs": np.arange(10, 20, dtype=np.int32), "targets": np.arange(10, 20, dtype=np.int32)},
          {"inputs": np.array([10], np.int32), "targets": np.array([], np.int32)}]
    out = P.append_eos_after_trim().process_batch(ex, _ctx(2, sequence_length={"inputs": 4, "targets": 4}))
    assert out[0]["inputs"].tolist() == [10, 11, 12, 1]  # add_eos: 3 tokens + EOS
    assert out[0]["targets"].tolist() == [10, 11, 12, 13]  # no EOS: full length
    assert out[0]["_truncated_tokens"] == 7 + 6
    assert out[1]["inputs"].tolist() == [10, 1] and out[1]["_truncated_tokens"] == 0


def test_filter_empty():
    ex = [{"inputs": np.array([4], np.int32), "targets": np.array([], np.int32)},
          {"inputs": np.array([4], np.int32), "targets": np.array([5], np.int32)},
          {"inputs": np.array([4], np.int32)}]
    out = P.filter_empty().process_batch(ex, _ctx(3))
    assert out[0] is None and out[1] is ex[1] and out[2] is ex[2]


def _keep_even_with_draw(example, ctx):
    if example["n"] % 2:
        return None
    return {**example, "draw": int(ctx.rng(0).integers(0, 1 << 30))}


def _batched_double(examples, ctx):
    return [{**e, "n": e["n"] * 2} for e in examples]


def test_function_preprocessor_and_run():
    per_example = P.FunctionPreprocessor(_keep_even_with_draw, "keep_even", {"version": 1})
    batched = P.FunctionPreprocessor(_batched_double, "double", batched=True)
    assert per_example.params() == {"version": 1} and repr(per_example) == "keep_even(version=1)"
    keys = [_key(i) for i in range(6)]
    ctx = _ctx(6, seed=1, keys=keys)
    out = P.run_preprocessors([per_example, batched], [{"n": i} for i in range(6)], ctx)
    assert [i for i, _ in out] == [0, 2, 4]
    assert [e["n"] for _, e in out] == [0, 4, 8]
    assert out[1][1]["draw"] == int(ctx.rng(2).integers(0, 1 << 30))
    with pytest.raises(ValueError, match="returned 1 outputs for 2 examples"):
        P.FunctionPreprocessor(lambda exs, c: exs[:1], "bad", batched=True).process_batch([{}, {}], _ctx(2))


@pytest.mark.parametrize("keep", [0, 1, 3, 7, None])
@pytest.mark.parametrize("eos", [None, 1])
def test_cut_tokens_keeps_each_examples_first_tokens(keep, eos):
    """Every example's first ``keep`` tokens, then ``eos``, examples of every
    length (empty ones, exactly ``keep``, longer), against a loop over them."""
    from seqcache.tasks.preprocessors import cut_tokens

    rng = np.random.default_rng(7)
    lengths = rng.integers(0, 12, size=200)
    lengths[:4] = [0, keep or 0, (keep or 0) + 1, 11]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = rng.integers(2, 1000, size=int(offsets[-1])).astype(np.int32)
    got, got_offsets, cut = cut_tokens(values, offsets, keep, eos)
    want = [values[a:b][:keep].tolist() + ([eos] if eos is not None else [])
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    assert [got[a:b].tolist() for a, b in zip(got_offsets[:-1].tolist(), got_offsets[1:].tolist())] == want
    assert cut.tolist() == [max(n - keep, 0) if keep is not None else 0 for n in lengths.tolist()]
    assert got.dtype == np.int32
