"""Time and memory of every reader of a file a user hands over, on hostile files.

Each entry point reads each hostile shape in a fresh child process (the
command line, or the library function a command calls); the script reports
the child's wall time, its peak RSS (``wait4``'s ru_maxrss) and the lines it
printed, and kills it after ``--timeout`` seconds. The shapes: a million keys
in one object (12-20 MB), nesting 100,000 deep, an integer of 100,001 digits,
a byte order mark, a byte that is not UTF-8, a key given twice, a YAML
base-60 integer of 3 MB (``1:59:59:...``), a YAML syntax error, a YAML merge
key and an alias bomb, in each place they fit: a mixture schedule (JSON and
YAML; ``seqcache which --mixture-schedule`` and ``seqcache train``'s
``load_mixture_schedule``), a feeder state (``seqcache which STATE``, a
checkpoint step's ``feeder/metadata`` as a resume reads it) and a manifest
(``seqcache info``, ``show``, ``verify``, ``report --json``).

The same script runs against another release's installed package (run it
with that environment's ``python``): a reader without the bounds shows its
time and memory, up to ``--timeout``. The figures are in benchmarks/README.md
and docs/bad-input.md ("Time and memory").

Usage: python benchmarks/hostile_input.py [--timeout 60] [--only info,which] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np


def _keys(n: int) -> str:
    return "{" + ",".join(f'"k{i:07d}":1' for i in range(n)) + "}"


def _yaml_keys(n: int) -> str:
    return "".join(f"  k{i:07d}: 1\n" for i in range(n))


def json_shapes(doc: dict, place: list, duplicate: str) -> dict[str, bytes]:
    """Hostile variants of the JSON document ``doc``: the value at ``place``
    (a key path) replaced by raw text, whole-file damage, and the top-level
    key ``duplicate`` given again (with another value) at the end."""
    def at(text: str) -> bytes:
        marked = json.loads(json.dumps(doc))
        node = marked
        for key in place[:-1]:
            node = node[key]
        node[place[-1]] = "@@"
        return json.dumps(marked).replace('"@@"', text).encode()

    good = json.dumps(doc).encode()
    again = json.dumps({duplicate: 1 if doc[duplicate] != 1 else 2})[1:-1].encode()
    return {
        "1e6 keys": at(_keys(10**6)),
        "deep 1e5": at("[" * 10**5 + "]" * 10**5),
        "int 100,001 digits": at("1" * 100_001),
        "BOM": b"\xef\xbb\xbf" + good,
        "bad UTF-8": good[:-1] + b' \xff}',
        "duplicate key": good[:-1] + b", " + again + b"}",
    }


def yaml_shapes() -> dict[str, bytes]:
    """Hostile YAML mixture schedules (task ``c``)."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefghi", "bcdefghij"))
    return {
        "yaml 1e6 keys": ("0:\n" + _yaml_keys(10**6)).encode(),
        "yaml base-60 3 MB": ("0: {c: 1}\n5: {c: " + "1" + ":59" * 1_000_000 + "}\n").encode(),
        "yaml deep 1e5": ("0: " + "[" * 10**5 + "]" * 10**5 + "\n").encode(),
        "yaml syntax error": b"0: {c: 1\n5: {c: 2}\n",
        "yaml merge key": b"base: {c: 1}\n0: {<<: {c: 2}}\n",
        "yaml alias bomb": bomb.encode(),
        "yaml BOM": b"\xef\xbb\xbf0: {c: 1}\n",
        "yaml bad UTF-8": b"0: {c: 1}\n# \xff\n",
        "yaml duplicate key": b"0: {c: 1}\n0: {c: 2}\n",
    }


# Runs the measured command from a small process, so that its peak RSS is its
# own (a child forked from this script would start with this script's pages
# counted), and prints the command's peak RSS (KiB) on its last line: wait4's
# ru_maxrss, or its VmHWM when it is killed after the timeout (exit status 124).
_LAUNCHER = """
import os, subprocess, sys, time
timeout, argv = float(sys.argv[1]), sys.argv[2:]
child = subprocess.Popen(argv)
deadline = time.monotonic() + timeout
while True:
    pid, status, usage = os.wait4(child.pid, os.WNOHANG)
    if pid:
        print(f"@@rss {usage.ru_maxrss}", flush=True)
        sys.exit(os.waitstatus_to_exitcode(status))
    if time.monotonic() > deadline:
        hwm = [line.split()[1] for line in open(f"/proc/{child.pid}/status") if line.startswith("VmHWM:")]
        child.kill()
        os.wait4(child.pid, 0)
        print(f"@@rss {hwm[0] if hwm else 0}", flush=True)
        sys.exit(124)
    time.sleep(0.02)
"""


