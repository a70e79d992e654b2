"""Hugging Face tokenizers vocabularies: special ids, sentinels, batch encoding,
storage in a cache, pickling into fresh processes, deterministic training."""

import hashlib
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from seqcache import tasks
from seqcache.manifest import read_shard_checksums
from seqcache.tasks import hf_tokenizer as H
from seqcache.tasks import sources as S
from seqcache.tasks import vocabularies as V
from testsupport import write_lines


@pytest.fixture(scope="module")
def botchan_sample(corpora):
    src = S.TextLineSource(str(corpora.botchan), on_error={"empty": "skip"})
    return tasks.sample_for_vocabulary(src, max_records=3000, seed=7)


@pytest.fixture(scope="module")
def bpe_path(botchan_sample, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    H.train_hf_tokenizer(botchan_sample, output_path=str(path), model="bpe", vocab_size=800)
    return path


def _word_level(tmp_path, specials, name="wl.json"):
    """A tiny WordLevel tokenizer.json with the given special tokens first."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = [*specials, "hello", "world", "[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    path = tmp_path / name
    path.write_text(tok.to_str(), encoding="utf-8")
    return path


def test_trained_bpe_has_t5_special_ids_and_round_trips(bpe_path, botchan_sample, corpora):
    v = H.HfTokenizerVocabulary(str(bpe_path))
    assert (v.pad_id, v.eos_id, v.unk_id) == (0, 1, 2)
    assert v.special_tokens() == {"eos": "</s>", "pad": "<pad>", "unk": "<unk>"}
    assert v.vocab_size == v.base_vocab_size == 800
    arrays = v.encode_batch(botchan_sample[:500])
    assert all(a.dtype == np.int32 and a.ndim == 1 for a in arrays)
    assert [a.tolist() for a in arrays] == [v.encode(t) for t in botchan_sample[:500]]
    # Byte-level BPE encodes everything; NFKC is the only change (none on this text).
    assert tasks.round_trip_problems(v, botchan_sample[:500]) == []
    lines = corpora.blns.read_text(encoding="utf-8").split("\n")
    import unicodedata

    for line in lines:
        assert v.decode(v.encode(line)) == unicodedata.normalize("NFKC", line)
    # Special tokens written in the text are text, never control ids.
    ids = v.encode("a </s> b <pad>")
    assert v.eos_id not in ids and v.pad_id not in ids and v.decode(ids) == "a </s> b <pad>"
    assert v.decode([v.pad_id, *v.encode("hi"), v.eos_id, v.pad_id]) == "hi"
    assert v.encode_batch([]) == []


def test_extra_ids_are_the_last_ids_in_seqio_order(bpe_path):
    v = H.HfTokenizerVocabulary(str(bpe_path), extra_ids=100)
    assert v.vocab_size == 900 and v.base_vocab_size == 800
    assert v.sentinel_id(0) == 899 and v.sentinel_id(99) == 800
    assert v.id_to_piece(899) == "<extra_id_0>" and v.id_to_piece(800) == "<extra_id_99>"
    assert v.decode([v.sentinel_id(0), *v.encode("x y"), v.sentinel_id(5)]) == "x y"
    with pytest.raises(ValueError, match="sentinel index 100 is out of range"):
        v.sentinel_id(100)
    assert v.fingerprint()["extra_ids"] == 100
    assert v != H.HfTokenizerVocabulary(str(bpe_path))  # the sentinels are part of the identity


def test_special_tokens_are_found_named_or_refused(tmp_path):
    gpt = H.HfTokenizerVocabulary(str(_word_level(tmp_path, ["<|endoftext|>"], "gpt.json")))
    assert (gpt.eos_id, gpt.pad_id, gpt.unk_id) == (0, 0, 3)  # no pad: the EOS id; unk from the model
    bert = _word_level(tmp_path, ["[PAD]", "[CLS]", "[SEP]"], "bert.json")
    with pytest.raises(ValueError, match=r"bert\.json: the tokenizer has none of the EOS tokens.*\[CLS\], \[PAD\], \[SEP\]"):
        H.HfTokenizerVocabulary(str(bert)).encode("hello")
    named = H.HfTokenizerVocabulary(str(bert), eos_token="[SEP]")
    assert (named.eos_id, named.pad_id, named.unk_id) == (2, 0, 5)
    with pytest.raises(ValueError, match=r"bert\.json: the eos token '</s>' is not in the tokenizer's vocabulary"):
        H.HfTokenizerVocabulary(str(bert), eos_token="</s>").eos_id
    # The same through a --vocabulary spec, and the EOS choice is part of the identity.
    spec = tasks.vocabulary_from_spec(f"{bert}#eos=[SEP],pad=[CLS]")
    assert (spec.eos_id, spec.pad_id) == (2, 1)
    assert spec.fingerprint() != named.fingerprint()
    with pytest.raises(ValueError, match="bad vocabulary option 'bos=x'"):
        tasks.vocabulary_from_spec(f"{bert}#eos=[SEP],bos=x")
    with pytest.raises(ValueError, match="is not a valid tokenizer.json"):
        H.HfTokenizerVocabulary(tokenizer_bytes=b"{not json")


def test_truncation_and_padding_in_the_file_are_ignored(bpe_path, tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bpe_path))
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=64)
    changed = tmp_path / "truncating.json"
    changed.write_text(tok.to_str(), encoding="utf-8")
    text = "a sentence that is longer than four tokens, surely"
    assert H.HfTokenizerVocabulary(str(changed)).encode(text) == H.HfTokenizerVocabulary(str(bpe_path)).encode(text)
    assert len(H.HfTokenizerVocabulary(str(changed)).encode(text)) > 4


def test_spec_and_json_round_trip_and_checks(bpe_path, tmp_path):
    v = tasks.vocabulary_from_spec(str(bpe_path), extra_ids=3)
    assert isinstance(v, H.HfTokenizerVocabulary)
    # A tokenizer.json under another name is recognised by its content.
    other = tmp_path / "vocab.bin"
    other.write_bytes(bpe_path.read_bytes())
    assert tasks.vocabulary_from_spec(str(other), extra_ids=3) == v
    assert tasks.vocabulary_from_spec(str(bpe_path.parent), extra_ids=3) == v  # the folder that holds it
    desc = v.to_json()
    assert desc["kind"] == "hf_tokenizer" and desc["sha256"] == hashlib.sha256(bpe_path.read_bytes()).hexdigest()
    (tmp_path / desc["file"]).write_bytes(v.model_bytes())
    back = tasks.vocabulary_from_json(json.loads(json.dumps(desc)), str(tmp_path))
    assert back == v and back.encode("the school") == v.encode("the school")
    (tmp_path / desc["file"]).write_bytes(v.model_bytes().replace(b'"</s>"', b'"</S>"'))
    with pytest.raises(ValueError, match=r"tokenizer\.json .* has sha256 [0-9a-f]{64}, but the cache expects"):
        tasks.vocabulary_from_json(desc, str(tmp_path))


def test_pickle_carries_the_bytes_into_a_fresh_process(bpe_path, tmp_path):
    copy = tmp_path / "gone.json"
    copy.write_bytes(bpe_path.read_bytes())
    v = H.HfTokenizerVocabulary(str(copy), extra_ids=2)
    expected = v.encode_batch(["the school master", "Botchan"])
    blob = tmp_path / "vocab.pkl"
    blob.write_bytes(pickle.dumps(v))
    copy.unlink()  # a worker cannot open the path: it must get the bytes
    code = ("import pickle, sys, json; v = pickle.load(open(sys.argv[1], 'rb')); "
            "print(json.dumps([a.tolist() for a in v.encode_batch(['the school master', 'Botchan'])] "
            "+ [v.sha256, v.vocab_size]))")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], check=True, capture_output=True, text=True,
                         timeout=120)
    *ids, sha, size = json.loads(out.stdout)
    assert ids == [a.tolist() for a in expected] and sha == v.sha256 and size == 802


def test_pickle_carries_a_stored_tokenizer_by_reference(bpe_path, tmp_path):
    """Inside ``stored_models`` (a build's steps) a stored tokenizer.json travels
    as its file's URL and sha256, and loads from there in a fresh process."""
    data = bpe_path.read_bytes()
    stored = tmp_path / "vocabulary-targets.json"
    stored.write_bytes(data)
    v = H.HfTokenizerVocabulary(str(bpe_path), extra_ids=2)
    expected = [a.tolist() for a in v.encode_batch(["the school master", "Botchan"])]
    with V.stored_models({str(stored): data}):
        blob = pickle.dumps(v)
    assert len(blob) < 2000 < len(data)
    stored.rename(tmp_path / "elsewhere.json")
    # Pickled again where the copy cannot be read (a Dask worker before it has the
    # build's file-system options): the same reference, the file not read.
    (tmp_path / "vocab.pkl").write_bytes(pickle.dumps(pickle.loads(blob)))
    assert (tmp_path / "vocab.pkl").stat().st_size < 2000
    (tmp_path / "elsewhere.json").rename(stored)
    code = ("import pickle, sys, json; v = pickle.load(open(sys.argv[1], 'rb')); "
            "print(json.dumps([a.tolist() for a in v.encode_batch(['the school master', 'Botchan'])] + [v.sha256]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "vocab.pkl")], check=True, capture_output=True,
                         text=True, timeout=120)
    *ids, sha = json.loads(out.stdout)
    assert ids == expected and sha == v.sha256


_TRAIN = """
import sys
from seqcache.tasks import hf_tokenizer as H, sources as S, vocabulary_training as V
src = S.TextLineSource(sys.argv[1], on_error={"empty": "skip"})
texts = V.sample_for_vocabulary(src, max_records=1500, seed=3)
H.train_hf_tokenizer(texts, output_path=sys.argv[2], model=sys.argv[3], vocab_size=600)
"""


@pytest.mark.parametrize("model", ["bpe", "unigram"])
def test_training_is_byte_identical_across_processes(model, corpora, tmp_path):
    corpus = str(corpora.botchan)
    digests = []
    for name in ("a.json", "b.json"):
        out = tmp_path / name
        subprocess.run([sys.executable, "-c", _TRAIN, corpus, str(out), model], check=True, timeout=300)
        digests.append(hashlib.sha256(out.read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    v = H.HfTokenizerVocabulary(str(tmp_path / "a.json"))
    assert (v.pad_id, v.eos_id, v.unk_id, v.vocab_size) == (0, 1, 2, 600)
    assert v.decode(v.encode("the school master")) == "the school master"


def test_unigram_falls_back_to_bytes_and_keeps_spaces(botchan_sample, tmp_path):
    v = H.train_hf_tokenizer(botchan_sample, output_path=str(tmp_path / "u.json"), model="unigram", vocab_size=600,
                             normalization="identity")
    assert v.encode("the")[:1] != [v.unk_id]
    text = "the school  中文 𝒳"  # characters the sample lacks become byte tokens
    ids = v.encode(text)
    assert v.unk_id not in ids and any(v.id_to_piece(i).startswith("<0x") for i in ids)
    assert v.decode(ids) == text
    with pytest.raises(ValueError, match="vocab_size must be >= 260"):
        H.train_hf_tokenizer(["x"], output_path=str(tmp_path / "x.json"), model="bpe", vocab_size=100)
    with pytest.raises(ValueError, match="model must be one of"):
        H.train_hf_tokenizer(["x"], output_path=str(tmp_path / "x.json"), model="wordpiece", vocab_size=300)


def test_a_cache_built_with_it_in_fresh_workers_is_read_by_the_feeder(bpe_path, corpora, tmp_path):
    """multi_processing workers are fresh processes that cannot open the (deleted)
    tokenizer.json; the cache they build is the in-process one, byte for byte, and
    the feeder's batches decode back to the source lines."""
    pipelines = pytest.importorskip("seqcache.pipelines")
    from seqcache.feeders import CacheReader, Feeder

    lines = corpora.shakespeare_lines(2000)
    corpus = tmp_path / "corpus"
    write_lines(corpus / "play.txt", lines)
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(bpe_path.read_bytes())
    vocab = tasks.HfTokenizerVocabulary(str(copy))
    vocab.encode("load it")
    copy.unlink()
    L = 32
    task = tasks.Task(
        "shakespeare_bpe",
        source=tasks.TextLineSource(str(corpus / "play.txt"), on_error={"empty": "skip"}),
        output_features={"targets": tasks.Feature(vocab)},
        preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize(),
                       tasks.preprocessors.append_eos(), tasks.preprocessors.trim()],
    )
    config = pipelines.BuildConfig(num_shards=2, sequence_length={"targets": L})
    args = ["--direct_running_mode=multi_processing", "--direct_num_workers=2"]
    a = pipelines.build_task(task, cache_dir=str(tmp_path / "a"), config=config, pipeline_args=args)
    b = pipelines.build_task(task, cache_dir=str(tmp_path / "b"), config=config)
    assert read_shard_checksums(a.cache_dir, a.manifest) == read_shard_checksums(b.cache_dir, b.manifest)
    assert a.manifest.vocabularies["targets"].sha256 == vocab.sha256
    assert a.manifest.num_examples == sum(1 for line in lines if line)

    with CacheReader(a.cache_dir) as reader:
        stored = reader.vocabulary("targets")
    assert isinstance(stored, tasks.HfTokenizerVocabulary) and stored == vocab
    wanted = set(lines)
    matched = 0
    with Feeder(cache=a.cache_dir, global_batch_size=8, sequence_length=L, host_index=0, host_count=1, seed=1) as f:
        for step in range(4):
            batch = f.get_batch(step)
            assert batch["targets"].shape == (8, L) and batch["targets"].dtype == np.int32
            for row in batch["targets"]:
                tokens = row[row != 0].tolist()
                assert tokens, "an empty row"
                text = stored.decode(tokens)
                if tokens[-1] == stored.eos_id:  # not trimmed: the whole line
                    assert text in wanted
                    matched += 1
                else:
                    assert any(line.startswith(text) for line in wanted)
    assert matched >= 16
