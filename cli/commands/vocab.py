"""``seqcache vocab``: train and try vocabularies."""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import time

import click
from rich.console import Console
from rich.table import Column, Table

from seqcache.cli.commands.common import on_error_option
from seqcache.tasks import (SampleCounts, describe_record, is_error_record, parse_source_spec, round_trip_problems,
                            sample_for_vocabulary, train_hf_tokenizer, train_sentencepiece, vocabulary_from_spec)


@click.group()
def vocab():
    """Train a vocabulary (SentencePiece, or a tokenizers BPE/Unigram tokenizer.json) or encode text with one."""


MODELS = ("sentencepiece", "bpe", "unigram")


@vocab.command("train")
@click.option("--source", "sources", multiple=True, required=True,
              help="Source spec, as for build (text:, files:, jsonl:, parquet:, tsv:, parallel:, tfrecord:, tfds:, "
                   "hf:). A record of several values (parallel:, tsv:, named fields) contributes every one. "
                   "Repeat to sample from several sources.")
@on_error_option(
    "Bad source records, as for build: by default empty and whitespace-only records are skipped, control "
    "characters and U+2581 kept, and every other kind raises; raise (strict), skip (left out of the sample) or "
    "replace for every kind, or KIND=ACTION per kind, e.g. --on-error control_characters=skip. Repeatable.")
@click.option("--exclude", "exclude", multiple=True, help="Leave out files whose path matches this glob (repeatable).")
@click.option("--model", type=click.Choice(MODELS), default="sentencepiece", show_default=True,
              help="sentencepiece: a SentencePiece .model file; bpe (byte-level BPE) or unigram: a Hugging Face "
                   "tokenizers tokenizer.json. All use pad 0, eos 1, unk 2 and encode every text.")
@click.option("--vocab-size", type=click.IntRange(min=260), required=True,
              help="Number of ids (pieces), including pad/eos/unk and the 256 byte pieces.")
@click.option("--output", type=click.Path(dir_okay=False), required=True,
              help="Where to write the .model file (sentencepiece) or the tokenizer.json (bpe, unigram).")
