"""The ad-hoc task that ``seqcache build`` and ``seqcache scan`` describe on
the command line (``--source``, ``--vocabulary``, ``--objective``,
``--sequence-length``, ``--pack``): its source, vocabulary, preprocessors,
packing and sequence lengths, each bad flag a click usage error. It imports
no Beam: ``seqcache scan`` and ``seqcache build --help`` load none."""

from __future__ import annotations

import click

from seqcache import lengths as lengths_lib
from seqcache import tasks
from seqcache.cli.commands import common


def source_options(command):
    """The flags that describe an ad-hoc task's input, one definition for
    ``build`` and ``scan``: ``--source`` (given once), ``--exclude``
    (repeatable), ``--vocabulary``. A decorator of a click command."""
    for option in reversed((
        click.option("--source", "source_spec", multiple=True, callback=common.given_once,
                     help="Ad-hoc task source: text:GLOB | files:GLOB | jsonl:GLOB#field | parquet:GLOB#column | "
                          "tfrecord:GLOB[#feature] | tfds:NAME[/CONFIG][:VERSION][@SPLIT]#feature | "
                          "hf:PATH[@SPLIT]#column; two values per record: parallel:inputs=GLOB,targets=GLOB "
                          "(line-aligned files) | jsonl:GLOB#inputs=FIELD,targets=FIELD | "
                          "parquet:GLOB#inputs=COLUMN,targets=COLUMN | tsv:GLOB[#inputs=0,targets=1] "
                          "(tab-separated columns)."),
        click.option("--exclude", "exclude", multiple=True,
                     help="Ad-hoc task: leave out files whose path matches this glob (repeatable)."),
        click.option("--vocabulary", "vocabulary_spec", default="byte", show_default=True,
                     help="Ad-hoc task vocabulary: byte, a SentencePiece .model path or a Hugging Face "
                          "tokenizer.json path (scan: for its token id checks)."),
    )):
        command = option(command)
    return command


# The objectives of an ad-hoc task (``--objective``; ``adhoc_task`` says what each makes).
OBJECTIVES = ("lm", "span_corruption", "prefix_lm", "supervised")
# ``--pack`` values; ``--pack`` alone picks the objective's packing (``PACK_DEFAULT``).
PACKINGS = ("lm", "first_fit", "none")
PACK_DEFAULT = "auto"
SPAN_CORRUPTION_DEFAULTS = {"noise_density": 0.15, "mean_noise_span_length": 3.0}


def _source_keys(source) -> list[str]:
    """The keys of a record's values (named fields or files), else ``["text"]``."""
    if isinstance(source, tasks.ParallelTextSource):
        return list(source.files)
    for attr in ("fields", "columns"):  # JsonLinesSource, ParquetSource
        named = getattr(source, attr, None)
        if isinstance(named, dict):
            return list(named)
    return ["text"]


def adhoc_task(*, name, source_spec, exclude=(), on_error=None, vocabulary_spec, extra_ids, sequence_length, pack,
               objective=None, noise_density=None, mean_noise_span_length=None, split="train",
               tfds_data_dir=None):
    """The task ``build --source ... --vocabulary ...`` describes.

    ``objective``, one of ``OBJECTIVES`` (None: ``supervised`` for a source of
    ``inputs`` and ``targets``, else ``lm``): ``lm`` tokenizes the text into
    ``targets`` with EOS; ``span_corruption`` and ``prefix_lm`` make ``inputs``
    and ``targets`` with T5's preprocessors (``seqcache.tasks.span_corruption``,
    ``noise_density`` 0.15 and ``mean_noise_span_length`` 3.0 by default, its
    sentinels the vocabulary's ``extra_ids``; ``seqcache.tasks.prefix_lm``,
    ``noise_density`` 0.5); ``supervised`` tokenizes the source's own values.
    ``split`` and ``tfds_data_dir``: the split a ``tfds:`` or ``hf:`` source
    reads unless its spec names one, and where a ``tfds:`` dataset was prepared.
    ``pack``: one of ``PACKINGS``, None/False, or True/``"auto"`` for the
    objective's own (``lm`` for ``lm``, else ``first_fit``).
    ``sequence_length``: feature -> tokens (or None), as given.

    Raises:
      click.UsageError: a bad source or vocabulary spec, or options that do not
        go together; the message names the flag (``--extra-ids``, ``--pack``,
        ``--objective``, ``--noise-density``, ...).
      click.BadParameter: a bad task name.
    """
    source, vocabulary = _adhoc_source_and_vocabulary(source_spec, exclude=exclude, on_error=on_error, split=split,
                                                      tfds_data_dir=tfds_data_dir, vocabulary_spec=vocabulary_spec,
                                                      extra_ids=extra_ids)
    objective = _adhoc_objective(source_spec, source, objective, noise_density=noise_density,
                                 mean_noise_span_length=mean_noise_span_length)
    packing = _adhoc_packing(pack, objective)
    features, pre, corruption = _adhoc_preprocessing(vocabulary, objective, packing=packing,
                                                     sequence_length=sequence_length, noise_density=noise_density,
                                                     mean_noise_span_length=mean_noise_span_length)
    try:
        task = tasks.Task(name, source=source, output_features=features, preprocessors=pre, packing=packing)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--name") from None
    if objective == "span_corruption":
        _check_sentinels(corruption, vocabulary, adhoc_sequence_length(task, sequence_length), extra_ids)
    return task


