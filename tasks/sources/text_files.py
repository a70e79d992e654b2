"""``TextFileSource``: one record per whole file."""

from __future__ import annotations

from typing import Iterator

from seqcache.tasks.sources.base import BOM, SourceRecord, TextSource, read_whole


class TextFileSource(TextSource):
    """One record per whole file (plain or ``.gz``), e.g. for code corpora.

    ``record_number`` is 0 (``locator`` ``"file"``), ``raw`` the file's
    decompressed bytes without a leading byte order mark; a file is one split.

    Args:
      field: key of the file's text in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec. Kinds met here: ``invalid_utf8`` and the
        content kinds (an empty file is ``empty``).

    Raises (from ``read_split`` / ``read_file``):
      ValueError: bad input whose action is ``"raise"`` or an unreadable file
        (names it); a split that is not the whole file.
    """

    kind = "files"
    locator = "file"
    spec_forms = "'files:PATTERN' (one record per file)"

    def describe(self) -> str:
        return f"whole files of {self._pattern_text()}"

    def read_file(self, file_index: int, path: str) -> Iterator[SourceRecord]:
        raw = read_whole(path).removeprefix(BOM)
        where = self.where(path, 0)
        repairs = []
        text, bad = self._decode(file_index, 0, raw, where, repairs)
        yield bad if bad is not None else self._record(file_index, 0, raw, where, {self.field: text}, repairs)
