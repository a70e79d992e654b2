"""Every name of Beam's that is not its public API, in the one module that uses them.

The rest of the package uses Beam's public API only: the ``apache_beam``
package's ``Pipeline`` and transforms, ``apache_beam.io``'s file systems, the
pipeline options (``apache_beam.options``), the runner classes ``--runner``
names, and the portability API: the protos of ``apache_beam.portability.api``
and the standard URNs of ``apache_beam.portability.common_urns``. Those are
public although Beam's user guide does not list them: they are generated from
Beam's model protos (its Runner, Fn and job APIs, versioned ``v1``), the
language-neutral contract every SDK and runner speaks (Prism in Go, the Java
job servers, the SDK harness in its container), and Beam documents the
EXTERNAL environment and its worker pool that this module serves with them.

Private, and used here alone: a name of Beam's starting with ``_``, and the
modules Beam keeps for its own machinery: ``apache_beam.internal``,
``apache_beam.runners.portability.fn_api_runner``, ``apache_beam.runners.worker``,
the portable runner's job-service handle, ``apache_beam.runners.runner``'s
runner lookup, and the Python SDK's own URNs (``apache_beam.portability.python_urns``,
which are not part of the model protos). tests/test_beam_internals.py fails on
such a name used anywhere else in the package, and unless the list below is
exactly the names this module uses. They were read against the Beam release
constraints.txt pins (2.77.0); the tests of the local engine (tests/pipelines/
test_runners*.py, tests/test_cli_beam_workers.py, tests/test_beam_import.py)
run every one of them.

The private names used here (each name, why, what breaks if Beam changes it):

- ``apache_beam.runners.portability.fn_api_runner.fn_runner.FnApiRunner``:
  the local engine, the default runner. Beam's DirectRunner would reach it only
  after trying to download and start Prism; named directly, a build needs no
  network and honours ``--direct_running_mode``. ``LocalEngine`` subclasses it,
  calls ``__init__()`` without arguments, and overrides
  ``run_via_runner_api(pipeline_proto, options)``, which FnApiRunner's
  ``run_pipeline`` calls with the pipeline's proto before running it. Moved or
  renamed: importing seqcache.pipelines.runner fails, and with it every
  build; that method no longer called, or with other arguments: the
  multi_processing workers become Beam's own (started by Beam, importing
  pandas, none started ahead: same bytes, slower) or every build on the local
  engine fails.
- ``apache_beam.portability.python_urns.SUBPROCESS_SDK``: the URN of the
  environment FnApiRunner gives the steps in multi_processing mode, found
  here and replaced by an EXTERNAL environment served by seqcache's worker
  pool. Changed: the environment is no longer found, and the workers become
  Beam's own, as above.
- ``apache_beam.runners.worker.sdk_worker_main``: the command FnApiRunner
  writes into that environment (``python -m apache_beam.runners.worker.sdk_worker_main``,
  matched to tell the local workers' environment from any other). Changed:
  as above.
- ``apache_beam.runners.worker.sdk_worker_main.main``: Beam's SDK harness,
  which each of seqcache's worker processes runs (``run_sdk_worker``, from
  worker_main.py) once the pool has handed it the harness's environment
  (control and logging endpoints, options, worker id). Moved or changed: the
  worker processes fail, and so does every build with ``--workers`` above 1.
- ``apache_beam.runners.portability.portable_runner.JobServiceHandle.encode_pipeline_options``:
  encodes the options into the workers' ``PIPELINE_OPTIONS`` as Beam's own
  runners do (a Struct of ``beam:option:NAME:v1`` keys, which the harness
  reads back). Moved or changed: every build on the local engine fails as it
  starts, or the workers lose the object-store options and the harness's log
  level.
- ``apache_beam.runners.runner.create_runner``: how Beam turns a ``--runner``
  name into a runner (``Pipeline`` calls it); ``runner.check_runner_available``
  calls it to refuse an unknown runner, or one whose packages are missing,
  before anything is written. Moved: importing this module fails; its error
  for an unknown name changed (a ``ValueError`` saying "Unexpected pipeline
  runner", which ``runner`` reads): the one line says the runner "is not
  available" instead of "is unknown".
- ``apache_beam.internal.cloudpickle.cloudpickle.register_pickle_by_value``:
  Beam's pickler (the cloudpickle Beam vendors) is told to send the functions
  of a task module loaded from a file (``--module my_tasks.py``) by value,
  since worker processes cannot import it by name
  (``register_pickle_by_value``). Moved: importing this module fails; gone:
  such a build fails in its workers (the module is not found there).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from concurrent import futures

import grpc
from google.protobuf import json_format, text_format

from seqcache import process
from seqcache.pipelines import workers

process.import_beam()  # before Beam's modules below: quietly, without pandas
from apache_beam.internal.cloudpickle import cloudpickle as beam_cloudpickle  # noqa: E402
from apache_beam.options import pipeline_options as po  # noqa: E402
from apache_beam.portability import common_urns, python_urns  # noqa: E402
from apache_beam.portability.api import beam_fn_api_pb2, beam_fn_api_pb2_grpc  # noqa: E402
from apache_beam.portability.api import beam_runner_api_pb2, endpoints_pb2  # noqa: E402
from apache_beam.runners import runner as beam_runner  # noqa: E402
from apache_beam.runners.portability.fn_api_runner import fn_runner  # noqa: E402
from apache_beam.runners.portability.portable_runner import JobServiceHandle  # noqa: E402
from apache_beam.runners.worker import sdk_worker_main  # noqa: E402


def create_runner(name: str):
    """Beam's runner for ``name`` (``apache_beam.runners.runner.create_runner``):
    raises ``ValueError`` for a name Beam does not know, ``ImportError`` or
    ``AttributeError`` for one it cannot load."""
    return beam_runner.create_runner(name)


def register_pickle_by_value(module) -> None:
    """Beam's pickler sends the functions of ``module`` by value, not by name."""
    beam_cloudpickle.register_pickle_by_value(module)


