"""Vocabularies: text <-> token ids.

Three vocabularies; those seqcache trains use the T5 id layout for special ids:

=============  ====  ====  ====  ==================================================
vocabulary     pad   eos   unk   other ids
=============  ====  ====  ====  ==================================================
byte           0     1     2     byte ``b`` -> ``b + 3`` (ByT5, arXiv 2105.13626)
sentencepiece  0     1     2     pieces of the model (models trained by seqcache)
hf_tokenizer   0     1     2     tokens of a ``tokenizer.json`` (trained by seqcache;
                                 any other file's own special tokens, see
                                 ``seqcache.tasks.hf_tokenizer``)
=============  ====  ====  ====  ==================================================

All can add ``extra_ids`` sentinel ids after the base vocabulary, numbered as in
seqio/T5: ``<extra_id_0>`` is the last id (``vocab_size - 1``) and
``<extra_id_i>`` is ``base_vocab_size + extra_ids - 1 - i``.

``encode`` never adds EOS (the ``append_eos`` preprocessor does); ``decode`` drops
pad, EOS, unknown-to-the-model ids and sentinels, and never stops early.

A vocabulary is stored in a cache as ``to_json()`` (plus, for SentencePiece and
tokenizers, the model file named by ``desc["file"]`` next to the manifest) and
rebuilt with ``vocabulary_from_json``.
"""

from __future__ import annotations

import abc
import itertools
import collections
import contextlib
import dataclasses
import functools
import hashlib
import heapq
import io
import logging
import os
import threading
from typing import Iterable, Sequence

import numpy as np

from seqcache import fs
from seqcache.tasks.sources import ERROR_KINDS, Source, is_error_record, text_problems


