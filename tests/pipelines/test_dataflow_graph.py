"""Dataflow's job graph of a real build, translated and never submitted: Beam's
DataflowRunner with ``--dry_run=True`` (docs/scaling.md, "Dataflow";
``seqcache.pipelines.dataflow``).

The task is every line of tinyshakespeare with the byte vocabulary. What is
checked, on this machine and without Google Cloud:

- the job graph: the build's nine steps in order (``ListWork`` ...
  ``WriteSummary``), the steps that run code as ParDos and the three
  GroupByKeys as the runner's own, a batch job, no folder left behind;
- what the workers get, each way docs/scaling.md names: the wheel that
  ``pip wheel`` builds (``--extra_package``), the source archive Beam builds
  from ``--setup_file=pyproject.toml``, or a container image of one's own
  (``--sdk_container_image``), Dataflow's image of this Python and Beam
  version otherwise;
- what the workers must import: the modules that the steps' pickled code
  names (read with an unpickler that records them) are seqcache's, Beam's,
  the standard library's or seqcache's declared dependencies', and every
  seqcache module among them is in the wheel or the archive staged for them;
- the docs' command line through ``seqcache build`` (a task module given by
  path, the recipe's flags): exit status 0, the job described (``--json``, or
  one line), nothing built, and a cache already there left byte for byte, as
  the shards and work folder of the same build that died.

Beam's Dataflow runner needs Google's client libraries (Beam's GCP extras,
``seqcache[gcs]``). In the test venv they would be imported by every process
that imports Beam, so ``make gcp`` installs them into ``build/gcp``, beside
the venv (runners/dataflow/requirements.txt), and one child process, with that
folder on its ``PYTHONPATH``, translates every job here (``translated``);
the tests read what it wrote. An interpreter that has them itself (a venv with
``seqcache[gcs]``) needs no folder. Without them the tests that need them are
skipped, or, with ``CI`` set, fail.

The child and every process it starts (Beam's ``pip freeze`` and ``python -m
build``) refuse and record any connection and any name lookup
(``sitecustomize``): none may happen. ``--temp_location`` and
``--staging_location`` are ``gs://`` URLs Beam checks and never reaches.

Not checked here, since each needs Google Cloud: staging the files and the
graph under ``--staging_location`` and creating the job (Dataflow's API,
credentials); a cache folder or corpus on ``gs://`` (the build reads and writes
there before the job is translated); the workers installing the package and
running the steps.
"""

from __future__ import annotations

import base64
import bz2
import dataclasses
import importlib.metadata
import importlib.util
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile

import apache_beam as beam
import pytest
from apache_beam.portability import common_urns, python_urns
from apache_beam.portability.api import beam_runner_api_pb2
from click.testing import CliRunner

from seqcache.cli.main import main
from seqcache.pipelines import BuildError, build_task
from testsupport import lines_task

TESTS = pathlib.Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
GCP_SITE = ROOT / "build" / "gcp"  # make gcp
BUCKET = "gs://seqcache-dry-run"  # checked for its form, never reached
DATAFLOW = ["--runner=DataflowRunner", "--project=my-project", "--region=us-central1",
            f"--temp_location={BUCKET}/tmp", f"--staging_location={BUCKET}/staging"]
STEPS = ("ListWork", "SpreadWork", "ReadPreprocess", "GroupByShard", "SpreadCopies", "GroupWithCopies",
         "SortPackWrite", "GatherResults", "WriteSummary")
GROUPS = ("GroupByShard", "GroupWithCopies", "GatherResults")
OWN_IMAGE = "us-central1-docker.pkg.dev/my-project/images/seqcache:0.2.0"
# The modules that unpickling the reading step imports: the steps, the task and its source and vocabulary.
READ_MODULES = {"seqcache.pipelines.transforms", "seqcache.tasks.task", "seqcache.tasks.sources.text_lines",
                "seqcache.tasks.vocabularies"}
