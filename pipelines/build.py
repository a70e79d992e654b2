"""The deterministic cache build: a Beam pipeline and its driver.

Data flow (DESIGN.md, Data flow)::

    files ──Reshuffle──> read + preprocess in batches ──> spill files per shard
      │                                               └─> quarantine chunks (skipped, repaired)
      ──(shard, spill path)──> GroupByKey
      ──> read the shard's spill files, sort by (key, sub-index, bytes, provenance)
      ──> [pack] ──> write shard
      ──(quarantine chunk paths)──> ToList ──> merge into quarantine.jsonl
    driver: verify every shard, add empty shards, write manifest.json last;
            a replacement (overwrite) is built in a staging folder and published
            only when complete (writer.publish_dir)

The pipeline runs on Beam's DirectRunner by default and unchanged on any other
runner: every pipeline option passes through. Workers get everything they need
pickled with the DoFns (the task, its source and vocabularies; SentencePiece
vocabularies pickle their model bytes), so fresh worker processes need no access
to the driver's files except the corpus itself.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from seqcache import format as fmt
from seqcache.tasks.registry import USER_MODULE_PREFIX
from seqcache.pipelines import shuffle, spill, writer

log = logging.getLogger(__name__)

STATS_PREFIX = "shard-stats-"
QUARANTINE_TAG = "quarantine"
# More shards than max(FREE_SHARDS, input bytes / MIN_SHARD_BYTES) is refused.
MIN_SHARD_BYTES = 1024
FREE_SHARDS = 64
QUARANTINE_STATS = "quarantine-stats.json"


class BuildError(Exception):
    """A build cannot start or cannot finish (the message says why and what to do)."""


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """The options that define a cache. Every field is part of the fingerprint.

    Attributes:
      split: split name, the last folder of the cache path (``<task>/<split>``).
      seed: shuffle seed in [0, 2**64); also seeds random preprocessing per record.
      sequence_length: feature name -> length in tokens; used by ``trim`` and by
        packing. None leaves examples at their natural length.
      num_shards: shard count; None derives it from the corpus size
        (``shuffle.choose_num_shards``, about 128 MiB of raw text per shard).
    """

    split: str = "train"
    seed: int = 0
    sequence_length: Mapping[str, int] | None = None
    num_shards: int | None = None

    def __post_init__(self):
        shuffle.seed_key(self.seed)  # validates the range
        if self.num_shards is not None and self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1 (got {self.num_shards})")
        if not self.split or "/" in self.split or self.split in (".", ".."):
            raise ValueError(f"split must be a plain name (got {self.split!r})")


@dataclasses.dataclass
class BuildResult:
    """What ``build_task`` did: the cache folder, its manifest, and whether an
    existing cache with the same fingerprint was reused without work."""

    cache_dir: str
    manifest: fmt.Manifest
    reused: bool
    seconds: float


def _storage_dtype(feature) -> str:
    """The dtype a token feature is stored in: the smallest that holds every id of
    its vocabulary (uint16 up to 65,536 ids). Readers widen it back (the feeder
    gives int32), so this is a cache-size choice, not a model one."""
    if feature.dtype in ("int32", "int64", "uint32") and feature.vocabulary.vocab_size <= 1 << 16:
        return "uint16"
    return feature.dtype


def _features_in(task) -> list[fmt.FeatureSpec]:
    return [fmt.FeatureSpec(name, _storage_dtype(f)) for name, f in task.output_features.items()]


def _features_out(task, sequence_length=None) -> list[fmt.FeatureSpec]:
    """The features of a cached record. Packed caches add ``<feature>_segment_ids``
    (uint16 when the sequence length allows, else int32); positions are not stored:
    they restart at 0 with every segment, so readers derive them from the segment
    ids (4 bytes a token instead of 12 for uint16 tokens)."""
    specs = _features_in(task)
    if task.packing == "lm":
        (name,) = task.output_features
        length = (sequence_length or {}).get(name, 1 << 31)
        specs.append(fmt.FeatureSpec(f"{name}_segment_ids", "uint16" if length < 1 << 16 else "int32"))
    return specs


def _check_task(task, config: BuildConfig) -> None:
    unknown = sorted(set(config.sequence_length or {}) - set(task.output_features))
    if unknown:
        raise BuildError(
            f"task {task.name!r}: sequence length given for {unknown}, which the task does not produce "
            f"(its features: {sorted(task.output_features)})"
        )
    if task.packing not in (None, "lm"):
        raise BuildError(f"task {task.name!r}: unknown packing {task.packing!r} (expected None or 'lm')")
    if task.packing == "lm":
        if len(task.output_features) != 1:
            raise BuildError(
                f"task {task.name!r}: packing='lm' needs exactly one output feature (has {sorted(task.output_features)})"
            )
        (name,) = task.output_features
        if not config.sequence_length or name not in config.sequence_length:
            raise BuildError(
                f"task {task.name!r}: packing='lm' needs a sequence length for feature {name!r} "
                f"(pass --sequence-length {name}=N)"
            )


class _ReadAndPreprocess:
    """Reads one source file and preprocesses its records in batches of
    ``batch_records`` (one tokenizer call per batch).

    Yields ``("records", n)`` for every batch of n source records read,
    ``("examples", [(shard, key, sub_index, file_index, record_number,
    truncated, example_bytes, lengths), ...])`` per batch, and ``("skipped" |
    "replaced", (file_index, record_number, message, action))`` for each record
    the source or the task's checks skipped, or the source repaired, under its
    ``on_error`` policy: counted and quarantined, never dropped silently.
    """

    def __init__(self, task, *, seed, sequence_length, num_shards, batch_records=512):
        self.task = task
        self.seed = seed
        self.sequence_length = dict(sequence_length) if sequence_length else None
        self.num_shards = num_shards
        self.batch_records = batch_records
        self.features = _features_in(task)

    def read(self, file_index, path):
        key = shuffle.seed_key(self.seed)
        batch = []
        try:
            for record in self.task.source.read_file(file_index, path):
                batch.append(record)
                if len(batch) >= self.batch_records:
                    yield from self._flush(batch, key)
                    batch = []
            if batch:
                yield from self._flush(batch, key)
        except ValueError as e:
            if str(e).startswith(str(path)):
                raise
            # Preprocessing errors know the record number, not the file: add it.
            raise ValueError(f"{path}: {e}") from None

    def _flush(self, records, key):
        from seqcache.tasks import SOURCE_ERROR_KEY, SOURCE_ERROR_KIND_KEY, SOURCE_REPLACED_KEY

        yield "records", len(records)
        for r in records:
            if SOURCE_REPLACED_KEY in r.data:
                yield "replaced", (r.file_index, r.record_number, str(r.data[SOURCE_REPLACED_KEY]), "replaced",
                                   r.data.get(SOURCE_ERROR_KIND_KEY))
        if any(SOURCE_ERROR_KEY in r.data for r in records):
            for r in records:
                if SOURCE_ERROR_KEY in r.data:
                    yield "skipped", (r.file_index, r.record_number, str(r.data[SOURCE_ERROR_KEY]), "skipped",
                                      r.data.get(SOURCE_ERROR_KIND_KEY))
            records = [r for r in records if SOURCE_ERROR_KEY not in r.data]
            if not records:
                return
        keys = [shuffle.record_key(r.raw, key) for r in records]
        rejected: list = []
        out = self.task.preprocess_batch(records, keys, seed=self.seed, sequence_length=self.sequence_length,
                                         skipped=rejected)
        for idx, message in rejected:
            r = records[idx]
            yield "skipped", (r.file_index, r.record_number, message, "skipped", "bad_value")
        entries = []
        sub_index = collections.Counter()
        for idx, example in out:
            record = records[idx]
            k = keys[idx]
            truncated = int(example.pop("_truncated_tokens", 0) or 0)
            j = sub_index[idx]
            sub_index[idx] += 1
            try:
                data = fmt.encode_example(self.features, example)
            except (KeyError, ValueError) as e:
                raise ValueError(
                    f"task {self.task.name!r}: file {record.file_index} record {record.record_number}: {e}"
                ) from None
            lengths = [int(example[f.name].size) for f in self.features]
            entries.append((shuffle.shard_of(k, self.num_shards), k, j, record.file_index, record.record_number,
                            truncated, data, lengths))
        yield "examples", entries


def _make_spill_dofn(beam):
    class _ReadAndSpill(beam.DoFn):
        """Beam step around ``_ReadAndPreprocess``: buffers entries per shard,
        writes them to spill files (see spill.py) and emits ``(shard, path)``;
        writes skipped and repaired records to quarantine chunks and emits their
        paths on the ``QUARANTINE_TAG`` output. Memory: the spill buffers (about
        ``spill_bytes``) plus at most ``spill.QUARANTINE_BYTES`` of quarantine
        entries, however many records are skipped."""

        def __init__(self, reader, spill_dir, spill_bytes=spill.SPILL_BYTES):
            self.reader = reader
            self.spill_dir = spill_dir
            self.spill_bytes = spill_bytes

        def start_bundle(self):
            self._buffers = collections.defaultdict(spill.SpillBuffer)
            self._buffered = 0
            self._token = os.urandom(8).hex()
            self._flushes = 0
            self._quarantine = spill.QuarantineBuffer()
            self._quarantine_chunks = 0

        def _spill_quarantine(self):
            """Writes the bundle's quarantine entries as one sorted chunk; returns its path."""
            path = writer.join(self.spill_dir,
                               f"{spill.QUARANTINE_PREFIX}{self._token}-{self._quarantine_chunks:05d}.txt")
            writer.write_bytes(path, self._quarantine.to_bytes())
            self._quarantine_chunks += 1
            self._quarantine = spill.QuarantineBuffer()
            return path

        def _spill(self):
            out = []
            for shard in sorted(self._buffers):
                path = writer.join(self.spill_dir, f"{shard:05d}-{self._token}-{self._flushes:05d}.bin")
                writer.write_bytes(path, self._buffers[shard].to_bytes(len(self.reader.features)))
                out.append((shard, path))
            self._flushes += 1
            self._buffers = collections.defaultdict(spill.SpillBuffer)
            self._buffered = 0
            return out

        def process(self, file_entry):
            records_read = beam.metrics.Metrics.counter("seqcache", "records_read")
            records_read.inc(0)  # a file without records still reports a count: 0
            file_index, path = file_entry
            for kind, payload in self.reader.read(file_index, path):
                if kind == "records":
                    records_read.inc(payload)
                    continue
                if kind in ("skipped", "replaced"):
                    record_file, record_number, message, action, error_kind = payload
                    self._quarantine.add(record_file, record_number, action, path, message, error_kind)
                    if self._quarantine.nbytes >= spill.QUARANTINE_BYTES:
                        yield beam.pvalue.TaggedOutput(QUARANTINE_TAG, self._spill_quarantine())
                    continue
                for shard, *entry in payload:
                    buffer = self._buffers[shard]
                    buffer.add(*entry)
                    self._buffered += len(entry[5]) + spill.ENTRY_OVERHEAD
                if self._buffered >= self.spill_bytes:
                    yield from self._spill()

        def finish_bundle(self):
            windowed = beam.transforms.window.GlobalWindows.windowed_value
            if self._buffered:
                for element in self._spill():
                    yield windowed(element)
            if self._quarantine:
                yield beam.pvalue.TaggedOutput(QUARANTINE_TAG, windowed(self._spill_quarantine()))

    return _ReadAndSpill


