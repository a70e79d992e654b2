"""``HfDatasetSource``: a Hugging Face dataset on disk, read with pyarrow.

Two layouts, read without the ``datasets`` library and without download: a
folder of ``Dataset.save_to_disk`` (``state.json`` and its Arrow IPC stream
files) or ``DatasetDict.save_to_disk`` (``dataset_dict.json``, a folder per
split); or a Hub-style folder of Parquet shards (``PARQUET_LAYOUTS``, the
first that matches).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

import pyarrow as pa

from seqcache import fs
from seqcache.tasks.sources.base import Source, SourceFile, Split, read_error, match_files
from seqcache.tasks.sources.parquet import ParquetSource

# Hub-style Parquet layouts, in the order they are tried ({split} is the split).
PARQUET_LAYOUTS = ("data/{split}-*.parquet", "data/{split}/*.parquet", "{split}/*.parquet", "{split}-*.parquet")


class HfDatasetSource(ParquetSource):
    """One record per row of a Hugging Face dataset saved on disk (see the module
    docstring for the layouts), by column.

    ``record_number`` and ``raw`` are as for ``ParquetSource``, the same for a
    row of an Arrow file and of a Parquet shard. Parquet shards are split by
    row groups; an Arrow stream file is one split, read batch by batch.

    Args:
      path: the dataset's folder (local or a URL).
      split: a ``DatasetDict`` subfolder, or the ``SPLIT`` of the Parquet file
        names; a saved ``Dataset`` is the split its ``state.json`` names.
      column: the column to read, stored under ``output_key``.
      output_key: key of the value in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec (kinds as for ``ParquetSource``); a
        missing column always raises.

    Raises (from ``list_files``):
      FileNotFoundError: no dataset in ``path``, or no files of ``split``
        (names the layouts tried and the splits there are).
      ValueError: a ``state.json`` with an indices mapping.
    (from ``read_split``): ValueError as ``ParquetSource``.
    """

    kind = "hf"
    locator = "row"
    spec_forms = "'hf:PATH[@SPLIT][#COLUMN]' (a Hugging Face dataset saved on disk)"

    @classmethod
    def from_spec(cls, spec) -> "HfDatasetSource":
        """``hf:PATH[@SPLIT][#COLUMN]``: the split is the build's without ``@SPLIT``."""
        target, name = spec.target_and_name()
        path, split = spec.dataset_split(target)
        return cls(path, split=split, column=name or "text", on_error=spec.on_error)

    def __init__(self, path: str, *, split: str = "train", column: str = "text", output_key: str = "text",
                 on_error: "str | Mapping[str, str]" = "raise", batch_size: int = 1024):
        path = os.fspath(path)
        if not path:
            raise ValueError("HfDatasetSource needs the dataset's folder")
        if fs.is_local(path):
            path = os.path.abspath(os.path.expanduser(path))
        super().__init__(path, column=column, output_key=output_key, on_error=on_error, batch_size=batch_size)
        self.path = path.rstrip("/")
        self.split = split

    def _params(self) -> dict:
        return {"columns": self.columns, "split": self.split}

    def describe(self) -> str:
        sel = ", ".join(v if k == "text" else f"{v} as {k}" for k, v in self.columns.items())
        return f"Hugging Face dataset {self.path} split {self.split} (column {sel})"

    def _join(self, *parts: str) -> str:
        return fs.join(self.path, *parts)

    def list_files(self) -> list[SourceFile]:
        if fs.isfile(self._join("dataset_dict.json")):
            splits = json.loads(fs.read_text(self._join("dataset_dict.json"))).get("splits", [])
            if self.split not in splits:
                raise FileNotFoundError(f"{self.path}: the saved DatasetDict has no split {self.split!r} "
                                        f"(its splits: {', '.join(splits)})")
            return self._arrow_files(self._join(self.split))
        if fs.isfile(self._join("state.json")):
            saved = json.loads(fs.read_text(self._join("state.json"))).get("_split")
            if saved and saved != self.split:
                raise FileNotFoundError(f"{self.path}: the saved Dataset is split {saved!r}, not {self.split!r} "
                                        f"(read it with split={saved!r}, --split {saved} or @{saved})")
            return self._arrow_files(self.path)
        for layout in PARQUET_LAYOUTS:
            try:
                return match_files([self._join(layout.format(split=self.split))])
            except FileNotFoundError:
                continue
        found = sorted({f.path[len(self.path) + 1:] for f in fs.match(self._join("**"))}) if fs.isdir(self.path) else []
        raise FileNotFoundError(
            f"{self.path}: no Hugging Face dataset split {self.split!r} here: neither a save_to_disk folder "
            f"(state.json or dataset_dict.json) nor Parquet shards matching {', '.join(PARQUET_LAYOUTS)} with "
            f"{{split}}={self.split!r}" + (f" (files there: {', '.join(found[:10])})" if found else
                                          " (the folder is empty or missing)"))

    @staticmethod
    def _arrow_files(folder: str) -> list[SourceFile]:
        state = json.loads(fs.read_text(fs.join(folder, "state.json")))
        if state.get("_indices_data_files"):
            raise ValueError(f"{folder}/state.json: the dataset has an indices mapping (it was saved after "
                             "select/shuffle without flattening); save it again after `ds.flatten_indices()`")
        names = [d["filename"] for d in state.get("_data_files", [])]
        if not names:
            raise FileNotFoundError(f"{folder}/state.json lists no data files")
        out = []
        for name in names:
            found = fs.match(fs.join(folder, name))
            if not found:
                raise FileNotFoundError(f"{folder}: data file {name} listed in state.json is missing")
            out.append(SourceFile(*found[0]))
        return sorted(out)

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        if file.path.endswith(".arrow"):
            return Source.splits(self, file_index, file, target_bytes)
        return super().splits(file_index, file, target_bytes)

    def _arrow_batches(self, split: Split, wanted):
        """``ParquetSource._arrow_batches``; an Arrow IPC stream file whole."""
        if not split.path.endswith(".arrow"):
            yield from super()._arrow_batches(split, wanted)
            return
        self._require_whole(split)
        path = split.path
        number = 0
        try:
            with fs.open_binary(path, decompress=False) as f:
                reader = pa.ipc.open_stream(f)
                names = reader.schema.names
                missing = [c for c in wanted if c not in names]
                if missing:
                    raise ValueError(f"{path}: Arrow file has no column {missing[0]!r} (columns: {names})")
                for batch in reader:
                    yield number, batch.select(list(wanted))
                    number += batch.num_rows
        except (pa.ArrowException, OSError) as e:
            raise read_error(path, e, f"row {number}" if number else None) from None

