"""``TfdsSource``: the records of a prepared TensorFlow Datasets (TFDS) split.

The driver asks TFDS (``tfds.builder``, from the prepared dataset's
``dataset_info.json``) for the split's shard files and the range of records
each contributes (a slice such as ``train[:10%]`` too). The workers read the
shards without TFDS or TensorFlow: TFRecord with ``tfrecord``'s reader,
ArrayRecord with ``ArrayRecordReader``; every record is a serialized
``tf.train.Example``. Nothing is downloaded or prepared at build time.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Mapping

from array_record.python.array_record_module import ArrayRecordReader

from seqcache import fs
from seqcache.tasks.sources.base import FileSource, SourceFile, SourceRecord, Split, check_target, read_error
from seqcache.tasks.sources.policy import ErrorPolicy
from seqcache.tasks.sources.spec import PIP_HINT
from seqcache.tasks.sources.tfrecord import crc32c_function, ExampleRecords

# The TFDS file formats this source reads, by the infix of their shard names
# (``NAME-SPLIT.tfrecord-00000-of-00004``).
FILE_FORMATS = ("tfrecord", "array_record")
# ArrayRecord records read per call.
_BATCH = 1024


def import_tfds():
    """``tensorflow_datasets``, or an ImportError that says how to install it."""
    try:
        import tensorflow_datasets as tfds  # optional: tensorflow_datasets
    except ImportError as e:
        raise ImportError(f"the tfds: source needs TensorFlow Datasets: {PIP_HINT} ({e})") from None
    return tfds


def _format_of(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    for f in FILE_FORMATS:
        if f".{f}-" in name or name.endswith(f".{f}"):
            return f
    raise ValueError(f"{path}: not a TFDS shard file in a format this source reads ({', '.join(FILE_FORMATS)})")


@contextlib.contextmanager
def _array_record(path: str):
    """An ``ArrayRecordReader`` of ``path`` (a local copy of a URL), closed after the block."""
    with fs.local_copy(path, suffix=".array_record") as local:
        reader = ArrayRecordReader(local, "readahead_buffer_size:0")
        try:
            yield reader
        finally:
            if reader.is_open():
                reader.close()


def _flat_keys(info: Any, prefix: str = "") -> list[str]:
    """The feature names of a serialized example (nested ones joined with "/")."""
    out = []
    for k, v in info.items():
        if isinstance(v, dict):
            out += _flat_keys(v, f"{prefix}{k}/")
        else:
            out.append(f"{prefix}{k}")
    return out


class TfdsSource(ExampleRecords):
    """One record per example of a prepared TFDS split, read from its shard files.

    ``name`` is TFDS's ``NAME[/CONFIG][:VERSION]`` (``c4/en:3.0.1``), prepared
    in ``data_dir`` in the ``tfrecord`` or ``array_record`` file format (a
    dataset whose builder code is not installed is read from its files).
    ``record_number`` is the record's 0-based index in its shard file
    (``locator`` ``"record"``). A TFRecord shard is one split; an ArrayRecord
    shard is cut into record ranges of about ``target_bytes``. Values are read
    as ``TFRecordSource`` reads them; nested features are named with "/"
    (``"meta/title"``). TFDS (the ``tfds`` extra) is needed where the source is
    resolved (``list_files``, ``fingerprint``); workers need google-crc32c or
    array_record only.

    Args:
      name: ``NAME[/CONFIG][:VERSION]``.
      split: a TFDS split, sliced as TFDS slices (``"validation[:500]"``).
      data_dir: the TFDS data folder; None: TFDS's default
        (``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``).
      field: the feature to read, stored under ``output_key``.
      output_key: key of the value in ``SourceRecord.data``.
      on_error: the ``ErrorPolicy`` spec (kinds as for ``TFRecordSource``).

    Raises (from ``list_files``, ``fingerprint``, ``splits``):
      ImportError: TFDS is not installed (says ``pip install 'seqcache[tfds]'``).
      FileNotFoundError: the dataset is not prepared in ``data_dir`` (says how).
      ValueError: an unknown split or feature (lists those there are); another
        file format; a dataset TFDS cannot open (TFDS's message).
    (from ``read_split``): ValueError as ``TFRecordSource``.
    """

    kind = "tfds"
    locator = "record"
    spec_forms = "'tfds:NAME[/CONFIG][:VERSION][@SPLIT][#FEATURE]' (a prepared TFDS dataset)"

    @classmethod
    def from_spec(cls, spec) -> "TfdsSource":
        """``tfds:NAME[/CONFIG][:VERSION][@SPLIT][#FEATURE]`` in ``spec.tfds_data_dir``."""
        target, name = spec.target_and_name("tensorflow_datasets")
        dataset, split = spec.dataset_split(target)
        return cls(dataset, split=split, data_dir=spec.tfds_data_dir, field=name or "text", on_error=spec.on_error)

    def __init__(self, name: str, *, split: str = "train", data_dir: str | None = None, field: str = "text",
                 output_key: str = "text", on_error: "str | Mapping[str, str]" = "raise"):
        if not name or not isinstance(name, str):
            raise ValueError(f"TfdsSource needs a dataset name NAME[/CONFIG][:VERSION] (got {name!r})")
        if not split:
            raise ValueError("TfdsSource needs a split, e.g. 'train'")
        if not field:
            raise ValueError("TfdsSource needs a feature name (field=...)")
        self.name = name
        self.split = split
        if data_dir is not None:
            data_dir = os.fspath(data_dir)
            if fs.is_local(data_dir):
                data_dir = os.path.abspath(os.path.expanduser(data_dir))
        self.data_dir = data_dir
        self.field = field
        self.output_key = output_key
        self.features = {output_key: field}
        self.on_error = ErrorPolicy(on_error)
        # (full name, file format, {shard path: (first record, stop)}), from the driver.
        self._resolved: tuple[str, str, dict[str, tuple[int, int]]] | None = None


    def _how_to_prepare(self, where: str) -> str:
        dd = self.data_dir or "~/tensorflow_datasets"
        return (f"prepare it first (nothing is downloaded at build time): `tfds build {self.name.split(':')[0]} "
                f"--data_dir {dd}` with the dataset's builder installed, or in Python "
                f"`tfds.builder({self.name!r}, data_dir={dd!r}).download_and_prepare()`; {where}")

    def _resolve(self) -> tuple[str, str, dict[str, tuple[int, int]]]:
        if self._resolved is not None:
            return self._resolved
        tfds = import_tfds()
        kwargs = {"data_dir": self.data_dir} if self.data_dir else {}
        shown = self.data_dir or "TFDS's default data_dir"
        try:
            builder = tfds.builder(self.name, **kwargs)
        except tfds.core.registered.DatasetNotFoundError:
            raise FileNotFoundError(f"tfds:{self.name}: no prepared dataset of that name in {shown}; "
                                    + self._how_to_prepare("or give the folder it was prepared into with "
                                                           "--tfds-data-dir / data_dir=")) from None
        except (AssertionError, ValueError, OSError) as e:  # e.g. a version its installed builder code lacks
            message = " ".join(str(e).split())
            raise ValueError(f"tfds:{self.name}: TFDS cannot open it in {shown}: "
                             f"{message[:600]}{'...' if len(message) > 600 else ''}") from None
        if not builder.is_prepared():
            raise FileNotFoundError(f"tfds:{self.name}: not prepared in {builder.data_dir}; "
                                    + self._how_to_prepare("or point data_dir at the folder it was prepared into"))
        info = builder.info
        file_format = getattr(info.file_format, "value", str(info.file_format))
        if file_format not in FILE_FORMATS:
            raise ValueError(f"tfds:{self.name}: prepared in the {file_format!r} file format; this source reads "
                             f"{' and '.join(FILE_FORMATS)} (prepare it with file_format='array_record' or "
                             "'tfrecord', e.g. `tfds build --file_format array_record`)")
        try:
            split_info = info.splits[self.split]
        except (KeyError, ValueError) as e:
            raise ValueError(f"tfds:{self.name}: no split {self.split!r} ({e}); its splits: "
                             f"{', '.join(sorted(info.splits.keys()))}") from None
        names = sorted(_flat_keys(info.features.get_serialized_info()))  # TFDS's order varies between runs
        if self.field not in names:
            raise ValueError(f"tfds:{self.name}: no feature {self.field!r} (its features: {', '.join(names)})")
        ranges: dict[str, tuple[int, int]] = {}
        for fi in split_info.file_instructions:
            take = fi.examples_in_shard - fi.skip if fi.take in (None, -1) else fi.take
            if take > 0:
                ranges[os.fspath(fi.filename)] = (int(fi.skip), int(fi.skip + take))
        self._resolved = (builder.info.full_name, file_format, dict(sorted(ranges.items())))
        return self._resolved


    def list_files(self) -> list[SourceFile]:
        _, _, ranges = self._resolve()
        out = []
        for path in ranges:
            found = fs.match(path)
            if not found:
                raise FileNotFoundError(f"tfds:{self.name}: shard file {path} of split {self.split!r} is missing; "
                                        "prepare the dataset again")
            out.append(SourceFile(*found[0]))
        return out

    def _params(self) -> dict:
        full_name, file_format, ranges = self._resolve()
        return {"name": full_name, "split": self.split, "field": self.field, "file_format": file_format,
                "ranges": [list(r) for r in ranges.values()]}

    fingerprint = FileSource.fingerprint
    fingerprint_of_files = FileSource.fingerprint_of_files
    _fingerprint_of = FileSource._fingerprint_of

    def describe(self) -> str:
        where = f" in {self.data_dir}" if self.data_dir else ""
        return f"TFDS {self.name} split {self.split}{where} (feature {self.field})"

    def _range(self, path: str) -> tuple[int, int]:
        _, _, ranges = self._resolve()
        if path not in ranges:
            raise ValueError(f"{path}: not a shard file of tfds:{self.name} split {self.split!r}")
        return ranges[path]

    def splits(self, file_index: int, file: SourceFile, target_bytes: int) -> list[Split]:
        """One split per TFRecord shard; record ranges of about ``target_bytes``
        for an ArrayRecord shard."""
        check_target(target_bytes)
        lo, hi = self._range(file.path)
        if _format_of(file.path) == "tfrecord" or file.num_bytes <= target_bytes:
            return [Split(file_index, file.path, lo, hi, file.num_bytes)]
        records = self._num_records(file.path)
        per = max(1, int(records * target_bytes // max(file.num_bytes, 1)))
        out = []
        for start in range(lo, hi, per):
            stop = min(hi, start + per)
            out.append(Split(file_index, file.path, start, stop, file.num_bytes * (stop - start) // max(records, 1)))
        return out

    @staticmethod
    def _num_records(path: str) -> int:
        with _array_record(path) as reader:
            return int(reader.num_records())

    def read_split(self, split: Split) -> Iterator[SourceRecord]:
        """The records ``[start, stop)`` of a shard file (whole: the split's range)."""
        if split.whole and self._resolved is not None:
            start, stop = self._range(split.path)
        else:
            start, stop = split.start, split.stop
        if _format_of(split.path) == "tfrecord":
            crc32c_function()
            return self._read_tfrecord(split, start, stop)
        return self._read_array_record(split, start, stop)

    def _read_array_record(self, split: Split, start: int, stop: int | None) -> Iterator[SourceRecord]:
        path = split.path
        number = start
        try:
            with _array_record(path) as reader:
                if not reader.ok():
                    raise OSError("not an ArrayRecord file")
                end = reader.num_records() if stop is None else min(stop, reader.num_records())
                while number < end:
                    for data in reader.read(number, min(end, number + _BATCH)):
                        yield self._convert(split.file_index, number, path, data, True)
                        number += 1
        except (OSError, RuntimeError) as e:
            raise read_error(path, e, f"record {number}" if number > start else None) from None