class _WriteShard:
    """Sorts one shard's values, packs them if the task packs, writes the shard
    and its provenance sidecar, and leaves a statistics file for the driver."""

    def __init__(self, task, *, out_dir, stats_dir, num_shards, sequence_length):
        self.task_name = task.name
        self.packing = task.packing
        self.features_in = _features_in(task)
        self.features_out = _features_out(task, sequence_length)
        self.pack_feature = next(iter(task.output_features)) if task.packing == "lm" else None
        self.pack_length = int(sequence_length[self.pack_feature]) if self.pack_feature else None
        self.out_dir = out_dir
        self.stats_dir = stats_dir
        self.num_shards = num_shards

    def __call__(self, element):
        shard, paths = element
        entries = spill.load_shard(((p, writer.read_bytes(p)) for p in sorted(paths)), len(self.features_in))
        stats = _ShardStats(self.features_out)
        stats.source_examples = len(entries)
        stats.truncated_tokens = int(entries.truncated.sum(dtype=np.int64))

        def unpacked():
            stats.add_many(entries.lengths)
            for data, (fi, rn) in entries.items():
                yield data, [(fi, rn, 0)]  # already encoded: written as is

        def packed():
            from seqcache.tasks import pack_lm

            stream = ((fmt.decode_example(self.features_in, data), prov) for data, prov in entries.items())
            for example, segments in pack_lm(stream, feature=self.pack_feature, sequence_length=self.pack_length):
                stats.add(example, len(segments))
                yield example, [(prov[0], prov[1], offset) for prov, offset in segments]

        entry = writer.write_shard(
            self.out_dir,
            index=shard,
            num_shards=self.num_shards,
            features=self.features_out,
            examples=packed() if self.packing == "lm" else unpacked(),
        )
        payload = {"shard": entry, "statistics": stats.to_json()}
        writer.write_bytes_atomic(
            writer.join(self.stats_dir, f"{STATS_PREFIX}{shard:05d}.json"), json.dumps(payload).encode("utf-8")
        )
        yield shard