class Vocabulary(abc.ABC):
    """Maps text to int32 token ids and back.

    Subclasses implement the base vocabulary; ``extra_ids`` sentinels are added on
    top (see the module docstring for their numbering).
    """

    def __init__(self, extra_ids: int = 0):
        if extra_ids < 0:
            raise ValueError(f"extra_ids must be >= 0 (got {extra_ids=})")
        self.extra_ids = int(extra_ids)

    # -- sizes and special ids
    @property
    @abc.abstractmethod
    def base_vocab_size(self) -> int:
        """Number of ids of the underlying vocabulary, without extra ids."""

    @property
    def vocab_size(self) -> int:
        """Total number of ids, including the extra ids."""
        return self.base_vocab_size + self.extra_ids

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def eos_id(self) -> int:
        return 1

    @property
    def unk_id(self) -> int:
        return 2

    def sentinel_id(self, i: int) -> int:
        """Id of ``<extra_id_i>`` (seqio numbering: extra id 0 is the last id).

        Raises:
          ValueError: ``i`` is not in ``[0, extra_ids)``.
        """
        if not 0 <= i < self.extra_ids:
            raise ValueError(f"sentinel index {i} is out of range: this vocabulary has {self.extra_ids} extra ids")
        return self.base_vocab_size + self.extra_ids - 1 - i

    # -- encoding
    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended)."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of many texts: a list of 1-D int32 arrays, one per text."""
        return [np.asarray(self.encode(t), dtype=np.int32) for t in texts]

    def encode_batch_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` as one column: ``(ids, lengths)``, the token ids of
        every text one after the other (int32, shape (sum(lengths),)) and the
        number of ids of each text (int64, shape (len(texts),)).

        Raises:
          as ``encode_batch``.
        """
        arrays = self.encode_batch(texts) if len(texts) else []
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe") if arrays else np.zeros(0, np.int32)
        return flat, lengths

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; pad, EOS and sentinel ids are dropped."""

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """``[decode(ids) for ids in batch]``; vocabularies with a faster way
        (one call into SentencePiece) override it, with the same texts."""
        return [self.decode(ids) for ids in batch]

    # -- identity and storage
    @abc.abstractmethod
    def fingerprint(self) -> dict:
        """JSON-able identity: kind, sha256 of the model bytes (or None), extra_ids."""

    @abc.abstractmethod
    def to_json(self) -> dict:
        """JSON description stored in cache manifests; see ``vocabulary_from_json``."""

    def model_bytes(self) -> bytes | None:
        """The serialized model to store next to a cache, or None if there is none."""
        return None

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(repr(sorted(self.fingerprint().items())))


class ByteVocabulary(Vocabulary):
    """UTF-8 bytes as tokens, in the ByT5 layout (Xue et al. 2021, arXiv 2105.13626).

    Ids: 0 pad, 1 eos, 2 unk, byte ``b`` -> ``b + 3``; ``vocab_size`` is
    ``259 + extra_ids``. Every string is encodable; ``decode`` drops ids below 3
    and sentinels and decodes the bytes as UTF-8 with ``errors="replace"``.
    """

    _OFFSET = 3

    def __init__(self, extra_ids: int = 0):
        super().__init__(extra_ids)

    @property
    def base_vocab_size(self) -> int:
        return 256 + self._OFFSET

    def encode(self, text: str) -> list[int]:
        return self._encode_array(text).tolist()

    def _encode_array(self, text: str) -> np.ndarray:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        ids += self._OFFSET  # in place: one int32 copy of a long text, not two
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [self._encode_array(t) for t in texts]

    def encode_batch_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encoded = [t.encode("utf-8") for t in texts]
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        flat = np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(np.int32)
        flat += self._OFFSET
        return flat, lengths

    def decode(self, ids: Sequence[int]) -> str:
        a = np.asarray(ids, dtype=np.int64).ravel()
        a = a[(a >= self._OFFSET) & (a < self.base_vocab_size)]
        return (a - self._OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """``decode`` of each id sequence, the ids of all of them filtered in
        one numpy pass."""
        if not len(batch):
            return []
        arrays = [np.asarray(ids).ravel() for ids in batch]
        masks = [(a >= self._OFFSET) & (a < self.base_vocab_size) for a in arrays]
        data = (np.concatenate([a[m] for a, m in zip(arrays, masks)]).astype(np.int64) - self._OFFSET
                ).astype(np.uint8).tobytes()
        ends = np.cumsum([np.count_nonzero(m) for m in masks]).tolist()
        return [data[a:b].decode("utf-8", errors="replace") for a, b in zip([0, *ends[:-1]], ends)]

    def fingerprint(self) -> dict:
        return {"kind": "byte", "sha256": None, "extra_ids": self.extra_ids}

    def to_json(self) -> dict:
        return {"kind": "byte", "extra_ids": self.extra_ids, "vocab_size": self.vocab_size}

    def __repr__(self) -> str:
        return f"ByteVocabulary(extra_ids={self.extra_ids})"


def _read_bytes(path: str) -> bytes:
    return fs.read_bytes(path)


# -- model files a build stores, pickled by reference --------------------------
# Beam pickles every step of a pipeline, and compresses each pickle with bz2 at
# level 9 (``apache_beam.internal.pickler``), as it sends the steps to the
# workers and as each worker unpickles them, several times a build: a
# SentencePiece model or tokenizer.json inside the task's steps (hundreds of KB
# to several MB) cost a 1.2 MB build with an 8,000-piece model about 0.09 s of
# its 0.41 s pipeline time (benchmarks/README.md). While a
# build's pipeline is made and run (``stored_models``), a vocabulary whose model
# bytes the build has stored in its cache folder pickles that file's URL and
# sha256 instead (``ModelFile``), and loads it from there on first use, once per
# process; a vocabulary unpickled from a ``ModelFile`` pickles it again as it is
# (a worker's runner pickles the steps it was given anew).


_STORED = threading.local()  # .files: {sha256 hex: URL}, in the thread that makes and runs the pipeline
_LOADED: dict[str, bytes] = {}  # sha256 hex -> model bytes read from a ModelFile, in this process
_LOADED_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A vocabulary model stored in a cache folder: what a vocabulary pickles
    instead of its bytes while ``stored_models`` holds them."""

    url: str
    sha256: str

    def read(self) -> bytes:
        """The model's bytes, read once per process.

        Raises:
          ValueError: the file cannot be read, or its bytes are not the ones
            the build stored (their sha256 differs); the message names the file.
        """
        with _LOADED_LOCK:
            data = _LOADED.get(self.sha256)
        if data is not None:
            return data
        try:
            data = fs.read_bytes(self.url)
        except OSError as e:
            raise ValueError(f"cannot read the vocabulary model the build stored at {self.url}: {e}") from e
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"{self.url}: the vocabulary model the build stored there has changed since "
                             f"(sha256 {hashlib.sha256(data).hexdigest()[:12]}, stored {self.sha256[:12]})")
        with _LOADED_LOCK:
            _LOADED[self.sha256] = data
        return data


@contextlib.contextmanager
def stored_models(files: dict[str, bytes]):
    """While the block runs, in this thread, a vocabulary whose model bytes are
    one of ``files``' values pickles a ``ModelFile`` of that URL instead of the
    bytes (see the comment above ``ModelFile``).

    Args:
      files: {URL of a stored copy: the model bytes written there}.
    """
    before = getattr(_STORED, "files", None)
    current = dict(before or {})
    for url, data in files.items():
        current.setdefault(hashlib.sha256(data).hexdigest(), url)
    _STORED.files = current
    try:
        yield
    finally:
        _STORED.files = before


def _pickled_model(stored: ModelFile | None, data, digest_cache: list) -> bytes | ModelFile:
    """What a vocabulary pickles for its model: ``stored``, the reference it was
    unpickled from, as it is (the file not read), or else ``_model_state`` of
    ``data()``, its bytes."""
    return stored if stored is not None else _model_state(data(), digest_cache)


def _unpickled_model(value: bytes | ModelFile) -> tuple[bytes | None, ModelFile | None, list]:
    """(model bytes or None, the ``ModelFile`` or None, the digest cache) of a
    pickled model value (``_pickled_model``)."""
    if isinstance(value, ModelFile):
        return None, value, [value.sha256]
    return value, None, [None]


def _model_state(data: bytes, digest_cache: list) -> bytes | ModelFile:
    """What a vocabulary pickles for its model bytes ``data``: a ``ModelFile``
    when ``stored_models`` holds them in this thread, else the bytes.
    ``digest_cache``: a one-item list holding the bytes' sha256 (or None), kept
    by the vocabulary so that each pickle does not hash them again."""
    files = getattr(_STORED, "files", None)
    if not files:
        return data
    if digest_cache[0] is None:
        digest_cache[0] = hashlib.sha256(data).hexdigest()
    url = files.get(digest_cache[0])
    return data if url is None else ModelFile(url, digest_cache[0])


def _write_bytes(path: str, data: bytes) -> None:
    fs.write_bytes_atomic(path, data, fsync=False)


# Mean characters per text from which ``SentencePieceVocabulary.encode_batch_flat``
# asks SentencePiece for int32 buffers instead of lists of ints (documents, not
# lines: measured in benchmarks/pipeline.py's bound).
SENTENCEPIECE_BUFFER_CHARS = 256


ENCODING_THREADS_ENV = "SEQCACHE_ENCODING_THREADS"


def encoding_threads() -> int:
    """SentencePiece's encoding threads for a batch when the caller names none:
    ``$SEQCACHE_ENCODING_THREADS`` when set (a positive integer; a build
    hands its driver's value to every worker,
    ``seqcache.pipelines.transforms.driver_encoding_threads``), else the CPUs
    this process may run on
    (``os.sched_getaffinity``, which a container's or ``taskset``'s CPU set
    limits). Not SentencePiece's own default, the machine's hardware
    threads, which runs more threads than CPUs in a pinned process, a
    container or beside other workers, and makes them take turns.

    Raises:
      ValueError: ``$SEQCACHE_ENCODING_THREADS`` is not a positive integer.
    """
    given = os.environ.get(ENCODING_THREADS_ENV, "").strip()
    if given:
        if not (given.isascii() and given.isdigit()) or int(given) < 1:
            raise ValueError(f"{ENCODING_THREADS_ENV}={given!r}: expected a positive integer (encoding threads)")
        return int(given)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


@functools.lru_cache(maxsize=None)
def _encodes_to_numpy() -> bool:
    """True when the installed SentencePiece encodes to numpy arrays
    (``out_type="numpy"``; older releases lack it)."""
    import sentencepiece

    return hasattr(sentencepiece.SentencePieceProcessor, "EncodeAsNumpy")


class SentencePieceVocabulary(Vocabulary):
    """A SentencePiece model (Kudo & Richardson 2018, arXiv 1808.06226).

    The model is loaded lazily, on first use. A pickled vocabulary carries the
    model bytes, not the path, so that pipeline workers in fresh processes (or on
    other machines) can use it.

    Special ids come from the model: models trained by ``train_sentencepiece`` use
    pad 0, eos 1, unk 2 and no bos (T5 layout). For a model without a pad piece
    ``pad_id`` is 0 (padding is masked by loss weights anyway).

    Args:
      model_path: path of a ``.model`` file (local or a Beam FileSystems URL).
      model_bytes: the serialized model, instead of ``model_path``.
      extra_ids: number of sentinel ids added after the model's pieces.

    Raises:
      ValueError: neither or both of model_path and model_bytes are given; the
        file is missing or is not a SentencePiece model (the message names it).
        Reported on first use for a path, at once for bytes.
    """

    def __init__(self, model_path: str | None = None, *, model_bytes: bytes | None = None, extra_ids: int = 0):
        super().__init__(extra_ids)
        if (model_path is None) == (model_bytes is None):
            raise ValueError("SentencePieceVocabulary needs exactly one of model_path and model_bytes")
        self.model_path = os.fspath(model_path) if model_path is not None else None
        self._model_bytes = bytes(model_bytes) if model_bytes is not None else None
        self._model_file: ModelFile | None = None  # set when unpickled from a stored model's reference
        self._digest: list = [None]
        self._sp = None
        if self._model_bytes is not None:
            self._processor()

    # -- loading and pickling
    def _where(self) -> str:
        return self.model_path if self.model_path is not None else "<model bytes>"

    def model_bytes(self) -> bytes:
        if self._model_bytes is None:
            if self._model_file is not None:
                self._model_bytes = self._model_file.read()
                return self._model_bytes
            try:
                self._model_bytes = _read_bytes(self.model_path)
            except OSError as e:
                raise ValueError(f"cannot read SentencePiece model {self.model_path!r}: {e}") from e
        return self._model_bytes

    def _processor(self):
        if self._sp is None:
            import sentencepiece as spm

            data = self.model_bytes()
            sp = spm.SentencePieceProcessor()
            try:
                sp.LoadFromSerializedProto(data)
            except Exception as e:  # the C++ loader raises RuntimeError/OSError variants
                raise ValueError(
                    f"{self._where()} is not a valid SentencePiece model ({len(data)} bytes): {e}") from e
            if sp.get_piece_size() <= 0:
                raise ValueError(f"{self._where()} is not a valid SentencePiece model (no pieces)")
            self._sp = sp
        return self._sp

    def __getstate__(self):
        return {"model_bytes": _pickled_model(self._model_file, self.model_bytes, self._digest),
                "model_path": self.model_path, "extra_ids": self.extra_ids}

    def __setstate__(self, state):
        self.extra_ids = state["extra_ids"]
        self.model_path = state["model_path"]
        self._model_bytes, self._model_file, self._digest = _unpickled_model(state["model_bytes"])
        self._sp = None

    # -- sizes and special ids
    @property
    def base_vocab_size(self) -> int:
        return self._processor().get_piece_size()

    @property
    def pad_id(self) -> int:
        p = self._processor().pad_id()
        return p if p >= 0 else 0

    @property
    def eos_id(self) -> int:
        return self._processor().eos_id()

    @property
    def unk_id(self) -> int:
        return self._processor().unk_id()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.model_bytes()).hexdigest()

    # -- encoding
    def encode(self, text: str) -> list[int]:
        return list(self._processor().encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[np.ndarray]:
        """Token ids of many texts in one call into SentencePiece (int32 arrays).

        Args:
          texts: the texts.
          num_threads: SentencePiece's encoding threads (None:
            ``encoding_threads()``, the CPUs this process may use).
        """
        if not texts:
            return []
        kwargs = {"num_threads": int(encoding_threads() if num_threads is None else num_threads)}
        ids = self._processor().encode(list(texts), out_type=int, **kwargs)
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def encode_batch_flat(self, texts: Sequence[str], *, num_threads: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """``Vocabulary.encode_batch_flat``: one call into SentencePiece, and the
        ids gathered into one int32 array without an array per text; threads as
        ``encode_batch``'s."""
        if not len(texts):
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        kwargs = {"num_threads": int(encoding_threads() if num_threads is None else num_threads)}
        texts = list(texts)
        if sum(map(len, texts)) >= SENTENCEPIECE_BUFFER_CHARS * len(texts) and _encodes_to_numpy():
            # Long texts: SentencePiece's int32 buffers, no Python int per id.
            arrays = self._processor().encode(texts, out_type="numpy", **kwargs)
            lengths = np.fromiter(map(len, arrays), dtype=np.int64, count=len(arrays))
            return np.concatenate(arrays).astype(np.int32, copy=False), lengths
        # Short texts: a Python list per text costs less than a buffer object per text.
        ids = self._processor().encode(texts, out_type=int, **kwargs)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return flat, lengths

    def decode(self, ids: Sequence[int]) -> str:
        sp = self._processor()
        n = sp.get_piece_size()
        drop = {self.pad_id, self.eos_id}
        clean = [int(i) for i in ids if 0 <= int(i) < n and int(i) not in drop]
        return sp.decode(clean)

    def decode_batch(self, batch: Sequence[Sequence[int]], *, num_threads: int | None = None) -> list[str]:
        """``decode`` of each id sequence of ``batch``, the ids filtered with
        numpy and decoded in one call into SentencePiece (``num_threads``: as
        ``encode_batch``'s)."""
        if not len(batch):
            return []
        sp = self._processor()
        n = sp.get_piece_size()
        clean = []
        for ids in batch:
            a = np.asarray(ids, dtype=np.int64).ravel()
            clean.append(a[(a >= 0) & (a < n) & (a != self.pad_id) & (a != self.eos_id)].tolist())
        return sp.decode(clean, num_threads=int(encoding_threads() if num_threads is None else num_threads))

    def id_to_piece(self, i: int) -> str:
        """The piece of id ``i``; sentinels show as ``<extra_id_k>``."""
        n = self.base_vocab_size
        if n <= i < self.vocab_size:
            return f"<extra_id_{n + self.extra_ids - 1 - i}>"
        return self._processor().id_to_piece(int(i))

    # -- identity and storage
    def fingerprint(self) -> dict:
        return {"kind": "sentencepiece", "sha256": self.sha256, "extra_ids": self.extra_ids}

    def to_json(self) -> dict:
        """``{"kind", "file", "sha256", "extra_ids", "vocab_size"}``.

        ``file`` is the name under which a cache stores ``model_bytes()``; it is
        derived from the model's hash, so two features with different models never
        share a file.
        """
        sha = self.sha256
        return {"kind": "sentencepiece", "file": f"spm-{sha[:16]}.model", "sha256": sha,
                "extra_ids": self.extra_ids, "vocab_size": self.vocab_size}

    def __repr__(self) -> str:
        return f"SentencePieceVocabulary({self._where()!r}, extra_ids={self.extra_ids})"


def vocabulary_from_json(desc: dict, base_dir: str) -> Vocabulary:
    """Rebuilds a vocabulary from ``Vocabulary.to_json()``.

    Args:
      desc: the JSON description.
      base_dir: folder holding the model file ``desc["file"]`` (SentencePiece).

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
            data = _read_bytes(path)
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
        from seqcache.tasks.hf_tokenizer import HfTokenizerVocabulary

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

    The file is loaded at once, so that a bad one fails here, naming it.

    Raises:
      ValueError: anything else, a bad file or special-token option (the message
        says what is accepted).
    """
    if spec == "byte":
        return ByteVocabulary(extra_ids=extra_ids)
    path, names = _split_token_options(spec)
    if "://" not in path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")  # a tokenizer's folder, as Hugging Face saves one
    if path.endswith(".json") or (not path.endswith(".model") and _looks_like_json(path)):
        from seqcache.tasks.hf_tokenizer import HfTokenizerVocabulary

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


# ---------------------------------------------------------------------------
# Training.


@dataclasses.dataclass
class SampleCounts:
    """What ``sample_for_vocabulary`` met under the sources' ``on_error`` policies.

    Attributes:
      records: source records read (records).
      skipped: records skipped per kind of bad input (left out of the sample).
      replaced: records repaired per kind (a record repaired for two kinds counts
        under both).
      kept: records kept as they are per kind whose action is ``"keep"`` (for
        example ``empty``: such records are read, but empty texts never enter
        the sample).
    """

    records: int = 0
    skipped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    replaced: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    kept: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def by_kind(self) -> list[tuple[str, int, int, int]]:
        """``(kind, skipped, replaced, kept)`` for each kind met, in ``ERROR_KINDS`` order."""
        return [(k, self.skipped[k], self.replaced[k], self.kept[k]) for k in ERROR_KINDS
                if self.skipped[k] or self.replaced[k] or self.kept[k]]


def sample_for_vocabulary(source: Source | Sequence[Source], *, max_records: int, seed: int,
                          field: str | None = None, counts: SampleCounts | None = None) -> list[str]:
    """A deterministic sample of record texts to train a vocabulary on.

    Keeps the ``max_records`` records with the smallest keyed hash
    ``blake2b(raw, key=seed, digest_size=8)`` (a bottom-k sample): the sample
    depends only on the multiset of records and the seed, not on file order or on
    how records are split across files. Streams with a bounded heap, so memory is
    O(max_records) texts. Empty texts, non-string values and records a source
    skipped are left out. The result is ordered by hash.

    Args:
      source: one source or several (sampled together).
      max_records: sample size (records).
      seed: non-negative int, the hash key.
      field: the key of the text in ``SourceRecord.data``; None (default):
        every string value of the record, in key order, one per line (both
        sides of a parallel or TSV source; the text of a one-value source).
      counts: if given, filled with the records read and the skipped, repaired
        and kept records per kind (see ``SampleCounts``).

    Raises:
      ValueError: max_records < 1, seed < 0, or the sources hold no text.
    """
    if max_records < 1:
        raise ValueError(f"max_records must be >= 1 (got {max_records=})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0 (got {seed=})")
    sources = [source] if isinstance(source, Source) else list(source)
    key = int(seed).to_bytes(max(8, (int(seed).bit_length() + 7) // 8), "little")[:64]
    heap: list[tuple[int, bytes, str]] = []  # (-hash, -> max-heap on hash), raw, text
    counts = counts if counts is not None else SampleCounts()
    for src in sources:
        actions = getattr(getattr(src, "on_error", None), "actions", {})
        keep = {k for k, a in actions.items() if a == "keep"}
        for record in src.read_all():
            counts.records += 1
            if record.issue is not None:
                target = counts.skipped if record.issue.action == "skipped" else counts.replaced
                for kind in record.issue.kind.split(","):
                    target[kind] += 1
            if is_error_record(record):
                continue
            text = record.data.get(field) if field is not None else _record_text(record.data)
            if keep and isinstance(text, str):
                for kind in {k for k, _ in text_problems(text)} & keep:
                    counts.kept[kind] += 1
            if not isinstance(text, str) or not text:
                continue
            h = int.from_bytes(hashlib.blake2b(record.raw, key=key, digest_size=8).digest(), "big")
            item = (-h, _neg_bytes(record.raw), text)
            if len(heap) < max_records:
                heapq.heappush(heap, item)
            elif item > heap[0]:
                heapq.heapreplace(heap, item)
    if not heap:
        what = f"{field!r} text" if field is not None else "text"
        raise ValueError(f"no non-empty {what} found in {[s.describe() for s in sources]}")
    heap.sort(reverse=True)
    return [text for _, _, text in heap]


def _record_text(data: dict) -> str | None:
    """Every non-empty string value of a record, in key order, one per line."""
    values = [data[k] for k in sorted(data) if isinstance(data[k], str) and data[k]]
    return values[0] if len(values) == 1 else ("\n".join(values) if values else None)


def decode_with_sentinels(vocabulary, ids) -> str:
    """The text of ``ids`` (a sequence of int token ids) as ``Vocabulary.decode``
    gives it, except that each sentinel id is shown as ``<extra_id_i>`` (seqio's
    spelling; ``vocabulary.sentinel_id(i)`` is the id) instead of being
    dropped, so that a span-corrupted example reads as T5 shows it::

        inputs:  Thank you <extra_id_0> me to your party <extra_id_1> week.
        targets: <extra_id_0> for inviting <extra_id_1> last

    The ids between two sentinels are decoded together; a SentencePiece piece
    that starts a word (``▁``) right after a sentinel keeps its space. Pad and
    EOS are dropped, as by ``decode``."""
    extra = int(getattr(vocabulary, "extra_ids", 0) or 0)
    if not extra:
        return vocabulary.decode(ids)
    first = vocabulary.base_vocab_size
    end = first + extra
    piece = getattr(vocabulary, "id_to_piece", None)
    parts: list[str] = []
    run: list[int] = []

    def flush():
        if run:
            text = vocabulary.decode(run)
            if parts and piece is not None and piece(run[0]).startswith("\u2581"):
                text = " " + text
            parts.append(text)
            run.clear()

    for t in ids:
        if first <= t < end:
            flush()
            parts.append(f"<extra_id_{end - 1 - t}>")
        else:
            run.append(t)
    flush()
    return "".join(parts)


def _neg_bytes(b: bytes) -> bytes:
    # Orders ties on the hash by raw bytes, smallest kept, inside a max-heap.
    return bytes(255 - x for x in b) + b"\xff"


def train_sentencepiece(texts: Iterable[str], *, output_path: str, vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 0.9995, max_sentence_length: int = 16384,
                        input_sentence_size: int = 0, seed: int = 0, split_lines: bool = True,
                        normalization_rule_name: str = "nmt_nfkc", remove_extra_whitespaces: bool = True,
                        extra_ids: int = 0) -> SentencePieceVocabulary:
    """Trains a SentencePiece model with the T5 id layout and writes it to ``output_path``.

    Ids: pad 0, eos 1, unk 2, no bos; ``byte_fallback`` is on, so every string is
    encodable (unknown characters become byte pieces ``<0x..>``).

    Determinism: the same texts, in the same order, with the same options give a
    byte-identical ``.model`` file, in the same or another process (training runs
    on one thread with a fixed random seed and no input shuffling). Pass texts from
    ``sample_for_vocabulary`` to make the result independent of file order too.

    Args:
      texts: training texts; with ``split_lines`` each is split into lines and
        empty lines are skipped (SentencePiece trains on sentences).
      output_path: where to write the ``.model`` file (local or a Beam URL).
      vocab_size: number of pieces, including pad/eos/unk and the 256 byte pieces.
      model_type: ``"unigram"`` (Kudo 2018, arXiv 1804.10959) or ``"bpe"``.
      character_coverage: fraction of characters covered by single-character
        pieces (the rest fall back to bytes).
      max_sentence_length: longer sentences (in bytes) are skipped by SentencePiece.
      input_sentence_size: if > 0, train on the first this many sentences.
      seed: SentencePiece's random seed.
      split_lines: split texts into lines.
      normalization_rule_name: SentencePiece normalisation: ``"nmt_nfkc"`` (T5's
        choice) or ``"identity"``. With ``"identity"`` and
        ``remove_extra_whitespaces=False``, ``decode(encode(text)) == text`` for
        every text (lossless; useful for code); NFKC changes some characters.
      remove_extra_whitespaces: collapse runs of spaces and strip ends.
      extra_ids: sentinels of the returned vocabulary (not stored in the model).

    Raises:
      ValueError: bad options, no text, or SentencePiece refused to train (for
        example ``vocab_size`` too large for the text); the message says which.
    """
    import sentencepiece as spm

    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe' (got {model_type!r})")
    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (3 special ids + 256 byte pieces + 1) (got {vocab_size=})")

    sentences = _TrainingSentences(texts, split_lines=split_lines, max_sentence_length=max_sentence_length)
    writer = io.BytesIO()
    spm.set_random_generator_seed(int(seed))
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=writer,
            vocab_size=int(vocab_size),
            model_type=model_type,
            character_coverage=float(character_coverage),
            max_sentence_length=int(max_sentence_length),
            input_sentence_size=int(input_sentence_size),
            shuffle_input_sentence=False,
            num_threads=1,
            pad_id=0,
            eos_id=1,
            unk_id=2,
            bos_id=-1,
            byte_fallback=True,
            normalization_rule_name=normalization_rule_name,
            remove_extra_whitespaces=bool(remove_extra_whitespaces),
            minloglevel=2,
        )
    except (RuntimeError, OSError) as e:
        if sentences.all_too_long:
            raise sentences.too_long_error() from e
        raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}, model_type={model_type}): {e}") from e
    sentences.check()
    data = writer.getvalue()
    if not data:
        raise ValueError("SentencePiece training produced no model: were there any non-empty texts?")
    _write_bytes(os.fspath(output_path), data)
    vocab = SentencePieceVocabulary(model_bytes=data, extra_ids=extra_ids)
    vocab.model_path = os.fspath(output_path)
    return vocab


class _TrainingSentences:
    """The sentences SentencePiece trains on (non-empty lines of the texts, or the
    non-empty texts themselves), counted as they stream, with how many are longer
    than ``max_sentence_length`` bytes (SentencePiece skips those)."""

    def __init__(self, texts: Iterable[str], *, split_lines: bool, max_sentence_length: int):
        self.texts, self.split_lines, self.max_sentence_length = texts, split_lines, max_sentence_length
        self.sentences = self.too_long = 0

    def __iter__(self):
        for text in self.texts:
            if self.split_lines:
                for line in text.splitlines():
                    if line.strip():
                        yield self._count(line)
            elif text.strip():
                yield self._count(text)

    def _count(self, sentence: str) -> str:
        self.sentences += 1
        if len(sentence.encode("utf-8")) > self.max_sentence_length:
            self.too_long += 1
        return sentence

    @property
    def all_too_long(self) -> bool:
        return bool(self.sentences) and self.too_long == self.sentences

    def too_long_error(self) -> ValueError:
        return ValueError(
            f"every one of the {self.sentences:,} training sentences is longer than max_sentence_length "
            f"({self.max_sentence_length:,} bytes), so SentencePiece skipped them all; "
            + ("the lines themselves are that long: raise max_sentence_length (seqcache vocab train "
               "--max-sentence-length), or train on text with line breaks" if self.split_lines else
               "split the text into lines (split_lines=True) or raise max_sentence_length")
        )

    def check(self) -> None:
        """Raises when every sentence was too long; logs how many were skipped."""
        if self.all_too_long:
            raise self.too_long_error()
        if self.too_long:
            logging.getLogger(__name__).warning(
                "SentencePiece skipped %d of %d training sentences longer than max_sentence_length (%d bytes)",
                self.too_long, self.sentences, self.max_sentence_length,
            )


META_SPACE = "\u2581"  # SentencePiece's whitespace symbol: decodes as a space


def round_trip_problems(vocabulary: Vocabulary, texts: Sequence[str]) -> list[dict]:
    """Where ``decode(encode(text)) != text`` under the vocabulary's normalisation.

    Returns, for each such text (by index), a dict with ``index``, ``offset`` (the
    first differing character), ``expected`` and ``got`` (a few characters around
    it) and ``reason``: ``"contains U+2581"`` (SentencePiece's whitespace symbol,
    which decodes as a space), or ``"normalisation"`` (NFKC, collapsed or stripped
    spaces; ``identity`` normalisation without whitespace removal avoids it), or
    ``"unknown characters"`` when the vocabulary maps them to unk.
    """
    out = []
    for i, (text, ids) in enumerate(zip(texts, vocabulary.encode_batch(list(texts)))):
        got = vocabulary.decode(ids.tolist())
        if got == text:
            continue
        k = next((j for j, (a, b) in enumerate(zip(text, got)) if a != b), min(len(text), len(got)))
        if META_SPACE in text:
            reason = "contains U+2581"
        elif vocabulary.unk_id in set(ids.tolist()):
            reason = "unknown characters"
        else:
            reason = "normalisation"
        out.append({"index": i, "offset": k, "expected": text[max(0, k - 10):k + 20],
                    "got": got[max(0, k - 10):k + 20], "reason": reason})
    return out
