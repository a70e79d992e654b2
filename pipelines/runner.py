"""Which Beam runner a build runs on, its options, and running it.

The build is one portable Beam pipeline (see transforms.py): it uses no
feature that only some runners have (outputs from ``finish_bundle``, several
leaves, tagged outputs, metrics). What differs between runners is set here:

- **The runner's name.** ``RUNNER_ALIASES`` maps short names
  (``--runner=dask``, ``--runner=direct``) to what Beam wants; ``direct``
  means Beam's local engine, ``FnApiRunner``, which Beam's DirectRunner would
  only reach after trying to download Prism (``local_engine``: a subclass of
  it in beam_internals.py, the one module that uses Beam's private names).
- **How examples travel to the shard writers** (``exchange``): through the
  runner's own shuffle (``"runner"``), or, on Beam's local engine, whose
  shuffle keeps every element in the driver's memory, through spill files
  (``"spill"``, spill.py). ``"auto"`` picks spill where every step runs on
  this machine (``steps_run_here``: the local engine, Prism as a build starts
  it, and Flink embedded in its job server).
- **Parallelism on Dask.** Beam's DaskRunner puts 128 elements of ``Create``
  in a partition and treats ``Reshuffle`` as a no-op, so unless the user sets
  ``--dask_npartitions`` or ``--dask_partition_size``, every work unit gets its
  own partition (``--dask_partition_size=1``).
- **Prism, installed, never downloaded.** Beam's PrismRunner downloads its
  Go binary from GitHub unless ``--prism_location`` names one. Without that
  option a build passes the binary that ``prism_location`` finds (the
  ``SEQCACHE_PRISM`` variable, or ``prism`` beside the Python executable,
  where ``make prism`` links it, or on ``PATH``), and fails in one line, before
  anything is written, when there is none. Prism runs the Python steps in the
  submitting process (Beam's ``LOOPBACK`` environment, its default there), so
  ``"auto"`` moves examples through spill files there too.
- **Flink and Spark.** A build starts the Java job server itself
  (``job_server_for``, job_server.py: Beam's job server jar, run by its
  documented command line), the one ``make jars`` builds (runners/flink,
  runners/spark: Beam's runner library and its dependencies from Maven
  Central), found under ``$SEQCACHE_JARS`` (default ``build/jars``) unless
  ``--flink_job_server_jar`` / ``--spark_job_server_jar`` names one; never one
  Beam would download. Beam's public FlinkRunner or SparkRunner then submits
  the job to it through ``--job_endpoint``, set while the pipeline runs; with
  ``--job_endpoint`` given, or an uber jar submitted, nothing is started.
  Without a master, Flink runs embedded in the job server (``[local]``) and
  Spark as ``local[4]`` (Beam's defaults), and the Python steps run in the
  submitting process (Beam's LOOPBACK environment).
- **Starting and finishing.** A runner that cannot start (a job server that
  would have to be downloaded, a Dask scheduler that does not answer) raises
  ``RunnerError`` with one line that says which runner and why. The job
  server a Flink or Spark build starts dies with the build, also when the
  build is killed, and is stopped when its pipeline ends (``run``). A job
  run through a job service (Flink, Spark, ``--job_endpoint``:
  ``watches_stalls``) that makes no progress for ``stall_timeout()`` seconds
  (``$SEQCACHE_STALL_TIMEOUT``, default 5 minutes) is cancelled and fails in
  one line (stall.py): Beam would wait without end for a worker that died or
  never connected.
- **Dataflow's dry run.** With ``--dry_run=True`` Beam's DataflowRunner
  translates the job and submits nothing; ``run`` then raises
  ``dataflow.DryRun``, which carries the job (dataflow.py). The flag with any
  other runner, which would build the cache, is refused before the build starts.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import shutil
import sys
from typing import Any, Sequence

import grpc

from seqcache import process
from seqcache.pipelines import beam_internals, dataflow, job_server as job_server_mod, stall, workers
from seqcache.pipelines.beam_text import causes  # noqa: F401  (runner_mod.causes, for the build and the commands)
from seqcache.pipelines import beam_text

process.import_beam()  # before Beam's modules below: quietly, without pandas
from apache_beam.options import pipeline_options as po  # noqa: E402

log = logging.getLogger(__name__)

LOCAL_ENGINE = "FnApiRunner"
DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
PRISM_RUNNER = "PrismRunner"
# Names the Prism binary a build on --runner=prism uses, when --prism_location does not.
PRISM_VARIABLE = "SEQCACHE_PRISM"

# Short names users type -> what Beam's --runner accepts (lower-cased keys).
# Beam's DirectRunner first tries to download and start Prism; its own local
# engine does the same work and honours --direct_running_mode.
RUNNER_ALIASES = {
    "dask": DASK_RUNNER, "daskrunner": DASK_RUNNER,
    **dict.fromkeys(workers.LOCAL_ENGINE_NAMES, LOCAL_ENGINE),
    "dataflow": "DataflowRunner", "dataflowrunner": "DataflowRunner",
    "flink": "FlinkRunner", "flinkrunner": "FlinkRunner",
    "spark": "SparkRunner", "sparkrunner": "SparkRunner",
    "prism": PRISM_RUNNER, "prismrunner": PRISM_RUNNER,
    "portable": "PortableRunner", "portablerunner": "PortableRunner",
}
# The job servers of Beam's FlinkRunner and SparkRunner: runner -> (its option naming
# the jar, the jar `make jars` builds, under $SEQCACHE_JARS).
JOB_SERVERS = {
    "flinkrunner": ("flink_job_server_jar", "flink/flink-job-server.jar"),
    "sparkrunner": ("spark_job_server_jar", "spark/spark-job-server.jar"),
}
# Where `make jars` puts them: $SEQCACHE_JARS, else build/jars under the working directory.
JARS_ENV = "SEQCACHE_JARS"
DEFAULT_JARS = "build/jars"
# Runners whose job runs through a job service, watched for a job that makes no progress (stall.py).
_JOB_SERVICE_RUNNERS = {"flinkrunner", "sparkrunner", "portablerunner"}
# Runners whose shuffle is Beam's local engine (in the driver's memory).
_LOCAL_ENGINES = {"fnapirunner", "directrunner", "bundlebaseddirectrunner", "swallowingdirectrunner"}
EXCHANGES = ("auto", "runner", "spill")


class RunnerError(Exception):
    """The runner could not start or stopped for a reason of its own (not a
    bad record): the message is one line naming the runner and the cause."""


def resolve_runner(name: str | None) -> str:
    """The runner Beam is given for ``name`` (None: the local engine)."""
    return RUNNER_ALIASES.get(name.lower(), name) if name else LOCAL_ENGINE


def is_local_engine(runner: str) -> bool:
    """True for Beam's local engine (the DirectRunner's FnApiRunner)."""
    return runner.rsplit(".", 1)[-1].lower() in _LOCAL_ENGINES


def is_dask(runner: str) -> bool:
    return runner.rsplit(".", 1)[-1].lower() == "daskrunner"


def is_prism(runner: str) -> bool:
    return runner.rsplit(".", 1)[-1].lower() == "prismrunner"


def watches_stalls(runner: str) -> bool:
    """True for the runners whose job runs through a Beam job service and
    whose wait a build bounds (stall.py): Flink, Spark, and a job server
    named by ``--job_endpoint`` (``PortableRunner``). Prism gives up on a
    worker that does not connect by itself (after 60 s)."""
    return runner.rsplit(".", 1)[-1].lower() in _JOB_SERVICE_RUNNERS


def stall_timeout() -> float:
    """Seconds a watched job may go without progress before the build gives
    up (``watches_stalls``, stall.py): ``$SEQCACHE_STALL_TIMEOUT``, else
    ``stall.DEFAULT_TIMEOUT_S`` (300).

    Raises:
      RunnerError: the variable is not a number of seconds above 0.
    """
    text = os.environ.get(stall.TIMEOUT_VARIABLE, "").strip()
    if not text:
        return stall.DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise RunnerError(f"${stall.TIMEOUT_VARIABLE}={text!r}: expected the seconds a job may go without progress, "
                          f"a number above 0 (unset: {stall.DEFAULT_TIMEOUT_S:g})")
    return seconds


def prism_location() -> str | None:
    """The Prism binary for a build on ``--runner=prism`` without
    ``--prism_location``: the path in ``$SEQCACHE_PRISM`` when set (even one
    that does not exist: the build then names it), else ``prism`` in the
    folder of the Python executable (a venv's ``bin``, where ``make prism``
    links it), else ``prism`` on ``PATH``; None when there is none."""
    named = os.environ.get(PRISM_VARIABLE)
    if named:
        return named
    beside = os.path.join(os.path.dirname(sys.executable), "prism")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return shutil.which("prism")


def steps_run_here(runner: str, options=None) -> bool:
    """True where every step of a build runs on this machine: Beam's local
    engine, and Prism with its steps in the build's process (its default
    ``LOOPBACK`` environment, and the job server ``--runner=prism`` starts
    here, not one named by ``--job_endpoint``), and Flink embedded in the job
    server a build starts here (``is_embedded_flink``)."""
    if is_local_engine(runner) or is_embedded_flink(runner, options):
        return True
    if not is_prism(runner) or options is None:
        return False
    portable = options.view_as(po.PortableOptions)
    return (portable.environment_type or "LOOPBACK").upper() == "LOOPBACK" and not portable.job_endpoint


def job_server(runner: str) -> tuple[str, str] | None:
    """``(option, default jar path)`` for a runner that starts a Java job server
    (Beam's FlinkRunner, SparkRunner), else None. The path is
    ``$SEQCACHE_JARS/<runner>/<runner>-job-server.jar`` (default ``build/jars``)."""
    entry = JOB_SERVERS.get(runner.rsplit(".", 1)[-1].lower())
    if entry is None:
        return None
    option, jar = entry
    return option, os.path.join(os.environ.get(JARS_ENV) or DEFAULT_JARS, jar)


def is_embedded_flink(runner: str, options=None) -> bool:
    """True for Beam's FlinkRunner with the Flink cluster embedded in the job
    server it starts here (``--flink_master`` ``[local]`` or ``[auto]``, no
    ``--job_endpoint``): every process of the build shares this file system."""
    if runner.rsplit(".", 1)[-1].lower() != "flinkrunner" or options is None:
        return False
    all_options = options.get_all_options()
    return not all_options.get("job_endpoint") and (all_options.get("flink_master") or "[auto]") in ("[local]", "[auto]")


def choose_exchange(exchange: str, runner: str, options=None) -> str:
    """``"runner"`` or ``"spill"`` for the requested ``exchange`` on ``runner``
    (``options``: the build's ``PipelineOptions``). ``"auto"`` is spill files
    where every step runs on this machine (``steps_run_here``): on Prism, whose
    shuffle holds every example in its Go process, they cost about a third of
    the CPU and a twelfth of the memory of its shuffle at 100 MB; embedded
    Flink's batch sort must hold a shard's grouped values in one record and
    fails once they outgrow a sort buffer (docs/scaling.md). The runner's
    shuffle elsewhere.

    Raises:
      ValueError: an unknown exchange.
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)} (got {exchange!r})")
    if exchange != "auto":
        return exchange
    return "spill" if steps_run_here(runner, options) else "runner"


