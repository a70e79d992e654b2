"""seqcache.tasks: what goes into a cache.

Sources (raw records with stable ids), vocabularies, preprocessors, features,
tasks and mixtures with their registries, and LM packing. This package imports
neither Beam (except lazily, for remote paths) nor JAX. See docs/tasks.md.
"""

from seqcache.tasks.mixture import Mixture, RateNumExamples, rate_num_examples
from seqcache.tasks.packing import pack_lm
from seqcache.tasks.preprocessors import (
    TRUNCATED_TOKENS_KEY,
    FunctionPreprocessor,
    PreprocessContext,
    Preprocessor,
    append_eos,
    append_eos_after_trim,
    filter_empty,
    rekey,
    run_preprocessors,
    tokenize,
    trim,
)
from seqcache.tasks.registry import MixtureRegistry, TaskRegistry, get_task_or_mixture, import_definitions
from seqcache.tasks.sources import (
    SOURCE_ERROR_KEY,
    SOURCE_REPLACED_KEY,
    FunctionSource,
    JsonLinesSource,
    ParquetSource,
    Source,
    SourceFile,
    SourceRecord,
    TextFileSource,
    TextLineSource,
    canonical_json_bytes,
    is_error_record,
    parse_source_spec,
)
from seqcache.tasks.task import Feature, Task
from seqcache.tasks.vocabularies import (
    ByteVocabulary,
    SentencePieceVocabulary,
    Vocabulary,
    round_trip_problems,
    sample_for_vocabulary,
    train_sentencepiece,
    vocabulary_from_json,
    vocabulary_from_spec,
)

__all__ = [
    "SOURCE_ERROR_KEY",
    "SOURCE_REPLACED_KEY",
    "TRUNCATED_TOKENS_KEY",
    "ByteVocabulary",
    "Feature",
    "FunctionPreprocessor",
    "FunctionSource",
    "JsonLinesSource",
    "Mixture",
    "MixtureRegistry",
    "ParquetSource",
    "PreprocessContext",
    "Preprocessor",
    "RateNumExamples",
    "SentencePieceVocabulary",
    "Source",
    "SourceFile",
    "SourceRecord",
    "Task",
    "TaskRegistry",
    "TextFileSource",
    "TextLineSource",
    "Vocabulary",
    "append_eos",
    "append_eos_after_trim",
    "canonical_json_bytes",
    "filter_empty",
    "get_task_or_mixture",
    "import_definitions",
    "is_error_record",
    "pack_lm",
    "parse_source_spec",
    "rate_num_examples",
    "rekey",
    "round_trip_problems",
    "run_preprocessors",
    "sample_for_vocabulary",
    "tokenize",
    "train_sentencepiece",
    "trim",
    "vocabulary_from_json",
    "vocabulary_from_spec",
]