def run_sdk_worker(argv) -> None:
    """Beam's SDK harness (``sdk_worker_main.main``) with ``argv``, in this
    process, until its runner closes the control channel; it reads its
    endpoints, options and id from the environment."""
    sdk_worker_main.main(argv)


# The worker command of Beam's local engine in multi_processing mode.
_BEAM_WORKER_MAIN = "-m apache_beam.runners.worker.sdk_worker_main"

# The local engine's workers' log entries are logged under Beam's name, so that
# the build shows them as it shows Beam's own logs (with -v only).
_WORKER_LOG = logging.getLogger("apache_beam.runners.worker.logs")
_SEVERITY = beam_fn_api_pb2.LogEntry.Severity
_LOG_LEVELS = {_SEVERITY.TRACE: logging.DEBUG, _SEVERITY.DEBUG: logging.DEBUG, _SEVERITY.INFO: logging.INFO,
               _SEVERITY.NOTICE: logging.INFO, _SEVERITY.WARN: logging.WARNING, _SEVERITY.ERROR: logging.ERROR,
               _SEVERITY.CRITICAL: logging.CRITICAL}


class _WorkerPool(beam_fn_api_pb2_grpc.BeamFnExternalWorkerPoolServicer, beam_fn_api_pb2_grpc.BeamFnLoggingServicer):
    """Beam's worker-pool and logging services for the local engine's workers:
    each ``StartWorker`` request becomes the SDK harness's environment, handed
    to a worker process (``workers.hand_out``), whose log entries come back
    here (``Logging``)."""

    def __init__(self, pipeline_options_json: str, logging_endpoint: str):
        self._options = pipeline_options_json
        self._logging = endpoints_pb2.ApiServiceDescriptor(url=logging_endpoint)
        self.processes = []  # the worker processes handed out

    def StartWorker(self, request, context):  # noqa: N802  (the service's method name)
        # The runner names the control endpoint by this host's name; the worker is local.
        control = endpoints_pb2.ApiServiceDescriptor(url="localhost:" + request.control_endpoint.url.rsplit(":", 1)[1])
        environment = {"CONTROL_API_SERVICE_DESCRIPTOR": text_format.MessageToString(control),
                       "LOGGING_API_SERVICE_DESCRIPTOR": text_format.MessageToString(self._logging),
                       "PIPELINE_OPTIONS": self._options, "WORKER_ID": request.worker_id}
        try:
            self.processes.append(workers.hand_out(environment))
        except OSError as e:
            return beam_fn_api_pb2.StartWorkerResponse(error=f"cannot start a worker process: {e}")
        return beam_fn_api_pb2.StartWorkerResponse()

    def StopWorker(self, request, context):  # noqa: N802  (a worker leaves when its control channel closes)
        return beam_fn_api_pb2.StopWorkerResponse()

    def Logging(self, request_iterator, context):  # noqa: N802  (one stream per worker, until it exits)
        for entries in request_iterator:
            for entry in entries.log_entries:
                _WORKER_LOG.log(_LOG_LEVELS.get(entry.severity, logging.INFO), "worker: %s (%s)", entry.message,
                                entry.log_location)
        return iter([])