class _WriteQuarantine:
    """Merges the quarantine chunks named by the read step's outputs into the
    cache's quarantine file, sorted by (source file, record number), streaming
    (only when there is an entry), and leaves a ``spill.QuarantineSummary`` (the
    counts by action, the file's size and sha256, the first skipped records) for
    the driver. Memory: one line per chunk being merged."""

    def __init__(self, *, out_dir, stats_dir, scratch_dir):
        self.out_dir, self.stats_dir, self.scratch_dir = out_dir, stats_dir, scratch_dir

    def __call__(self, chunk_paths):
        summary = spill.QuarantineSummary()
        if chunk_paths:
            with writer.open_write_atomic(writer.join(self.out_dir, fmt.QUARANTINE_NAME)) as out:
                summary = spill.merge_quarantine(chunk_paths, out, scratch_dir=self.scratch_dir,
                                                 open_read=writer.open_read, open_write=writer.open_write,
                                                 join=writer.join)
        writer.write_bytes_atomic(writer.join(self.stats_dir, QUARANTINE_STATS),
                                  json.dumps(summary.to_json()).encode("utf-8"))
        return summary.skipped_records + summary.replaced_records


class _ShardStats:
    def __init__(self, features):
        self.names = [f.name for f in features if not f.name.endswith(("_segment_ids", "_positions"))]
        self.examples = 0
        self.segments = 0
        self.source_examples = 0
        self.truncated_tokens = 0
        self.tokens = dict.fromkeys(self.names, 0)
        self.max_length = dict.fromkeys(self.names, 0)

    def add(self, example, segments):
        self.add_lengths([int(example[name].size) for name in self.names], segments)

    def add_many(self, lengths):
        """Unpacked examples, one segment each; ``lengths`` (n, F) in ``self.names`` order."""
        n = int(lengths.shape[0])
        self.examples += n
        self.segments += n
        for k, name in enumerate(self.names):
            if n:
                self.tokens[name] += int(lengths[:, k].sum(dtype=np.int64))
                self.max_length[name] = max(self.max_length[name], int(lengths[:, k].max()))

    def add_lengths(self, lengths, segments):
        """``lengths``: tokens per feature, in ``self.names`` order."""
        self.examples += 1
        self.segments += segments
        for name, n in zip(self.names, lengths):
            self.tokens[name] += n
            if n > self.max_length[name]:
                self.max_length[name] = n

    def to_json(self):
        return {
            "examples": self.examples,
            "segments": self.segments,
            "source_examples": self.source_examples,
            "truncated_tokens": self.truncated_tokens,
            "tokens": self.tokens,
            "max_length": self.max_length,
        }