WAYS = ("extra_package", "setup_file", "sdk_container_image")
RECIPE_LINES = 400
MY_TASKS = """
from seqcache import tasks

def lower(example, ctx):  # defined here: it travels to the workers by value
    return dict(example, text=example["text"].lower())

tasks.TaskRegistry.add(
    "my_dataflow_task", source=tasks.TextLineSource({corpus!r}, on_error={{"empty": "skip"}}),
    output_features={{"targets": tasks.Feature(tasks.ByteVocabulary())}},
    preprocessors=[tasks.FunctionPreprocessor(lower, name="lower"),
                   tasks.preprocessors.rekey({{"targets": "text"}}), tasks.preprocessors.tokenize()])
"""

# Loaded first by the child and every Python process it starts: each connection
# and name lookup is refused and its arguments appended to $SEQCACHE_TEST_CONNECTIONS.
GUARD = textwrap.dedent("""
    import os, socket

    def _refuse(*args, **kwargs):
        with open(os.environ["SEQCACHE_TEST_CONNECTIONS"], "a") as log:
            log.write(repr(args[1:] if args and isinstance(args[0], socket.socket) else args) + "\\n")
        raise OSError("this process opens no connection")

    socket.socket.connect = socket.socket.connect_ex = _refuse
    socket.getaddrinfo = socket.create_connection = _refuse
""")

# The child: runs each case of the plan (argv: the tests' folder, the plan) and
# writes its result.json (and a dry run's job graph, pipeline.pb) into its folder.
# A "task" case is build_task on lines_task(corpus); a "cli" case is `seqcache
# build` (click's test runner) in its working folder.
TRANSLATE = textwrap.dedent("""
    import json, os, pathlib, socket, sys
    tests, plan = sys.argv[1:]
    sys.path.insert(0, tests)
    assert socket.getaddrinfo.__module__ == "sitecustomize", "the connection guard is not loaded"
    from click.testing import CliRunner
    from seqcache.cli.main import main
    from seqcache.pipelines import BuildConfig, build_task
    from seqcache.pipelines.dataflow import DryRun
    from testsupport import lines_task

    for case in json.loads(pathlib.Path(plan).read_text()):
        out = pathlib.Path(case["out"])
        out.mkdir(parents=True)
        if case["kind"] == "cli":
            os.chdir(case["cwd"])
            done = CliRunner().invoke(main, case["argv"])
            result = {"exit_code": done.exit_code, "stdout": done.stdout, "stderr": done.stderr}
        else:
            try:
                build_task(lines_task(case["corpus"]), cache_dir=case["cache_dir"], config=BuildConfig(seed=7),
                           pipeline_args=case["args"])
                result = {"raised": None}
            except DryRun as dry:
                (out / "pipeline.pb").write_bytes(dry.pipeline.SerializeToString())
                result = {"raised": "DryRun", "message": str(dry), "job_type": dry.job.proto.type_.name,
                          "staged_paths": dry.staged_files, **dry.to_json()}
        (out / "result.json").write_text(json.dumps(result))
""")


def _under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes", "on")


def _require(missing: str | None) -> None:
    """Skips the test when ``missing`` says what is missing, or fails it under CI."""
    if missing:
        if _under_ci():
            pytest.fail(missing + " (CI is set: it is required)", pytrace=False)
        pytest.skip(missing)


def _has_module(name: str) -> bool:
    """Whether this interpreter can import ``name`` (a package, not a folder of that name)."""
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        return False
    return spec is not None and spec.origin is not None


def _dataflow_site() -> str:
    """What the child's PYTHONPATH gains to run Beam's Dataflow runner: ``build/gcp``
    (``make gcp``), or nothing where this interpreter has Beam's GCP extras."""
    if (GCP_SITE / ".installed").exists():
        return str(GCP_SITE)
    if _has_module("google.cloud.dataflow_v1beta3") and _has_module("google.auth"):
        return ""
    _require(f"Beam's Dataflow runner needs its GCP extras: run `make gcp` (into {GCP_SITE}), "
             "or pip install 'seqcache[gcs]'")
    return ""