def _adhoc_source_and_vocabulary(source_spec, *, exclude, on_error, split, tfds_data_dir, vocabulary_spec,
                                 extra_ids):
    """(source, vocabulary) of an ad-hoc task; a bad spec is a click.UsageError."""
    try:
        source = tasks.parse_source_spec(source_spec, exclude=exclude, on_error=on_error, split=split,
                                         tfds_data_dir=tfds_data_dir)
        vocabulary = tasks.vocabulary_from_spec(vocabulary_spec, extra_ids=extra_ids)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise click.UsageError(str(e)) from None
    return source, vocabulary


def _adhoc_objective(source_spec, source, objective, *, noise_density, mean_noise_span_length) -> str:
    """The objective (given, or the source's default), checked against the source and the options."""
    keys = _source_keys(source)
    pair = sorted(keys) == ["inputs", "targets"]
    if not pair and keys != ["text"]:
        raise click.UsageError(f"--source {source_spec}: an ad-hoc task reads one value per record or two named "
                               f"inputs and targets (got {', '.join(keys)}), e.g. "
                               "'parallel:inputs=train.en.gz,targets=train.de.gz'")
    objective = objective or ("supervised" if pair else "lm")
    if objective not in OBJECTIVES:
        raise click.BadParameter(f"{objective!r} is not one of {', '.join(OBJECTIVES)}", param_hint="--objective")
    if pair != (objective == "supervised"):
        raise click.UsageError(
            f"--objective {objective} needs " + ("a source of two values, inputs and targets (e.g. "
                                                 "'parallel:inputs=A,targets=B' or 'jsonl:PATH#inputs=src,targets=tgt')"
                                                 if objective == "supervised" else
                                                 "one text value per record, but --source gives inputs and targets "
                                                 "(drop --objective: such a task is supervised)"))
    if noise_density is not None and objective not in ("span_corruption", "prefix_lm"):
        raise click.UsageError(f"--noise-density applies to --objective span_corruption or prefix_lm, "
                               f"not {objective}")
    if mean_noise_span_length is not None and objective != "span_corruption":
        raise click.UsageError(f"--mean-noise-span-length applies to --objective span_corruption, not {objective}")
    return objective


def _adhoc_packing(pack, objective) -> str | None:
    """``--pack`` -> the task's packing mode (None, ``"lm"`` or ``"first_fit"``), checked against the objective."""
    if pack is True or pack == PACK_DEFAULT:
        return "lm" if objective == "lm" else "first_fit"
    if pack in (None, False, "none"):
        return None
    if pack not in ("lm", "first_fit"):
        raise click.BadParameter(f"{pack!r} is not one of {', '.join(PACKINGS)}", param_hint="--pack")
    if pack == "lm" and objective != "lm":
        raise click.UsageError(f"--pack lm concatenates one feature, but --objective {objective} makes inputs and "
                               "targets: use --pack first_fit (or --pack alone)")
    return pack


def _adhoc_preprocessing(vocabulary, objective, *, packing, sequence_length, noise_density,
                         mean_noise_span_length):
    """(output features, preprocessors, the span corruption or prefix LM preprocessor or None)."""
    P = tasks.preprocessors
    corruption = None
    if objective == "lm":
        features = {"targets": tasks.Feature(vocabulary, add_eos=True)}
        pre = [P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()]
        if sequence_length and not packing:
            pre.append(P.trim())
        return features, pre, corruption
    features = {"inputs": tasks.Feature(vocabulary, add_eos=True),
                "targets": tasks.Feature(vocabulary, add_eos=True)}
    if objective == "supervised":
        pre = [P.rekey({"inputs": "inputs", "targets": "targets"}), P.tokenize()]
    else:
        corruption = _corruption(objective, noise_density=noise_density,
                                 mean_noise_span_length=mean_noise_span_length)
        pre = [P.rekey({"inputs": None, "targets": "text"}), P.tokenize(), corruption]
    pre.append(P.append_eos_after_trim())
    return features, pre, corruption


