"""The deterministic cache build: the driver (the steps are in transforms.py)::

    driver: list the files, plan work units (splits of files, plan.py)
    Create(unit indices) ──> read + preprocess ──(shard, batch)──> GroupByKey ──> spread copies of identical
                  records to their own keys' shards ──> GroupByKey ──> sort, pack, write shard
                                      └─(quarantine chunk)─┘            merge quarantine.jsonl
                                      └─(records read)─────┘            add up counts
                  ──> one summary of every shard and count (_tmp/summary.json)
    driver: verify every shard, add empty shards, write manifest.json last;
            a replacement (overwrite) is built in a staging folder and published
            only when complete (writer.publish_dir)

The pipeline runs on Beam's local engine by default and unchanged on any other
runner (runner.py). Workers get everything they need pickled with the steps
(the task, its source and vocabularies with their model bytes): they need no
file of the driver's but the corpus and the cache folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Mapping, Sequence

from array_record.python.array_record_module import ArrayRecordReader

from seqcache import format as fmt
from seqcache import fs, process
from seqcache.layout import cache_path  # noqa: F401  (re-exported: seqcache.pipelines.cache_path)
from seqcache.lengths import sequence_lengths
from seqcache.manifest import Manifest
from seqcache.pipelines import beam_text, dataflow
from seqcache.pipelines import exclusion as exclusion_mod
from seqcache.pipelines import plan as plan_mod
from seqcache.pipelines import runner as runner_mod
from seqcache.pipelines import near as near_mod
from seqcache.pipelines import shuffle, spill, stall, stats as stats_mod, transforms, work as work_mod, writer
from seqcache.pipelines.plan import BuildPlan
from seqcache.pipelines.runner import RunnerError
from seqcache.tasks import vocabularies as vocab_mod
from seqcache.tasks.near_duplicates import NearDuplicates
from seqcache.tasks.registry import USER_MODULE_PREFIX
from seqcache.tasks.sources.policy import ERROR_KINDS, BadInputError
import apache_beam as beam  # after runner's process.import_beam: quietly, without pandas
from seqcache.pipelines import beam_internals  # Beam's private names (the pickler)

try:
    import cloudpickle  # what Dask sends tasks with
except ImportError:
    cloudpickle = None

log = logging.getLogger(__name__)

# More shards than max(FREE_SHARDS, input bytes / MIN_SHARD_BYTES) is refused.
MIN_SHARD_BYTES = 1024
FREE_SHARDS = 64


class BuildError(Exception):
    """A build cannot start or cannot finish (the message says why and what to do).

    Attributes:
      bad_input: the build stopped because every record was skipped and some
        of them are of kinds the source's ``on_error`` policy can keep.
      final: the pipeline ran to its end and the build failed on what it
        made (zero examples, a shard that fails its check): the same build
        run again would fail the same way, so it leaves no work behind.
    """

    def __init__(self, message: str, *, bad_input: bool = False, final: bool = False):
        super().__init__(message)
        self.bad_input, self.final = bad_input, final


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """The options that define a cache (the fingerprint records each, and the
    shard count they give).

    Attributes:
      split: split name, the last folder of the cache path (``<task>/<split>``).
      seed: shuffle seed in [0, 2**64); also seeds random preprocessing per record.
      sequence_length: feature name -> length in tokens, or an int for every
        output feature of the task (``seqcache.lengths.sequence_lengths``);
        used by ``trim`` and by packing. None leaves examples at their natural
        length.
      num_shards: shard count; None derives it from the corpus's content size
        (the uncompressed size of its text: ``plan.content_bytes``) and
        ``shard_size``.
      shard_size: content bytes per shard when ``num_shards`` is None (default
        ``shuffle.DEFAULT_SHARD_BYTES``, 128 MiB): one shard is sorted in one
        worker's memory, so this bounds a worker's memory whatever the corpus
        size. There is no cap on the shard count.
      exclude_benchmarks: benchmarks whose overlapping source records the
        build leaves out (decontamination, exclusion.py): source spec strings
        (``jsonl:test.jsonl#question``, or ``NAME=SPEC`` to name it) or
        ``seqcache.tasks.contamination.Benchmark`` objects. A record that
        shares an n-gram of normalised words with an item goes to
        quarantine.jsonl with the benchmark, item and n-gram, counted per
        benchmark in ``statistics.excluded_by_benchmark``; each benchmark's
        fingerprint enters the cache's.
      exclude_ngram: n-gram length in words for the specs of
        ``exclude_benchmarks`` (default 13, GPT-3's; a ``Benchmark`` object
        keeps its own ``n``).
      near_duplicates: the parameters of near-duplicate removal
        (``seqcache.tasks.NearDuplicates``: shingle, bands, rows, seed,
        fields), used when the source's ``on_error`` sets ``near_duplicate``
        to ``"skip"`` (then None means the defaults); each enters the
        fingerprint. Given while ``near_duplicate`` is ``"keep"``, the build
        refuses them (``BuildError``).
    """

    split: str = "train"
    seed: int = 0
    sequence_length: Mapping[str, int] | int | None = None
    num_shards: int | None = None
    shard_size: int | None = None
    exclude_benchmarks: Sequence[Any] = ()
    exclude_ngram: int | None = None
    near_duplicates: NearDuplicates | None = None

    def __post_init__(self):
        shuffle.seed_key(self.seed)  # validates the range
        if isinstance(self.exclude_benchmarks, str):
            raise ValueError(f"exclude_benchmarks must be a sequence of specs or benchmarks "
                             f"(got the string {self.exclude_benchmarks!r}: write ({self.exclude_benchmarks!r},))")
        object.__setattr__(self, "exclude_benchmarks", tuple(self.exclude_benchmarks))
        if self.exclude_ngram is not None and self.exclude_ngram < 1:
            raise ValueError(f"exclude_ngram must be >= 1 word (got {self.exclude_ngram})")
        if self.num_shards is not None and self.num_shards < 1:
            raise ValueError(f"num_shards must be >= 1 (got {self.num_shards})")
        if self.near_duplicates is not None and not isinstance(self.near_duplicates, NearDuplicates):
            raise ValueError(f"near_duplicates must be a NearDuplicates (got {type(self.near_duplicates).__name__})")
        if self.shard_size is not None and self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1 byte (got {self.shard_size})")
        if not self.split or "/" in self.split or self.split in (".", ".."):
            raise ValueError(f"split must be a plain name (got {self.split!r})")


@dataclasses.dataclass
class BuildResult:
    """What ``build_task`` did: the cache folder, its manifest, whether an existing
    cache with the same fingerprint was reused without work, the seconds taken,
    and the work folder kept for a later build (``keep_work``), or None."""

    cache_dir: str
    manifest: fmt.Manifest
    reused: bool
    seconds: float
    work_dir: str | None = None


def task_for_split(task, split: str):
    """``task`` as the cache of ``split`` reads it (``Task.for_split``: the
    split's source, for a task with a source per split; else ``task``).

    Raises:
      BuildError: the task has a source per split and none for ``split`` (one
        line, listing its splits); raised before anything is written.
    """
    for_split = getattr(task, "for_split", None)
    if for_split is None:  # a task-like object without splits
        return task
    try:
        return for_split(split)
    except ValueError as e:
        raise BuildError(str(e)) from None


def _check_task(task, config: BuildConfig) -> BuildConfig:
    """``config`` with its sequence lengths as a mapping over the task's
    features (``seqcache.lengths.sequence_lengths``: an int is every
    feature's), once checked against the task's packing (BuildError)."""
    features, name = task.output_features, task.name
    try:
        lengths = sequence_lengths(config.sequence_length, features)
    except ValueError as e:
        raise BuildError(f"task {name!r}: {e}") from None
    if task.packing not in (None, "lm", "first_fit"):
        raise BuildError(f"task {name!r}: unknown packing {task.packing!r} (expected None, 'lm' or 'first_fit')")
    missing = [n for n in features if n not in lengths]
    if task.packing == "first_fit" and missing:
        raise BuildError(f"task {name!r}: packing='first_fit' needs a sequence length for every feature; missing "
                         f"{missing} (pass --sequence-length " + ",".join(f"{n}=N" for n in missing) + ")")
    if task.packing == "lm" and len(features) != 1:
        raise BuildError(f"task {name!r}: packing='lm' needs exactly one output feature (has {sorted(features)})")
    if task.packing == "lm" and missing:
        raise BuildError(f"task {name!r}: packing='lm' needs a sequence length for feature {missing[0]!r} "
                         f"(pass --sequence-length {missing[0]}=N)")
    return dataclasses.replace(config, sequence_length=lengths or None)


def build_task(
    task,
    *,
    cache_dir: str,
    config: BuildConfig = BuildConfig(),
    pipeline_args: Sequence[str] | Any = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    split_size: int | None = None,
    exchange: str = "auto",
    resume: bool = True,
    work_dir: str | None = None,
    keep_work: bool = False,
    unit_progress: Callable[[int, int, int], None] | None = None,
) -> BuildResult:
    """Builds (or reuses) the cache of one task at ``cache_dir/<task>/<split>``.

    Args:
      task: a ``seqcache.tasks.Task``; one with a source per split reads
        ``config.split``'s (``Task.for_split``).
      cache_dir: the caches root (local path or gs://, s3://, hdfs:// URL).
      config: the options that define the cache (see ``BuildConfig``).
      pipeline_args: Beam pipeline options (a list of ``--flag=value`` strings or
        a ``PipelineOptions``); without ``--runner``, Beam's local engine.
        Short runner names (``--runner=dask``) are resolved (runner.py).
      overwrite: replace an existing cache whose fingerprint differs.
      progress: called as ``progress(shards_written, num_shards)`` while writing.
      split_size: bytes of input per unit of reading work (default: see
        ``plan.choose_split_size``); large uncompressed text and JSON-lines
        files are read in byte ranges, Parquet files by row groups. It changes
        how the work is divided, never the cache's bytes.
      exchange: how examples reach the shard writers: ``"auto"``, ``"runner"``
        (the runner's shuffle) or ``"spill"`` (spill files; runner.py). It never
        changes the cache's bytes.
      resume: keep the build's work in its work folder (work.py): a rerun
        after it died reuses every unit read and shard written, a build of a
        grown corpus every unit whose inputs are unchanged; False: nothing.
      work_dir: the work folder (default ``work.work_path(<the cache>)``).
      keep_work: keep it once the cache is complete (for a grown corpus).
      unit_progress: ``unit_progress(reused, done, total)``: work units found
        complete when the build started, complete now, in all (local folders).

    Returns:
      A ``BuildResult``. A cache whose fingerprint matches is reused without
      work. The manifest's ``work`` says what the work folder gave.

    Raises:
      FileNotFoundError: the task's source matches no file.
      BuildError: the task has a source per split but none for
        ``config.split``; a different cache exists and ``overwrite`` is False; the task
        produced zero examples; a shard failed verification; the runner could
        not start or lost its workers (one line; nothing is left behind); a
        benchmark of ``config.exclude_benchmarks`` cannot be read.
      pipelines.dataflow.DryRun: Dataflow's ``--dry_run=True`` translated the job (it carries it); nothing was built.
      Any error of the task's sources or preprocessors, naming file and record.
    """
    start = time.monotonic()
    task = task_for_split(task, config.split)
    config = _check_task(task, config)
    options, runner, exchange, fs_options = _runner(pipeline_args, exchange)
    process.freeze_heap()  # what is imported lives on: a listing's collections (many files) skip it
    files = task.source.list_files()
    if not files:
        raise FileNotFoundError(f"task {task.name!r}: source {task.source.describe()} matches no file")
    total_bytes = sum(f.num_bytes for f in files)
    num_shards, shard_size, content = _shard_count(task, config, files, total_bytes)
    exclusion = _exclusion(config)
    inputs = task_fingerprint_inputs(task, config, num_shards, exclusion=exclusion, files=files)
    out_dir = cache_path(cache_dir, task.name, config.split)
    plan = BuildPlan(
        task=task, config=config, files=files, total_bytes=total_bytes, num_shards=num_shards,
        shard_size=None if config.num_shards else shard_size, inputs=inputs, fingerprint=fmt.fingerprint_of(inputs),
        out_dir=out_dir, runner=runner, exchange=exchange, split_size=split_size or plan_mod.choose_split_size(total_bytes),
        options=options, fs_options=fs_options, content_bytes=content, exclusion=exclusion,
        work_dir=(work_dir or work_mod.work_path(out_dir, steps_run_here=runner_mod.steps_run_here(runner, options)))
        if resume else None, keep_work=bool(keep_work and resume))
    if not resume:
        _note_work_left(out_dir)
    with cache_lock(plan.out_dir), _work_lock(plan):
        return _build_locked(plan, overwrite=overwrite, progress=progress, start=start, unit_progress=unit_progress)


def _note_work_left(out_dir: str) -> None:
    """Says (a warning) that a build keeping nothing leaves an earlier build's work folder as it is."""
    if fs.isdir(work_mod.work_path(out_dir)):
        log.warning("%s: the work folder of an earlier build is left as it is (a build with --work off neither reads "
                    "nor removes it; seqcache clean does)", work_mod.work_path(out_dir))


def _runner(pipeline_args, exchange: str) -> tuple[Any, str, str, list]:
    """(options, runner, exchange, file-system options) of a build, the runner
    checked (BuildError in one line) and the file systems given the options
    before the first file access (object-store endpoints and credentials)."""
    options, runner = runner_mod.pipeline_options(pipeline_args)
    try:
        runner_mod.check_runner_available(runner, options)
        exchange = runner_mod.choose_exchange(exchange, runner, options)
    except (RunnerError, ValueError) as e:
        raise BuildError(str(e)) from None
    fs_options = runner_mod.fs_options(pipeline_args)
    fs.set_options(options)
    return options, runner, exchange, fs_options


def _shard_count(task, config: BuildConfig, files, total_bytes: int) -> tuple[int, int, int | None]:
    """(shard count, shard size, content bytes or None) of a build: the count
    given, or the one the uncompressed size of the text (Parquet footers,
    sampled compression ratios; ``plan.content_bytes``), not the file bytes,
    gives; BuildError for more shards than the input can fill."""
    shard_size = config.shard_size or shuffle.DEFAULT_SHARD_BYTES
    content = None if config.num_shards else plan_mod.content_bytes(task.source, files)
    num_shards = config.num_shards or shuffle.choose_num_shards(content, target_shard_bytes=shard_size)
    max_shards = max(FREE_SHARDS, max(total_bytes, content or 0) // MIN_SHARD_BYTES)
    if num_shards > max_shards:
        raise BuildError(f"task {task.name!r}: {num_shards:,} shards for {total_bytes:,} bytes of input is too many "
                         f"(each shard, even empty, is a file); use at most {max_shards:,}, or leave --num-shards out")
    return num_shards, shard_size, content


def _exclusion(config: BuildConfig) -> "exclusion_mod.Exclusion | None":
    """The benchmarks the build excludes, or None; BuildError when one cannot be read, or two share a name."""
    if not config.exclude_benchmarks:
        return None
    try:
        return exclusion_mod.Exclusion(exclusion_mod.load_benchmarks(config.exclude_benchmarks,
                                                                     n=config.exclude_ngram))
    except (ValueError, FileNotFoundError) as e:
        raise BuildError(f"exclude_benchmarks: {e}", bad_input=isinstance(e, BadInputError)) from None


@contextlib.contextmanager
def _work_lock(plan: BuildPlan):
    """The lock of a work folder given apart from the cache (``--work-dir``,
    local): ``<work>/.lock``, as ``cache_lock``. The default work folder
    lies beside the cache and its lock covers it."""
    work_dir = plan.work_dir
    if work_dir is None or not fs.is_local(work_dir) or (fs.is_local(plan.out_dir)
                                                         and work_dir == work_mod.work_path(plan.out_dir)):
        yield
        return
    if fs.exists(work_dir) and not fs.isdir(work_dir):
        raise BuildError(f"--work-dir {work_dir} is a file, not a folder: give a folder (it is created if missing)")
    with cache_lock(os.path.join(fs.local_path(work_dir), "folder"), lock_name=work_mod.WORK_LOCK,
                    what="work folder", advice="wait for it to finish, or give this build another --work-dir"):
        yield


@contextlib.contextmanager
def cache_lock(out_dir: str, *, lock_name: str | None = None, what: str = "cache",
               advice: str = "wait for it to finish, or build into another --cache-dir"):
    """An exclusive lock on one cache folder for the length of a build (local
    file systems: ``fcntl.flock`` on ``<task>/.<split>.lock``, or
    ``lock_name`` beside ``out_dir``); a second build fails at once, saying
    so. The lock file is removed at the end (a taker checks that the file it
    locked is still the one at the path), and so are the folders the build
    created when left empty. Object stores have no such lock; there, run one
    build per cache at a time. ``advice`` ends the refusal's line: what to do."""
    if not fs.is_local(out_dir):
        yield
        return
    path = os.path.abspath(fs.local_path(out_dir))
    parent = os.path.dirname(path)
    lock_path = os.path.join(parent, lock_name or f".{os.path.basename(path)}.lock")
    made = []  # the folders this build creates, deepest first: removed again when left empty
    missing = os.path.abspath(parent)
    while not os.path.isdir(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(parent, exist_ok=True)
    while True:
        f = open(lock_path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            where = out_dir if lock_name is None else parent
            raise BuildError(f"{where}: another build of this {what} is running (it holds {lock_path}); "
                             f"{advice}") from None
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(f.fileno()), os.stat(lock_path)):
                break
        f.close()  # the holder removed it while we waited: lock the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()
        for folder in made:
            try:
                os.rmdir(folder)  # only when empty: a failed first build leaves no folder behind
            except OSError:
                break


def _build_locked(plan: BuildPlan, *, overwrite, progress, start, unit_progress=None) -> BuildResult:
    out_dir = plan.out_dir
    had_work = plan.work_dir is not None and fs.exists(plan.work_dir)
    if plan.work_dir is not None:
        try:
            work_mod.claim(plan.work_dir, out_dir)
        except ValueError as e:
            raise BuildError(str(e)) from None
    staging = writer.staging_path(out_dir)
    # a killed replacement: the old cache back, staging leftovers gone (kept when this build can resume them)
    writer.recover_publish(out_dir, keep_staging=_resumable(staging, plan))
    existing = _read_existing(out_dir, overwrite=overwrite)
    if existing is not None:
        if existing.fingerprint == plan.fingerprint:
            log.info("cache %s is up to date (fingerprint %s); reusing it", out_dir, plan.fingerprint[:12])
            writer.remove_cache_tree(staging)
            fs.remove_tree(fs.join(out_dir, writer.TMP_DIR_NAME))  # a build killed once its manifest was written
            _finish_work(plan, None, completed_now=False)
            return BuildResult(out_dir, existing, reused=True, seconds=time.monotonic() - start,
                               work_dir=plan.work_dir if plan.keep_work and fs.isdir(plan.work_dir) else None)
        if not overwrite:
            changed = describe_changes(_recorded_inputs(existing), plan.inputs)
            raise BuildError(f"{out_dir}: holds a cache with fingerprint {existing.fingerprint[:12]}, this build's "
                             f"fingerprint is {plan.fingerprint[:12]}; what changed: {changed}. "
                             "Pass --overwrite to replace it, or choose another --cache-dir")
    # A complete cache is replaced through a staging folder published when the
    # new cache is complete; else (no cache, or leftovers) the build goes in place.
    staged = existing is not None
    build_dir = staging if staged else out_dir
    resumable = _resumable(build_dir, plan)
    if not resumable:
        writer.remove_cache_tree(build_dir)
    try:
        manifest, units = _build_into(plan, progress=progress, build_dir=build_dir, unit_progress=unit_progress)
    except dataflow.DryRun:
        _after_dry_run(plan, build_dir, resumable=resumable, had_work=had_work)
        raise
    except BaseException as e:
        final = isinstance(e, BuildError) and e.final
        if plan.work_dir is None or final:
            writer.remove_cache_tree(build_dir)
            if final and not plan.keep_work:
                work_mod.remove(plan.work_dir)
        else:  # a build that died keeps its work folder and the shards it wrote, for the rerun
            with contextlib.suppress(OSError):
                fs.remove_tree(fs.join(build_dir, writer.TMP_DIR_NAME, "spill"))
        raise
    if staged:
        log.info("publishing %s over the cache with fingerprint %s", out_dir, existing.fingerprint[:12])
        writer.publish_dir(build_dir, out_dir)
    _finish_work(plan, units, completed_now=True)
    return BuildResult(out_dir, manifest, reused=False, seconds=time.monotonic() - start,
                       work_dir=plan.work_dir if plan.keep_work else None)


def _after_dry_run(plan: BuildPlan, build_dir: str, *, resumable: bool, had_work: bool) -> None:
    """After Dataflow's dry run, which ran no step: the folders this build
    made are removed, and what was there before stays (the shards of a build
    that died, ``resumable``, and a work folder that existed, ``had_work``)."""
    if resumable:
        fs.remove_tree(fs.join(build_dir, writer.TMP_DIR_NAME, "spill"))
    else:
        writer.remove_cache_tree(build_dir)
    if plan.work_dir is not None and not had_work:
        work_mod.remove(plan.work_dir)


# What a build that keeps its work records of itself in its folder: its fingerprint (``_resumable``).
BUILD_RECORD = "build.json"


def _resumable(build_dir: str, plan: BuildPlan) -> bool:
    """Whether ``build_dir`` holds an unfinished run of this very build (its
    ``_tmp/build.json`` names the plan's fingerprint), whose written shards a
    rerun reuses (``WriteGroup``'s marks); never for a build keeping nothing."""
    if plan.work_dir is None:
        return False
    url = fs.join(build_dir, writer.TMP_DIR_NAME, BUILD_RECORD)
    try:
        return fs.exists(url) and json.loads(fs.read_bytes(url)).get("fingerprint") == plan.fingerprint
    except (OSError, ValueError, AttributeError):
        return False


def _finish_work(plan: BuildPlan, units, *, completed_now: bool) -> None:
    """The work folder once the cache is complete: removed, or (``keep_work``)
    kept with this build's units only and their plan (``work.write_plan``,
    for the next build of a grown corpus). A cache found complete leaves a
    kept folder (one with a plan) as it is, and removes a leftover one."""
    work_dir = plan.work_dir
    if work_dir is None or not (completed_now or fs.isdir(work_dir)):
        return
    kept = fs.exists(fs.join(work_dir, work_mod.PLAN_NAME))
    if not plan.keep_work:
        if completed_now or not kept:
            process.fault_point("work:remove")
            work_mod.remove(work_dir)
        return
    if units is None:  # nothing was built: the plan and the units stay as they are
        return
    units, sizes, base, attempts = units
    work_mod.write_plan(work_dir, base, plan.files, units, sizes)
    removed = work_mod.keep_only(work_dir, attempts)
    log.info("kept the work folder %s for a later build (%d files of other builds removed)", work_dir, removed)


def _build_into(plan: BuildPlan, *, progress, build_dir, unit_progress=None) -> tuple[Manifest, Any]:
    """Runs the pipeline into ``build_dir`` (``out_dir`` itself, or its staging
    folder) and writes the manifest there last; returns the manifest and, for
    a build keeping its work, ``(units, split sizes, address base, attempts
    per unit)`` for ``_finish_work``. The steps carry the vocabulary models
    the cache stores by reference to those files
    (``vocabularies.stored_models``): Beam compresses every pickle of a step
    with bz2."""
    work = _plan_work(plan)
    units = work.units
    log.info(
        "building %s: %d files, %.1f MB, %d work units, %d shards, examples through %s -> %s", plan.task.name,
        len(plan.files), plan.total_bytes / 1e6, len(units), plan.num_shards,
        "the runner's shuffle" if plan.exchange == "runner" else "spill files", build_dir,
    )
    fs.makedirs(build_dir)
    scratch = fs.join(build_dir, writer.TMP_DIR_NAME)
    fs.remove_tree(fs.join(scratch, "spill"))  # a killed run's: what it wrote there is named by nothing now
    fs.remove_file(fs.join(scratch, transforms.SUMMARY_NAME))
    fs.makedirs(scratch)
    if plan.work_dir is not None:
        fs.makedirs(fs.join(scratch, SHARD_MARKS))
        fs.write_bytes_atomic(fs.join(scratch, BUILD_RECORD), json.dumps({"fingerprint": plan.fingerprint}).encode())
        for folder in (work_mod.UNITS_DIR, work_mod.RUNS_DIR):
            fs.makedirs(fs.join(plan.work_dir, folder))
    vocabularies, stored = _write_vocabularies(plan.task, build_dir)
    # Spill files and quarantine chunks go to the cache's _tmp/, where every
    # worker reads them; the local engine's (and Prism's, as a build starts it) workers
    # share this machine, so for a cache on an object store they stay on local disk
    # (a request per ranged read).
    local_scratch = None
    if (plan.exchange == "spill" and not fs.is_local(build_dir)
            and runner_mod.steps_run_here(plan.runner, plan.options)):
        spill_dir = local_scratch = tempfile.mkdtemp(prefix="seqcache-spill-")
    else:
        spill_dir = fs.join(scratch, "spill")
        fs.makedirs(spill_dir)
    try:
        with vocab_mod.stored_models(stored):
            _run_pipeline(plan, progress=progress, build_dir=build_dir, scratch=scratch, spill_dir=spill_dir,
                          work=work, unit_progress=unit_progress)
    except Exception:
        if fs.is_local(scratch) and not fs.exists(scratch):  # its working folder gone (an object store has none)
            raise BuildError(f"{plan.out_dir}: the build's working folder {scratch} was removed while it ran; "
                             "nothing was published (a cache there before is untouched); run the build again") from None
        raise
    finally:
        if local_scratch is not None:
            shutil.rmtree(local_scratch, ignore_errors=True)
    summary = _read_summary(plan, scratch, units)
    try:
        entries, statistics, quarantine = _gather(plan, summary, build_dir)
    except BuildError as e:
        e.final = True
        raise
    manifest = _manifest(plan, entries, statistics, quarantine, vocabularies, work=_work_record(plan, work, summary))
    _remove_strays(build_dir, manifest)
    manifest.write(build_dir)
    fs.remove_tree(scratch)  # after the manifest: a build killed while writing it still finds its shards
    done = summary.get("work") or {}
    return manifest, (units, work.sizes, work.base, done.get("attempts", {})) if plan.work_dir else None


# Where a build that keeps its work records each shard it wrote (``WriteGroup``), in its _tmp/.
SHARD_MARKS = "shards"


@dataclasses.dataclass
class _Work:
    """A build's units: ``units`` (``plan.plan_units``), their split sizes
    (bytes), the address base and addresses (work.py; None for a build
    keeping nothing), and the units found complete when it started."""

    units: list
    sizes: list
    base: str | None = None
    addresses: list | None = None
    completed: set = dataclasses.field(default_factory=set)


def _plan_work(plan: BuildPlan) -> _Work:
    """Plans the units (keeping those of a kept plan in the work folder) and their addresses."""
    if plan.work_dir is None:
        sizes: list = []
        return _Work(plan_mod.plan_units(plan.task.source, plan.files, plan.split_size, sizes=sizes), sizes)
    base = work_mod.address_base(plan.inputs, plan.files)
    kept = work_mod.read_plan(plan.work_dir, base)
    sizes = []
    units = plan_mod.plan_units(plan.task.source, plan.files, plan.split_size, kept=kept, sizes=sizes)
    addresses = work_mod.unit_addresses(base, plan.files, units)
    done = work_mod.completed(plan.work_dir, addresses)
    if done:
        log.info("%s: %d of %d work units are in the work folder %s", plan.task.name, len(done), len(units),
                 plan.work_dir)
    return _Work(units, sizes, base, addresses, done)


def _work_record(plan: BuildPlan, work: _Work, summary: dict) -> dict | None:
    """The manifest's ``work``: what the work folder gave this build (None
    for a build keeping nothing)."""
    if plan.work_dir is None:
        return None
    done = summary.get("work") or {}
    shards = sum(1 for r in summary["shards"].values() if r.get("reused"))
    return {"units": len(work.units), "units_reused": int(done.get("reused", 0)),
            "units_resumed": int(done.get("resumed", 0)), "checkpoints_reused": int(done.get("found", 0)),
            "checkpoints_rejected": int(done.get("rejected", 0)), "shards_reused": shards}


def _remove_strays(build_dir: str, manifest: Manifest) -> None:
    """Removes what a killed run of the build left in its folder that is not
    part of the cache (temporary files of writes it did not finish)."""
    names = {e.file for e in manifest.shards} | {e.provenance_file for e in manifest.shards}
    for name in fs.sizes_in(build_dir):
        if name.startswith(".tmp-") or (name.startswith((fmt.DATA_PREFIX, fmt.PROVENANCE_PREFIX)) and name not in names):
            fs.remove_file(fs.join(build_dir, name))


def _write_vocabularies(task, build_dir: str) -> tuple[dict, dict]:
    """Stores each feature's vocabulary model in the cache; returns
    ({feature: manifest entry}, {URL of each stored model: its bytes})."""
    vocabularies, stored = {}, {}
    for name, feature in task.output_features.items():
        desc = dict(feature.vocabulary.to_json())
        model = feature.vocabulary.model_bytes()
        if model is not None:  # one file per feature, with the ending of the vocabulary's own file
            ending = os.path.splitext(desc.get("file") or "")[1] or ".model"
            desc["file"] = f"vocabulary-{name}{ending}"
            url = fs.join(build_dir, desc["file"])
            fs.write_bytes_atomic(url, model)
            stored[url] = model
        vocabularies[name] = desc
    return vocabularies, stored


def _duplicate_action(source, kind: str = "duplicate") -> str:
    """The source's ``on_error`` action for ``kind`` (``"duplicate"`` or
    ``"near_duplicate"``; ``"keep"`` for a source without a policy)."""
    policy = getattr(source, "on_error", None)
    return policy.action(kind) if policy is not None else "keep"


def near_duplicates_of(task, config: BuildConfig) -> NearDuplicates | None:
    """The near-duplicate parameters a build of ``task`` uses: None when its
    source keeps near duplicates, else ``config.near_duplicates`` or the defaults.

    Raises:
      BuildError: parameters given while the source keeps near duplicates.
    """
    if _duplicate_action(task_for_split(task, config.split).source, "near_duplicate") != "skip":
        if config.near_duplicates is not None:
            raise BuildError(f"task {task.name!r}: near-duplicate parameters were given, but its source keeps near "
                             "duplicates; set its on_error near_duplicate to 'skip' (--on-error near_duplicate=skip)")
        return None
    return config.near_duplicates or NearDuplicates()


def _steps(plan: BuildPlan, *, build_dir, scratch, spill_dir, work: _Work, heartbeat: stall.Heartbeat) -> tuple:
    """The pipeline's steps: (read, spread, write, summarize); the first three beat into ``heartbeat``."""
    task, config, num_shards = plan.task, plan.config, plan.num_shards
    near = near_duplicates_of(task, config)
    reader = transforms.ReadPreprocess(task, seed=config.seed, sequence_length=config.sequence_length,
                                       num_shards=num_shards, exclusion=plan.exclusion, near=near,
                                       note_kept=_duplicate_action(task.source) == "skip" or near is not None)
    table = transforms.WorkTable.store(spill_dir, [f.path for f in plan.files], [f.num_bytes for f in plan.files],
                                       [splits for _, splits in work.units], addresses=work.addresses)
    read = transforms.ReadUnit(reader, paths=table, spill_dir=spill_dir, exchange=plan.exchange,
                               fs_options=plan.fs_options, encoding_threads=transforms.driver_encoding_threads(),
                               work_dir=plan.work_dir, heartbeat=heartbeat)
    keeps = plan.work_dir is not None
    write = transforms.WriteGroup(task, out_dir=build_dir, scratch_dir=spill_dir, num_shards=num_shards,
                                  sequence_length=config.sequence_length, fs_options=plan.fs_options, work=table,
                                  marks_dir=fs.join(scratch, SHARD_MARKS) if keeps else None,
                                  fingerprint=plan.fingerprint if keeps else None, near=near is not None,
                                  heartbeat=heartbeat)
    # The work table maps the units' file indices, and words the entries of skipped copies.
    spread = transforms.SpreadCopies(seed=config.seed, num_features=len(reader.features), spill_dir=spill_dir,
                                     exchange=plan.exchange, num_shards=num_shards, fs_options=plan.fs_options,
                                     duplicates=_duplicate_action(task.source), paths=table,
                                     locator=getattr(task.source, "locator", "record"), near=near,
                                     heartbeat=heartbeat)
    summarize = transforms.WriteSummary(scratch_dir=scratch, fs_options=plan.fs_options)
    clusters = None
    if near is not None:
        clusters = (near.rounds, near_mod.ResolveClusters(
            paths=table, locator=getattr(task.source, "locator", "record"), spill_dir=spill_dir,
            num_shards=num_shards, quarantine_key=transforms.QUARANTINE_KEY, counts_key=transforms.COUNTS_KEY,
            members=near_mod.member_dtype(len(reader.features), near), duplicates=_duplicate_action(task.source)))
    return read, spread, write, summarize, clusters


def _near_duplicate_clusters(spread, rounds: int, resolve, num_shards: int):
    """The near-duplicate branch (near.py) from the copies step's output: its
    band rows through the band buckets, ``rounds`` pairs of large-star and
    small-star rounds, then the edges and the member info joined by node group
    (the labels) and the clusters; returns the quarantine chunks, counts and
    removed keys, keyed as the shards' values."""
    def tagged(tag):
        return lambda kv: isinstance(kv[0], bytes) and kv[0][:1] == tag

    edges = (spread | "Bands" >> beam.Filter(tagged(near_mod.BAND_TAG))
             | "GroupByBand" >> beam.GroupByKey() | "StarEdges" >> beam.FlatMap(near_mod.StarEdges(num_shards)))
    for k in range(rounds):
        edges = (edges | f"GroupLarge{k}" >> beam.GroupByKey()
                 | f"LargeStar{k}" >> beam.FlatMap(near_mod.LargeStar(num_shards))
                 | f"GroupSmall{k}" >> beam.GroupByKey()
                 | f"SmallStar{k}" >> beam.FlatMap(near_mod.SmallStar(num_shards)))
    members = spread | "Members" >> beam.Filter(tagged(near_mod.MEMBER_TAG))
    return ((edges, members) | "EdgesAndMembers" >> beam.Flatten() | "GroupByNode" >> beam.GroupByKey()
            | "JoinLabels" >> beam.FlatMap(near_mod.JoinLabels(rounds, num_shards, resolve.members))
            | "GroupByCluster" >> beam.GroupByKey() | "ResolveClusters" >> beam.FlatMap(resolve))


def _run_pipeline(plan: BuildPlan, *, progress, build_dir, scratch, spill_dir, work: _Work, unit_progress=None) -> None:
    """The Beam pipeline, one straight line with one leaf, run to its end;
    BuildError when the runner failed (one line), its job made no progress
    for the stall bound (stall.py) or the disk filled up."""
    heartbeat = _heartbeat(plan, scratch)
    read, spread, write, summarize, clusters = _steps(plan, build_dir=build_dir, scratch=scratch, spill_dir=spill_dir,
                                                      work=work, heartbeat=heartbeat)
    _pickle_user_modules_by_value()
    pipeline = beam.Pipeline(runner=runner_mod.pipeline_runner(plan.runner, plan.options), options=plan.options)
    spread_out = (
        pipeline
        | "ListWork" >> beam.Create([unit_index for unit_index, _ in work.units])
        | "SpreadWork" >> beam.Reshuffle()
        | "ReadPreprocess" >> beam.FlatMap(read)
        | "GroupByShard" >> beam.GroupByKey()
        | "SpreadCopies" >> beam.FlatMap(spread)
    )
    if clusters is not None:  # near duplicates: a branch that joins the shards' grouping
        removed = _near_duplicate_clusters(spread_out, clusters[0], clusters[1], plan.num_shards)
        shards = spread_out | "ShardValues" >> beam.Filter(lambda kv: not isinstance(kv[0], bytes))
        spread_out = (shards, removed) | "WithNearDuplicates" >> beam.Flatten()
    _ = (
        spread_out
        | "GroupWithCopies" >> beam.GroupByKey()
        | "SortPackWrite" >> beam.FlatMap(write)
        | "GatherResults" >> beam.GroupByKey()
        | "WriteSummary" >> beam.FlatMap(summarize)
    )
    process.freeze_heap()
    watch = _Progress(build_dir, plan.num_shards, progress, plan.work_dir, work, unit_progress)
    try:
        with watch.running():
            runner_mod.run(pipeline, plan.runner, heartbeats=heartbeat.folder)
    except RunnerError as e:
        raise BuildError(str(e)) from None
    except BaseException as e:  # no manifest: nothing looks complete
        if _is_no_space(e):
            kept = (f"; the work done so far is kept in {plan.work_dir} for that rerun (seqcache clean removes it)"
                    if plan.work_dir is not None else "")
            raise BuildError(f"{plan.out_dir}: no space left on the device while building; nothing was published "
                             "(no manifest). Free space (the build needs about twice the cache's size while it runs, "
                             "and its work folder about the tokenized size) or use another --cache-dir, then run the "
                             f"build again{kept}") from e
        raise
    finally:
        if heartbeat.folder is not None:
            with contextlib.suppress(OSError):  # the working folder goes with the build, or stays for its rerun
                fs.remove_tree(heartbeat.folder)


def _heartbeat(plan: BuildPlan, scratch: str) -> stall.Heartbeat:
    """The steps' heartbeat (stall.py): into ``<scratch>/beats/``, made
    empty, on a runner whose job the build watches (``watches_stalls``),
    every ``stall.beat_interval`` of the bound; one that does nothing on
    any other runner."""
    if not runner_mod.watches_stalls(plan.runner):
        return stall.Heartbeat(None)
    folder = fs.join(scratch, stall.BEATS_DIR)
    fs.remove_tree(folder)  # a killed run's
    fs.makedirs(folder)
    return stall.Heartbeat(folder, every_s=stall.beat_interval(runner_mod.stall_timeout()))


def _read_summary(plan: BuildPlan, scratch: str, units) -> dict:
    """The summary the pipeline wrote; BuildError when it is missing or lacks work units."""
    summary = transforms.read_summary(scratch)
    if summary is None:
        raise BuildError(f"{plan.out_dir}: the runner {plan.runner} finished but the build's summary "
                         f"({fs.join(scratch, transforms.SUMMARY_NAME)}) is missing; nothing was published")
    if summary["units"] is not None and summary["units"] != len(units):
        raise BuildError(f"{plan.out_dir}: {summary['units']} of {len(units)} work units reported their records; "
                         "the runner lost work, nothing was published")
    return summary


def _gather(plan: BuildPlan, summary: dict, build_dir: str) -> tuple[list, dict, "spill.QuarantineSummary"]:
    """(shard entries in shard order, the cache's statistics, the quarantine
    summary), writing the empty shards; BuildError for zero examples or a shard
    that disagrees with its entry."""
    task, config, num_shards = plan.task, plan.config, plan.num_shards
    records_read = summary["records"]
    entries, shard_stats = [], []
    out_features = transforms.features_out(task, config.sequence_length)
    for shard in range(num_shards):
        result = summary["shards"].get(shard)
        if result is not None:
            entries.append(result["entry"])
            shard_stats.append(result["statistics"])
        else:  # no record hashed into this key range: an empty shard keeps the layout regular
            entries.append(writer.write_shard(build_dir, index=shard, num_shards=num_shards,
                                              features=out_features, examples=[]))
            shard_stats.append(stats_mod.ShardStats(out_features).to_json())
    statistics = stats_mod.merge_stats(shard_stats, records_read)
    if summary["files"] is not None:
        names = [f.name for f in transforms.features_in(task) if not f.name.endswith(fmt.PRETOKENIZED_SUFFIX)]
        columns = summary["files"][:2 + len(names)] if len(summary["files"]) else summary["files"]
        # file indices, examples, the token features' tokens (the source text columns come last)
        statistics["source_files"] = stats_mod.source_file_table(columns, len(plan.files), names)
    quarantine = spill.QuarantineSummary(**(summary["quarantine"] or {}))
    statistics["skipped_records"] = quarantine.skipped_records
    statistics["replaced_records"] = quarantine.replaced_records
    # Copies skipped after the read step counted their kept or repaired kinds there: taken off (spill.py).
    statistics["bad_input_records"] = stats_mod.BadInputCounts.merge([summary.get("bad_input")],
                                                                     minus=quarantine.uncounted)
    if plan.exclusion is not None:
        statistics["excluded_records"] = quarantine.excluded_records
        statistics["excluded_by_benchmark"] = {b.name: quarantine.excluded_by_benchmark.get(b.name, 0)
                                               for b in plan.exclusion.benchmarks}
        if quarantine.excluded_records:
            log.info("task %s: excluded %d records that overlap benchmarks %s; listed in %s", task.name,
                     quarantine.excluded_records, statistics["excluded_by_benchmark"],
                     fs.join(plan.out_dir, fmt.QUARANTINE_NAME))
    if statistics["skipped_records"]:
        log.info("task %s: skipped %d bad records; their locations and reasons are in %s",
                 task.name, statistics["skipped_records"], fs.join(plan.out_dir, fmt.QUARANTINE_NAME))
    if statistics["examples"] == 0:
        raise _zero_examples_error(task, config, plan.files, plan.total_bytes, records_read, quarantine)
    _verify_written(build_dir, entries)
    return entries, statistics, quarantine


def _manifest(plan: BuildPlan, entries, statistics, quarantine, vocabularies, work: dict | None = None) -> Manifest:
    """The manifest of the build (``Manifest.create``), not yet written."""
    task, config = plan.task, plan.config
    out_features = transforms.features_out(task, config.sequence_length)
    quarantined = statistics["skipped_records"] + statistics["replaced_records"] + statistics.get("excluded_records", 0)
    return Manifest.create(
        task=task.name,
        split=config.split,
        fingerprint=plan.fingerprint,
        fingerprint_inputs=plan.inputs,
        fingerprint_known=True,  # fmt.fingerprint_of(plan.inputs), when planned
        features=[{"name": f.name, "dtype": f.dtype,
                   **({"vocabulary": f.name, "add_eos": bool(task.output_features[f.name].add_eos)}
                      if f.name in task.output_features else {})} for f in out_features],
        shards=entries,
        sources=fmt.SourceTable.from_columns(*_file_columns(plan.files), locators=getattr(task.source, "locator", "record")),
        statistics=statistics,
        seed=config.seed,
        sequence_length=config.sequence_length,
        packing=task.packing,
        vocabularies=vocabularies,
        quarantine=fmt.QUARANTINE_NAME if quarantined else None,
        **({"quarantine_num_bytes": quarantine.num_bytes, "quarantine_sha256": quarantine.sha256}
           if quarantined else {}),
        sharding={"num_shards": plan.num_shards, "shard_size": plan.shard_size, "input_bytes": plan.total_bytes,
                  "content_bytes": plan.content_bytes},
        evaluation=task.evaluation() if hasattr(task, "evaluation") else None,
        **({"work": work} if work is not None else {}),
    )


def _file_columns(files) -> tuple[list, list, list]:
    """The paths, sizes and modification times of ``files`` (``SourceFile``s) as three lists."""
    return tuple([f[k] for f in files] for k in range(3))


def _recorded_inputs(manifest: Manifest) -> dict:
    """A cache's fingerprint inputs as hashed (with the file list from its
    source table file), for ``describe_changes``; the manifest's own inputs
    when that file cannot be read."""
    try:
        return manifest.full_fingerprint_inputs() or {}
    except (fmt.CacheError, ValueError) as e:
        log.warning("%s", e)
        return manifest.fingerprint_inputs or {}


def _zero_examples_error(task, config, files, total_bytes, records_read, quarantine) -> BuildError:
    """Why a build produced nothing: the counts, and (no quarantine file is
    written) the first skipped records with their reasons."""
    skipped, replaced = quarantine.skipped_records, quarantine.replaced_records
    excluded = quarantine.excluded_records
    read = "an unknown number of" if records_read is None else f"{records_read:,}"
    text = (
        f"task {task.name!r} split {config.split!r}: zero examples from {read} source records "
        f"({skipped:,} skipped, {replaced:,} replaced under the source's on_error policy; "
        + (f"{excluded:,} excluded for overlapping {quarantine.excluded_by_benchmark}; " if excluded else "")
        + f"source {task.source.describe()}, {len(files)} files, {total_bytes:,} bytes); nothing was written"
    )
    if records_read == 0:
        return BuildError(text + ". The files hold no records: check the source pattern and the files")
    if skipped:
        reasons = "; ".join(f"{e['path']}: {e['error']}" for e in quarantine.first_skipped)
        more = f" (first {len(quarantine.first_skipped)} of {skipped:,})" if skipped > len(quarantine.first_skipped) else ""
        text += f". Skipped{more}: {reasons}"
        if records_read is not None and skipped >= records_read:
            advice, keepable = _every_record_skipped(quarantine.first_skipped)
            return BuildError(text + advice, bad_input=keepable)
    kept = None if records_read is None else records_read - skipped - excluded
    if kept:
        text += f". The task's preprocessors dropped all {kept:,} other records: check its filters"
    return BuildError(text)


def _every_record_skipped(first_skipped) -> tuple[str, bool]:
    """What to do when every record was skipped: keep them (the kinds that can
    be), or fix the input; and whether some can be kept."""
    kinds = list(dict.fromkeys(e.get("kind") for e in first_skipped if e.get("kind")))
    keepable = [k for k in kinds if "keep" in ERROR_KINDS.get(k, ())]
    if not keepable:
        what = f" ({', '.join(kinds)}: these cannot be kept as they are)" if kinds else ""
        return f". Every record was skipped: fix the input{what}", False
    options = ", ".join(f"{k!r}: 'keep'" for k in keepable)
    flags = " ".join(f"--on-error {k}=keep" for k in keepable)
    return (". Every record was skipped: fix the input, or accept these records with the source's "
            f"on_error option (on_error={{{options}}}; on the command line {flags})"), True


def _is_no_space(error: BaseException) -> bool:
    """ENOSPC, raised here or by a worker (``beam_text.read``: a worker's
    ``OSError`` comes back inside another error, across processes as text)."""
    return beam_text.read(error).no_space


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
            for i, (x, y) in enumerate(zip(a, b)):  # a file by its path too, not by its index alone
                named = isinstance(x, dict) and isinstance(y, dict) and x.get("path") == y.get("path") is not None
                walk(x, y, f"{path[:-1]}[{i}] ({x['path']})." if named else f"{path[:-1]}[{i}].")
        elif isinstance(a, list) and isinstance(b, list) and _paths(a) is not None and _paths(b) is not None:
            files_changed(a, b, path[:-1])
        elif a != b:
            diffs.append(f"{path[:-1]}: {short(a)} -> {short(b)}")

    def files_changed(a, b, where):
        """Two file lists of other lengths: the paths added and removed, then the files changed."""
        before, after = _paths(a), _paths(b)
        for word, paths in (("added", [p for p in after if p not in before]),
                            ("removed", [p for p in before if p not in after])):
            if paths:
                more = f" and {len(paths) - 2:,} more" if len(paths) > 2 else ""
                diffs.append(f"{where}: {word} {', '.join(paths[:2])}{more}")
        for p in (p for p in after if p in before):
            walk(before[p], after[p], f"{where} ({p}).")

    walk(old, new, "")
    if not diffs:
        return "nothing recorded differs (an older seqcache wrote it)"
    return "; ".join(diffs[:limit]) + ("; and more" if len(diffs) > limit else "")


def _paths(files: list) -> dict | None:
    """{path: entry} of a fingerprint's file list (dicts with a ``path``), or None for another list."""
    if not all(isinstance(f, dict) and isinstance(f.get("path"), str) for f in files):
        return None
    return {f["path"]: f for f in files}


import_beam = process.import_beam  # Beam imported quietly, without pandas; returns ``apache_beam``


def _read_existing(out_dir: str, *, overwrite: bool):
    """The manifest of the cache at ``out_dir``, or None when there is none, or
    when ``overwrite`` and it cannot be read (then it is replaced like leftovers;
    without ``overwrite``, its ``CacheError`` is raised)."""
    if not fs.exists(fs.join(out_dir, fmt.MANIFEST_NAME)):
        return None
    try:
        return fmt.read_manifest(out_dir)
    except fmt.CacheError as e:
        if not overwrite:
            raise
        log.warning("replacing the cache at %s, which this seqcache cannot read: %s", out_dir, e)
        return None


def _pickle_user_modules_by_value() -> None:
    """Task modules imported from a file path (``--module my_tasks.py``) are not
    importable by name in worker processes: their functions travel by value,
    with Beam's pickler and with the cloudpickle that Dask sends tasks with."""
    for name, module in list(sys.modules.items()):
        if name.startswith(USER_MODULE_PREFIX):
            beam_internals.register_pickle_by_value(module)
            if cloudpickle is not None:
                cloudpickle.register_pickle_by_value(module)


def _verify_written(out_dir: str, entries) -> None:
    """The driver's check of every shard before the manifest is written: the file
    exists with the size its writer reported and, locally, the record count
    (on an object store, one listing gives every size)."""
    local = fs.is_local(out_dir)
    if not local:
        found = {f.path.rstrip("/").rpartition("/")[2]: f.num_bytes for f in fs.match(fs.join(out_dir, "*"))}
    for e in entries:
        for name, size in ((e["file"], e["num_bytes"]), (e["provenance_file"], e["provenance_num_bytes"])):
            path = os.path.join(fs.local_path(out_dir), name) if local else fs.join(out_dir, name)
            actual = (os.path.getsize(path) if os.path.exists(path) else None) if local else found.get(name)
            if actual != size:
                raise BuildError(f"{path}: shard has {actual} bytes after the build, its writer reported {size}")
            if not local:
                continue
            reader = ArrayRecordReader(path)
            try:
                n = reader.num_records()
            finally:
                reader.close()
            if n != e["num_records"]:
                raise BuildError(f"{path}: shard holds {n} records, its writer reported {e['num_records']}")


def task_fingerprint_inputs(task, config: BuildConfig, num_shards: int, *,
                            exclusion: "exclusion_mod.Exclusion | None" = None, files=None) -> dict:
    """What a cache's fingerprint is the sha256 of (``fmt.fingerprint_of``);
    ``exclude_benchmarks`` (each benchmark's ``describe()``, by name) only when
    the build excludes benchmarks, so other caches keep their fingerprints.
    ``files``: the source's ``list_files()`` as the build listed them (the
    same value; the files are not listed a second time). A task with a
    source per split counts ``config.split``'s source only."""
    task = task_for_split(task, config.split)
    inputs = {
        "format_version": fmt.RECORD_FORMAT_VERSION,
        "shuffle_version": shuffle.SHUFFLE_VERSION,
        "writer_options": fmt.WRITER_OPTIONS,
        "split": config.split,
        "num_shards": num_shards,
        "record_features": [[f.name, f.dtype] for f in transforms.features_out(task, config.sequence_length)],
        "task": task.fingerprint(seed=config.seed, sequence_length=config.sequence_length, files=files),
    }
    if exclusion is not None:
        inputs["exclude_benchmarks"] = exclusion.describe()
    near = near_duplicates_of(task, config)
    if near is not None:
        inputs["near_duplicates"] = near.to_json()
    return inputs


class _Progress:
    """Reports a build's progress while its pipeline runs, polling folders
    the driver reads (local folders only): ``shards(written, num_shards)``
    from the data shards in place in ``build_dir`` (a shard gets its final
    name only when complete), and ``units(reused, done, total)`` from the
    complete ledgers in the work folder (``work.completed``): a progress
    that works on any runner whose workers write where the driver reads."""

    def __init__(self, build_dir: str, num_shards: int, shards, work_dir: str | None, work: "_Work", units,
                 interval_s: float = 0.5):
        self.build_dir, self.num_shards, self.shards, self.interval_s = build_dir, num_shards, shards, interval_s
        self.work_dir, self.work, self.units = work_dir, work, units if work_dir and work.addresses else None

    def report(self) -> None:
        if self.shards is not None and fs.is_local(self.build_dir):
            try:
                n = sum(1 for name in os.listdir(fs.local_path(self.build_dir)) if name.startswith(fmt.DATA_PREFIX))
            except OSError:
                n = 0
            self.shards(n, self.num_shards)
        if self.units is not None:
            done = len(work_mod.completed(self.work_dir, self.work.addresses)) if fs.is_local(self.work_dir) else 0
            self.units(len(self.work.completed), max(done, len(self.work.completed)), len(self.work.units))

    @contextlib.contextmanager
    def running(self):
        if self.shards is None and self.units is None:
            yield
            return
        stop = threading.Event()

        def poll():
            while not stop.wait(self.interval_s):
                self.report()

        self.report()
        thread = threading.Thread(target=poll, name="seqcache-build-progress", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            self.report()
