"""seqcache.tasks: what goes into a cache.

Sources (raw records with stable ids), vocabularies, preprocessors, features,
tasks and mixtures with their registries, and LM packing. This package imports
neither Beam (except lazily, for remote paths) nor JAX. See docs/tasks.md.
"""

from seqcache.tasks.denoising import denoise, prefix_lm, random_spans_helper, resolve_sentinels, span_corruption
from seqcache.tasks.mixture import Mixture, RateNumExamples, rate_num_examples
from seqcache.tasks.packing import pack_first_fit, pack_lm
from seqcache.tasks.preprocessors import (
    TRUNCATED_TOKENS_KEY, FunctionPreprocessor, PreprocessContext, Preprocessor, append_eos, append_eos_after_trim,
    filter_empty, rekey, run_preprocessors, tokenize, trim,
)
from seqcache.tasks.near_duplicates import NearDuplicates
from seqcache.tasks.registry import MixtureRegistry, TaskRegistry, get_task_or_mixture, import_definitions
from seqcache.tasks.sources import (
    ERROR_KINDS, ErrorPolicy, FunctionSource, HfDatasetSource, JsonLinesSource, ParallelTextSource, ParquetSource,
    Source, SourceFile, SourceRecord, TextFileSource, TextLineSource, TFRecordSource, TfdsSource, TsvSource,
    canonical_json_bytes, describe_record, is_error_record, RecordIssue, Split, parse_on_error, parse_source_spec,
)
from seqcache.tasks.task import Feature, Task
from seqcache.tasks.scan import KindCount, ScanReport, scan_task
from seqcache.tasks.hf_tokenizer import HfTokenizerVocabulary, train_hf_tokenizer
from seqcache.tasks.vocabularies import ByteVocabulary, SentencePieceVocabulary, Vocabulary, decode_with_sentinels
from seqcache.tasks.vocabulary_specs import vocabulary_from_json, vocabulary_from_spec
from seqcache.tasks.vocabulary_training import (
    SampleCounts, round_trip_problems, sample_for_vocabulary, train_sentencepiece,
)

__all__ = [
    "ERROR_KINDS", "ErrorPolicy", "TRUNCATED_TOKENS_KEY", "ByteVocabulary", "HfTokenizerVocabulary", "Feature",
    "FunctionPreprocessor", "FunctionSource", "HfDatasetSource", "JsonLinesSource", "KindCount", "Mixture",
    "MixtureRegistry", "NearDuplicates", "ParallelTextSource", "ParquetSource", "PreprocessContext", "Preprocessor",
    "RateNumExamples",
    "ScanReport", "SampleCounts", "SentencePieceVocabulary", "Source", "SourceFile", "SourceRecord", "Task",
    "TaskRegistry", "TextFileSource", "TextLineSource", "TFRecordSource", "TsvSource", "TfdsSource", "Vocabulary",
    "append_eos", "denoise", "prefix_lm", "random_spans_helper", "resolve_sentinels", "span_corruption",
    "append_eos_after_trim", "canonical_json_bytes", "describe_record", "filter_empty", "get_task_or_mixture",
    "import_definitions", "is_error_record", "RecordIssue", "Split", "pack_first_fit", "pack_lm", "parse_on_error",
    "parse_source_spec", "rate_num_examples", "rekey", "round_trip_problems", "run_preprocessors",
    "sample_for_vocabulary", "scan_task", "tokenize", "train_hf_tokenizer", "train_sentencepiece", "trim",
    "vocabulary_from_json", "decode_with_sentinels", "vocabulary_from_spec",
]
