"""``parse_source_spec``: a source from its command-line form."""

from __future__ import annotations

from typing import Mapping, Sequence

from seqcache.tasks.sources.base import Source
from seqcache.tasks.sources.json_lines import JsonLinesSource
from seqcache.tasks.sources.parallel import ParallelTextSource
from seqcache.tasks.sources.parquet import ParquetSource
from seqcache.tasks.sources.text_files import TextFileSource
from seqcache.tasks.sources.text_lines import TextLineSource
from seqcache.tasks.sources.tsv import TsvSource

_SPEC_HELP = (
    "accepted source specs: 'text:PATTERN' (one record per line), "
    "'files:PATTERN' (one record per file), 'jsonl:PATTERN#FIELD' (FIELD may be dotted, "
    "default 'text'), 'parquet:PATTERN#COLUMN' (default 'text')"
)
# Several values per record: parallel text, and JSON lines or Parquet with named fields.
_SPEC_HELP += (
    "; two or more values per record: 'parallel:inputs=PATTERN,targets=PATTERN' (line-aligned "
    "files), 'jsonl:PATTERN#inputs=FIELD,targets=FIELD', 'parquet:PATTERN#inputs=COLUMN,targets=COLUMN', "
    "'tsv:PATTERN[#inputs=0,targets=1]' (tab-separated columns by 0-based index)"
)


def _named_values(spec: str, text: str) -> dict[str, str] | None:
    """``"inputs=a,targets=b"`` -> ``{"inputs": "a", "targets": "b"}`` in the
    order given; None for a plain name without ``=``.

    Raises:
      ValueError: an empty key or value, or a key given twice (names the spec).
    """
    if "=" not in text:
        return None
    out: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise ValueError(f"bad source spec {spec!r}: {part!r} is not KEY=VALUE; {_SPEC_HELP}")
        if key in out:
            raise ValueError(f"bad source spec {spec!r}: {key!r} is given twice")
        out[key] = value
    return out


def parse_source_spec(spec: str, *, exclude: Sequence[str] = (),
                      on_error: "str | Mapping[str, str] | None" = None, split: str = "train",
                      tfds_data_dir: str | None = None) -> Source:
    """Builds a source from its command-line form.

    Forms: ``text:PATTERN``, ``files:PATTERN``, ``jsonl:PATTERN#FIELD`` and
    ``parquet:PATTERN#COLUMN`` (FIELD / COLUMN default to ``text``). The value is
    stored under the key ``"text"``. ``exclude``: glob patterns of paths to leave out;
    ``on_error``: the source's ``ErrorPolicy`` spec (see ``parse_on_error``).

    Several values per record, each under its own key (``KEY=...`` pairs joined
    by commas):

    - ``parallel:inputs=PATTERN,targets=PATTERN``: a ``ParallelTextSource`` of
      line-aligned files, line k of one translating line k of the other (e.g.
      ``parallel:inputs=multi30k/train.en.gz,targets=multi30k/train.de.gz``),
      its fields in sorted key order (provenance names the first key's files);
    - ``jsonl:PATTERN#inputs=FIELD,targets=FIELD``: ``JsonLinesSource(fields=...)``;
    - ``parquet:PATTERN#inputs=COLUMN,targets=COLUMN``: ``ParquetSource(columns=...)``;
    - ``tsv:PATTERN#inputs=0,targets=1``: ``TsvSource(columns=...)``, tab-separated
      columns by 0-based index (``tsv:PATTERN`` alone: columns 0 and 1 as inputs
      and targets).

    Dataset forms: ``tfrecord:PATTERN`` (raw UTF-8 records) and
    ``tfrecord:PATTERN#FEATURE`` (a ``tf.train.Example`` feature);
    ``tfds:NAME[/CONFIG][:VERSION][@SPLIT]#FEATURE`` (a prepared TFDS dataset in
    ``tfds_data_dir``); ``hf:PATH[@SPLIT]#COLUMN`` (a Hugging Face dataset saved on
    disk). The TFDS / Hugging Face split is ``@SPLIT`` or else ``split`` (the
    build's ``--split``); FEATURE / COLUMN default to ``text``.

    Raises:
      ValueError: an unknown kind, an empty pattern, a malformed ``KEY=VALUE``
        list, a parallel spec with fewer than two files or with ``exclude``; the
        message lists the forms.
        ``exclude`` with a ``tfds:`` or ``hf:`` source (they have no file patterns).
      ImportError: a ``tfrecord:`` or ``tfds:`` source without the ``tfds`` extra
        (the message gives ``pip install 'seqcache[tfds]'``).
    """
    kind, sep, rest = spec.partition(":")
    if not sep or not rest:
        raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
    if kind == "text":
        return TextLineSource(rest, exclude=exclude, on_error=on_error)
    if kind == "files":
        return TextFileSource(rest, exclude=exclude, on_error=on_error)
    if kind == "parallel":
        return _parallel_source(spec, rest, exclude=exclude, on_error=on_error)
    if kind in ("jsonl", "parquet"):
        return _keyed_file_source(spec, kind, rest, exclude=exclude, on_error=on_error)
    if kind == "tsv":
        return _tsv_source(spec, rest, exclude=exclude, on_error=on_error)
    if kind in ("tfrecord", "tfds", "hf"):
        return _dataset_source(spec, kind, rest, exclude=exclude, on_error=on_error, split=split,
                               tfds_data_dir=tfds_data_dir)
    raise ValueError(f"bad source spec {spec!r}: unknown kind {kind!r}; {_SPEC_HELP}")