def pipeline_options(pipeline_args: Sequence[str] | Any = None):
    """``(options, runner)``: Beam ``PipelineOptions`` from the command line's
    free arguments and the runner's resolved name (the last ``--runner`` wins;
    none: the local engine, named explicitly, since the DirectRunner would
    first try to download Prism), with the Dask partitioning default and, on
    Prism, ``--prism_location`` from ``prism_location()`` when not given
    (``check_runner_available`` refuses a missing binary).
    """
    if isinstance(pipeline_args, po.PipelineOptions):
        standard = pipeline_args.view_as(po.StandardOptions)
        standard.runner = resolve_runner(standard.runner)
        prism = pipeline_args.view_as(po.PrismRunnerOptions)
        if is_prism(standard.runner) and not prism.prism_location:
            prism.prism_location = prism_location()
        return pipeline_args, standard.runner
    args, out, name = iter(pipeline_args or []), [], None
    for a in args:
        if a == "--runner":
            name = next(args, name)
        elif a.startswith("--runner="):
            name = a.split("=", 1)[1]
        else:
            out.append(a)
    runner = resolve_runner(name)
    out.append(f"--runner={runner}")
    server = job_server(runner)
    if server and not any(a.startswith((f"--{server[0]}", "--job_endpoint")) for a in out):
        out.append(f"--{server[0]}={server[1]}")  # never a jar Beam would download
    if is_dask(runner) and not any(a.startswith(("--dask_npartitions", "--dask_partition_size")) for a in out):
        out.append("--dask_partition_size=1")
    if is_prism(runner) and not any(a.startswith("--prism_location") for a in out):
        location = prism_location()
        if location:
            out.append(f"--prism_location={location}")
    return po.PipelineOptions(out), runner


