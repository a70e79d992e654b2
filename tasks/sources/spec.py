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
                      on_error: "str | Mapping[str, str] | None" = None) -> Source:
    """Builds a source from its command-line form.

    Forms: ``text:PATTERN``, ``files:PATTERN``, ``jsonl:PATTERN#FIELD`` and
    ``parquet:PATTERN#COLUMN`` (FIELD / COLUMN default to ``text``). The value is
    stored under the key ``"text"``. ``exclude``: glob patterns of paths to leave out;
    ``on_error``: the source's ``ErrorPolicy`` spec (see ``parse_on_error``).

    Raises:
      ValueError: an unknown kind or an empty pattern; the message lists the forms.
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
    raise ValueError(f"bad source spec {spec!r}: unknown kind {kind!r}; {_SPEC_HELP}")
