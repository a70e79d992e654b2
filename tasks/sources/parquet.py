"""``ParquetSource``: one record per row of Parquet files, split by row groups."""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

from seqcache import fs
from seqcache.tasks.sources.base import (
    Split,
    SourceFile,
    SourceRecord,
    _check_target,
    _FileSource,
    _json_default,
    _read_error,
    RecordBatch,
    _encode_json_string,
    _text_of_bytes,
    canonical_json_bytes,
)
from seqcache.tasks.sources.policy import suspect_utf8_values



def _row_groups(pf) -> list[tuple[int, int]]:
    """``(rows, compressed bytes)`` of each row group of an open ``ParquetFile``."""
    md = pf.metadata
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        out.append((rg.num_rows, sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))))
    return out


class ParquetSource(_FileSource):
    """One record per row of Parquet files, read with pyarrow in record batches.

    ``record_number`` is the 0-based row index in the file (``locator``
    ``"row"``), whatever the split. A file is split by row groups: consecutive
    row groups are grouped up to about ``target_bytes`` (their compressed size,
    from the footer), and a split's ``start`` / ``stop`` are row indices at
    row-group boundaries; reading a split reads only its row groups. Memory is
    bounded by ``batch_size`` rows (``ParquetFile.iter_batches``), not by the
    file size. ``column`` is stored under ``output_key``; several columns can be
    selected with ``columns={output_key: column, ...}``.

    Args:
      pattern: a glob pattern (``**`` recursive) or a sequence of them.
      column: the column to read.
      output_key: key of the value in ``SourceRecord.data``.
      columns: optional mapping output key -> column (several values).
      batch_size: rows per record batch.
      on_error: the ``ErrorPolicy`` spec for the content kinds (string values)
        and the task's checks; a missing column always raises (it is a property
        of the file, not of a record).

    Raises (from ``splits``, ``read_split`` / ``read_file``):
      ValueError: a file that is not Parquet or cannot be read; a column is
        missing from a file (names the file, the column and the columns the file
        has); a split whose rows do not lie on row-group boundaries.
    """

    kind = "parquet"
    locator = "row"

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
        import pyarrow as pa
        import pyarrow.parquet as pq

        _check_target(target_bytes)
        try:
            with fs.open_binary(file.path, decompress=False) as f:
                groups = _row_groups(pq.ParquetFile(f))
        except (pa.ArrowException, OSError) as e:
            raise _read_error(file.path, e, None) from None
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
            values = {c: batch.column(c).to_pylist() for c in wanted}
            for i in range(batch.num_rows):
                yield self._row(file_index, number + i, path, {c: values[c][i] for c in wanted})

    def read_batches(self, split: Split, batch_records: int) -> Iterator[RecordBatch]:
        """``read_split`` in batches; a single text column in column form: its
        values' suspect characters found in the column's UTF-8 bytes at once
        (``suspect_utf8_values``), the shuffle key's input (the row's canonical
        JSON) built without an encoder per row, and only the rows those checks
        find (empty, whitespace-only, a suspect character, null) read one by one
        as ``read_split`` reads them. The same records, in the same order."""
        import pyarrow as pa

        if len(self.columns) != 1:
            yield from super().read_batches(split, batch_records)
            return
        [(key, column)] = self.columns.items()
        path, file_index = split.path, split.file_index
        prefix = "{" + _encode_json_string(column) + ":"
        for number, batch in self._arrow_batches(split, [column]):
            array = batch.column(column)
            if not (pa.types.is_string(array.type) or pa.types.is_large_string(array.type)):
                records = [self._row(file_index, number + i, path, {column: v})
                           for i, v in enumerate(array.to_pylist())]
                for a in range(0, len(records), batch_records):
                    yield RecordBatch.from_records(records[a:a + batch_records])
                continue
            texts = array.to_pylist()
            odd_rows = self._odd_rows(array, texts, large=pa.types.is_large_string(array.type))
            raws = [f"{prefix}{_encode_json_string(t)}}}".encode("utf-8") if t is not None else b"" for t in texts]
            numbers = list(range(number, number + len(texts)))
            odd = {}
            for i in odd_rows:
                odd[i] = self._row(file_index, numbers[i], path, {column: texts[i]})
                raws[i] = odd[i].raw
            for a in range(0, len(texts), batch_records):
                b = min(a + batch_records, len(texts))
                yield RecordBatch(file_index, numbers[a:b], raws[a:b], field=key, texts=texts[a:b],
                                  odd={i - a: odd[i] for i in odd if a <= i < b} if odd else {})

    @staticmethod
    def _odd_rows(array, texts: list, *, large: bool) -> list[int]:
        """The rows of a string ``array`` (``texts``: its values) that
        ``check_text_values`` may act on: nulls, empty and whitespace-only
        values, and values with a suspect character."""
        import numpy as np

        _, offsets, data = array.buffers()
        odd = {i for i, t in enumerate(texts) if not t or t.isspace()}  # None, "" and whitespace-only
        if offsets is not None and data is not None and len(texts):
            offs = np.frombuffer(offsets, dtype="<i8" if large else "<i4")[array.offset:array.offset + len(texts) + 1]
            raw = np.frombuffer(data, dtype=np.uint8)[int(offs[0]):int(offs[-1])]
            odd.update(suspect_utf8_values(raw, offs).tolist())
        return sorted(odd)

    def _arrow_batches(self, split: Split, wanted: Sequence[str]):
        """``(row index of the first row, pyarrow RecordBatch of the columns
        ``wanted``)`` for the rows of ``split``, in order.

        Raises:
          ValueError: a file that is not Parquet or cannot be read (names the
            file and the row reached), or that lacks a wanted column.
        """
        import pyarrow as pa
        import pyarrow.parquet as pq

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
            raise _read_error(path, e, f"row {number}" if number else None) from None

    @staticmethod
    def _row_groups_of(split: Split, pf) -> list[int]:
        """The row groups holding rows ``[split.start, split.stop)``.

        Raises:
          ValueError: ``start`` or ``stop`` is not a row-group boundary."""
        first = [0]
        for rows, _ in _row_groups(pf):
            first.append(first[-1] + rows)
        stop = first[-1] if split.stop is None else split.stop
        if split.start not in first or stop not in first or stop < split.start:
            raise ValueError(f"{split.path}: rows [{split.start}, {split.stop}) do not lie on row-group "
                             f"boundaries (row groups start at rows {first[:-1][:20]}, {first[-1]} rows in all)")
        lo, hi = first.index(split.start), first.index(stop)
        # An empty row group shares its first row with the next group; a split may then
        # read it twice, which yields no row twice.
        return list(range(lo, hi))

    def _row(self, file_index: int, number: int, path: str, row: dict) -> SourceRecord:
        where = f"{path}: record {number} (row index {number})"
        row, problem = _text_of_bytes(row)
        repairs = []
        if problem is not None:
            if self.on_error.actions["invalid_utf8"] != "replace":
                return self._bad("invalid_utf8", file_index, number, b"", where, f": {problem}")
            repairs.append(("invalid_utf8", f"{where}: {problem}"))
        try:
            raw = canonical_json_bytes(row, default=_json_default)
        except (TypeError, ValueError) as e:
            return self._bad("bad_value", file_index, number, b"", where, f": {e}")
        return self._record(file_index, number, raw, where, {k: row[c] for k, c in self.columns.items()}, repairs)
