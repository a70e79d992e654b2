"""``seqcache.deferred``: a deferred module loads on its first attribute read,
once, and whole for every thread (Python's own ``LazyLoader`` before 3.12.3
shows a second thread a half-run module); ``import_beam`` defers Beam's
object-store and HTTP clients, which still work afterwards. Each check runs in
a fresh interpreter."""

import json
import subprocess
import sys
import textwrap

import pytest

# A module whose body takes a while and counts its runs in a file.
SLOW_MODULE = '''
import os, time
with open(os.environ["RUNS_FILE"], "a") as f:
    f.write("run\\n")
FIRST = 1
time.sleep(0.3)
LAST = 2
'''

THREADS = r'''
import json, sys, threading
from seqcache import deferred

with deferred.deferring(["slowmod"]):
    import slowmod
deferred_before = deferred.is_deferred("slowmod")
barrier = threading.Barrier(8)
seen, errors = [], []

def read():
    barrier.wait()
    try:
        seen.append(slowmod.LAST)
    except Exception as e:  # a half-run module has FIRST but not yet LAST
        errors.append(repr(e))

threads = [threading.Thread(target=read) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps({"deferred_before": deferred_before, "deferred_after": deferred.is_deferred("slowmod"),
                  "seen": seen, "errors": errors}))
'''


def _run(code, env_extra=None, cwd=None, tmp_path=None):
    import os

    env = dict(os.environ, **(env_extra or {}))
    if tmp_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_deferred_module_runs_once_and_every_thread_sees_it_whole(tmp_path):
    (tmp_path / "slowmod.py").write_text(SLOW_MODULE)
    runs = tmp_path / "runs.txt"
    out = _run(THREADS, {"RUNS_FILE": str(runs)}, tmp_path=tmp_path)
    assert out["deferred_before"] is True and out["deferred_after"] is False
    assert out["errors"] == []
    assert out["seen"] == [2] * 8
    assert runs.read_text().splitlines() == ["run"]


MODES = r'''
import json, sys
from seqcache import deferred
import json as already
with deferred.deferring(["json", "no_such_module_here", "slowmod"]):
    import json
    try:
        import no_such_module_here
        missing = "imported"
    except ImportError:
        missing = "ImportError"
    import slowmod
print(json.dumps({"already_imported_deferred": deferred.is_deferred("json"), "missing": missing,
                  "runs_before_use": open(sys.argv[1]).read() if __import__("os").path.exists(sys.argv[1]) else "",
                  "value": slowmod.FIRST, "finder_left": any(type(f).__name__ == "_Finder" for f in sys.meta_path)}))
'''


def test_already_imported_and_missing_modules_import_as_usual(tmp_path):
    (tmp_path / "slowmod.py").write_text(SLOW_MODULE)
    runs = tmp_path / "runs.txt"
    code = MODES.replace("sys.argv[1]", repr(str(runs)))
    out = _run(code, {"RUNS_FILE": str(runs)}, tmp_path=tmp_path)
    assert out == {"already_imported_deferred": False, "missing": "ImportError", "runs_before_use": "",
                   "value": 1, "finder_left": False}


BEAM = textwrap.dedent(r'''
    import json, sys
    from seqcache import deferred, fs

    beam = fs.import_beam()
    out = {name: deferred.is_deferred(name) for name in fs.BEAM_DEFERRED_MODULES}
    from apache_beam.io.filesystems import FileSystems
    out["s3_registered"] = type(FileSystems.get_filesystem("s3://b/k")).__name__
    import boto3
    client = boto3.client("s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9",
                          aws_access_key_id="a", aws_secret_access_key="b")
    out["client"] = type(client).__name__
    out["boto3_deferred_after_use"] = deferred.is_deferred("boto3")
    print(json.dumps(out))
''')


def test_beam_defers_its_clients_and_they_work_after():
    pytest.importorskip("boto3")
    out = _run(BEAM)
    assert out == {**out, "boto3": True, "httplib2": True}
    assert out["s3_registered"] == "S3FileSystem"
    assert out["client"] == "S3" and out["boto3_deferred_after_use"] is False


