"""Dataflow's dry run: a build's job translated on this machine, never submitted.

Beam's DataflowRunner with ``--dry_run=True`` (an option of Beam's
``TestOptions``) does a submission's work here and stops before its first
request to Google Cloud: it applies Dataflow's transform overrides, gathers
what the workers get (``--extra_package``, ``--setup_file`` built into a
source archive, ``--requirements_file``, the container image), translates the
pipeline into the Runner API proto that Dataflow is sent (its staged
``pipeline.pb``) and makes the job's description. It stages no file, calls no
API and reads no credentials, so it runs offline; ``--temp_location`` and
``--staging_location`` must still be ``gs://`` URLs, checked and never
written (given anything else, Beam looks for a default bucket over the
network).

A build run so stops once the job is translated (``runner.run`` raises
``DryRun``): no step ran, so there is no summary and no shard; the build
removes the folders it made and leaves what was there before, a died
build's work included (``build_task``). ``DryRun`` carries the job: the
steps, what the workers get, and the protos.

Beam reads ``--dry_run`` as text: any value, ``False`` included, is a dry run
(``runner.check_runner_available`` refuses the values that look false, and
the flag with any runner but Dataflow, which would build the cache).
"""

from __future__ import annotations

from typing import Any

from seqcache import process

process.import_beam()  # before Beam's modules below: quietly, without pandas
from apache_beam.options import pipeline_options as po  # noqa: E402
from apache_beam.portability import common_urns  # noqa: E402
from apache_beam.portability.api import beam_runner_api_pb2  # noqa: E402

# Beam's runners that read --dry_run (lower-cased class names).
DATAFLOW_RUNNERS = frozenset({"dataflowrunner", "testdataflowrunner"})
# --dry_run values that read as "no" to a person, and as a dry run to Beam.
FALSE_LOOKING = frozenset({"false", "0", "no", "off", "none"})


def is_dataflow(runner: str) -> bool:
    """True for Beam's DataflowRunner (by its short or fully qualified name)."""
    return runner.rsplit(".", 1)[-1].lower() in DATAFLOW_RUNNERS


def dry_run_value(options) -> str | None:
    """The value of ``--dry_run`` in ``options`` (Beam ``PipelineOptions``, or
    None) as text, or None where it is unset or empty: Beam's DataflowRunner
    makes a dry run of any other value."""
    value = options.view_as(po.TestOptions).dry_run if options is not None else None
    return str(value) if value else None


def _top_steps(pipeline: beam_runner_api_pb2.Pipeline) -> tuple[str, ...]:
    """The names of the pipeline's top-level transforms, in order (the build's
    steps: ``ListWork`` ... ``WriteSummary``)."""
    transforms = pipeline.components.transforms
    ids = list(pipeline.root_transform_ids)
    if len(ids) == 1 and not transforms[ids[0]].spec.urn:  # one composite holding the whole pipeline
        ids = list(transforms[ids[0]].subtransforms)
    return tuple(transforms[i].unique_name for i in ids)


def _worker_files(pipeline: beam_runner_api_pb2.Pipeline) -> tuple[tuple[str, ...], dict[str, str]]:
    """``(container images, {staged name: local path})``: the images of the
    pipeline's Docker environments and the files Dataflow would stage for
    their workers (``--extra_package``'s packages, the ``--setup_file``
    archive ``workflow.tar.gz``, Beam's own lists)."""
    images, files = [], {}
    for environment in pipeline.components.environments.values():
        if environment.urn == common_urns.environments.DOCKER.urn:
            image = beam_runner_api_pb2.DockerPayload.FromString(environment.payload).container_image
            if image not in images:
                images.append(image)
        for artifact in environment.dependencies:
            if artifact.role_urn != common_urns.artifact_roles.STAGING_TO.urn:
                continue
            name = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(artifact.role_payload).staged_name
            path = (beam_runner_api_pb2.ArtifactFilePayload.FromString(artifact.type_payload).path
                    if artifact.type_urn == common_urns.artifact_types.FILE.urn else "")
            files[name] = path
    return tuple(images), files


class DryRun(RuntimeError):
    """A pipeline on Dataflow with ``--dry_run=True``: its job was translated
    and not submitted; nothing was staged, run or built (``build_task`` raises
    this where it would return a ``BuildResult``, and the folders the build
    made are gone). A ``RuntimeError``, so that a caller that words a runner's
    failure in one line (``seqcache overlap``) words this too.

    Attributes:
      job: Beam's ``apiclient.Job``: ``job.proto`` is the Dataflow ``Job``
        message (name, type), ``job.options`` the job's pipeline options.
      pipeline: the job graph, a Runner API ``Pipeline`` proto: what Dataflow
        would be sent (staged as ``pipeline.pb``), every step's pickled code in
        its ``ParDoPayload``.
      job_name: the job's name (Beam's ``beamapp-USER-...`` unless ``--job_name``).
      steps: the names of the pipeline's top-level steps, in order.
      container_images: the workers' SDK container images.
      staged_files: ``{name: local path}`` of every file Dataflow would stage
        for the workers under ``staging_location``: the packages of
        ``--extra_package``, ``workflow.tar.gz`` (the source archive Beam
        builds from ``--setup_file``), Beam's own lists.
      staging_location: where a submission would stage them (a ``gs://`` URL).
    """

    def __init__(self, job: Any):
        self.job = job
        self.pipeline = job.proto_pipeline
        self.job_name = job.proto.name
        self.steps = _top_steps(self.pipeline)
        self.container_images, self.staged_files = _worker_files(self.pipeline)
        self.staging_location = job.options.view_as(po.GoogleCloudOptions).staging_location
        super().__init__(
            f"Dataflow dry run: job {self.job_name} translated, not submitted ({len(self.steps)} steps: "
            f"{', '.join(self.steps)}; workers run {', '.join(self.container_images) or 'no container image'} "
            f"with {', '.join(self.staged_files) or 'no staged file'}); nothing was staged, run or built")

    def to_json(self) -> dict:
        """The dry run as ``seqcache build --json`` prints it (names and URLs only)."""
        return {"job_name": self.job_name, "steps": list(self.steps), "container_images": list(self.container_images),
                "staged_files": sorted(self.staged_files), "staging_location": self.staging_location}
