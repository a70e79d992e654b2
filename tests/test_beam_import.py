"""``seqcache.process.import_beam`` imports Beam without pandas (which Beam would
import only to register pandas batch types), without boto3 and without Beam's
IO connectors (``apache_beam.io``'s ``__init__``), and leaves pandas importable
and working afterwards, boto3 loaded on the first use of an s3:// file system
and ``beam.io``'s names on their first read; a pipeline still runs, and the
local engine's worker processes import Beam the same way. Each check in a
fresh interpreter."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r'''
import json, sys
from seqcache import process

beam = process.import_beam()
out = {"pandas_after_beam": "pandas" in sys.modules}
import pandas  # works as before
import pyarrow as pa
out["to_pandas"] = list(pa.table({"a": [1, 2, 3]}).to_pandas().shape)
with beam.Pipeline(runner="FnApiRunner") as p:
    _ = p | beam.Create([1, 2, 3]) | beam.Map(lambda x: x * 2) | beam.combiners.Count.Globally()
out["pandas_version"] = pandas.__version__
print(json.dumps(out))
'''

ALREADY = r'''
import json, sys
import pandas
from seqcache import process

process.import_beam()
import apache_beam.typehints as th
print(json.dumps({"pandas_types": hasattr(th, "pandas_type_compatibility")}))
'''


def _run(code):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_beam_is_imported_without_pandas_and_pandas_still_works():
    pytest.importorskip("pandas")
    out = _run(SCRIPT)
    assert out["pandas_after_beam"] is False
    assert out["to_pandas"] == [3, 1] and out["pandas_version"]


def test_pandas_imported_first_leaves_beams_import_alone():
    pytest.importorskip("pandas")
    assert _run(ALREADY) == {"pandas_types": True}


DEFERRED = r'''
import json, sys
from seqcache import process

beam = process.import_beam()
loaded = lambda *names: sorted(m for m in names if m in sys.modules)
out = {"with_beam": loaded("apache_beam.io.textio", "apache_beam.io.mongodbio", "apache_beam.io.parquetio",
                           "pymongo", "boto3", "botocore", "pandas")}
from apache_beam.io.filesystems import FileSystems
from apache_beam.io.aws.clients.s3 import boto3_client

out["s3"] = type(FileSystems.get_filesystem("s3://bucket/key")).__name__  # registered as before
out["s3_before_use"] = loaded("boto3")
out["session"] = boto3_client.boto3.session.Session.__module__  # what Beam's S3 client reads: boto3 loads
out["s3_after_use"] = loaded("boto3")
out["read_from_text"] = beam.io.ReadFromText.__module__  # a name of beam.io: its __init__ runs now
out["after_io"] = loaded("apache_beam.io.mongodbio", "pandas")
try:
    beam.io.no_such_name
except AttributeError:
    out["missing"] = "AttributeError"
print(json.dumps(out))
'''


def test_beam_io_connectors_and_boto3_load_on_first_use():
    pytest.importorskip("boto3")
    done = subprocess.run([sys.executable, "-c", DEFERRED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "apitools" not in done.stderr and "bigquery" not in done.stderr.lower(), done.stderr  # Beam's import warnings
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"with_beam": [], "s3": "S3FileSystem", "s3_before_use": [], "session": "boto3.session",
                   "s3_after_use": ["boto3"], "read_from_text": "apache_beam.io.textio",
                   "after_io": ["apache_beam.io.mongodbio"], "missing": "AttributeError"}


WORKERS = r'''
import json, sys
from seqcache import process
from seqcache.pipelines import runner

beam = process.import_beam()
options, name = runner.pipeline_options(["--direct_running_mode=multi_processing", "--direct_num_workers=2"])


def probe(i, folder):  # each element's row in a file of its own: no Beam IO connector in the pipeline
    import gc, os, sys
    row = [os.getpid(), "pandas" in sys.modules, sys.argv[0], os.environ.get("OPENBLAS_NUM_THREADS"),
           gc.get_freeze_count(), os.environ.get("SEQCACHE_ENCODING_THREADS"),
           sorted(m for m in ("boto3", "pymongo", "apache_beam.io.textio") if m in sys.modules)]
    with open(os.path.join(folder, f"{i}.json"), "w") as f:
        f.write(json.dumps(row))


with beam.Pipeline(runner=runner.local_engine(options), options=options) as p:
    _ = p | beam.Create(range(8)) | beam.Reshuffle() | beam.Map(probe, sys.argv[1])

'''


def test_local_engine_workers_import_beam_without_pandas(tmp_path):
    pytest.importorskip("pandas")
    out = tmp_path / "probe"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "SEQCACHE_ENCODING_THREADS")}
    done = subprocess.run([sys.executable, "-c", WORKERS, str(out)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(path.read_text()) for path in sorted(out.iterdir())]
    assert len(rows) == 8
    assert {row[1] for row in rows} == {False}  # pandas
    assert {tuple(row[6]) for row in rows} == {()}  # boto3, and Beam's IO connectors (pymongo, textio)
    assert all(row[2].endswith("worker_main.py") for row in rows), rows
    assert {row[3] for row in rows} == {"1"}  # one numpy BLAS thread, the driver's environment having none
    assert min(row[4] for row in rows) > 10_000  # Beam's modules frozen out of the cyclic collections
    assert {row[5] for row in rows} == {None}  # SentencePiece threads: each worker's own CPUs


CLI_PROCESS = r'''
import json, os, sys
import seqcache.cli.main
import numpy  # imported by the command line already
from seqcache import process
process.freeze_heap()  # not seqcache's own process yet: nothing frozen
import gc
before = gc.get_freeze_count()
process.own_process()
process.freeze_heap()
print(json.dumps([os.environ.get("OPENBLAS_NUM_THREADS"), before, gc.get_freeze_count()]))
'''


@pytest.mark.parametrize("given", [None, "3"])
def test_command_line_asks_for_one_blas_thread_unless_told_and_freezes_only_its_own_heap(given):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    done = subprocess.run([sys.executable, "-c", CLI_PROCESS], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    threads, before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert threads == (given or "1")
    assert before == 0 and after > 10_000


SETTLE_PROCESS = r'''
import gc, json
from seqcache import process
from seqcache.pipelines import transforms
process.own_process()
process.freeze_heap()
frozen = gc.get_freeze_count()
made = [[i] for i in range(50_000)]  # what a worker builds after its start (its steps, Beam's bundle processors)
transforms.settle_worker()
first = gc.get_freeze_count()
more = [[i] for i in range(1_000)]
transforms.settle_worker()  # once per process
print(json.dumps([frozen, first, gc.get_freeze_count()]))
'''


def test_a_worker_freezes_what_it_made_before_its_first_element_once():
    done = subprocess.run([sys.executable, "-c", SETTLE_PROCESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    frozen, first, again = json.loads(done.stdout.strip().splitlines()[-1])
    assert first >= frozen + 50_000 and again == first
