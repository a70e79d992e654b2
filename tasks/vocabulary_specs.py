"""Vocabularies from their descriptions: ``vocabulary_from_json`` (a cache's
manifest entry, ``Vocabulary.to_json()``) and ``vocabulary_from_spec`` (the
command line's ``--vocabulary``)."""

from __future__ import annotations

import hashlib
import os

from seqcache import fs
from seqcache.tasks.hf_tokenizer import HfTokenizerVocabulary
from seqcache.tasks.vocabularies import ByteVocabulary, SentencePieceVocabulary, Vocabulary


def vocabulary_from_json(desc: dict, base_dir: str) -> Vocabulary:
    """Rebuilds a vocabulary from ``Vocabulary.to_json()`` (``desc``), its model
    file ``desc["file"]`` in ``base_dir``.

    Raises:
      ValueError: an unknown kind, a missing model file, or a model whose sha256
        differs from ``desc["sha256"]`` (the message names the file and both hashes).
    """
    kind = desc.get("kind")
    extra_ids = int(desc.get("extra_ids", 0))
    if kind == "byte":
        return ByteVocabulary(extra_ids=extra_ids)
    if kind in ("sentencepiece", "hf_tokenizer"):
        what = "SentencePiece model" if kind == "sentencepiece" else "tokenizer.json"
        name = desc.get("file")
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise ValueError(f"vocabulary description has a bad model file name {name!r} (expected a plain file name)")
        path = f"{base_dir.rstrip('/')}/{name}"
        try:
            data = fs.read_bytes(path)
        except OSError as e:
            raise ValueError(f"{what} {path!r} named by the cache is missing: {e}") from e
        want = desc.get("sha256")
        got = hashlib.sha256(data).hexdigest()
        if want is not None and got != want:
            raise ValueError(f"{what} {path!r} has sha256 {got}, but the cache expects {want}")
        if kind == "sentencepiece":
            vocab = SentencePieceVocabulary(model_bytes=data, extra_ids=extra_ids)
            vocab.model_path = path
            return vocab
        try:
            vocab = HfTokenizerVocabulary(tokenizer_bytes=data, extra_ids=extra_ids, eos_token=desc.get("eos_token"),
                                          pad_token=desc.get("pad_token"), unk_token=desc.get("unk_token"))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e
        vocab.path = path
        return vocab
    raise ValueError(f"unknown vocabulary kind {kind!r} in {desc!r} (expected 'byte', 'sentencepiece' or "
                     "'hf_tokenizer')")


def vocabulary_from_spec(spec: str, extra_ids: int = 0) -> Vocabulary:
    """The vocabulary a command-line ``--vocabulary`` value names.

    ======================================  ==========================================
    spec                                    vocabulary
    ======================================  ==========================================
    ``byte``                                ``ByteVocabulary``
    ``PATH.model``                          ``SentencePieceVocabulary``
    ``PATH.json`` (a ``tokenizer.json``)    ``HfTokenizerVocabulary``; ``PATH#eos=TOKEN``
                                            (also ``pad=``, ``unk=``, comma-separated)
                                            names its special tokens
    a folder holding ``tokenizer.json``     the same, for that file
    another existing file                   by its content: JSON -> tokenizers, else
                                            SentencePiece
    ======================================  ==========================================

    Raises:
      ValueError: anything else, a bad file (loaded at once, named) or
        special-token option (says what is accepted).
    """
    if spec == "byte":
        return ByteVocabulary(extra_ids=extra_ids)
    path, names = _split_token_options(spec)
    if "://" not in path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")  # a tokenizer's folder, as Hugging Face saves one
    if path.endswith(".json") or (not path.endswith(".model") and _looks_like_json(path)):
        vocab = HfTokenizerVocabulary(path, extra_ids=extra_ids, **names)
        vocab._tokenizer()  # fail now, naming the path
        return vocab
    if names:
        raise ValueError(f"bad vocabulary {spec!r}: #eos=/pad=/unk= options apply to a tokenizer.json only")
    if path.endswith(".model") or ("://" not in path and os.path.isfile(path)):
        vocab = SentencePieceVocabulary(path, extra_ids=extra_ids)
        vocab._processor()  # fail now, naming the path
        return vocab
    raise ValueError(f"bad vocabulary {spec!r}: expected 'byte' or the path of a SentencePiece .model file or "
                     "of a tokenizers tokenizer.json")


_TOKEN_OPTIONS = {"eos": "eos_token", "pad": "pad_token", "unk": "unk_token"}


def _split_token_options(spec: str) -> tuple[str, dict[str, str]]:
    """``"a/tokenizer.json#eos=<|im_end|>,pad=<pad>"`` -> path and keyword arguments."""
    path, sep, opts = spec.rpartition("#")
    if not sep or not any(opts.startswith(f"{k}=") for k in _TOKEN_OPTIONS):
        return spec, {}
    names = {}
    for part in opts.split(","):
        key, eq, value = part.partition("=")
        if key not in _TOKEN_OPTIONS or not eq or not value:
            raise ValueError(f"bad vocabulary option {part!r} in {spec!r}: expected eos=TOKEN, pad=TOKEN or unk=TOKEN")
        names[_TOKEN_OPTIONS[key]] = value
    return path, names


def _looks_like_json(path: str) -> bool:
    if "://" in path or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False  # SentencePiece's loader then reports the file