def test_the_executable_keeps_exit_codes_and_output():
    ok = subprocess.run([sys.executable, "-m", "seqcache.cli", "--version"], capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0 and "seqcache" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "seqcache.cli", "no-such-command"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no-such-command" in bad.stderr


# A package whose code imports its submodule after a while; the submodule takes
# a while too.
PKG_INIT = '''
import time
time.sleep(0.3)
from slowpkg import sub
VALUE = sub.X + 1
'''
PKG_SUB = '''
import time
time.sleep(0.3)
X = 1
'''

SUBMODULE = r'''
import json, sys, threading, time
from seqcache import deferred

with deferred.deferring(["slowpkg"]):
    import slowpkg
out = {}

def run_module():  # runs the package's code, which imports slowpkg.sub
    out["value"] = slowpkg.VALUE

def import_submodule():  # meanwhile: holds slowpkg.sub's import lock, reads slowpkg.__path__
    import slowpkg.sub
    out["x"] = slowpkg.sub.X

a = threading.Thread(target=run_module)
a.start()
time.sleep(0.1)
b = threading.Thread(target=import_submodule)
b.start()
a.join(15)
b.join(15)
out["hung"] = a.is_alive() or b.is_alive()
print(json.dumps(out), flush=True)
import os
os._exit(0)  # a hung thread must not keep the process alive
'''


def test_a_submodule_imported_while_the_module_runs_in_another_thread(tmp_path):
    pkg = tmp_path / "slowpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PKG_INIT)
    (pkg / "sub.py").write_text(PKG_SUB)
    out = _run(SUBMODULE, tmp_path=tmp_path)
    assert out == {"value": 2, "x": 1, "hung": False}


PICKLE = r'''
import json, pickle, sys
import cloudpickle
from seqcache import deferred

with deferred.deferring(["slowmod"]):
    import slowmod

class Holder:
    def __init__(self):
        self.module = slowmod

blob = cloudpickle.dumps(Holder())
plain = pickle.dumps(slowmod)
out = {"deferred_after_pickling": deferred.is_deferred("slowmod")}
out["same_module"] = cloudpickle.loads(blob).module is slowmod and pickle.loads(plain) is slowmod
print(json.dumps(out))
'''


def test_a_deferred_module_pickles_by_name_without_running(tmp_path):
    pytest.importorskip("cloudpickle")
    (tmp_path / "slowmod.py").write_text(SLOW_MODULE)
    runs = tmp_path / "runs.txt"
    out = _run(PICKLE, {"RUNS_FILE": str(runs)}, tmp_path=tmp_path)
    assert out == {"deferred_after_pickling": True, "same_module": True}
    assert not runs.exists()


SUBMODULE_FIRST = r"""
import importlib, json, sys
from seqcache import deferred, fs

fs.import_beam()
name = sys.argv[1]
out = {"deferred": {n: deferred.is_deferred(n) for n in ("boto3", "httplib2", "requests")}}
module = importlib.import_module(name)  # the first import of the package's code: a submodule
top = sys.modules[name.partition(".")[0]]
out["package_runs_after"] = bool(dir(top)) and not deferred.is_deferred(top.__name__)
out["same_module"] = sys.modules[name] is module
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["boto3.session", "boto3.s3.transfer", "httplib2.auth", "requests.adapters"])
def test_a_submodule_imported_first_after_beam(name):
    """A deferred package's submodule imported before the package has run
    imports as usual, and the package still runs whole; requests, whose
    submodules import one another through the package, is not deferred."""
    pytest.importorskip(name.partition(".")[0])
    done = subprocess.run([sys.executable, "-c", SUBMODULE_FIRST, name], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["deferred"] == {"boto3": True, "httplib2": True, "requests": False}
    assert out["package_runs_after"] is True and out["same_module"] is True