def _package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir: module prefix -> source folder."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of what building the package reads (pyproject.toml, README.md and the
    package's folders): setuptools writes its build files beside the sources."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, copy / name)
    for folder in {d.split("/")[0] for d in _package_dirs().values()}:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return copy


@pytest.fixture(scope="module")
def wheel(checkout, tmp_path_factory) -> pathlib.Path:
    """seqcache's wheel, as docs/scaling.md has it built (``pip wheel --no-deps -w
    dist .``), here with no package index and the build tools installed here."""
    dist = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--disable-pip-version-check", "-q", "-w", str(dist), str(checkout)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (found,) = dist.glob("seqcache-*.whl")
    return found


@dataclasses.dataclass
class Translated:
    """What the child wrote: ``result(case)`` (its result.json), ``pipeline(case)``
    (the job graph of a dry run); ``connections``: the attempts it and the
    processes it started made, each refused (one line each); ``recipe``: the docs
    recipe's working folder; ``before``: the files of its ``caches/`` and
    ``died/`` before the dry runs over them (``_files``); ``setup_file_missing``:
    why ``--setup_file`` could not be tried, or None."""
    root: pathlib.Path
    connections: list[str]
    recipe: pathlib.Path
    before: dict
    setup_file_missing: str | None

    def result(self, case: str) -> dict:
        return json.loads((self.root / case / "result.json").read_text())

    def pipeline(self, case: str) -> beam_runner_api_pb2.Pipeline:
        return beam_runner_api_pb2.Pipeline.FromString((self.root / case / "pipeline.pb").read_bytes())


