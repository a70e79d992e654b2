"""``seqcache.process.import_beam`` imports Beam without pandas (which Beam would
import only to register pandas batch types) and leaves pandas importable and
working afterwards; a pipeline still runs, and the local engine's worker
processes import Beam the same way. Each check in a fresh interpreter."""

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


WORKERS = r'''
import json, sys
from seqcache import process
from seqcache.pipelines import runner

beam = process.import_beam()
options, name = runner.pipeline_options(["--direct_running_mode=multi_processing", "--direct_num_workers=2"])


def probe(_):
    import gc, os, sys
    return json.dumps([os.getpid(), "pandas" in sys.modules, sys.argv[0], os.environ.get("OPENBLAS_NUM_THREADS"),
                       gc.get_freeze_count(), os.environ.get("SEQCACHE_ENCODING_THREADS")])


with beam.Pipeline(runner=runner.local_engine(options), options=options) as p:
    _ = (p | beam.Create(range(8)) | beam.Reshuffle() | beam.Map(probe)
         | beam.io.WriteToText(sys.argv[1], shard_name_template=""))

'''


def test_local_engine_workers_import_beam_without_pandas(tmp_path):
    pytest.importorskip("pandas")
    out = tmp_path / "probe.txt"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "SEQCACHE_ENCODING_THREADS")}
    done = subprocess.run([sys.executable, "-c", WORKERS, str(out)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    assert {row[1] for row in rows} == {False}  # pandas
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