@click.option("--max-records", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Records sampled (deterministically, by keyed hash) to train on.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Sampling and training seed.")
@click.option("--model-type", type=click.Choice(["unigram", "bpe"]), default=None,
              help="SentencePiece's algorithm (--model sentencepiece only)  [default: unigram]")
@click.option("--normalization", type=click.Choice(["nmt_nfkc", "nfkc", "identity"]), default=None,
              help="nmt_nfkc (T5's choice, sentencepiece only: NFKC, runs of spaces collapsed), nfkc (NFKC only) or "
                   "identity (lossless: keeps every character and space, for code)  "
                   "[default: nmt_nfkc for sentencepiece, nfkc for bpe and unigram]")
@click.option("--character-coverage", type=click.FloatRange(0.98, 1.0), default=0.9995, show_default=True,
              help="Fraction of characters covered by their own pieces; the rarest fall back to byte pieces "
                   "(sentencepiece, unigram).")
@click.option("--max-sentence-length", type=click.IntRange(min=1), default=16384, show_default=True,
              help="Longest training line in bytes; SentencePiece skips longer ones (counted and warned) "
                   "(sentencepiece, unigram).")
def train(sources, exclude, on_error, model, vocab_size, output, max_records, seed, model_type, normalization,
          character_coverage, max_sentence_length):
    """Train a vocabulary on a deterministic sample of the sources' records.

    --model sentencepiece (the default) writes a SentencePiece model (T5 ids: pad
    0, eos 1, unk 2; byte fallback). --model bpe and --model unigram write a
    tokenizers tokenizer.json with the same ids: bpe is byte-level (GPT-2's
    pre-tokenizer, NFKC), unigram splits at spaces (Metaspace, NFKC) and falls back
    to byte tokens. Use the file with --vocabulary in build.

    The same sources, options and seed give a byte-identical file. The bad input
    met while sampling is printed per kind: records skipped, replaced and kept.
    """
    console = Console(stderr=True, emoji=False)
    if model != "sentencepiece" and model_type is not None:
        raise click.BadParameter(f"--model-type chooses SentencePiece's algorithm; --model {model} is one already",
                                 param_hint="--model-type")
    if model == "sentencepiece":
        model_type = model_type or "unigram"
        normalization = normalization or "nmt_nfkc"
    else:
        normalization = normalization or "nfkc"
        if normalization == "nmt_nfkc":
            raise click.BadParameter(f"nmt_nfkc is SentencePiece's; --model {model} takes nfkc or identity",
                                     param_hint="--normalization")
    wanted, other = (".model", ".json") if model == "sentencepiece" else (".json", ".model")
    if output.endswith(other):
        raise click.BadParameter(f"--model {model} writes a {wanted} file (got {output!r}); --vocabulary tells the "
                                 "two kinds apart by this ending", param_hint="--output")
    try:
        parsed = [parse_source_spec(s, exclude=exclude, on_error=on_error) for s in sources]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--source") from None
    out_dir = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(out_dir, exist_ok=True)  # before minutes of training, not after
    except OSError as e:
        raise click.BadParameter(f"cannot create {out_dir}: {e}", param_hint="--output") from None
    start = time.perf_counter()
    counts = SampleCounts()
    try:
        texts = sample_for_vocabulary(parsed, max_records=max_records, seed=seed, counts=counts)
        sample_s = time.perf_counter() - start
        _print_counts(console, counts)
        if model == "sentencepiece":
            vocabulary = train_sentencepiece(texts, output_path=output, vocab_size=vocab_size, model_type=model_type,
                                             character_coverage=character_coverage, seed=seed,
                                             max_sentence_length=max_sentence_length,
                                             normalization_rule_name=normalization,
                                             remove_extra_whitespaces=normalization != "identity")
        else:
            vocabulary = train_hf_tokenizer(texts, output_path=output, model=model, vocab_size=vocab_size,
                                            normalization=normalization, seed=seed,
                                            character_coverage=character_coverage,
                                            max_sentence_length=max_sentence_length)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(option_names(str(e))) from None
    total_s = time.perf_counter() - start
    chars = sum(len(t) for t in texts)
    tokens = sum(len(a) for a in vocabulary.encode_batch(texts[:2000]))
    chars_head = sum(len(t) for t in texts[:2000])

    kind = f"SentencePiece ({model_type})" if model == "sentencepiece" else f"tokenizers {model}"
    table = Table(title=f"{kind} vocabulary", show_header=False)
    table.add_row("model", f"{output} ({os.path.getsize(output):,} bytes)" if os.path.exists(output) else output)
    table.add_row("sha256", vocabulary.sha256)
    table.add_row("pieces", f"{vocabulary.vocab_size:,} ({kind}, normalization {normalization})")
    table.add_row("ids", f"pad {vocabulary.pad_id}, eos {vocabulary.eos_id}, unk {vocabulary.unk_id}")
    table.add_row("sample", f"{len(texts):,} records, {chars:,} characters (seed {seed})")
    if tokens:
        table.add_row("characters / token", f"{chars_head / tokens:.2f} (first {min(len(texts), 2000):,} records)")
    table.add_row("time", f"{sample_s:.1f} s sampling, {total_s - sample_s:.1f} s training")
    console.print(table, markup=False)  # the --output path: not markup


def _print_counts(console, counts) -> None:
    """The bad input met while sampling, per kind: records skipped, replaced, kept."""
    rows = counts.by_kind()
    if not rows:
        console.print(f"{counts.records:,} records read, no bad input", highlight=False)
        return
    table = Table("kind", *(Column(n, justify="right") for n in ("skipped", "replaced", "kept")),
                  title=f"bad input in {counts.records:,} records read")
    for kind, skipped, replaced, kept in rows:
        table.add_row(kind, f"{skipped:,}", f"{replaced:,}", f"{kept:,}")
    console.print(table, markup=False)


_SP_INTERNAL = re.compile(r"\b[A-Z_]+: src/\S+\(\d+\) \[[^\]]*\] ")
_SP_OPTION = re.compile(r"(?<![-\w])(?:--)?(vocab_size|character_coverage|max_sentence_length|model_type)\b(?: option)?")


def option_names(message: str) -> str:
    """A trainer's message in this command's terms: SentencePiece's option names
    (``--character_coverage``, ``vocab_size``) become ``--character-coverage``,
    ``--vocab-size``; its source location and failed check are dropped."""
    message = _SP_INTERNAL.sub("", message)
    message = _SP_OPTION.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    # "decrease character_coverage with --character_coverage option" names the option twice.
    return re.sub(r"(--[a-z-]+) with \1\b", r"\1", message)


@vocab.command("encode")
@click.option("--vocabulary", "vocabulary_spec", default="byte", show_default=True,
              help="'byte', the path of a SentencePiece .model file or of a tokenizer.json (PATH#eos=TOKEN names "
                   "its EOS token).")
@click.option("--extra-ids", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--pieces/--no-pieces", default=False, help="Also print each id's piece (SentencePiece, tokenizers).")
@click.argument("text")
def encode(vocabulary_spec, extra_ids, pieces, text):
    """Print the token ids of TEXT (no EOS appended)."""
    try:
        vocabulary = vocabulary_from_spec(vocabulary_spec, extra_ids=extra_ids)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--vocabulary") from None
    ids = vocabulary.encode(text)
    click.echo(" ".join(str(i) for i in ids))
    if pieces and hasattr(vocabulary, "id_to_piece"):
        click.echo(" ".join(vocabulary.id_to_piece(i) for i in ids))


@vocab.command("check")
@click.option("--vocabulary", "vocabulary_spec", required=True,
              help="'byte', the path of a SentencePiece .model file or of a tokenizer.json.")
@click.option("--source", "sources", multiple=True, required=True,
              help="Source spec (text:, files:, jsonl:, parquet:); repeatable.")
@click.option("--exclude", "exclude", multiple=True, help="Leave out files whose path matches this glob (repeatable).")
@on_error_option(
    "As for build, except that the content kinds (control_characters, u2581, empty, whitespace) are kept unless "
    "set here: this command exists to report them.",
    base=("control_characters=keep", "u2581=keep", "empty=keep", "whitespace=keep"))
@click.option("--max-records", type=click.IntRange(min=1), default=100_000, show_default=True,
              help="Check at most this many records (in source order).")
@click.option("--show", "show_n", type=click.IntRange(min=0), default=10, show_default=True,
              help="Print this many of the records that do not survive.")
@click.option("--json", "as_json", is_flag=True)
def check(vocabulary_spec, sources, exclude, on_error, max_records, show_n, as_json):
    """Report the records where decode(encode(text)) != text under the
    vocabulary's normalisation: text that contains U+2581 (decoded as a space),
    characters NFKC rewrites, collapsed spaces, or characters the vocabulary cannot
    represent. Exits 1 when any record does not survive the round trip.

    The normalisation lives in the model file (SentencePiece .model or
    tokenizer.json), whose sha256 is part of every cache fingerprint: a model
    with other normalisation gives another cache."""
    try:
        vocabulary = vocabulary_from_spec(vocabulary_spec)
        parsed = [parse_source_spec(s, exclude=exclude, on_error=on_error) for s in sources]
    except (ValueError, FileNotFoundError) as e:
        raise click.UsageError(str(e)) from None
    rows, texts = [], []
    try:
        for src in parsed:
            for i, f in enumerate(src.list_files()):
                for r in src.read_file(i, f.path):
                    if len(texts) >= max_records:
                        break
                    if is_error_record(r):
                        continue
                    for key in sorted(r.data):  # every text value: both sides of a parallel or TSV source
                        if isinstance(r.data[key], str):
                            rows.append((f.path, r.record_number, src.locator))
                            texts.append(r.data[key])
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    problems = round_trip_problems(vocabulary, texts)
    for p in problems:
        p["path"], p["record_number"], p["locator"] = rows[p["index"]]
    by_reason = dict(collections.Counter(p["reason"] for p in problems))
    report = {"records": len(texts), "changed": len(problems), "by_reason": by_reason, "examples": problems[:show_n]}
    if as_json:
        click.echo(json.dumps(report, indent=2, ensure_ascii=False))
    else:
        click.echo(f"{len(texts):,} records checked, {len(problems):,} change in decode(encode(text))"
                   + (f": {', '.join(f'{k} {v:,}' for k, v in sorted(by_reason.items()))}" if problems else ""))
        for p in problems[:show_n]:
            where = describe_record(p["path"], p["locator"], p["record_number"])
            click.echo(f"  {p['path']} {where} ({p['reason']}, at character {p['offset']}): "
                       f"{p['expected']!r} -> {p['got']!r}")
    sys.exit(1 if problems else 0)