def _merge_stats(per_shard: Sequence[Mapping[str, Any]], records_read: int | None) -> dict:
    names = sorted({n for s in per_shard for n in s["tokens"]})
    examples = sum(s["examples"] for s in per_shard)
    tokens = {n: sum(s["tokens"].get(n, 0) for s in per_shard) for n in names}
    out = {
        "examples": examples,
        "segments": sum(s["segments"] for s in per_shard),
        "source_examples": sum(s["source_examples"] for s in per_shard),
        "tokens": tokens,
        "max_length": {n: max((s["max_length"].get(n, 0) for s in per_shard), default=0) for n in names},
        "mean_length": {n: (tokens[n] / examples if examples else 0.0) for n in names},
        "truncated_tokens": sum(s["truncated_tokens"] for s in per_shard),
        "skipped_records": 0,
        "units": "examples and segments in records; tokens, lengths in tokens",
    }
    if records_read is not None:
        out["source_records"] = records_read
    return out


def _is_no_space(error: BaseException) -> bool:
    """ENOSPC, raised here or by a worker (Beam wraps workers' errors in others)."""
    import errno

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def describe_changes(old: Any, new: Any, *, limit: int = 4) -> str:
    """The differing fields of two fingerprint inputs, as dotted paths with both
    values, e.g. ``task.seed: 0 -> 1; task.source.files[3].mtime_ns: ... -> ...``."""
    diffs: list[str] = []

    def short(v):
        text = json.dumps(v, sort_keys=True, ensure_ascii=False)
        return text if len(text) <= 80 else text[:77] + "..."

    def walk(a, b, path):
        if len(diffs) > limit:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                if k not in a:
                    diffs.append(f"{path}{k}: added {short(b[k])}")
                elif k not in b:
                    diffs.append(f"{path}{k}: removed (was {short(a[k])})")
                else:
                    walk(a[k], b[k], f"{path}{k}.")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{path[:-1]}[{i}].")
        elif a != b:
            diffs.append(f"{path[:-1]}: {short(a)} -> {short(b)}")

    walk(old, new, "")
    if not diffs:
        return "nothing recorded differs (an older seqcache wrote it)"
    more = f"; and more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def import_beam():
    """Imports Beam without its import-time warning about optional GCP client
    libraries (root logger, WARNING), which says nothing about this build."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        import apache_beam
    finally:
        root.setLevel(level)
    return apache_beam


def cache_path(cache_dir: str, task_name: str, split: str) -> str:
    """``cache_dir/<task>/<split>``: where one task's cache lives."""
    return writer.join(cache_dir, task_name, split)


