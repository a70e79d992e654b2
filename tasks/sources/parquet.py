"""``ParquetSource``: one record per row of Parquet files, split by row groups."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa

from seqcache import fs
from seqcache.tasks.sources.base import (FileSource, RecordBatch, SourceFile, SourceRecord, Split, check_target,
                                         encode_json_string, json_string_bodies, read_error)
from seqcache.tasks.sources.policy import suspect_utf8_values


def _row_groups(pf) -> list[tuple[int, int]]:
    """``(rows, compressed bytes)`` of each row group of an open ``ParquetFile``."""
    md = pf.metadata
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        out.append((rg.num_rows, sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))))
    return out


def _python_values(array) -> list:
    """``array.to_pylist()``; ``bytes`` for a string column that is not UTF-8,
    so that the ``invalid_utf8`` policy decides each row."""
    try:
        return array.to_pylist()
    except UnicodeDecodeError:
        if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)
                or getattr(pa.types, "is_string_view", lambda t: False)(array.type)):
            raise
        return array.cast(pa.large_binary()).to_pylist()


class ParquetSource(FileSource):
    """One record per row of Parquet files, read with pyarrow in record batches.

    ``record_number`` is the 0-based row index in the file (``locator``
    ``"row"``). A split is consecutive row groups of about ``target_bytes``
    (compressed, from the footer), its ``start`` / ``stop`` row indices at
    row-group boundaries. Memory is bounded by ``batch_size`` rows.

    Args:
      column: the column to read.
      output_key: key of the value in ``SourceRecord.data``.
      columns: optional mapping output key -> column (several values).
      batch_size: rows per record batch.
      on_error: for the content kinds and the task's checks; a missing column
        always raises.

    Raises (from ``splits``, ``read_split`` / ``read_file``):
      ValueError: a file that is not Parquet or cannot be read; a missing
        column (names the file's columns); a split off row-group boundaries.
    """

    kind = "parquet"
    locator = "row"
    spec_forms = "'parquet:PATTERN#COLUMN' (default 'text'), 'parquet:PATTERN#inputs=COLUMN,targets=COLUMN'"

    @classmethod
    def from_spec(cls, spec) -> "ParquetSource":
        """``parquet:PATTERN[#COLUMN]`` or ``parquet:PATTERN#KEY=COLUMN,...``."""
        pattern, names = spec.one_or_named("column", "columns")
        return cls(pattern, **names, exclude=spec.exclude, on_error=spec.on_error)

    def __init__(self, pattern: str | Sequence[str], *, column: str = "text", output_key: str = "text",
                 columns: dict[str, str] | None = None, batch_size: int = 1024,
                 on_error: "str | Mapping[str, str] | None" = None,
                 exclude: str | Sequence[str] = ()):
        super().__init__(pattern, on_error=on_error, exclude=exclude)
        if columns is None:
            columns = {output_key: column}
        if not columns:
            raise ValueError("ParquetSource: columns must name at least one column")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (got {batch_size=})")
        self.columns = dict(sorted(columns.items()))
        self.batch_size = int(batch_size)

    def _params(self) -> dict:
        return {"columns": self.columns}

    def describe(self) -> str:
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.columns.items())
        return f"Parquet rows of {self._pattern_text()} (column {sel})"

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """Groups of consecutive row groups of about ``target_bytes`` compressed
        bytes (at least one row group each), read from the file's footer."""
        import pyarrow.parquet as pq  # keeps pyarrow.parquet out of seqcache.tasks's import

        check_target(target_bytes)
        try:
            with fs.open_binary(file.path, decompress=False) as f:
                groups = _row_groups(pq.ParquetFile(f))
        except (pa.ArrowException, OSError) as e:
            raise read_error(file.path, e, None) from None
        parts: list[list[int]] = []  # [first row, rows, bytes]
        for rows, size in groups:
            if parts and parts[-1][2] + size <= target_bytes:
                parts[-1][1] += rows
                parts[-1][2] += size
            else:
                parts.append([parts[-1][0] + parts[-1][1] if parts else 0, rows, size])
        if len(parts) <= 1:
            return [Split(file_index, file.path, 0, None, file.num_bytes)]
        return [Split(file_index, file.path, start, start + rows if k + 1 < len(parts) else None, size)
                for k, (start, rows, size) in enumerate(parts)]

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        path, file_index = split.path, split.file_index
        wanted = sorted(set(self.columns.values()))
        for number, batch in self._arrow_batches(split, wanted):
            values = {c: _python_values(batch.column(c)) for c in wanted}
            for i in range(batch.num_rows):
                yield self._row(file_index, number + i, path, {c: values[c][i] for c in wanted})

    def read_batches(self, split: Split, batch_records: int) -> Iterator[RecordBatch]:
        """``read_split`` in batches; a single text column in column form (the
        suspect values found and the canonical JSON escaped for the whole
        column at once), only the rows those checks find read one by one."""
        if len(self.columns) != 1 or self.overrides_read_split(ParquetSource):  # else read_split's path
            yield from super().read_batches(split, batch_records)
            return
        [(key, column)] = self.columns.items()
        path, file_index = split.path, split.file_index
        for number, batch in self._arrow_batches(split, [column]):
            array = batch.column(column)
            columns = None
            if pa.types.is_string(array.type) or pa.types.is_large_string(array.type):
                try:
                    columns = self._column_records(file_index, path, number, column, array)
                except UnicodeDecodeError:  # a value that is not UTF-8 (its writer did not check): row by row
                    pass
            if columns is not None:
                numbers, texts, raws, odd = columns
            else:  # not text (bytes, numbers), or text that is not UTF-8: row by row
                records = [self._row(file_index, number + i, path, {column: v})
                           for i, v in enumerate(_python_values(array))]
                numbers, texts, raws = [r.record_number for r in records], [None] * len(records), \
                    [r.raw for r in records]
                odd = dict(enumerate(records))
            yield from RecordBatch(file_index, numbers, raws, field=key, texts=texts, odd=odd).pieces(batch_records)

    def _column_records(self, file_index: int, path: str, number: int, column: str, array):
        """``(record numbers, texts, raws, {row: SourceRecord})`` of a string
        ``array`` from row ``number``: the rows to look at built by ``_row``."""
        texts = array.to_pylist()
        n = len(texts)
        _, offsets, data = array.buffers()
        dtype = "<i8" if pa.types.is_large_string(array.type) else "<i4"
        offs = np.frombuffer(offsets, dtype=dtype)[array.offset:array.offset + n + 1] if n else np.zeros(1, np.int64)
        values = bytes(memoryview(data)[int(offs[0]):int(offs[-1])]) if data is not None and n else b""
        odd_rows = {i for i, t in enumerate(texts) if not t or t.isspace()}  # None, "" and whitespace-only
        odd_rows.update(suspect_utf8_values(np.frombuffer(values, np.uint8), offs).tolist())
        escaped, out = json_string_bodies(values, offs)
        head, tail = ("{" + encode_json_string(column) + ':"').encode("utf-8"), b'"}'
        raws = [head + escaped[a:b] + tail for a, b in zip(out[:-1], out[1:])]
        numbers = list(range(number, number + n))
        odd = {}
        for i in sorted(odd_rows):
            odd[i] = self._row(file_index, numbers[i], path, {column: texts[i]})
            raws[i] = odd[i].raw
        return numbers, texts, raws, odd

    def _arrow_batches(self, split: Split, wanted: Sequence[str]):
        """``(first row index, pyarrow RecordBatch of the columns wanted)`` of
        the rows of ``split``. ``ValueError`` for a file that cannot be read
        (names it and the row reached) or lacks a column."""
        import pyarrow.parquet as pq  # keeps pyarrow.parquet out of seqcache.tasks's import

        path = split.path
        number = split.start
        try:
            with fs.open_binary(path, decompress=False) as f:
                pf = pq.ParquetFile(f)
                names = pf.schema_arrow.names
                missing = [c for c in wanted if c not in names]
                if missing:
                    raise ValueError(f"{path}: Parquet file has no column {missing[0]!r} (columns: {names}); "
                                     "leave the file out with exclude if it belongs to another dataset")
                row_groups = None if split.whole else self._row_groups_of(split, pf)
                if row_groups == []:
                    return
                for batch in pf.iter_batches(batch_size=self.batch_size, columns=list(wanted), row_groups=row_groups):
                    yield number, batch
                    number += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise read_error(path, e, f"row {number}" if number else None) from None

    @staticmethod
    def _row_groups_of(split: Split, pf) -> list[int]:
        """The row groups of rows ``[split.start, split.stop)``; ``ValueError``
        when these are not row-group boundaries."""
        first = [0]
        for rows, _ in _row_groups(pf):
            first.append(first[-1] + rows)
        stop = first[-1] if split.stop is None else split.stop
        if split.start not in first or stop not in first or stop < split.start:
            raise ValueError(f"{split.path}: rows [{split.start}, {split.stop}) do not lie on row-group "
                             f"boundaries (row groups start at rows {first[:-1][:20]}, {first[-1]} rows in all)")
        lo, hi = first.index(split.start), first.index(stop)
        # An empty row group read twice yields no row twice.
        return list(range(lo, hi))

    def _row(self, file_index: int, number: int, path: str, row: dict) -> SourceRecord:
        return self._row_record(file_index, number, f"{path}: record {number} (row index {number})", row, self.columns)
