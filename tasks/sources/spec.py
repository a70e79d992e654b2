"""``parse_source_spec``: a source from its command-line form."""

from __future__ import annotations

from typing import Mapping, Sequence

from seqcache.tasks.sources.base import Source
from seqcache.tasks.sources.json_lines import JsonLinesSource
from seqcache.tasks.sources.parquet import ParquetSource
from seqcache.tasks.sources.text_files import TextFileSource
from seqcache.tasks.sources.text_lines import TextLineSource

_SPEC_HELP = (
    "accepted source specs: 'text:PATTERN' (one record per line), "
    "'files:PATTERN' (one record per file), 'jsonl:PATTERN#FIELD' (FIELD may be dotted, "
    "default 'text'), 'parquet:PATTERN#COLUMN' (default 'text')"
)


def parse_source_spec(spec: str, *, exclude: Sequence[str] = (),
                      on_error: "str | Mapping[str, str]" = "raise", split: str = "train",
                      tfds_data_dir: str | None = None) -> Source:
    """Builds a source from its command-line form.

    Forms: ``text:PATTERN``, ``files:PATTERN``, ``jsonl:PATTERN#FIELD`` and
    ``parquet:PATTERN#COLUMN`` (FIELD / COLUMN default to ``text``). The value is
    stored under the key ``"text"``. ``exclude``: glob patterns of paths to leave out;
    ``on_error``: the source's ``ErrorPolicy`` spec (see ``parse_on_error``).

    Dataset forms: ``tfrecord:PATTERN`` (raw UTF-8 records) and
    ``tfrecord:PATTERN#FEATURE`` (a ``tf.train.Example`` feature);
    ``tfds:NAME[/CONFIG][:VERSION][@SPLIT]#FEATURE`` (a prepared TFDS dataset in
    ``tfds_data_dir``); ``hf:PATH[@SPLIT]#COLUMN`` (a Hugging Face dataset saved on
    disk). The TFDS / Hugging Face split is ``@SPLIT`` or else ``split`` (the
    build's ``--split``); FEATURE / COLUMN default to ``text``.

    Raises:
      ValueError: an unknown kind or an empty pattern; the message lists the forms.
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
    if kind in ("jsonl", "parquet"):
        pattern, _, name = rest.rpartition("#") if "#" in rest else (rest, "", "text")
        if not pattern or not name:
            raise ValueError(f"bad source spec {spec!r}: {_SPEC_HELP}")
        if kind == "jsonl":
            return JsonLinesSource(pattern, field=name, exclude=exclude, on_error=on_error)
        return ParquetSource(pattern, column=name, exclude=exclude, on_error=on_error)
    if kind in ("tfrecord", "tfds", "hf"):
        return _dataset_source(spec, kind, rest, exclude=exclude, on_error=on_error, split=split,
                               tfds_data_dir=tfds_data_dir)
    raise ValueError(f"bad source spec {spec!r}: unknown kind {kind!r}; {_SPEC_HELP}")


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
