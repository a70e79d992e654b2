"""Many small files against one file of the same bytes, measured in one run.

tinyshakespeare (40,000 lines, 1.1 MB) is written twice into a temporary
folder: as one file, and cut into --files files of consecutive lines (5,000
files of 8 lines by default), so that both hold the same lines in the same
order. With --lines-per-file N the corpus is --files times N lines instead:
tinyshakespeare's lines in order, as often as needed, each copy after the
first with its copy number in front (``2 First Citizen:``), so that
``--files 50000 --lines-per-file 1`` is 50,000 one-line files. Each is built
with the command a user types::

    seqcache build --source 'text:DIR/*.txt' --vocabulary byte --name NAME --cache-dir D --json

in a child process, the two alternating, --repeat times. Reported, as medians
over the rounds with [min, max]:

  wall: the command's wall-clock seconds (interpreter start-up included);
  cpu: its CPU seconds (user + system, its waited-for workers included);
  build: the seconds ``build_task`` reports (listing, planning, the pipeline
         and the manifest, without the interpreter's start-up and imports);

and each as a ratio many / one, taken in the same round. The data shards of
the two builds must have the same sha256 (guarantee G1: the bytes depend on
the multiset of records, not on how they are split into files); the run
fails otherwise. Also reported: the two manifests' sizes and the source table
files' (bytes).

Usage: python benchmarks/small_files.py [--files 5000] [--lines-per-file N] [--repeat 3] [--work-dir DIR]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from seqcache import format as fmt

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


# The ``seqcache`` command, as its console script runs it.
CLI = "import sys; from seqcache.cli.main import run; sys.argv[0] = 'seqcache'; sys.exit(run())"


def corpus_lines(num_files: int, lines_per_file: int | None) -> list[bytes]:
    """tinyshakespeare's lines; with ``lines_per_file``, ``num_files *
    lines_per_file`` of them, the lines repeated in order as often as needed,
    copy c >= 2 with ``b"c "`` in front of each line."""
    data = (DATA / "tinyshakespeare" / "input.txt").read_bytes()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    if lines_per_file is None:
        return lines
    n = len(lines)
    return [lines[k % n] if k < n else b"%d %s" % (k // n + 1, lines[k % n])
            for k in range(num_files * lines_per_file)]


def write_corpus(folder: pathlib.Path, num_files: int, lines_per_file: int | None = None) -> dict[str, str]:
    """``one/input.txt`` and ``many/part-NNNNN.txt`` (``num_files`` files of
    consecutive lines, as even as the line count allows) under ``folder``;
    returns the two source specs."""
    lines = corpus_lines(num_files, lines_per_file)
    (folder / "one").mkdir(parents=True)
    (folder / "one" / "input.txt").write_bytes(b"".join(line + b"\n" for line in lines))
    (folder / "many").mkdir()
    for k in range(num_files):
        part = lines[len(lines) * k // num_files:len(lines) * (k + 1) // num_files]
        (folder / "many" / f"part-{k:05d}.txt").write_bytes(b"".join(line + b"\n" for line in part))
    return {name: f"text:{folder / name}/*.txt" for name in ("one", "many")}


def build(spec: str, cache_dir: pathlib.Path) -> dict:
    """One ``seqcache build`` in a child process: ``{"wall_s", "cpu_s",
    "build_s", "data_sha256": [per shard], "examples"}``."""
    shutil.rmtree(cache_dir, ignore_errors=True)
    args = [sys.executable, "-c", CLI, "build", "--source", spec, "--vocabulary", "byte",
            "--name", "x", "--cache-dir", str(cache_dir), "--json"]
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tempfile.gettempdir())
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"seqcache build of {spec} failed:\n{err.decode(errors='replace')[-3000:]}")
    report = json.loads(out)[0]
    folder = cache_dir / "x" / "train"
    hashes = [hashlib.sha256((folder / s.file).read_bytes()).hexdigest()
              for s in fmt.read_manifest(str(folder)).shards]
    table = folder / fmt.SOURCE_TABLE_NAME
    return {"wall_s": wall, "build_s": float(report["seconds"]), "data_sha256": hashes,
            "examples": int(report["num_examples"]), "manifest_bytes": (folder / fmt.MANIFEST_NAME).stat().st_size,
            "source_table_bytes": table.stat().st_size if table.exists() else None}


def _cpu_children() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(work: pathlib.Path, num_files: int, repeat: int, lines_per_file: int | None = None) -> dict:
    specs = write_corpus(work / "in", num_files, lines_per_file)
    rounds = []
    for r in range(repeat):
        row = {}
        # Alternate which goes first: a machine that slows down during a round
        # does not always favour the same one.
        for name in (("one", "many") if r % 2 == 0 else ("many", "one")):
            before = _cpu_children()
            row[name] = build(specs[name], work / f"cache-{name}")
            row[name]["cpu_s"] = _cpu_children() - before
        if row["one"]["data_sha256"] != row["many"]["data_sha256"]:
            raise SystemExit(f"the data shards differ between one file and {num_files} files: "
                             f"{row['one']['data_sha256']} against {row['many']['data_sha256']}")
        rounds.append(row)
    out = {"files": num_files, "lines_per_file": lines_per_file, "repeat": repeat,
           "examples": rounds[0]["one"]["examples"], "data_sha256_equal": True, "rounds": rounds,
           **{f"{name}_{what}": rounds[0][name][what] for name in ("one", "many")
              for what in ("manifest_bytes", "source_table_bytes")}}
    for what in ("wall_s", "cpu_s", "build_s"):
        for name in ("one", "many"):
            out[f"{name}_{what}"] = statistics.median(row[name][what] for row in rounds)
        ratios = [row["many"][what] / row["one"][what] for row in rounds]
        out[f"ratio_{what}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def print_report(res: dict) -> None:
    per_file = f" of {res['lines_per_file']} lines" if res.get("lines_per_file") else ""
    print(f"tinyshakespeare, 1 file against {res['files']:,} files{per_file}, {res['examples']:,} examples, "
          f"{res['repeat']} rounds; data shards equal (sha256): {res['data_sha256_equal']}")
    tables = [f"{n:,} bytes" if n is not None else "none" for n in (res["one_source_table_bytes"],
                                                                     res["many_source_table_bytes"])]
    print(f"manifest.json: {res['one_manifest_bytes']:,} bytes (1 file), {res['many_manifest_bytes']:,} bytes (many); "
          f"{fmt.SOURCE_TABLE_NAME}: {tables[0]} (1 file), {tables[1]} (many)")
    print(f"{'':>8} {'1 file':>9} {'many':>9} {'many / 1 file':>28}")
    for what, label in (("wall_s", "wall s"), ("cpu_s", "CPU s"), ("build_s", "build s")):
        r = res[f"ratio_{what}"]
        print(f"{label:>8} {res['one_' + what]:>9.2f} {res['many_' + what]:>9.2f} "
              f"{r['median']:>10.2f}x [{r['min']:.2f}, {r['max']:.2f}]")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=5000, help="files to cut tinyshakespeare into (default 5000)")
    ap.add_argument("--lines-per-file", type=int, help="lines per file: the corpus is --files times this many "
                    "lines, tinyshakespeare's repeated with a copy number in front (default: tinyshakespeare "
                    "once, cut into --files files)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds, each building both (default 3)")
    ap.add_argument("--work-dir", help="folder for the corpus and caches (default: a temporary one, removed)")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    if args.files < 1 or args.repeat < 1 or (args.lines_per_file is not None and args.lines_per_file < 1):
        ap.error("--files, --lines-per-file and --repeat must be >= 1")
    with tempfile.TemporaryDirectory(prefix="small-files-", dir=args.work_dir) as tmp:
        res = measure(pathlib.Path(tmp), args.files, args.repeat, args.lines_per_file)
    print_report(res)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