def _parallel_source(spec, rest, *, exclude, on_error) -> Source:
    """``parallel:KEY=PATTERN,...``: a ``ParallelTextSource``, its keys in sorted order."""
    files = _named_values(spec, rest)
    if not files or len(files) < 2:
        raise ValueError(f"bad source spec {spec!r}: a parallel source names two or more line-aligned files as "
                         f"KEY=PATTERN, e.g. 'parallel:inputs=train.en.gz,targets=train.de.gz'; {_SPEC_HELP}")
    if exclude:
        raise ValueError(f"{spec!r}: exclude does not apply to a parallel source (its files are named one by one)")
    # Keys in sorted order, as JsonLinesSource and ParquetSource keep them: the
    # same files in another order are the same source (fingerprint,
    # provenance paths, which name the first key's files).
    return ParallelTextSource(dict(sorted(files.items())), on_error=on_error)


def _keyed_file_source(spec, kind, rest, *, exclude, on_error) -> Source:
    """``jsonl:PATTERN#FIELD`` / ``parquet:PATTERN#COLUMN``, or ``#KEY=NAME,...`` for several values."""
    pattern, _, name = rest.rpartition("#") if "#" in rest else (rest, "", "text")
    if not pattern or not name:
        raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
    named = _named_values(spec, name)
    if named is not None:
        if kind == "jsonl":
            return JsonLinesSource(pattern, fields=named, exclude=exclude, on_error=on_error)
        return ParquetSource(pattern, columns=named, exclude=exclude, on_error=on_error)
    if kind == "jsonl":
        return JsonLinesSource(pattern, field=name, exclude=exclude, on_error=on_error)
    return ParquetSource(pattern, column=name, exclude=exclude, on_error=on_error)


def _tsv_source(spec, rest, *, exclude, on_error) -> Source:
    """``tsv:PATTERN[#KEY=INDEX,...]``: a ``TsvSource`` of 0-based column indices."""
    pattern, _, named = rest.partition("#")
    if not pattern:
        raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
    columns = _named_values(spec, named) if named else None
    if named and columns is None:
        raise ValueError(f"bad source spec {spec!r}: a tsv source names its columns as KEY=INDEX, e.g. "
                         f"'tsv:pairs.tsv#inputs=0,targets=1'")
    try:
        indices = {k: int(v) for k, v in columns.items()} if columns else None
    except ValueError:
        raise ValueError(f"bad source spec {spec!r}: tsv columns are 0-based indices, e.g. "
                         f"'tsv:pairs.tsv#inputs=0,targets=1'") from None
    return TsvSource(pattern, columns=indices, exclude=exclude, on_error=on_error)


def _dataset_source(spec, kind, rest, *, exclude, on_error, split, tfds_data_dir) -> Source:
    from seqcache.tasks.sources.hf_datasets import HfDatasetSource
    from seqcache.tasks.sources.tfds import TfdsSource
    from seqcache.tasks.sources.tfrecord import TFRecordSource

    target, sep, name = rest.rpartition("#")
    if not sep:
        target, name = rest, None
    if not target or (sep and not name):
        raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
    require_extra(kind)
    if kind == "tfrecord":
        return TFRecordSource(target, feature=name, exclude=exclude, on_error=on_error)
    if exclude:
        raise ValueError(f"--exclude applies to file patterns, not to the {kind}: source {spec!r}")
    head, at, tail = target.rpartition("@")
    if at and tail and "/" not in tail:
        target, split = head, tail
    if kind == "tfds":
        return TfdsSource(target, split=split, data_dir=tfds_data_dir, field=name or "text", on_error=on_error)
    return HfDatasetSource(target, split=split, column=name or "text", on_error=on_error)


# What each dataset source imports to read (the extra that installs it is ``tfds``).
_NEEDS = {"tfrecord": "google_crc32c", "tfds": "tensorflow_datasets"}


def require_extra(kind: str) -> None:
    """Checks, without importing it, that what a ``kind`` source reads with is
    installed.

    Raises:
      ImportError: it is not; the message gives the pip command."""
    import importlib.util

    module = _NEEDS.get(kind)
    if module is None:
        return
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        from seqcache.tasks.sources.tfrecord import PIP_HINT

        raise ImportError(f"the {kind}: source needs the tfds extra ({module} is not installed): {PIP_HINT}")
