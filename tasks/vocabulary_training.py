"""Training and trying vocabularies: a deterministic sample of a source's
texts (``sample_for_vocabulary``), a SentencePiece model trained on it
(``train_sentencepiece``) and the round trip of texts through a vocabulary
(``round_trip_problems``)."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import io
import logging
import os
from typing import Iterable, Sequence

import sentencepiece as spm

from seqcache import fs
from seqcache.tasks.sources import ERROR_KINDS, Source, is_error_record, text_problems
from seqcache.tasks.vocabularies import SentencePieceVocabulary, Vocabulary


@dataclasses.dataclass
class SampleCounts:
    """What ``sample_for_vocabulary`` met under the sources' ``on_error`` policies.

    Attributes:
      records: source records read.
      skipped, replaced, kept: records skipped (left out), repaired, or kept as
        they are (action ``"keep"``; empty texts never enter the sample) per
        kind of bad input; a record counts under each of its kinds.
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

    The ``max_records`` records with the smallest keyed hash ``blake2b(raw,
    key=seed, digest_size=8)`` (a bottom-k sample, ordered by hash): it depends
    only on the multiset of records and the seed. Memory: O(max_records)
    texts. Empty texts, non-string values and skipped records are left out.

    Args:
      source: one source or several (sampled together).
      max_records: sample size (records).
      seed: non-negative int, the hash key.
      field: the key of the text in ``SourceRecord.data``; None: every string
        value of the record, in key order, one per line.
      counts: if given, filled in (``SampleCounts``).

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


def _neg_bytes(b: bytes) -> bytes:
    # Orders ties on the hash by raw bytes, smallest kept, inside a max-heap.
    return bytes(255 - x for x in b) + b"\xff"


def train_sentencepiece(texts: Iterable[str], *, output_path: str, vocab_size: int, model_type: str = "unigram",
                        character_coverage: float = 0.9995, max_sentence_length: int = 16384,
                        input_sentence_size: int = 0, seed: int = 0, split_lines: bool = True,
                        normalization_rule_name: str = "nmt_nfkc", remove_extra_whitespaces: bool = True,
                        extra_ids: int = 0) -> SentencePieceVocabulary:
    """Trains a SentencePiece model with the T5 id layout and writes it to ``output_path``.

    Ids: pad 0, eos 1, unk 2, no bos; with ``byte_fallback`` every string is
    encodable (byte pieces ``<0x..>``). The same texts in the same order with
    the same options give a byte-identical ``.model`` file (one thread, a fixed
    seed, no shuffling).

    Args:
      texts: training texts (with ``split_lines``, their non-empty lines).
      output_path: where to write the ``.model`` file (local or a URL).
      vocab_size: number of pieces, including pad/eos/unk and the 256 byte pieces.
      model_type: ``"unigram"`` (Kudo 2018, arXiv 1804.10959) or ``"bpe"``.
      character_coverage: fraction of characters covered by their own pieces.
      max_sentence_length: longer sentences (in bytes) are skipped by SentencePiece.
      input_sentence_size: if > 0, train on the first this many sentences.
      seed: SentencePiece's random seed.
      split_lines: split texts into lines.
      normalization_rule_name: ``"nmt_nfkc"`` (T5's) or ``"identity"`` (with
        ``remove_extra_whitespaces=False``: ``decode(encode(text)) == text``).
      remove_extra_whitespaces: collapse runs of spaces and strip ends.
      extra_ids: sentinels of the returned vocabulary (not stored in the model).

    Raises:
      ValueError: bad options, no text, or SentencePiece refused to train (for
        example ``vocab_size`` too large for the text); the message says which.
    """
    if model_type not in ("unigram", "bpe"):
        raise ValueError(f"model_type must be 'unigram' or 'bpe' (got {model_type!r})")
    if vocab_size < 260:
        raise ValueError(f"vocab_size must be >= 260 (3 special ids + 256 byte pieces + 1) (got {vocab_size=})")

    sentences = _TrainingSentences(texts, split_lines=split_lines, max_sentence_length=max_sentence_length)
    writer = io.BytesIO()
    spm.set_random_generator_seed(int(seed))
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=writer, vocab_size=int(vocab_size), model_type=model_type,
            character_coverage=float(character_coverage), max_sentence_length=int(max_sentence_length),
            input_sentence_size=int(input_sentence_size), shuffle_input_sentence=False, num_threads=1,
            pad_id=0, eos_id=1, unk_id=2, bos_id=-1, byte_fallback=True,
            normalization_rule_name=normalization_rule_name,
            remove_extra_whitespaces=bool(remove_extra_whitespaces), minloglevel=2)
    except (RuntimeError, OSError) as e:
        if sentences.all_too_long:
            raise sentences.too_long_error() from e
        raise ValueError(f"SentencePiece training failed (vocab_size={vocab_size}, model_type={model_type}): {e}") from e
    sentences.check()
    data = writer.getvalue()
    if not data:
        raise ValueError("SentencePiece training produced no model: were there any non-empty texts?")
    fs.write_bytes_atomic(os.fspath(output_path), data, fsync=False)
    vocab = SentencePieceVocabulary(model_bytes=data, extra_ids=extra_ids)
    vocab.model_path = os.fspath(output_path)
    return vocab


class _TrainingSentences:
    """The non-empty lines (or texts) SentencePiece trains on, counted as they
    stream, with those over ``max_sentence_length`` bytes (it skips them)."""

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

    Returns, for each such text, a dict with ``index``, ``offset`` (the first
    differing character), ``expected`` and ``got`` (the characters around it)
    and ``reason``: ``"contains U+2581"`` (decodes as a space),
    ``"unknown characters"`` (mapped to unk) or ``"normalisation"`` (NFKC,
    collapsed or stripped spaces).
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