def _run(argv: list[str], timeout: float) -> dict:
    """Runs ``argv``; its wall time, peak RSS (MB), exit status and output."""
    start = time.monotonic()
    out = tempfile.TemporaryFile()
    child = subprocess.run([sys.executable, "-c", _LAUNCHER, str(timeout), *argv], stdout=out,
                           stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    out.seek(0)
    text = out.read().decode("utf-8", "replace")
    rss = [int(line.split()[1]) for line in text.splitlines() if line.startswith("@@rss ")]
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("@@rss ")]
    return {"seconds": round(seconds, 2), "peak_rss_mb": round(rss[-1] / 1024) if rss else None,
            "exit": "killed" if child.returncode == 124 else child.returncode, "lines": len(lines),
            "first": (lines[0] if lines else "")[:160], "last": (lines[-1] if lines else "")[:160]}


# A library function's refusal as one line: its class and message.
_CALL = """
import sys
try:
    {call}
except Exception as e:
    print(f"{{type(e).__module__}}.{{type(e).__name__}}: {{e}}")
    sys.exit(1)
"""


_STATE_READ = _CALL.format(call="""import json
    from seqcache.feeders import state
    if hasattr(state, "load_checkpoint_state"):
        state.load_checkpoint_state(sys.argv[1], any_feeder=True)
    else:  # before: Orbax's JsonRestore, Python's json
        json.loads(open(sys.argv[1] + "/feeder/metadata").read())""")


def _cache(root: str) -> str:
    from seqcache import format as fmt
    from seqcache.pipelines.writer import write_cache

    shards = [[({"targets": np.arange(i, i + 6, dtype=np.int32) % 250 + 3}, [(0, i, 0)]) for i in range(s, 23, 3)]
              for s in range(3)]
    path = os.path.join(root, "c", "train")
    write_cache(path, task="c", split="train", features=(fmt.FeatureSpec("targets", "int32"),), shards=shards,
                sources=[{"path": "corpus.txt"}], fingerprint_inputs={"task": "c"})
    return path


def cases(root: str) -> list[tuple[str, str, list[str]]]:
    """(entry point, shape, argv) of every measurement."""
    from seqcache.feeders import Feeder

    py, seqcache = sys.executable, [sys.executable, "-m", "seqcache.cli"]
    cache = _cache(root)
    with Feeder(cache=cache, global_batch_size=4, sequence_length=8, host_index=0, host_count=1) as f:
        state = json.loads(json.dumps(f.state()))
    out = []
    schedule = {"0": {"train": 1}, "5": {"train": 2}}  # the cache's folder, relative to the folder which is given
    yaml = {name: data.replace(b"{c:", b"{train:") for name, data in yaml_shapes().items()}
    for name, data in list(json_shapes(schedule, ["0"], "0").items()) + list(yaml.items()):
        path = os.path.join(root, name.replace(" ", "_") + (".yaml" if name.startswith("yaml") else ".json"))
        with open(path, "wb") as f:
            f.write(data)
        out.append(("which --mixture-schedule", name, seqcache + ["which", os.path.dirname(cache), "--mixture-schedule",
                                                                  path, "--step", "0", "--row", "0", "--batch-size", "4"]))
        out.append(("train: load_mixture_schedule", name, [py, "-c", _CALL.format(
            call="from seqcache.training.data import load_mixture_schedule; load_mixture_schedule(sys.argv[1])"), path]))
    for name, data in json_shapes(state, ["mixture"], "seed").items():
        step = os.path.join(root, "ckpt-" + name.replace(" ", "_"), "4")
        os.makedirs(os.path.join(step, "feeder"))
        with open(os.path.join(step, "feeder", "metadata"), "wb") as f:
            f.write(data)
        out.append(("which CHECKPOINT_STEP", name, seqcache + ["which", step, "--step", "0", "--row", "0"]))
        out.append(("resume: feeder/metadata", name, [py, "-c", _STATE_READ, step]))
    with open(os.path.join(cache, "manifest.json")) as f:
        manifest = json.load(f)
    shapes = json_shapes(manifest, ["statistics", "tokens"], "seed")
    shapes["1e6 vocabularies"] = json_shapes(manifest, ["vocabularies"], "seed")["1e6 keys"]
    bogus = dict(manifest, sequence_length={"bogus": 1})
    shapes["sequence_length bogus"] = json.dumps(bogus).encode()
    for name, data in shapes.items():
        copy = os.path.join(root, "m-" + name.replace(" ", "_"), "train")
        shutil.copytree(cache, copy)
        with open(os.path.join(copy, "manifest.json"), "wb") as f:
            f.write(data)
        for command in (["info"], ["show"], ["verify"], ["report", "--json"]):
            out.append((command[0], name, seqcache + [command[0], copy] + command[1:]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a child is killed")
    parser.add_argument("--only", help="comma-separated entry points (a prefix of each) to measure")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="seqcache-hostile-")
    rows = []
    try:
        for entry, shape, argv in cases(root):
            if args.only and not any(entry.startswith(o) for o in args.only.split(",")):
                continue
            row = {"entry": entry, "shape": shape, **_run(argv, args.timeout)}
            rows.append(row)
            print(f"{entry:30} {shape:22} {row['seconds']:7.2f} s {row['peak_rss_mb']:6} MB  exit {row['exit']}  "
                  f"{row['lines']} line(s)  {row['last'][:90]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timeout_s": args.timeout, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
