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

A cache stores a vocabulary as ``to_json()`` (and the model file
``desc["file"]`` next to the manifest), rebuilt by ``vocabulary_from_json``
(``vocabulary_specs``); ``vocabulary_training`` trains and tries them.
"""

from __future__ import annotations

import abc
import itertools
import contextlib
import dataclasses
import hashlib
import os
import threading
from typing import Sequence

import numpy as np
import sentencepiece as spm

from seqcache import fs


class Vocabulary(abc.ABC):
    """Maps text to int32 token ids and back.

    Subclasses implement the base vocabulary; ``extra_ids`` sentinels are added on
    top (see the module docstring for their numbering).
    """

    def __init__(self, extra_ids: int = 0):
        if extra_ids < 0:
            raise ValueError(f"extra_ids must be >= 0 (got {extra_ids=})")
        self.extra_ids = int(extra_ids)

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

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no EOS appended)."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of many texts: a list of 1-D int32 arrays, one per text."""
        return [np.asarray(self.encode(t), dtype=np.int32) for t in texts]

    def encode_batch_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` as one column: ``(ids, lengths)``, every text's ids
        one after the other (int32, (sum(lengths),)) and their counts (int64,
        (len(texts),)). Raises as ``encode_batch``."""
        arrays = self.encode_batch(texts) if len(texts) else []
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        flat = np.concatenate(arrays, dtype=np.int32, casting="unsafe") if arrays else np.zeros(0, np.int32)
        return flat, lengths

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; pad, EOS and sentinel ids are dropped."""

    def decode_batch(self, batch: Sequence[Sequence[int]]) -> list[str]:
        """``[decode(ids) for ids in batch]`` (overridden by faster ways)."""
        return [self.decode(ids) for ids in batch]

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


# Model files a build stores, pickled by reference: Beam pickles every step
# several times a build (a model in them cost 0.09 s of a 0.41 s build,
# benchmarks/README.md), so a stored model pickles as its URL and sha256.


_STORED = threading.local()  # .files: {sha256 hex: URL}, in the thread that makes and runs the pipeline
_LOADED: dict[str, bytes] = {}  # sha256 hex -> model bytes read from a ModelFile, in this process
_LOADED_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ModelFile:
    """A model stored in a cache folder, pickled instead of its bytes (``stored_models``)."""

    url: str
    sha256: str

    def read(self) -> bytes:
        """The model's bytes, read once per process; ``ValueError`` naming the
        file when it cannot be read or its sha256 differs."""
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
    a value of ``files`` ({URL of a stored copy: its bytes}) pickles a
    ``ModelFile`` of that URL instead of the bytes."""
    before = getattr(_STORED, "files", None)
    current = dict(before or {})
    for url, data in files.items():
        current.setdefault(hashlib.sha256(data).hexdigest(), url)
    _STORED.files = current
    try:
        yield
    finally:
        _STORED.files = before


def read_model(path: str, stored: ModelFile | None, what: str) -> bytes:
    """A vocabulary's model bytes: ``stored`` (a build's copy) when given, else
    the file ``path``. Raises ``ValueError`` naming ``what`` and the file."""
    if stored is not None:
        return stored.read()
    try:
        return fs.read_bytes(path)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path!r}: {e}") from e


def pickled_model(stored: ModelFile | None, data, digest_cache: list) -> bytes | ModelFile:
    """What a vocabulary pickles for its model: ``stored`` (the reference it was
    unpickled from) as it is, else ``_model_state(data())``."""
    return stored if stored is not None else _model_state(data(), digest_cache)


def unpickled_model(value: bytes | ModelFile) -> tuple[bytes | None, ModelFile | None, list]:
    """(bytes or None, ``ModelFile`` or None, digest cache) of a ``pickled_model`` value."""
    if isinstance(value, ModelFile):
        return None, value, [value.sha256]
    return value, None, [None]


def _model_state(data: bytes, digest_cache: list) -> bytes | ModelFile:
    """A ``ModelFile`` for ``data`` when ``stored_models`` holds it in this
    thread, else ``data``; ``digest_cache`` (a one-item list) keeps its sha256."""
    files = getattr(_STORED, "files", None)
    if not files:
        return data
    if digest_cache[0] is None:
        digest_cache[0] = hashlib.sha256(data).hexdigest()
    url = files.get(digest_cache[0])
    return data if url is None else ModelFile(url, digest_cache[0])


# Mean characters per text from which ``encode_batch_flat`` asks SentencePiece
# for int32 buffers instead of lists (benchmarks/pipeline.py).
SENTENCEPIECE_BUFFER_CHARS = 256
ENCODING_THREADS_ENV = "SEQCACHE_ENCODING_THREADS"


def encoding_threads() -> int:
    """SentencePiece's encoding threads when the caller names none:
    ``$SEQCACHE_ENCODING_THREADS`` when set (a build hands its driver's value
    to every worker), else the CPUs this process may run on
    (``os.sched_getaffinity``), not SentencePiece's default, the hardware
    threads, which oversubscribes a pinned process or a container.

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


# Whether the installed SentencePiece encodes to numpy arrays (older releases do not).
_ENCODES_TO_NUMPY = hasattr(spm.SentencePieceProcessor, "EncodeAsNumpy")


class SentencePieceVocabulary(Vocabulary):
    """A SentencePiece model (Kudo & Richardson 2018, arXiv 1808.06226).

    Loaded on first use; a pickled vocabulary carries the model bytes, not the
    path. Special ids come from the model (``train_sentencepiece``: pad 0,
    eos 1, unk 2, no bos); without a pad piece ``pad_id`` is 0.

    Args:
      model_path: path of a ``.model`` file (local or a Beam FileSystems URL).
      model_bytes: the serialized model, instead of ``model_path``.
      extra_ids: number of sentinel ids added after the model's pieces.

    Raises:
      ValueError: neither or both of model_path and model_bytes; a missing file
        or not a SentencePiece model (names it; on first use for a path).
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

    def _where(self) -> str:
        return self.model_path if self.model_path is not None else "<model bytes>"

    def model_bytes(self) -> bytes:
        if self._model_bytes is None:
            self._model_bytes = read_model(self.model_path, self._model_file, "SentencePiece model")
        return self._model_bytes

    def _processor(self):
        if self._sp is None:
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
        return {"model_bytes": pickled_model(self._model_file, self.model_bytes, self._digest),
                "model_path": self.model_path, "extra_ids": self.extra_ids}

    def __setstate__(self, state):
        self.extra_ids = state["extra_ids"]
        self.model_path = state["model_path"]
        self._model_bytes, self._model_file, self._digest = unpickled_model(state["model_bytes"])
        self._sp = None

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

    def encode(self, text: str) -> list[int]:
        return list(self._processor().encode(text, out_type=int))

    def encode_batch(self, texts: Sequence[str], *, num_threads: int | None = None) -> list[np.ndarray]:
        """Token ids of many texts in one call into SentencePiece (int32 arrays),
        on ``num_threads`` threads (None: ``encoding_threads()``)."""
        if not texts:
            return []
        kwargs = {"num_threads": int(encoding_threads() if num_threads is None else num_threads)}
        ids = self._processor().encode(list(texts), out_type=int, **kwargs)
        return [np.asarray(x, dtype=np.int32) for x in ids]

    def encode_batch_flat(self, texts: Sequence[str], *, num_threads: int | None = None
                          ) -> tuple[np.ndarray, np.ndarray]:
        """``Vocabulary.encode_batch_flat`` in one call into SentencePiece."""
        if not len(texts):
            return np.zeros(0, np.int32), np.zeros(0, np.int64)
        kwargs = {"num_threads": int(encoding_threads() if num_threads is None else num_threads)}
        texts = list(texts)
        if sum(map(len, texts)) >= SENTENCEPIECE_BUFFER_CHARS * len(texts) and _ENCODES_TO_NUMPY:
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
        """``decode`` of each id sequence, in one call into SentencePiece."""
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

    def fingerprint(self) -> dict:
        return {"kind": "sentencepiece", "sha256": self.sha256, "extra_ids": self.extra_ids}

    def to_json(self) -> dict:
        """``{"kind", "file", "sha256", "extra_ids", "vocab_size"}``; ``file``, the
        name a cache stores ``model_bytes()`` under, comes from the model's hash."""
        sha = self.sha256
        return {"kind": "sentencepiece", "file": f"spm-{sha[:16]}.model", "sha256": sha,
                "extra_ids": self.extra_ids, "vocab_size": self.vocab_size}

    def __repr__(self) -> str:
        return f"SentencePieceVocabulary({self._where()!r}, extra_ids={self.extra_ids})"


def decode_with_sentinels(vocabulary, ids) -> str:
    """The text of ``ids`` (a sequence of int token ids) as ``Vocabulary.decode``
    gives it, except that each sentinel id is shown as ``<extra_id_i>`` (seqio's
    spelling; ``vocabulary.sentinel_id(i)`` is the id) instead of being
    dropped, so that a span-corrupted example reads as T5 shows it::

        inputs:  Thank you <extra_id_0> me to your party <extra_id_1> week.
        targets: <extra_id_0> for inviting <extra_id_1> last

    The ids between two sentinels are decoded together (a piece starting with
    ``▁`` after a sentinel keeps its space); pad and EOS are dropped."""
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
