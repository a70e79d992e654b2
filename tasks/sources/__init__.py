"""Sources: where a task's raw records come from, each with a stable record id.

A source lists its files (sorted by path), cuts each file into splits (the unit
of reading work: byte ranges, row groups, or the whole file) and streams the
records of a split. Every record carries a stable id, ``(file_index,
record_number)``, and ``raw``: the canonical bytes of the record, which the
pipeline hashes (with the seed) into the shuffle key. Because the key depends
only on ``raw``, the cache order does not depend on file order or on how
records are split across files (guarantee G1); because the id does not depend
on the split either, neither does anything a build writes.

``record_number`` within a file counts what the source's ``locator`` names
(a byte offset, a row, a record; each source's docstring and docs/tasks.md
give the table), and ``describe_record`` turns it into words such as
``"line 12 (byte 1,234)"``.

Splits (``Source.splits(file_index, file, target_bytes)``, read with
``Source.read_split``): text lines and JSON lines of uncompressed files are cut
into byte ranges of about ``target_bytes`` (a line belongs to the range where
its first byte lies; see ``seqcache.tasks.sources.lines``), Parquet files into
groups of consecutive row groups; compressed files, whole-file sources and
functions are one split. ``read_file(file_index, path)`` reads the whole file.
The pipeline reads a work unit's splits with ``read_batches_of(splits,
batch_records)``: batches of records that may span splits (the text source
joins the lines of small files into one batch), the same records in the same
order as the splits read one by one.

"Canonical JSON" is ``json.dumps(obj, sort_keys=True, separators=(",", ":"),
ensure_ascii=False)`` encoded as UTF-8.

Bad input is sorted into kinds with a policy per kind (``ErrorPolicy``; the
table is in ``seqcache.tasks.sources.policy``). A record that is skipped has
``data == {}`` and ``issue == RecordIssue("skipped", kind, message)``; a
repaired one has its repaired data and ``issue.action == "replaced"``.

Paths are local paths or, when they contain ``://`` (``gs://``, ``s3://``,
``hdfs://``), URLs matched and opened through ``seqcache.fs`` (Apache Beam's
``FileSystems``, imported only then). Sources are small, picklable objects: they
hold patterns and options, never file contents or open handles.

Modules: ``base`` (records, splits, files, the ``Source`` interface), ``policy``
(kinds of bad input and their actions), ``lines`` (byte ranges of line files),
``text_lines``, ``text_files``, ``json_lines``, ``tsv``, ``parquet``, ``function``,
``tfrecord``, ``tfds``, ``hf_datasets`` (one source each) and ``spec``
(``parse_source_spec``: each source with a command-line form registers its
``kind`` by defining ``from_spec``). ``tfrecord`` and ``tfds`` need the
``tfds`` extra (google-crc32c; TFDS where a TFDS dataset is resolved), imported
only when such a source is used: nothing here imports TensorFlow.
"""

from seqcache.tasks.sources.base import (
    LOCATORS,
    RecordIssue,
    Source,
    SourceFile,
    SourceRecord,
    Split,
    canonical_json_bytes,
    describe_record,
    is_error_record,
    match_files,
)
from seqcache.tasks.sources.function import FunctionSource
from seqcache.tasks.sources.hf_datasets import HfDatasetSource
from seqcache.tasks.sources.json_lines import JsonLinesSource
from seqcache.tasks.sources.parallel import ParallelTextSource
from seqcache.tasks.sources.parquet import ParquetSource
from seqcache.tasks.sources.policy import (
    ERROR_KINDS,
    ErrorPolicy,
    Where,
    check_text_values,
    error_hint,
    parse_on_error,
    text_problems,
)
from seqcache.tasks.sources.spec import parse_source_spec
from seqcache.tasks.sources.text_files import TextFileSource
from seqcache.tasks.sources.text_lines import TextLineSource
from seqcache.tasks.sources.tfds import TfdsSource
from seqcache.tasks.sources.tfrecord import TFRecordSource
from seqcache.tasks.sources.tsv import TsvSource

__all__ = [
    "ERROR_KINDS",
    "LOCATORS",
    "ErrorPolicy",
    "FunctionSource",
    "HfDatasetSource",
    "JsonLinesSource",
    "ParallelTextSource",
    "ParquetSource",
    "RecordIssue",
    "Source",
    "SourceFile",
    "SourceRecord",
    "Split",
    "TextFileSource",
    "TextLineSource",
    "TFRecordSource",
    "TfdsSource",
    "TsvSource",
    "Where",
    "canonical_json_bytes",
    "check_text_values",
    "describe_record",
    "error_hint",
    "is_error_record",
    "match_files",
    "parse_on_error",
    "parse_source_spec",
    "text_problems",
]