def _corruption(objective, *, noise_density, mean_noise_span_length):
    """The span corruption or prefix LM preprocessor, with defaults for the options not given."""
    try:
        if objective == "span_corruption":
            kw = {k: v if v is not None else SPAN_CORRUPTION_DEFAULTS[k]
                  for k, v in (("noise_density", noise_density),
                               ("mean_noise_span_length", mean_noise_span_length))}
            if not 0.0 < kw["noise_density"] < 1.0:
                raise ValueError(f"--noise-density must be in (0, 1) (got {kw['noise_density']})")
            return tasks.span_corruption(**kw)
        return tasks.prefix_lm(**({} if noise_density is None else {"noise_density": noise_density}))
    except ValueError as e:
        raise click.UsageError(str(e)) from None


def adhoc_sequence_length(task, sequence_length):
    """The sequence length of every feature of an ad-hoc task, from what
    ``--sequence-length`` gave (feature -> tokens; ``"*"``,
    ``seqcache.lengths.ALL_FEATURES``, for a bare N).

    lm: as given. Span corruption: ``inputs=N`` derives the targets length as
    T5 does (``random_spans_helper``: inputs 512 -> targets 114), ``targets=N``
    the shortest inputs length whose targets take N tokens
    (``inputs_length_for_targets``: 114 -> 508); both may be given. Prefix LM
    and supervised: one N is the length of both features.

    Returns: {feature: tokens} or None (no length given).

    Raises:
      click.UsageError: a feature the task does not have, a bare N for span
        corruption, a targets length shorter than the one span corruption
        makes; the message names ``--sequence-length``.
    """
    if not sequence_length:
        return None
    lengths = dict(sequence_length)
    names = list(task.output_features)
    bare = lengths.pop(lengths_lib.ALL_FEATURES, None)
    corruption = next((p for p in task.preprocessors if isinstance(p, tasks.span_corruption)), None)
    if bare is not None:
        if corruption is not None:
            raise click.UsageError(f"--sequence-length {bare}: span corruption needs inputs=N or targets=N "
                                   "(e.g. inputs=512, which gives targets=114)")
        for n in names:
            lengths.setdefault(n, bare)
    unknown = sorted(set(lengths) - set(names))
    if unknown:
        raise click.UsageError(f"--sequence-length: the task has no feature {', '.join(unknown)} "
                               f"(its features: {', '.join(names)})")
    if corruption is not None:
        try:
            inputs_length, _, targets_length = corruption.lengths(lengths)
        except ValueError as e:
            raise click.UsageError(f"--sequence-length: {e}") from None
        return {"inputs": lengths.get("inputs", inputs_length), "targets": lengths.get("targets", targets_length)}
    if len(names) == 2 and len(lengths) == 1:
        (n,) = lengths.values()
        return {name: n for name in names}
    return {n: lengths[n] for n in names if n in lengths}


def _check_sentinels(corruption, vocabulary, lengths, extra_ids):
    """Span corruption needs one sentinel (extra id) per noise span a row can hold."""
    if extra_ids < 1:
        raise click.UsageError("--objective span_corruption marks noise spans with sentinel ids: give the vocabulary "
                               "extra ids, e.g. --extra-ids 100 (as T5)")
    if lengths is None:
        raise click.UsageError("--objective span_corruption needs --sequence-length inputs=N or targets=N "
                               "(e.g. inputs=512, which gives targets=114)")
    _, tokens_length, _ = corruption.lengths(lengths)
    num_noise = min(max(int(round(tokens_length * corruption.noise_density)), 1), max(tokens_length - 1, 1))
    num_spans = max(int(round(num_noise / corruption.mean_noise_span_length)), 1)
    if extra_ids < num_spans:
        raise click.UsageError(f"--extra-ids {extra_ids}: span corruption of {tokens_length} tokens makes "
                               f"{num_spans} noise spans, one sentinel each; give --extra-ids {num_spans} or more "
                               "(T5 uses 100)")
