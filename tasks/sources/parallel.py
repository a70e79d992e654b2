"""``ParallelTextSource``: line-aligned files, one record per line index."""

from __future__ import annotations

import itertools
from typing import Iterator, Mapping, Sequence

from seqcache import fs
from seqcache.tasks.sources.base import (
    BOM,
    READ_ERRORS,
    Source,
    SourceFile,
    SourceRecord,
    Split,
    read_error,
    canonical_json_bytes,
    match_files,
)
from seqcache.tasks.sources.policy import ErrorPolicy


class ParallelTextSource(Source):
    """Parallel text: one file per field (language), line ``k`` of each file
    translating line ``k`` of the others, e.g. Multi30k's ``train.en.gz`` and
    ``train.de.gz`` or NTREX's ``newstest2019-src.eng.txt`` and a reference file.

    ``files`` maps a field name to a glob pattern, each matching as many
    files; the k-th files (sorted by path) of every field form pair k,
    ``file_index`` k (``list_files`` lists the first field's files, each with
    the pair's size). ``record_number`` is the 0-based line index (``locator``
    ``"line"``), ``data`` ``{field: text}``, ``raw`` its canonical JSON. A pair
    is one split, streamed line by line; terminators and a leading byte order
    mark are removed.

    Args:
      files: field -> pattern (at least two fields), in the order given.
      on_error: the ``ErrorPolicy`` spec (``invalid_utf8`` and the content kinds,
        per field; an empty line on either side is ``empty``).

    Raises:
      ValueError: fewer than two fields; patterns matching different numbers
        of files; files of different lengths (names both and the first line
        one lacks), or bad input whose action is ``"raise"``.
    """

    kind = "parallel"
    locator = "line"
    spec_forms = "'parallel:inputs=PATTERN,targets=PATTERN' (line-aligned files)"

    @classmethod
    def from_spec(cls, spec) -> "ParallelTextSource":
        """``parallel:KEY=PATTERN,...``, its keys sorted (the same files in
        another order are the same source).

        Raises:
          ValueError: fewer than two files, or ``exclude`` (the files are named one by one).
        """
        files = spec.named(spec.rest)
        if not files or len(files) < 2:
            raise spec.error("a parallel source names two or more line-aligned files as KEY=PATTERN, "
                             "e.g. 'parallel:inputs=train.en.gz,targets=train.de.gz'")
        if spec.exclude:
            raise ValueError(f"{spec.text!r}: exclude does not apply to a parallel source (its files are named one "
                             "by one)")
        return cls(dict(sorted(files.items())), on_error=spec.on_error)

    def __init__(self, files: Mapping[str, str], *, on_error=None):
        files = dict(files)
        if len(files) < 2:
            raise ValueError(f"ParallelTextSource needs at least two fields (got {sorted(files)})")
        self.files = files
        self.on_error = ErrorPolicy(on_error)
        # The last listing (list_files): (its result, each field's files). A build lists once: its
        # fingerprint and, where the source is pickled to, its reads use this listing.
        self._listing: tuple[list[SourceFile], dict[str, list[SourceFile]]] | None = None

    def _matched(self) -> dict[str, list[SourceFile]]:
        matched = {field: match_files([pattern]) for field, pattern in self.files.items()}
        counts = {field: len(m) for field, m in matched.items()}
        if len(set(counts.values())) != 1:
            raise ValueError(f"ParallelTextSource: the patterns match different numbers of files ({counts}); "
                             "each field needs one file per pair")
        return matched

    def list_files(self) -> list[SourceFile]:
        matched = self._matched()
        first = next(iter(matched.values()))
        files = [SourceFile(f.path, sum(m[k].num_bytes for m in matched.values()), f.mtime_ns)
                 for k, f in enumerate(first)]
        self._listing = (files, matched)
        return files

    def fingerprint(self) -> dict:
        return self._fingerprint(self._matched())

    def fingerprint_of_files(self, files: Sequence[SourceFile]) -> dict:
        """``fingerprint()``, from the fields' files of the ``list_files`` call
        that gave ``files`` (listed again when ``files`` is another list)."""
        listing = self._listing
        return self._fingerprint(listing[1] if listing is not None and listing[0] is files else self._matched())

    def _fingerprint(self, matched: dict[str, list[SourceFile]]) -> dict:
        return {
            "kind": self.kind,
            "params": {"fields": list(self.files)},
            "on_error": self.on_error.to_json(),
            "files": {field: [{"path": f.path, "num_bytes": f.num_bytes, "mtime_ns": f.mtime_ns} for f in m]
                      for field, m in matched.items()},
        }

    def describe(self) -> str:
        return "parallel text of " + ", ".join(f"{k}={v}" for k, v in self.files.items())

    def pair(self, file_index: int) -> dict[str, str]:
        """The paths of pair ``file_index``: field -> path, in the last
        ``list_files`` (the build's, which the pipeline's file indices
        count), else in a new listing."""
        matched = self._listing[1] if self._listing is not None else self._matched()
        return {field: m[file_index].path for field, m in matched.items()}

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        self._require_whole(split)
        paths = self.pair(split.file_index)
        return self._read(split.file_index, paths)

    def _read(self, file_index: int, paths: dict[str, str]) -> Iterator[SourceRecord]:
        fields = list(paths)
        handles = {f: fs.open_binary(p) for f, p in paths.items()}
        k = -1
        try:
            # iter(readline): Beam's decompressing files (a URL, .zst) have readline, not iteration.
            lines_of = [iter(handles[f].readline, b"") for f in fields]
            for k, lines in enumerate(itertools.zip_longest(*lines_of)):
                if any(line is None for line in lines):
                    have = [f for f, line in zip(fields, lines) if line is not None]
                    lack = [f for f, line in zip(fields, lines) if line is None]
                    raise ValueError(
                        f"parallel files are not line-aligned: {paths[have[0]]} has line {k + 1:,} but "
                        f"{paths[lack[0]]} ends after line {k:,}; both must have the same number of lines")
                yield self._pair_record(file_index, k, dict(zip(fields, lines)), paths)
        except READ_ERRORS as e:
            raise read_error(", ".join(paths.values()), e, f"line {k + 1}" if k >= 0 else None) from None
        finally:
            for h in handles.values():
                h.close()

    def _pair_record(self, file_index: int, k: int, lines: dict[str, bytes], paths) -> SourceRecord:
        data, repairs = {}, []
        for field, line in lines.items():
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            line = line.removeprefix(BOM) if k == 0 else line
            where = self.where(paths[field], k)
            text, bad = self._decode(file_index, k, line, where, repairs)
            if bad is not None:
                return bad
            data[field] = text
        raw = canonical_json_bytes(data)
        where = self.where(f"{paths[next(iter(paths))]} and its parallel files", k)
        return self._record(file_index, k, raw, where, data, repairs)
