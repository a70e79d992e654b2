"""Start-up: what the ``seqcache`` executable imports and the CPU it spends
before and around a tiny piece of work, per command (``seqcache --help``,
``seqcache build --help``, ``seqcache scan`` and ``seqcache build`` of a
one-line text file with the byte vocabulary): the modules in ``sys.modules``
at exit (one extra run each) and the median CPU (user + system, the
command's waited children included) and wall seconds of ``--repeat`` fresh
interpreters.

``--against COMMIT`` runs the same commands on the package of that commit
too (its ``core``, ``cli``, ``tasks``, ... laid out as ``seqcache`` in a
temporary folder, first on ``PYTHONPATH``), alternating with this checkout's
own (laid out the same way) every round. Run from the repository root with
the project's environment::

    python benchmarks/startup.py --repeat 5 --against cbf62fa

benchmarks/README.md, "Start-up: what a command imports".
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
# Package folder -> the folder of the checkout it comes from (pyproject.toml's package-dir).
LAYOUT = {"seqcache": "core", "seqcache/cli": "cli", "seqcache/tasks": "tasks", "seqcache/pipelines": "pipelines",
          "seqcache/feeders": "feeders", "seqcache/training": "training"}
COMMANDS = {
    "seqcache --help": ["--help"],
    "seqcache build --help": ["build", "--help"],
    "seqcache scan (one line)": ["scan", "--source", "text:one.txt"],
    "seqcache build (one record)": ["build", "--source", "text:one.txt", "--name", "one", "--cache-dir", "caches"],
}
# The executable; with $STARTUP_MODULES_OUT set, it writes the names in sys.modules there at exit.
ENTRY = ("import atexit, json, os, sys\n"
         "out = os.environ.get('STARTUP_MODULES_OUT')\n"
         "if out:\n"
         "    atexit.register(lambda: json.dump(sorted(sys.modules), open(out, 'w')))\n"
         "sys.argv[0] = 'seqcache'\n"
         "from seqcache.cli.executable import run\n"
         "run()\n")


def lay_out(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """The package folders of the checkout ``source`` copied to ``dest`` as ``seqcache``; returns ``dest``."""
    for package, folder in sorted(LAYOUT.items()):
        target = dest / package
        target.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source / folder, target, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def checkout_of(commit: str, dest: pathlib.Path) -> pathlib.Path:
    """The package folders of ``commit`` (``git archive``) in ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, *sorted(set(LAYOUT.values()))],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run(pythonpath: pathlib.Path, args: list[str], work: pathlib.Path, modules_out: pathlib.Path | None = None):
    """(wall s, CPU s) of one ``seqcache ARGS`` in ``work`` with ``pythonpath`` first."""
    shutil.rmtree(work / "caches", ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    env.pop("STARTUP_MODULES_OUT", None)
    if modules_out is not None:
        env["STARTUP_MODULES_OUT"] = str(modules_out)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", ENTRY, *args], cwd=work, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"seqcache {' '.join(args)} failed: {stderr.decode()[-2000:]}")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def measure(trees: dict[str, pathlib.Path], repeat: int, work: pathlib.Path) -> list[dict]:
    """One row per command and tree: modules, median CPU and wall of ``repeat`` runs (trees alternating)."""
    rows = []
    for label, args in COMMANDS.items():
        runs: dict[str, list] = {name: [] for name in trees}
        counts = {}
        for name, tree in trees.items():
            out = work / "modules.json"
            run(tree, args, work, modules_out=out)
            counts[name] = len(json.loads(out.read_text()))
        for r in range(repeat):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                runs[name].append(run(trees[name], args, work))
        for name in trees:
            rows.append({"command": label, "tree": name, "modules": counts[name],
                         "cpu_s": round(statistics.median(c for _, c in runs[name]), 3),
                         "wall_s": round(statistics.median(w for w, _ in runs[name]), 3), "repeat": repeat})
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh interpreters per command and tree (median)")
    parser.add_argument("--against", help="a commit to measure too, alternating with this checkout")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        trees = {"this checkout": lay_out(REPO, tmp / "current")}
        if opts.against:
            trees[opts.against] = lay_out(checkout_of(opts.against, tmp / "source"), tmp / "against")
        work = tmp / "work"
        work.mkdir()
        (work / "one.txt").write_text("hello world\n")
        rows = measure(trees, opts.repeat, work)
    print(f"{'command':30s} {'tree':15s} {'modules':>8s} {'CPU s':>7s} {'wall s':>7s}")
    for row in rows:
        print(f"{row['command']:30s} {row['tree']:15s} {row['modules']:8d} {row['cpu_s']:7.3f} {row['wall_s']:7.3f}")
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