def fs_options(pipeline_args) -> list[str]:
    """The pipeline options file systems read (object-store endpoints and
    credentials), for workers that never saw the pipeline options."""
    if not isinstance(pipeline_args, (list, tuple)):
        return []
    prefixes = ("--s3_", "--gcs_", "--hdfs_", "--azure_", "--blob_", "--project", "--temp_location")
    return [a for a in pipeline_args if isinstance(a, str) and a.startswith(prefixes)]


def local_engine(options):
    """Beam's local engine for ``options`` (``beam_internals.LocalEngine``, a
    subclass of Beam's ``FnApiRunner``). Its multi_processing worker
    processes are seqcache's (``seqcache.pipelines.workers``: Beam imported
    without pandas, started ahead by the ``seqcache build`` executable), and
    get ``options`` (the object-store options, the harness log level)."""
    return beam_internals.LocalEngine(options)


def pipeline_runner(runner: str, options):
    """The runner object a pipeline on ``runner`` is given (``beam.Pipeline(runner=...)``):
    the local engine (``local_engine``); None for any other runner, which
    Beam makes from its name."""
    return local_engine(options) if runner == LOCAL_ENGINE else None


def job_server_for(runner: str, options) -> job_server_mod.JobServer | None:
    """The job server (not yet started) a build on ``runner`` with
    ``options`` starts (job_server.py): Flink's or Spark's jar, the one its
    ``--flink_job_server_jar`` / ``--spark_job_server_jar`` names, else
    ``make jars``'s (``job_server``). None for any other runner, without
    options, with ``--job_endpoint`` or an uber jar submitted
    (``job_server.starts_one``)."""
    server = job_server(runner)
    kind = runner.rsplit(".", 1)[-1].lower().removesuffix("runner")
    if server is None or options is None or not job_server_mod.starts_one(kind, options):
        return None
    option, default_jar = server
    return job_server_mod.JobServer(kind, options, options.get_all_options().get(option) or default_jar)