def task_fingerprint_inputs(task, config: BuildConfig, num_shards: int) -> dict:
    return {
        "format_version": fmt.FORMAT_VERSION,
        "writer_options": fmt.WRITER_OPTIONS,
        "split": config.split,
        "num_shards": num_shards,
        "record_features": [[f.name, f.dtype] for f in _features_out(task, config.sequence_length)],
        "task": task.fingerprint(seed=config.seed, sequence_length=config.sequence_length),
    }


def _read_existing(out_dir: str):
    path = writer.join(out_dir, fmt.MANIFEST_NAME)
    if not writer.exists(path):
        return None
    return fmt.parse_manifest(json.loads(writer.read_text(path)), path=path)


def _pipeline_options(pipeline_args):
    """Beam options from the command line's free arguments.

    Without ``--runner`` the build runs on ``FnApiRunner``, the engine of Beam's
    DirectRunner, named explicitly: the DirectRunner itself first tries to
    download and start the Prism runner, which would make a local build depend on
    network access and ignore ``--direct_running_mode``."""
    from apache_beam.options.pipeline_options import PipelineOptions

    if pipeline_args is None:
        pipeline_args = []
    if isinstance(pipeline_args, PipelineOptions):
        return pipeline_args
    args = list(pipeline_args)
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        args.append("--runner=FnApiRunner")
    return PipelineOptions(args)


def _pickle_user_modules_by_value() -> None:
    """Task modules imported from a file path (``--module my_tasks.py``) are not
    importable by name in worker processes: their functions travel by value."""
    import sys

    from apache_beam.internal.cloudpickle import cloudpickle

    for name, module in list(sys.modules.items()):
        if name.startswith(USER_MODULE_PREFIX):
            cloudpickle.register_pickle_by_value(module)


class _ShardProgress:
    """Polls the statistics folder while the pipeline runs and reports
    ``callback(shards_written, num_shards)``: progress that works on any runner
    whose workers write to the same file system the driver reads."""

    def __init__(self, stats_dir, num_shards, callback, interval_s=0.5):
        self.stats_dir, self.num_shards, self.callback, self.interval_s = stats_dir, num_shards, callback, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="seqcache-build-progress", daemon=True)

    def _count(self):
        if not writer.is_local(self.stats_dir):
            return None
        try:
            return sum(1 for n in os.listdir(self.stats_dir) if n.startswith(STATS_PREFIX))
        except OSError:
            return 0

    def _run(self):
        while not self._stop.wait(self.interval_s):
            n = self._count()
            if n is not None:
                self.callback(n, self.num_shards)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        n = self._count()
        if n is not None:
            self.callback(n, self.num_shards)