class LocalEngine(fn_runner.FnApiRunner):
    """Beam's local engine (``FnApiRunner``) whose multi_processing workers are
    seqcache's (``seqcache.pipelines.workers``): their environment becomes an
    EXTERNAL one, served by a ``_WorkerPool`` on localhost while the pipeline
    runs; any other environment is left as Beam made it. ``options``: the
    pipeline's options, which the workers get."""

    def __init__(self, options):
        super().__init__()
        # The workers' PIPELINE_OPTIONS, encoded as Beam's DirectRunner encodes them.
        encoded = JobServiceHandle.encode_pipeline_options(options.get_all_options())
        self._options_json = json_format.MessageToJson(encoded)

    def run_via_runner_api(self, pipeline_proto, options):
        """Runs ``pipeline_proto`` as FnApiRunner does, its multi_processing
        workers served by seqcache's pool (the method FnApiRunner's
        ``run_pipeline`` calls)."""
        beam_command = f"{sys.executable} {_BEAM_WORKER_MAIN}".encode()
        local = [env for env in pipeline_proto.components.environments.values()
                 if env.urn == python_urns.SUBPROCESS_SDK and env.payload == beam_command]
        if not local:
            return super().run_via_runner_api(pipeline_proto, options)
        # A thread per worker's log stream, and some for its requests (threads start as
        # needed: an unset count, 1 worker, is sized as 0, every CPU, at no cost).
        num_workers = options.view_as(po.DirectOptions).direct_num_workers or multiprocessing.cpu_count()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=num_workers + 4))
        # localhost, as Beam names its own endpoints (which a no_proxy setting names too).
        port = server.add_insecure_port("localhost:0")
        servicer = _WorkerPool(self._options_json, f"localhost:{port}")
        beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(servicer, server)
        beam_fn_api_pb2_grpc.add_BeamFnLoggingServicer_to_server(servicer, server)
        server.start()
        pool = beam_runner_api_pb2.ExternalPayload(endpoint=endpoints_pb2.ApiServiceDescriptor(url=f"localhost:{port}"))
        for env in local:
            env.urn, env.payload = common_urns.environments.EXTERNAL.urn, pool.SerializeToString()
        ended = False
        try:
            result = super().run_via_runner_api(pipeline_proto, options)
            ended = True
            return result
        finally:  # interrupted or failed: its workers are killed at once
            server.stop(None)
            workers.stop_waiting()
            workers.reap(servicer.processes, kill=not ended)