def _unknown(args: Sequence[str]) -> set[str]:
    """The option names of ``args`` that no registered Beam options class
    defines: what ``get_all_options`` keeps only when told to retain unknown options."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            known = po.PipelineOptions(list(args)).get_all_options()
            return set(po.PipelineOptions(list(args)).get_all_options(retain_unknown_options=True)) - set(known)
    except SystemExit:  # a value an option refuses: option_value_errors words it
        return set()


def unknown_flags(args: Sequence[str]) -> list[str]:
    """The arguments of ``args`` whose ``--flag`` no Beam option defines (a
    typo such as ``--runnr=dask`` would otherwise be ignored without a word)."""
    beam_logger = logging.getLogger("apache_beam.options.pipeline_options")
    level, beam_logger.level = beam_logger.level, logging.ERROR  # its "Discarding unparseable args" warning
    try:
        unknown = _unknown(args)
        if unknown:
            with contextlib.suppress(ImportError):  # only then import the Dask runner for its options
                import apache_beam.runners.dask.dask_runner  # noqa: F401  optional: dask (registers DaskOptions)
            unknown = _unknown(args)
    finally:
        beam_logger.level = level
    return [a for a in args if a.startswith("--") and a.partition("=")[0][2:].replace("-", "_") in unknown]


def option_value_errors(args: Sequence[str]) -> str | None:
    """What is wrong with the values of ``args`` (Beam pipeline options whose
    flags exist), as one line, or None: argparse's own message for a value its
    option refuses ("argument --direct_running_mode: invalid choice: ..."),
    found here rather than in the pipeline, whose workers' standard error a
    build hides; and a negative ``--direct_num_workers`` (0 is "every CPU")."""
    message = io.StringIO()
    try:
        with contextlib.redirect_stderr(message):
            options = po.PipelineOptions(list(args))
            options.get_all_options()
            workers = options.view_as(po.DirectOptions).direct_num_workers
    except SystemExit:
        return beam_text.option_error(message.getvalue())
    if workers is not None and int(workers) < 0:
        return f"--direct_num_workers={workers}: expected 0 (every CPU) or more"
    return None


def _check_job_server(runner: str, option: str, default_jar: str, options) -> None:
    """RunnerError unless ``runner``'s job server can start here: its jar exists
    (never one Beam would download) and ``java`` is on the PATH; nothing to
    check when ``--job_endpoint`` names a running job server."""
    name = runner.rsplit(".", 1)[-1].lower().removesuffix("runner")
    all_options = options.get_all_options() if options is not None else {}
    if all_options.get("job_endpoint"):
        return
    jar = all_options.get(option) or default_jar
    if "://" in jar:
        raise RunnerError(f"{name} runner: --{option}={jar} is a URL; seqcache downloads no job server, "
                          "run `make jars` and give the jar's path")
    missing = jar if not os.path.isfile(jar) else None
    if missing is None and os.path.abspath(jar) == os.path.abspath(default_jar):  # `make jars`'s launcher: jars in lib/
        lib = os.path.join(os.path.dirname(jar), "lib")
        missing = lib if not os.path.isdir(lib) or not os.listdir(lib) else None
    if missing is not None:
        what = "job server jar" if missing == jar else f"job server libraries (for {jar})"
        raise RunnerError(f"{name} runner: no {what} at {missing}; run `make jars` in the checkout, "
                          f"or set {JARS_ENV} or --{option}")
    if shutil.which("java") is None:
        raise RunnerError(f"{name} runner: no `java` on the PATH to start the job server {jar} (Java 17 or newer)")


def check_runner_available(runner: str, options=None) -> None:
    """Fails early, before anything is written, when ``runner`` cannot be used
    here: an unknown name, a runner whose Python packages are missing, Prism
    without a binary on this machine, or a Flink or Spark job server jar that
    ``make jars`` has not built (``options``: the build's ``PipelineOptions``,
    for ``--prism_location`` and the jar's option).

    Raises:
      RunnerError: one line naming the runner and what to do; also for
        ``--dry_run`` with a runner other than Dataflow (which would build
        the cache), or with a value that looks false (Beam's DataflowRunner
        makes a dry run of any value), and for a ``$SEQCACHE_STALL_TIMEOUT``
        that is no number of seconds on a runner that reads it.
    """
    _check_dry_run(runner, options)
    if watches_stalls(runner):
        stall_timeout()
    if is_prism(runner):
        _check_prism(options)
    server = job_server(runner)
    if server:
        _check_job_server(runner, *server, options)
        return
    if is_dask(runner):
        try:
            import dask.distributed  # noqa: F401  optional: dask
        except ImportError:
            raise RunnerError(f"runner {runner}: dask.distributed is not installed "
                              "(pip install 'seqcache[dask]')") from None
        return
    try:
        beam_internals.create_runner(runner)
    except (ValueError, ImportError, AttributeError) as e:
        known = ", ".join(sorted({v.rsplit(".", 1)[-1] for v in RUNNER_ALIASES.values()}))
        why = "is unknown" if beam_text.unknown_runner(e) else f"is not available: {first_line(e)}"
        raise RunnerError(f"runner {runner!r} {why} (runners: {known}, or a fully qualified class name)") from None


def _check_dry_run(runner: str, options) -> None:
    """RunnerError for a ``--dry_run`` that would not do what it says: with a
    runner other than Dataflow (the only one that reads it) or with a value
    that looks false (Beam's DataflowRunner reads any value as a dry run)."""
    value = dataflow.dry_run_value(options)
    if value is None:
        return
    if not dataflow.is_dataflow(runner):
        raise RunnerError(f"--dry_run={value}: only DataflowRunner makes a dry run; runner "
                          f"{runner.rsplit('.', 1)[-1]} would build the cache (leave the flag out, or add "
                          "--runner=DataflowRunner)")
    if value.lower() in dataflow.FALSE_LOOKING:
        raise RunnerError(f"--dry_run={value}: Beam's DataflowRunner makes a dry run of any value of --dry_run; "
                          "leave the flag out to submit the job")


def _check_prism(options) -> None:
    """RunnerError unless ``options``' ``--prism_location`` is an executable file
    here (Beam would otherwise try to download one, or take a URL)."""
    location = options.view_as(po.PrismRunnerOptions).prism_location if options is not None else None
    where = (f"at {location}" if location else
             f"beside {sys.executable}, in ${PRISM_VARIABLE} or on PATH")
    if not location or not (os.path.isfile(location) and os.access(location, os.X_OK)):
        raise RunnerError(f"prism runner: no prism binary {where}; run `make prism` in the seqcache checkout, "
                          f"or set {PRISM_VARIABLE} or --prism_location to one")


def run(pipeline, runner: str, *, heartbeats: str | None = None) -> None:
    """Runs ``pipeline`` to the end: on Flink and Spark, first starts the
    job server (``job_server_for``) and points the pipeline's options at it,
    then stops it whatever the end (job_server.py).

    ``heartbeats``: the folder of the steps' heartbeats (``stall.Heartbeat``)
    on a runner that ``watches_stalls``: its job is then given up after
    ``stall_timeout()`` seconds without progress (stall.py). None: waited for
    without a bound.

    Raises:
      RunnerError: the runner could not start, lost its workers or its job
        server, or its job made no progress for the bound (one line).
      dataflow.DryRun: Dataflow with ``--dry_run=True`` translated the job
        and ran nothing (it carries the job).
      The error a step raised (a bad record, a full disk), as the runner reports it.
    """
    server = job_server_for(runner, pipeline.options)
    standard = pipeline.options.view_as(po.StandardOptions) if pipeline.options is not None else None
    named = standard.runner if standard is not None else None
    try:
        _run(pipeline, runner, heartbeats, server)
    finally:
        if server is not None:
            server.stop()
        if standard is not None:  # Beam's portable runner clears it: the options may serve another task
            standard.runner = named


def _run(pipeline, runner: str, heartbeats: str | None, server) -> None:
    short = runner.rsplit(".", 1)[-1]
    try:
        if server is not None:
            server.start()  # sets --job_endpoint: Beam's runner starts none
        result = pipeline.run()
    except Exception as e:
        if beam_text.read(e).step_raised:
            raise
        # The local engine runs the whole pipeline here: it started, then failed.
        how = "failed" if is_local_engine(runner) else "could not start"
        raise RunnerError(f"runner {short} {how}: {first_line(e)}") from e
    if dataflow.is_dataflow(runner) and dataflow.dry_run_value(pipeline.options):
        raise dataflow.DryRun(result.job)  # the job translated, nothing submitted: no summary will come
    try:
        _wait(result, runner, heartbeats)
    except KeyboardInterrupt:
        # Ctrl-C or SIGTERM: stop the runner's remaining work (Dask would go on
        # writing shards into the folder the driver is about to remove).
        with contextlib.suppress(Exception):  # cancelling is best effort
            result.cancel()
        raise
    except stall.Stalled as e:
        stall.cancel(result, e)
        raise RunnerError(f"runner {short}: the job made no progress for {e.seconds:g} s (no step of the build "
                          "did any work): an SDK worker died or never connected (one "
                          "that cannot start: a worker pool whose python lacks Beam or seqcache, a container that "
                          "exits); nothing was published, run the build again once its workers start "
                          f"(${stall.TIMEOUT_VARIABLE} sets the bound, in seconds)") from None
    except Exception as e:
        if any(type(c).__name__ in ("KilledWorker", "CommClosedError", "FutureCancelledError") for c in causes(e)):
            raise RunnerError(f"runner {short}: a worker died and the work could not be "
                              f"finished ({first_line(e)}); nothing was published, run the build again") from e
        lost = next((c for c in causes(e) if isinstance(c, grpc.RpcError) and callable(getattr(c, "code", None))
                     and c.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)), None)
        if lost is not None and not beam_text.read(e).step_raised:
            # Flink, Spark, any job service: its connection went away (the job server died).
            raise RunnerError(f"runner {short}: lost its job server while the job ran ({first_line(lost)}); "
                              "nothing was published, run the build again") from e
        if beam_text.read(e).worker_connection_ended:
            raise RunnerError(f"runner {short}: the job failed when an SDK worker's connection ended: a worker "
                              f"that died ({first_line(e)}); nothing was published, run the build again") from e
        if beam_text.read(e).workers_unreachable:
            raise RunnerError(f"runner {short}: the job failed as its SDK workers could not be reached: no worker "
                              "pool listening at --environment_config, or one that died "
                              f"({first_line(e)}); nothing was published, run the build again once the pool runs") from e
        raise
    finally:
        client = getattr(result, "client", None)  # DaskRunner: its client of the cluster
        if client is not None:
            with contextlib.suppress(Exception):  # closing is best effort
                client.close()
    state = str(getattr(result, "state", "DONE"))
    if "FAILED" in state or "CANCELLED" in state:
        raise RunnerError(f"runner {short} finished in state {state}")


def _wait(result, runner: str, heartbeats: str | None) -> None:
    """``result.wait_until_finish()``, bounded (``stall.wait``) on a runner
    that ``watches_stalls`` when the steps beat into ``heartbeats``."""
    if heartbeats is None or not watches_stalls(runner):
        result.wait_until_finish()
        return
    stall.wait(result, timeout_s=stall_timeout(), progress=lambda: stall.progress_of(heartbeats))


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (a gRPC error's code and details), at most 300 characters."""
    if callable(getattr(error, "details", None)) and callable(getattr(error, "code", None)):
        with contextlib.suppress(Exception):  # a gRPC error whose call never completed has neither
            return f"{error.code().name}: {error.details()}"[:300]
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0][:300]


def interrupted_in_step(error: BaseException) -> bool:
    """Whether ``error`` is a ``KeyboardInterrupt`` raised inside a step (Ctrl-C
    reaches the engine's threads and workers): Beam hands it back wrapped in
    another error, across processes as text only (``beam_text.read``)."""
    return beam_text.read(error).interrupted
