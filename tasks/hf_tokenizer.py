"""Hugging Face ``tokenizers`` vocabularies: a ``tokenizer.json`` file as a ``Vocabulary``.

``HfTokenizerVocabulary`` wraps any ``tokenizer.json`` of the ``tokenizers``
package (BPE, Unigram, WordPiece, WordLevel models); ``train_hf_tokenizer``
trains one, deterministically, with the T5 id layout (pad 0, eos 1, unk 2):

=========  ==========================  =====================  ==========================================
model      normalizer                  pre-tokenizer          trainer
=========  ==========================  =====================  ==========================================
bpe        NFKC (or none)              ByteLevel (GPT-2)      ``tokenizers.trainers.BpeTrainer`` over the
                                                              256 byte symbols: every text is encodable
unigram    NFKC (or none)              Metaspace (``▁``)      SentencePiece's unigram trainer (Kudo 2018),
                                                              its pieces and log-probabilities written as a
                                                              ``tokenizers`` Unigram model, byte fallback
=========  ==========================  =====================  ==========================================

SentencePiece trains the unigram model because ``tokenizers``' UnigramTrainer
sums in hash-map order and so differs from run to run; SentencePiece on one
thread with a fixed seed does not. The result is an ordinary Unigram model.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import unicodedata
from typing import Iterable, Sequence

import numpy as np
import sentencepiece as spm
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from seqcache import fs
from seqcache.tasks.vocabularies import ModelFile, Vocabulary, pickled_model, read_model, unpickled_model
from seqcache.tasks.vocabulary_training import META_SPACE, train_sentencepiece

# Tried in this order when no token is named (the first one in the vocabulary wins).
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "<|eot_id|>")
PAD_CANDIDATES = ("<pad>", "[PAD]", "<|padding|>", "<|pad|>", "<|finetune_right_pad_id|>")
UNK_CANDIDATES = ("<unk>", "[UNK]", "<|unk|>")

# The special tokens of tokenizers trained by ``train_hf_tokenizer``, at ids 0, 1, 2.
TRAINED_SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")


def _tokenizer_from_bytes(data: bytes, where: str):
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own Exception subclass; UnicodeDecodeError too
        raise ValueError(f"{where} is not a valid tokenizer.json ({len(data):,} bytes): {e}") from e
    # Every token of the text, unpadded; special tokens in the text are text.
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


class HfTokenizerVocabulary(Vocabulary):
    """A Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json`` file) as a vocabulary.

    Loaded on first use; a pickled vocabulary carries the file's bytes, whose
    sha256 is its identity. Encoding never adds special tokens (``append_eos``
    appends EOS), ignores the file's truncation and padding, and reads special
    tokens written in the text (a literal ``"</s>"``) as text.

    Special ids: each of EOS, pad and unk is the token named here, or else the
    first of ``EOS_CANDIDATES`` / ``PAD_CANDIDATES`` / (the model's own unk
    token, then) ``UNK_CANDIDATES`` in the vocabulary. Without a pad token
    ``pad_id`` is ``eos_id``; without an unk token ``unk_id`` is None.
    ``extra_ids`` sentinels follow the tokenizer's ids, as in seqio/T5.

    Args:
      path: a ``tokenizer.json`` file (local or a URL).
      tokenizer_bytes: the file's bytes, instead of ``path``.
      extra_ids: number of sentinel ids added after the tokenizer's ids.
      eos_token, pad_token, unk_token: the special tokens, by their text.

    Raises:
      ValueError: neither or both of path and tokenizer_bytes; a missing file
        or not a tokenizer.json; a named token the vocabulary lacks; no EOS
        token found. Names the file; on first use for a path, at once for bytes.
    """

    def __init__(self, path: str | None = None, *, tokenizer_bytes: bytes | None = None, extra_ids: int = 0,
                 eos_token: str | None = None, pad_token: str | None = None, unk_token: str | None = None):
        super().__init__(extra_ids)
        if (path is None) == (tokenizer_bytes is None):
            raise ValueError("HfTokenizerVocabulary needs exactly one of path and tokenizer_bytes")
        self.path = os.fspath(path) if path is not None else None
        self._bytes = bytes(tokenizer_bytes) if tokenizer_bytes is not None else None
        self._model_file: ModelFile | None = None  # set when unpickled from a stored model's reference
        self._digest: list = [None]
        self._names = {"eos": eos_token, "pad": pad_token, "unk": unk_token}
        self._tok = None
        self._special: dict[str, tuple[str | None, int | None]] | None = None
        self._size: int | None = None
        if self._bytes is not None:
            self._tokenizer()

    def _where(self) -> str:
        return self.path if self.path is not None else "<tokenizer.json bytes>"

    def model_bytes(self) -> bytes:
        """The ``tokenizer.json`` bytes (what a cache stores next to its manifest)."""
        if self._bytes is None:
            self._bytes = read_model(self.path, self._model_file, "tokenizer")
        return self._bytes

    def _tokenizer(self):
        if self._tok is None:
            data = self.model_bytes()
            tok = _tokenizer_from_bytes(data, self._where())
            vocab = tok.get_vocab(with_added_tokens=True)
            if not vocab:
                raise ValueError(f"{self._where()} is a tokenizer.json with an empty vocabulary")
            self._size = max(vocab.values()) + 1
            self._special = self._resolve_special(tok, vocab, data)
            self._tok = tok
        return self._tok

    def _resolve_special(self, tok, vocab: dict, data: bytes) -> dict:
        where = self._where()
        out = {}
        for role in ("eos", "pad", "unk"):
            name = self._names[role]
            if name is not None:
                if name not in vocab:
                    raise ValueError(f"{where}: the {role} token {name!r} is not in the tokenizer's vocabulary")
                out[role] = (name, vocab[name])
                continue
            candidates = {"eos": EOS_CANDIDATES, "pad": PAD_CANDIDATES, "unk": UNK_CANDIDATES}[role]
            if role == "unk":
                candidates = (*_model_unk_token(data), *candidates)
            found = next((c for c in candidates if c in vocab), None)
            out[role] = (found, vocab[found]) if found is not None else (None, None)
        if out["eos"][0] is None:
            specials = sorted(t.content for t in tok.get_added_tokens_decoder().values() if t.special)
            raise ValueError(
                f"{where}: the tokenizer has none of the EOS tokens {', '.join(EOS_CANDIDATES)}; name one with "
                f"eos_token=... (or 'PATH#eos=TOKEN' as a --vocabulary spec); its special tokens: "
                f"{', '.join(specials) or 'none'}")
        return out

    def __getstate__(self):
        if self._model_file is not None and self._tok is None:
            # Unpickled from a stored model and not used since: not read again.
            names = dict(self._names)
        else:
            self._tokenizer()
            names = {role: self._special[role][0] for role in ("eos", "pad", "unk")}
        return {"tokenizer_bytes": pickled_model(self._model_file, self.model_bytes, self._digest),
                "path": self.path, "extra_ids": self.extra_ids, "names": names}

    def __setstate__(self, state):
        self.extra_ids = state["extra_ids"]
        self.path = state["path"]
        self._bytes, self._model_file, self._digest = unpickled_model(state["tokenizer_bytes"])
        self._names = dict(state["names"])
        self._tok = None
        self._special = None
        self._size = None

    @property
    def base_vocab_size(self) -> int:
        """1 + the largest id of the tokenizer (its vocabulary and added tokens)."""
        self._tokenizer()
        return self._size

    @property
    def eos_id(self) -> int:
        self._tokenizer()
        return self._special["eos"][1]

    @property
    def pad_id(self) -> int:
        self._tokenizer()
        pad = self._special["pad"][1]
        return pad if pad is not None else self.eos_id

    @property
    def unk_id(self) -> int | None:
        self._tokenizer()
        return self._special["unk"][1]

    def special_tokens(self) -> dict[str, str | None]:
        """The texts of the EOS, pad and unk tokens in use: ``{"eos", "pad", "unk"}`` (None where absent)."""
        self._tokenizer()
        return {role: self._special[role][0] for role in ("eos", "pad", "unk")}

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.model_bytes()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer().encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of many texts in one parallel call into ``tokenizers``: int32 arrays."""
        if not texts:
            return []
        tok = self._tokenizer()
        batch = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no character offsets
        return [np.asarray(e.ids, dtype=np.int32) for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; pad, EOS, sentinels and ids outside the tokenizer are dropped."""
        tok = self._tokenizer()
        n = self._size
        drop = {self.pad_id, self.eos_id}
        clean = [int(i) for i in ids if 0 <= int(i) < n and int(i) not in drop]
        return tok.decode(clean, skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        """The token of id ``i``; sentinels show as ``<extra_id_k>``."""
        n = self.base_vocab_size
        if n <= i < self.vocab_size:
            return f"<extra_id_{n + self.extra_ids - 1 - i}>"
        piece = self._tokenizer().id_to_token(int(i))
        return piece if piece is not None else f"<id {i}>"

    def fingerprint(self) -> dict:
        return {"kind": "hf_tokenizer", "sha256": self.sha256, "extra_ids": self.extra_ids,
                "eos_id": self.eos_id, "pad_id": self.pad_id, "unk_id": self.unk_id}

    def to_json(self) -> dict:
        """``{"kind", "file", "sha256", "extra_ids", "vocab_size", "eos_token",
        "pad_token", "unk_token"}``; ``file`` comes from the hash."""
        sha = self.sha256
        names = self.special_tokens()
        return {"kind": "hf_tokenizer", "file": f"tokenizer-{sha[:16]}.json", "sha256": sha,
                "extra_ids": self.extra_ids, "vocab_size": self.vocab_size,
                "eos_token": names["eos"], "pad_token": names["pad"], "unk_token": names["unk"]}

    def __repr__(self) -> str:
        return f"HfTokenizerVocabulary({self._where()!r}, extra_ids={self.extra_ids})"


def _model_unk_token(data: bytes) -> tuple[str, ...]:
    """The unk token a tokenizer.json's model names (``unk_token`` or ``unk_id``), or ()."""
    try:
        model = json.loads(data)["model"]
        if model.get("unk_token"):
            return (model["unk_token"],)
        if model.get("unk_id") is not None:
            return (model["vocab"][model["unk_id"]][0],)
    except (ValueError, KeyError, IndexError, TypeError):
        pass
    return ()


HF_MODELS = ("bpe", "unigram")


def train_hf_tokenizer(texts: Iterable[str], *, output_path: str, model: str, vocab_size: int,
                       normalization: str = "nfkc", seed: int = 0, character_coverage: float = 0.9995,
                       max_sentence_length: int = 16384, extra_ids: int = 0) -> HfTokenizerVocabulary:
    """Trains a ``tokenizers`` tokenizer and writes its ``tokenizer.json`` to ``output_path``.

    Ids: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2 (T5 layout), then the model's
    tokens. Every string is encodable: bpe works on bytes (GPT-2's ByteLevel,
    Radford et al. 2019; merges by Sennrich et al. 2016, arXiv 1508.07909);
    unigram (Kudo 2018, arXiv 1804.10959) falls back to byte tokens ``<0x..>``.
    The same texts in the same order with the same options give a
    byte-identical tokenizer.json (texts from ``sample_for_vocabulary`` do not
    depend on file order either).

    Args:
      texts: training texts (unigram: their non-blank lines).
      output_path: where to write the tokenizer.json (local or a URL).
      model: ``"bpe"`` or ``"unigram"``.
      vocab_size: number of ids, including the 3 special tokens (and for bpe the
        256 byte symbols): >= 260.
      normalization: ``"nfkc"`` (Unicode NFKC, as T5's models) or ``"identity"``
        (none: ``decode(encode(text)) == text`` for every text with bpe).
      seed: SentencePiece's random seed (unigram; bpe has no randomness).
      character_coverage: unigram: fraction of characters with their own pieces.
      max_sentence_length: unigram: longer lines (bytes) are skipped by SentencePiece.
      extra_ids: sentinels of the returned vocabulary (not stored in the file).

    Raises:
      ValueError: bad options, no text, or the trainer refused (the message says which).
    """
    if model not in HF_MODELS:
        raise ValueError(f"model must be one of {HF_MODELS} (got {model!r})")
    if normalization not in ("nfkc", "identity"):
        raise ValueError(f"normalization must be 'nfkc' or 'identity' (got {normalization!r})")
    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (3 special ids + 256 byte symbols + 1) (got {vocab_size=})")
    texts = [t for t in texts if isinstance(t, str) and t.strip()]
    if not texts:
        raise ValueError("no non-blank text to train a tokenizer on")
    if model == "bpe":
        tok = _train_bpe(texts, vocab_size=vocab_size, normalization=normalization)
    else:
        tok = _train_unigram(texts, vocab_size=vocab_size, normalization=normalization, seed=seed,
                             character_coverage=character_coverage, max_sentence_length=max_sentence_length)
    data = tok.to_str(pretty=True).encode("utf-8")
    fs.write_bytes_atomic(os.fspath(output_path), data, fsync=False)
    vocab = HfTokenizerVocabulary(tokenizer_bytes=data, extra_ids=extra_ids)
    vocab.path = os.fspath(output_path)
    return vocab


def _set_normalizer(tok, normalization: str) -> None:
    if normalization == "nfkc":
        tok.normalizer = normalizers.NFKC()


def _train_bpe(texts: list[str], *, vocab_size: int, normalization: str):
    tok = Tokenizer(models.BPE(unk_token=TRAINED_SPECIAL_TOKENS[2]))
    _set_normalizer(tok, normalization)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, show_progress=False,
                                  special_tokens=list(TRAINED_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    try:
        tok.train_from_iterator(texts, trainer, length=len(texts))
    except Exception as e:  # tokenizers' own exception type
        raise ValueError(f"BPE training failed (vocab_size={vocab_size}): {e}") from e
    return tok


def _train_unigram(texts: list[str], *, vocab_size: int, normalization: str, seed: int, character_coverage: float,
                   max_sentence_length: int):
    # SentencePiece sees the text as the tokenizer's normalizer gives it.
    if normalization == "nfkc":
        texts = [unicodedata.normalize("NFKC", t) for t in texts]
    with tempfile.TemporaryDirectory(prefix="seqcache-unigram-") as tmp:
        try:
            sp_vocab = train_sentencepiece(texts, output_path=os.path.join(tmp, "unigram.model"),
                                           vocab_size=vocab_size, model_type="unigram",
                                           character_coverage=character_coverage,
                                           max_sentence_length=max_sentence_length, seed=seed,
                                           normalization_rule_name="identity", remove_extra_whitespaces=False)
        except ValueError as e:  # the model type is not a choice here
            raise ValueError(str(e).replace(", model_type=unigram)", ")")) from e
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(sp_vocab.model_bytes())
    n = sp.get_piece_size()
    scores = [sp.get_score(i) for i in range(n)]
    normal = [scores[i] for i in range(n) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))]
    # Byte and control tokens score below every piece: "<0x41>" in text is characters.
    floor = (min(normal) if normal else 0.0) - 1e6
    vocab = [(sp.id_to_piece(i), floor if (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i))
              else float(scores[i])) for i in range(n)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=True))
    _set_normalizer(tok, normalization)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META_SPACE, prepend_scheme="always", split=True)
    # Llama's decoder: U+2581 -> space, <0x..> runs -> bytes, the prepended space off.
    tok.decoder = decoders.Sequence([decoders.Replace(META_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TRAINED_SPECIAL_TOKENS])
    return tok