def build_task(
    task,
    *,
    cache_dir: str,
    config: BuildConfig = BuildConfig(),
    pipeline_args: Sequence[str] | Any = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> BuildResult:
    """Builds (or reuses) the cache of one task at ``cache_dir/<task>/<split>``.

    Args:
      task: a ``seqcache.tasks.Task``.
      cache_dir: the caches root (local path or gs://, s3://, hdfs:// URL).
      config: the options that define the cache (see ``BuildConfig``).
      pipeline_args: Beam pipeline options (a list of ``--flag=value`` strings or
        a ``PipelineOptions``); the runner defaults to the DirectRunner.
      overwrite: replace an existing cache whose fingerprint differs.
      progress: called as ``progress(shards_written, num_shards)`` while writing.

    Returns:
      A ``BuildResult``. A cache whose fingerprint matches is reused without work.

    Raises:
      FileNotFoundError: the task's source matches no file.
      BuildError: a different cache exists and ``overwrite`` is False; the task
        produced zero examples; a shard failed verification.
      Any error of the task's sources or preprocessors, naming file and record.
    """
    beam = import_beam()

    start = time.monotonic()
    _check_task(task, config)
    files = task.source.list_files()
    if not files:
        raise FileNotFoundError(f"task {task.name!r}: source {task.source.describe()} matches no file")
    total_bytes = sum(f.num_bytes for f in files)
    num_shards = config.num_shards or shuffle.choose_num_shards(total_bytes)
    max_shards = max(FREE_SHARDS, total_bytes // MIN_SHARD_BYTES)
    if num_shards > max_shards:
        raise BuildError(
            f"task {task.name!r}: {num_shards:,} shards for {total_bytes:,} bytes of input is too many (each shard, "
            f"even empty, is a file); use at most {max_shards:,}, or leave --num-shards out"
        )
    inputs = task_fingerprint_inputs(task, config, num_shards)
    fingerprint = fmt.fingerprint_of(inputs)
    out_dir = cache_path(cache_dir, task.name, config.split)

    with _build_lock(out_dir):
        return _build_locked(task, config=config, pipeline_args=pipeline_args, overwrite=overwrite,
                             progress=progress, beam=beam, start=start, files=files, total_bytes=total_bytes,
                             num_shards=num_shards, inputs=inputs, fingerprint=fingerprint, out_dir=out_dir)


@contextlib.contextmanager
def _build_lock(out_dir: str):
    """An exclusive lock on one cache folder for the length of a build (local
    file systems: ``fcntl.flock`` on ``<task>/.<split>.lock``), so that two builds
    of the same cache never interleave. A second build fails at once, saying so.
    Object stores have no such lock; there, run one build per cache at a time."""
    if not writer.is_local(out_dir):
        yield
        return
    import fcntl

    path = writer.local_path(out_dir)
    lock_path = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.lock")
    os.makedirs(os.path.dirname(lock_path), exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BuildError(
                f"{out_dir}: another build of this cache is running (it holds {lock_path}); "
                "wait for it to finish, or build into another --cache-dir"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _build_locked(task, *, config, pipeline_args, overwrite, progress, beam, start, files, total_bytes,
                  num_shards, inputs, fingerprint, out_dir) -> BuildResult:
    writer.recover_publish(out_dir)  # a killed replacement: the old cache back, staging leftovers gone
    existing = _read_existing(out_dir)
    if existing is not None:
        if existing.fingerprint == fingerprint:
            log.info("cache %s is up to date (fingerprint %s); reusing it", out_dir, fingerprint[:12])
            return BuildResult(out_dir, existing, reused=True, seconds=time.monotonic() - start)
        if not overwrite:
            changed = describe_changes(existing.raw.get("fingerprint_inputs", {}), inputs)
            raise BuildError(
                f"{out_dir}: holds a cache with fingerprint {existing.fingerprint[:12]}, this build's fingerprint is "
                f"{fingerprint[:12]}; what changed: {changed}. "
                "Pass --overwrite to replace it, or choose another --cache-dir"
            )
    # Replacing a complete cache: build beside it, in a staging folder, and publish
    # only when the new cache is complete; a build that fails leaves the old cache
    # as it was. Otherwise (no cache, or the leftovers of an unfinished build) build
    # in place after removing what is there: nothing there is worth keeping.
    staged = existing is not None
    build_dir = writer.staging_path(out_dir) if staged else out_dir
    if not staged:
        writer.remove_cache_tree(out_dir)
    try:
        raw = _build_into(task, config=config, pipeline_args=pipeline_args, progress=progress, beam=beam,
                          files=files, total_bytes=total_bytes, num_shards=num_shards, inputs=inputs,
                          fingerprint=fingerprint, build_dir=build_dir, out_dir=out_dir)
    except BaseException:
        if staged:
            writer.remove_cache_tree(build_dir)
        raise
    if staged:
        log.info("publishing %s over the cache with fingerprint %s", out_dir, existing.fingerprint[:12])
        writer.publish_dir(build_dir, out_dir)
    return BuildResult(out_dir, fmt.parse_manifest(raw), reused=False, seconds=time.monotonic() - start)


def _build_into(task, *, config, pipeline_args, progress, beam, files, total_bytes, num_shards, inputs, fingerprint,
                build_dir, out_dir) -> dict:
    """Runs the pipeline into ``build_dir`` (``out_dir`` itself, or its staging
    folder) and writes the manifest there last; returns the manifest."""
    writer.makedirs(build_dir)
    stats_dir = writer.join(build_dir, writer.TMP_DIR_NAME)
    writer.makedirs(stats_dir)

    vocabularies = {}
    for name, feature in task.output_features.items():
        desc = dict(feature.vocabulary.to_json())
        model = feature.vocabulary.model_bytes()
        if model is not None:
            desc["file"] = f"vocabulary-{name}.model"
            writer.write_bytes_atomic(writer.join(build_dir, desc["file"]), model)
        vocabularies[name] = desc

    options = _pipeline_options(pipeline_args)
    read = _ReadAndPreprocess(
        task, seed=config.seed, sequence_length=config.sequence_length, num_shards=num_shards
    )
    spill_dir = writer.join(stats_dir, "spill")
    writer.makedirs(spill_dir)
    write = _WriteShard(
        task, out_dir=build_dir, stats_dir=stats_dir, num_shards=num_shards, sequence_length=config.sequence_length
    )
    file_entries = [(i, f.path) for i, f in enumerate(files)]
    log.info(
        "building %s: %d files, %.1f MB, %d shards -> %s", task.name, len(files), total_bytes / 1e6, num_shards,
        build_dir,
    )
    _pickle_user_modules_by_value()
    pipeline = beam.Pipeline(options=options)
    outputs = (
        pipeline
        | "ListFiles" >> beam.Create(file_entries)
        | "SpreadFiles" >> beam.Reshuffle()
        | "ReadPreprocessSpill" >> beam.ParDo(_make_spill_dofn(beam)(read, spill_dir)).with_outputs(
            QUARANTINE_TAG, main="examples"
        )
    )
    _ = outputs.examples | "GroupByShard" >> beam.GroupByKey() | "SortPackWrite" >> beam.FlatMap(write)
    _ = (
        outputs[QUARANTINE_TAG]
        | "CollectQuarantineChunks" >> beam.combiners.ToList()  # paths only: a few per bundle
        | "WriteQuarantine" >> beam.Map(
            _WriteQuarantine(out_dir=build_dir, stats_dir=stats_dir, scratch_dir=spill_dir)
        )
    )
    records_read = None
    try:
        with _ShardProgress(stats_dir, num_shards, progress) if progress else contextlib.nullcontext():
            result = pipeline.run()
            result.wait_until_finish()
    except BaseException as e:
        # No manifest was written, so nothing looks complete; free the spill files
        # (a full disk is a common cause) and say what to do.
        writer.remove_tree(stats_dir)
        if _is_no_space(e):
            raise BuildError(
                f"{out_dir}: no space left on the device while building; nothing was published (no manifest). "
                "Free space (the build needs about twice the cache's size while it runs) or use another "
                "--cache-dir, then run the build again"
            ) from e
        raise
    try:
        counters = result.metrics().query(beam.metrics.MetricsFilter().with_name("records_read"))["counters"]
        if counters:
            records_read = int(sum(c.committed or c.attempted or 0 for c in counters))
    except Exception:  # metrics are optional on some runners
        records_read = None

    entries, stats = [], []
    for shard in range(num_shards):
        stats_path = writer.join(stats_dir, f"{STATS_PREFIX}{shard:05d}.json")
        if writer.exists(stats_path):
            payload = json.loads(writer.read_text(stats_path))
            entries.append(payload["shard"])
            stats.append(payload["statistics"])
        else:
            # No record hashed into this key range: an empty shard keeps the layout regular.
            entries.append(
                writer.write_shard(
                    build_dir, index=shard, num_shards=num_shards,
                    features=_features_out(task, config.sequence_length), examples=[],
                )
            )
            stats.append(_ShardStats(_features_out(task, config.sequence_length)).to_json())
    statistics = _merge_stats(stats, records_read)
    quarantine_stats = writer.join(stats_dir, QUARANTINE_STATS)
    quarantine = spill.QuarantineSummary()
    if writer.exists(quarantine_stats):
        quarantine = spill.QuarantineSummary(**json.loads(writer.read_text(quarantine_stats)))
    statistics["skipped_records"] = quarantine.skipped_records
    statistics["replaced_records"] = quarantine.replaced_records
    if statistics["skipped_records"]:
        log.info(
            "task %s: skipped %d bad records; their locations and reasons are in %s",
            task.name, statistics["skipped_records"], writer.join(out_dir, fmt.QUARANTINE_NAME),
        )
    if statistics["examples"] == 0:
        writer.remove_cache_tree(build_dir)
        raise BuildError(_zero_examples_message(task, config, files, total_bytes, records_read, quarantine))
    _verify_written(build_dir, entries)

    quarantined = statistics["skipped_records"] + statistics["replaced_records"]
    raw = writer.build_manifest(
        task=task.name,
        split=config.split,
        fingerprint=fingerprint,
        fingerprint_inputs=inputs,
        features=[
            {"name": f.name, "dtype": f.dtype, **_feature_meta(task, f.name)}
            for f in _features_out(task, config.sequence_length)
        ],
        shards=entries,
        sources=[{"path": f.path, "num_bytes": f.num_bytes, "mtime_ns": f.mtime_ns} for f in files],
        statistics=statistics,
        seed=config.seed,
        sequence_length=config.sequence_length,
        packing=task.packing,
        vocabularies=vocabularies,
        extra={"quarantine": fmt.QUARANTINE_NAME if quarantined else None,
               **({"quarantine_num_bytes": quarantine.num_bytes, "quarantine_sha256": quarantine.sha256}
                  if quarantined else {})},
    )
    writer.remove_tree(stats_dir)
    writer.write_manifest(build_dir, raw)
    return raw


def _zero_examples_message(task, config, files, total_bytes, records_read, quarantine) -> str:
    """Why a build produced nothing: the counts, and since nothing is written (so no
    quarantine file either), the first skipped records with their reasons."""
    skipped, replaced = quarantine.skipped_records, quarantine.replaced_records
    read = "an unknown number of" if records_read is None else f"{records_read:,}"
    text = (
        f"task {task.name!r} split {config.split!r}: zero examples from {read} source records "
        f"({skipped:,} skipped, {replaced:,} replaced under the source's on_error policy; "
        f"source {task.source.describe()}, {len(files)} files, {total_bytes:,} bytes); nothing was written"
    )
    if records_read == 0:
        return text + ". The files hold no records: check the source pattern and the files"
    if skipped:
        reasons = "; ".join(f"{e['path']} record {e['record_number']}: {e['error']}" for e in quarantine.first_skipped)
        more = f" (first {len(quarantine.first_skipped)} of {skipped:,})" if skipped > len(quarantine.first_skipped) else ""
        text += f". Skipped{more}: {reasons}"
        if records_read is not None and skipped >= records_read:
            text += (". Every record was skipped: fix the input, or accept these records with the source's "
                     "on_error option (for instance on_error={'empty': 'keep'}; on the command line "
                     "--on-error empty=keep)")
            return text
    kept = None if records_read is None else records_read - skipped
    if kept:
        text += f". The task's preprocessors dropped all {kept:,} other records: check its filters"
    return text


def _feature_meta(task, name):
    if name in task.output_features:
        f = task.output_features[name]
        return {"vocabulary": name, "add_eos": bool(f.add_eos)}
    return {}


def _verify_written(out_dir: str, entries) -> None:
    """The driver's check of every shard before the manifest is written: the file
    exists with the size and record count its writer reported."""
    if not writer.is_local(out_dir):
        return
    from array_record.python.array_record_module import ArrayRecordReader

    for e in entries:
        for name, size in ((e["file"], e["num_bytes"]), (e["provenance_file"], e["provenance_num_bytes"])):
            path = os.path.join(writer.local_path(out_dir), name)
            actual = os.path.getsize(path) if os.path.exists(path) else None
            if actual != size:
                raise BuildError(f"{path}: shard has {actual} bytes after the build, its writer reported {size}")
            reader = ArrayRecordReader(path)
            try:
                n = reader.num_records()
            finally:
                reader.close()
            if n != e["num_records"]:
                raise BuildError(f"{path}: shard holds {n} records, its writer reported {e['num_records']}")
