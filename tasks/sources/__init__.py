"""Sources: where a task's raw records come from, each with a stable record id.

A source lists its files (sorted by path), cuts each into splits (byte ranges
of uncompressed text and JSON lines, groups of Parquet row groups, else the
whole file; ``Source.splits``) and streams a split's records
(``read_split``; the pipeline reads a work unit with ``read_batches_of``,
whose batches may span the splits of small files: the same records, in the
same order). A record's id ``(file_index, record_number)`` and its ``raw``
bytes (the shuffle key's input, canonical JSON for rows:
``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``
as UTF-8) depend neither on file order nor on the split (guarantee G1).
``record_number`` counts what the source's ``locator`` names;
``describe_record`` words it (``"line 12 (byte 1,234)"``).

Bad input is sorted into kinds with an action per kind (``ErrorPolicy``, see
``policy``): a skipped record has ``data == {}`` and ``issue ==
RecordIssue("skipped", kind, message)``, a repaired one its repaired data and
``issue.action == "replaced"``.

Paths are local, or URLs (``gs://``, ``s3://``, ...) matched and opened
through ``seqcache.fs``. Sources are small picklable objects (patterns and
options, never file contents). ``tfrecord`` and ``tfds`` need the ``tfds``
extra, imported only when such a source reads: nothing here imports
TensorFlow. A source with a command-line form registers its ``kind`` by
defining ``from_spec`` (``spec.parse_source_spec``).
"""

from seqcache.tasks.sources.base import (
    LOCATORS, RecordIssue, Source, SourceFile, SourceRecord, Split, canonical_json_bytes, describe_record,
    is_error_record, match_files, read_failure, users_class,
)
from seqcache.tasks.sources.function import FunctionSource
from seqcache.tasks.sources.hf_datasets import HfDatasetSource
from seqcache.tasks.sources.json_lines import JsonLinesSource
from seqcache.tasks.sources.parallel import ParallelTextSource
from seqcache.tasks.sources.parquet import ParquetSource
from seqcache.tasks.sources.policy import (
    ERROR_KINDS, BadInputError, ErrorPolicy, Where, check_text_values, error_hint, parse_on_error, text_problems,
    with_path,
)
from seqcache.tasks.sources.spec import parse_source_spec
from seqcache.tasks.sources.text_files import TextFileSource
from seqcache.tasks.sources.text_lines import TextLineSource
from seqcache.tasks.sources.tfds import TfdsSource
from seqcache.tasks.sources.tfrecord import TFRecordSource
from seqcache.tasks.sources.tsv import TsvSource

__all__ = [
    "ERROR_KINDS", "LOCATORS", "BadInputError", "ErrorPolicy", "FunctionSource", "HfDatasetSource", "JsonLinesSource",
    "ParallelTextSource", "ParquetSource", "RecordIssue", "Source", "SourceFile", "SourceRecord", "Split",
    "TextFileSource", "TextLineSource", "TFRecordSource", "TfdsSource", "TsvSource", "Where", "canonical_json_bytes",
    "check_text_values", "describe_record", "error_hint", "is_error_record", "match_files", "parse_on_error",
    "parse_source_spec", "read_failure", "text_problems", "users_class", "with_path",
]