def _files(folder: pathlib.Path) -> dict:
    """Relative path -> bytes of every file under ``folder``."""
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _recipe_cases(root: pathlib.Path, corpora, wheel) -> list:
    """The docs recipe's three runs in ``root/recipe``, where ``my_tasks.py`` and
    its corpus are written: with ``--json`` into ``fresh/`` (no cache); over the
    cache in ``caches/`` (``--overwrite``, another seed); over the folder of the
    same build that died in ``died/`` (2 shards, the second one's writing
    raised: its work folder and first shard are kept for a rerun). The cache
    and the died build are made here, on Beam's local engine."""
    recipe = root / "recipe"
    recipe.mkdir()
    corpus = recipe / "corpus.txt"
    corpus.write_text("\n".join(corpora.shakespeare_lines(RECIPE_LINES)) + "\n", encoding="utf-8")
    (recipe / "my_tasks.py").write_text(MY_TASKS.format(corpus=str(corpus)), encoding="utf-8")
    task = ["build", "my_dataflow_task", "--module", "./my_tasks.py"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(recipe)
        built = CliRunner().invoke(main, [*task, "--cache-dir", str(recipe / "caches")])
        assert built.exit_code == 0, built.output
        mp.setenv("SEQCACHE_FAULT", "write:shard:2:raise")
        died = CliRunner().invoke(main, [*task, "--cache-dir", str(recipe / "died"), "--num-shards=2"])
        assert died.exit_code == 1 and "fault injected at write:shard #2" in died.output, died.output
    recipe_args = [*task, *DATAFLOW, f"--extra_package={wheel}", "--num_workers=1000", "--max_num_workers=1000",
                   "--autoscaling_algorithm=NONE", "--machine_type=n2-standard-4", "--job_name=seqcache-dry-run",
                   "--dry_run=True"]
    runs = {"recipe_json": ["--cache-dir", str(recipe / "fresh"), "--json"],
            "recipe_over_a_cache": ["--cache-dir", str(recipe / "caches"), "--overwrite", "--seed=3"],
            "recipe_over_a_died_build": ["--cache-dir", str(recipe / "died"), "--num-shards=2"]}
    return [{"kind": "cli", "out": str(root / name), "cwd": str(recipe), "argv": [*recipe_args, *args]}
            for name, args in runs.items()]


@pytest.fixture(scope="module")
def dataflow_site() -> str:
    """``_dataflow_site()``, before anything is built for the dry runs."""
    return _dataflow_site()


@pytest.fixture(scope="module")
def translated(dataflow_site, tmp_path_factory, corpora, checkout, wheel) -> Translated:
    """Every dry run of this module, in one child process with Beam's Dataflow
    runner (``TRANSLATE``), its connections refused (``GUARD``)."""
    site = dataflow_site
    root = tmp_path_factory.mktemp("dataflow")
    setup_file_missing = None if (site and (pathlib.Path(site) / "build" / "__init__.py").exists()) or \
        _has_module("build") else "--setup_file=pyproject.toml needs the build package (pip install build)"
    ways = {"extra_package": [f"--extra_package={wheel}"],
            "setup_file": [f"--setup_file={checkout / 'pyproject.toml'}"],
            "sdk_container_image": [f"--sdk_container_image={OWN_IMAGE}"]}
    # Beam's `pip freeze` of this environment, staged for the workers' logs, is left out here: half a dry run's time.
    cases = [{"kind": "task", "out": str(root / how), "corpus": str(corpora.shakespeare),
              "cache_dir": str(root / how / "caches"),
              "args": [*DATAFLOW, *args, "--experiments=disable_logging_submission_environment", "--dry_run=True"]}
             for how, args in ways.items() if not (how == "setup_file" and setup_file_missing)]
    cases += _recipe_cases(root, corpora, wheel)
    recipe = root / "recipe"
    before = {name: _files(recipe / name) for name in ("caches", "died")}
    (root / "guard").mkdir()
    (root / "guard" / "sitecustomize.py").write_text(GUARD, encoding="utf-8")
    (root / "tmp").mkdir()
    (root / "plan.json").write_text(json.dumps(cases), encoding="utf-8")
    log = root / "connections.log"
    env = dict(os.environ, SEQCACHE_TEST_CONNECTIONS=str(log), TMPDIR=str(root / "tmp"),
               PYTHONPATH=os.pathsep.join(p for p in (str(root / "guard"), site, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", TRANSLATE, str(TESTS), str(root / "plan.json")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-5000:]
    connections = log.read_text().splitlines() if log.exists() else []
    return Translated(root, connections, recipe, before, setup_file_missing)


def _step_modules(pipeline) -> dict[str, set[str]]:
    """Step name -> the modules that unpickling its code imports (each global the
    pickle names), for every ParDo of the job graph. Beam stores a step's code
    as base64 of its bz2-compressed cloudpickle."""

    class Names(pickle.Unpickler):
        def find_class(self, module, name):
            self.modules.add(module)
            return super().find_class(module, name)

    out = {}
    for transform in pipeline.components.transforms.values():
        if transform.spec.urn != common_urns.primitives.PAR_DO.urn:
            continue
        do_fn = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload).do_fn
        assert do_fn.urn == python_urns.PICKLED_DOFN_INFO, transform.unique_name
        names = Names(io.BytesIO(bz2.decompress(base64.b64decode(do_fn.payload))))
        names.modules = set()
        names.load()
        out[transform.unique_name] = names.modules
    return out


def _required_imports() -> set[str]:
    """The top-level import names of the distributions the installed seqcache
    requires (not those of an extra): what pip installs on a worker with it."""
    required = {re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0].lower().replace("_", "-")
                for r in importlib.metadata.requires("seqcache") or () if "extra ==" not in r}
    return {top for top, dists in importlib.metadata.packages_distributions().items()
            if {d.lower().replace("_", "-") for d in dists} & required}


def _source_file(module: str, names: set[str], layout) -> bool:
    """Whether ``names`` (an archive's file names) hold ``module``'s source file, where
    ``layout(module, suffix)`` places it (``suffix``: ``.py``, or ``/__init__.py`` for a package)."""
    return any(layout(module, suffix) in names for suffix in (".py", "/__init__.py"))


def _in_wheel(module: str, suffix: str) -> str:
    """Where a module's file lies in a wheel: under its dotted name."""
    return module.replace(".", "/") + suffix


def _in_sdist(top: str):
    """Where a module's source lies in the source archive: under pyproject.toml's package-dir."""
    dirs = _package_dirs()

    def layout(module: str, suffix: str) -> str:
        prefix = max((p for p in dirs if module == p or module.startswith(p + ".")), key=len)
        rest = module[len(prefix):].lstrip(".").replace(".", "/")
        return "/".join(part for part in (top, dirs[prefix], rest) if part) + suffix

    return layout


def _staged_names(result: dict, wheel: pathlib.Path, how: str) -> tuple[set, object]:
    """(file names, layout) of the seqcache package a dry run stages: the wheel, or
    the source archive Beam built from pyproject.toml."""
    if how == "extra_package":
        with zipfile.ZipFile(wheel) as archive:
            return set(archive.namelist()), _in_wheel
    with tarfile.open(result["staged_paths"]["workflow.tar.gz"]) as archive:
        names = set(archive.getnames())
        (top,) = {n.split("/")[0] for n in names}
        assert re.search(r"^Name: seqcache$", archive.extractfile(f"{top}/PKG-INFO").read().decode(), re.M)
    return names, _in_sdist(top)


@pytest.mark.parametrize("how", WAYS)
def test_the_job_graph_has_the_build_steps_and_the_workers_get_seqcache(how, translated, wheel):
    if how == "setup_file":
        _require(translated.setup_file_missing)
    result, pipeline = translated.result(how), translated.pipeline(how)
    assert result["raised"] == "DryRun"
    assert not (translated.root / how / "caches").exists()  # the folders the build made are removed
    assert result["steps"] == list(STEPS)
    transforms = {t.unique_name: t for t in pipeline.components.transforms.values()}
    assert {name for name in STEPS if transforms[name].spec.urn == common_urns.primitives.GROUP_BY_KEY.urn} \
        == set(GROUPS)
    assert all(transforms[name].spec.urn == common_urns.primitives.PAR_DO.urn
               for name in ("ReadPreprocess", "SpreadCopies", "SortPackWrite", "WriteSummary"))
    assert result["job_type"] == "JOB_TYPE_BATCH"
    assert result["staging_location"].startswith(f"{BUCKET}/staging/{result['job_name']}.")
    assert result["message"].startswith(f"Dataflow dry run: job {result['job_name']} translated, not submitted "
                                        f"(9 steps: {', '.join(STEPS)}; workers run ")

    modules = _step_modules(pipeline)
    assert READ_MODULES <= modules["ReadPreprocess"]
    assert all("seqcache.pipelines.transforms" in modules[name]
               for name in ("SpreadCopies", "SortPackWrite", "WriteSummary"))
    named = set().union(*modules.values())
    elsewhere = {m.split(".")[0] for m in named} - {"seqcache", "apache_beam"} - set(sys.stdlib_module_names)
    assert elsewhere <= _required_imports(), f"the steps name modules a worker does not get: {elsewhere}"

    (image,) = result["container_images"]
    packages = {name for name in result["staged_files"] if name.endswith((".whl", ".tar.gz"))}
    if how == "sdk_container_image":
        assert image == OWN_IMAGE and packages == set()  # seqcache comes with the image
        return
    assert f"python{sys.version_info.major}.{sys.version_info.minor}_sdk:{beam.__version__}" in image
    if how == "extra_package":
        assert packages == {wheel.name} and result["staged_paths"][wheel.name] == str(wheel)
    else:
        assert packages == {"workflow.tar.gz"}  # the source archive Beam builds from pyproject.toml
    names, layout = _staged_names(result, wheel, how)
    ours = {m for m in named if m.split(".")[0] == "seqcache"}
    missing = sorted(m for m in ours if not _source_file(m, names, layout))
    assert not missing, f"modules the steps name that the staged package lacks: {missing}"


def test_the_docs_recipe_prints_the_job_as_json_and_builds_nothing(translated, wheel):
    """docs/scaling.md's command line (local paths for the corpus and the caches,
    ``--job_name``, ``--dry_run=True``, ``--json``): exit status 0, the job, no folder."""
    result = translated.result("recipe_json")
    assert result["exit_code"] == 0, result["stderr"]
    (dry,) = json.loads(result["stdout"])
    assert dry["dry_run"] is True and dry["task"] == "my_dataflow_task" and dry["split"] == "train"
    assert dry["cache_dir"] == str(translated.recipe / "fresh" / "my_dataflow_task" / "train")
    assert dry["job_name"] == "seqcache-dry-run" and dry["steps"] == list(STEPS)
    assert wheel.name in dry["staged_files"] and "workflow.tar.gz" not in dry["staged_files"]
    assert "submission_environment_dependencies.txt" in dry["staged_files"]  # Beam's pip freeze, offline
    assert dry["staging_location"].startswith(f"{BUCKET}/staging/seqcache-dry-run.")
    assert not (translated.recipe / "fresh").exists()


def test_the_docs_recipe_over_a_cache_says_so_in_one_line_and_leaves_the_cache_as_it_was(translated, wheel):
    """The same over a cache built before (``--overwrite``, another seed): one line
    saying nothing was built, and the cache byte for byte, with no staging folder
    or lock file beside it."""
    result = translated.result("recipe_over_a_cache")
    assert result["exit_code"] == 0, result["stderr"]
    assert result["stdout"] == ""
    line, = result["stderr"].splitlines()
    assert line.startswith("my_dataflow_task/train: nothing built (Dataflow dry run: job seqcache-dry-run "
                           f"translated, not submitted (9 steps: {', '.join(STEPS)}; workers run "), line
    assert wheel.name in line and line.endswith("); nothing was staged, run or built)")
    caches = translated.recipe / "caches"
    assert _files(caches) == translated.before["caches"]
    assert sorted(p.name for p in (caches / "my_dataflow_task").iterdir()) == ["train"]


def test_the_docs_recipe_over_a_build_that_died_leaves_its_work_for_the_rerun(translated):
    """The same over the folder of this very build, which died with its work
    folder and first shard kept (``--work auto``): every file stays as it was."""
    result = translated.result("recipe_over_a_died_build")
    assert result["exit_code"] == 0, result["stderr"]
    assert result["stderr"].startswith("my_dataflow_task/train: nothing built (Dataflow dry run: "), result["stderr"]
    before = translated.before["died"]
    assert pathlib.Path("my_dataflow_task/train/_tmp/shards/0000000.json") in before  # shard 0 written, marked
    assert any(path.parts[1:3] == (".train.work", "units") for path in before)  # its work folder's units
    assert _files(translated.recipe / "died") == before


def test_no_dry_run_opened_a_connection(translated):
    assert translated.connections == []


@pytest.mark.parametrize(("runner", "value", "says"), [
    ("direct", "True", "--dry_run=True: only DataflowRunner makes a dry run; runner FnApiRunner would build the cache"),
    ("DataflowRunner", "False", "--dry_run=False: Beam's DataflowRunner makes a dry run of any value of --dry_run"),
])
def test_a_dry_run_that_would_not_do_what_it_says_is_refused_before_anything_is_written(
        runner, value, says, corpora, tmp_path):
    """Only Dataflow reads ``--dry_run``, and it reads any value as a dry run:
    either mistake would build a cache, or leave unbuilt one that was meant to be."""
    with pytest.raises(BuildError, match=re.escape(says)):
        build_task(lines_task(str(corpora.shakespeare)), cache_dir=str(tmp_path / "caches"),
                   pipeline_args=[f"--runner={runner}", f"--dry_run={value}"])
    assert not (tmp_path / "caches").exists()
