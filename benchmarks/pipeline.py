"""Pipeline throughput against the tokenizer-only bound, measured in one run.

For each corpus the benchmark measures, on this machine's cores:
  bound: SentencePiece batch encode of exactly the records the build reads
         (``SentencePieceProcessor.encode(list, num_threads=T)``, with the
         output the build asks for: int32 buffers for texts of 256 characters
         or more on average, lists of ints for shorter ones), no I/O; T is
         --workers unless --bound-threads says otherwise (0: the threads a
         build's encoding uses, ``encoding_threads()``);
  tokenizers: next to it, the same bound for a byte-level BPE tokenizer.json
         (``tokenizers``, trained on the same sample with the same vocabulary
         size) through ``HfTokenizerVocabulary.encode_batch``: which tokenizer is
         faster on the same text (``--no-tokenizers`` skips it, ``--bound-only``
         measures the bounds alone);
  build: ``seqcache build`` of the same files in a child process (Beam
         DirectRunner, multi_processing with one worker per core, or in_memory
         with --workers 1), and its peak RSS (the build process's VmHWM, or
         a worker's ru_maxrss if larger: the largest single process),
and reports raw MB/s, tokens/s and the ratio build/bound, in wall time and in
CPU time (the bound's CPU seconds over the build's, its worker processes
included). Machines here are noisy and shared: compare the ratios, not the
absolute numbers; on a loaded machine the CPU ratio is the steadier one.

Corpora (from ../shared/data, repeated to the requested size with a copy number
prefixed to every record so that copies are distinct records):
  lines:     tinyshakespeare, one record per line (short records)
  documents: the C4 validation sample, one record per document

With --t5, the documents corpus is also built as T5 tasks on the command line
(span corruption to inputs 512 / targets 114, unpacked and first-fit packed; LM
packed to 512), each reported as a ratio of MB/s to the plain LM build of the
same text in the same run, with the packing efficiency per feature.

With --startup it also breaks a small build's fixed cost down: the CPU time of
each import step in fresh interpreters, a one-record build, and a 1 MB build.
Every figure is a median over --repeat runs; ratios also show their range.

Usage: python benchmarks/pipeline.py [--mb 50] [--workers N] [--repeat 3] [--startup] [--group-size]
                                     [--t5] [--cases lines,documents] [--no-tokenizers] [--bound-only]
                                     [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def make_lines(folder: pathlib.Path, target_bytes: int, num_files: int = 8) -> tuple[str, list[str]]:
    base = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n")
    records, size, copy = [], 0, 0
    while size < target_bytes:
        for line in base:
            r = f"{copy} {line}"
            records.append(r)
            size += len(r.encode()) + 1
        copy += 1
    folder.mkdir(parents=True)
    per = -(-len(records) // num_files)
    for k in range(num_files):
        (folder / f"part-{k:03d}.txt").write_text("\n".join(records[k * per:(k + 1) * per]) + "\n", encoding="utf-8")
    return f"text:{folder}/*.txt", records


def make_documents(folder: pathlib.Path, target_bytes: int, num_files: int = 8) -> tuple[str, list[str]]:
    base = pq.read_table(DATA / "c4" / "c4_validation_2k.parquet", columns=["text"]).column("text").to_pylist()
    records, size, copy = [], 0, 0
    while size < target_bytes:
        for doc in base:
            r = f"{copy} {doc}"
            records.append(r)
            size += len(r.encode())
        copy += 1
    folder.mkdir(parents=True)
    per = -(-len(records) // num_files)
    for k in range(num_files):
        pq.write_table(pa.table({"text": records[k * per:(k + 1) * per]}), folder / f"part-{k:03d}.parquet")
    return f"parquet:{folder}/*.parquet#text", records


def bound(model_path: str, records: list[str], cores: int, batch: int = 4096,
          details: dict | None = None) -> tuple[float, int]:
    """(seconds, tokens + one EOS per record) of SentencePiece alone on ``records``;
    ``details`` gets ``cpu_s``, this process's CPU seconds for it. The cyclic
    collector runs as in the build's processes (the heap frozen, seqcache's
    thresholds: ``seqcache.process``), so that the corpora this script holds
    are not walked by it on every full collection."""
    import gc
    import resource

    import sentencepiece as spm

    from seqcache.tasks.vocabularies import SENTENCEPIECE_BUFFER_CHARS

    sp = spm.SentencePieceProcessor(model_file=model_path)
    # SentencePiece's cheaper output for these records, as the build chooses it:
    # int32 buffers for long texts (no Python int per id), lists of ints for short ones.
    out_type = "numpy" if sum(map(len, records)) >= SENTENCEPIECE_BUFFER_CHARS * len(records) else int
    from seqcache import process

    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*process.GC_THRESHOLDS)
    try:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        start = time.perf_counter()
        tokens = 0
        for i in range(0, len(records), batch):
            for ids in sp.encode(records[i:i + batch], out_type=out_type, num_threads=cores):
                tokens += len(ids) + 1
        seconds = time.perf_counter() - start
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    if details is not None:
        after = resource.getrusage(resource.RUSAGE_SELF)
        details["cpu_s"] = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    return seconds, tokens


# -- the tokenizers (Hugging Face) bound next to SentencePiece's -------------------


def train_bpe_like_spm(sample: list[str], folder: pathlib.Path, vocab_size: int = 8000) -> str:
    """A byte-level BPE tokenizer.json (``seqcache vocab train --model bpe``) on the
    sample the SentencePiece model is trained on, with as many ids."""
    from seqcache import tasks

    path = folder / "bpe-tokenizer.json"
    tasks.train_hf_tokenizer(sample, output_path=str(path), model="bpe", vocab_size=vocab_size)
    return str(path)


def hf_bound(tokenizer_path: str, records: list[str], batch: int = 4096) -> tuple[float, int]:
    """``HfTokenizerVocabulary.encode_batch`` (what the pipeline calls: tokenizers'
    ``encode_batch_fast`` on its Rust thread pool, RAYON_NUM_THREADS threads) of
    the records, no I/O; (seconds, tokens + one EOS per record)."""
    from seqcache import tasks

    vocab = tasks.HfTokenizerVocabulary(tokenizer_path)
    vocab.encode("warm up")
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(records), batch):
        for ids in vocab.encode_batch(records[i:i + batch]):
            tokens += len(ids) + 1
    return time.perf_counter() - start, tokens


def tokenizer_row(case: str, raw_mb: float, sp: tuple[float, int], hf: tuple[float, int]) -> dict:
    """SentencePiece against tokenizers BPE on the same records: MB/s, tokens/s,
    tokens per raw byte and the speed ratio (>1: tokenizers is faster)."""
    (sp_s, sp_tokens), (hf_s, hf_tokens) = sp, hf
    return {"case": case, "raw_mb": round(raw_mb, 1),
            "spm_mb_s": round(raw_mb / sp_s, 2), "spm_tokens_s": round(sp_tokens / sp_s),
            "hf_bpe_mb_s": round(raw_mb / hf_s, 2), "hf_bpe_tokens_s": round(hf_tokens / hf_s),
            "spm_tokens_per_byte": round(sp_tokens / (raw_mb * 1e6), 4),
            "hf_bpe_tokens_per_byte": round(hf_tokens / (raw_mb * 1e6), 4),
            "hf_over_spm_speed": round(sp_s / hf_s, 3)}


def print_tokenizer_rows(rows: list[dict]) -> None:
    print(f"\n{'case':10} {'MB':>7} {'spm MB/s':>9} {'bpe MB/s':>9} {'spm tok/B':>10} {'bpe tok/B':>10} "
          f"{'bpe/spm speed':>14}")
    for r in rows:
        print(f"{r['case']:10} {r['raw_mb']:7.1f} {r['spm_mb_s']:9.2f} {r['hf_bpe_mb_s']:9.2f} "
              f"{r['spm_tokens_per_byte']:10.4f} {r['hf_bpe_tokens_per_byte']:10.4f} {r['hf_over_spm_speed']:13.2f}x")


# The build's child: ``seqcache build`` as the executable runs it, writing at exit
# its peak RSS in KiB: the larger of its own high-water mark (VmHWM) and its
# waited-for workers' (RUSAGE_CHILDREN). Not wait4's ru_maxrss: the child is
# started by vfork, and the kernel counts the parent's high-water mark (this
# process, the corpus in memory: 741 MB for 204 MB of documents whose build
# peaks at 339 MB) into the child's at its exec.
BUILD_CHILD = """
import atexit, resource, sys

def _peak():
    with open("/proc/self/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    with open({peak_file!r}, "w") as f:
        f.write(str(max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)))

atexit.register(_peak)
from seqcache.cli.main import run
sys.argv = ["seqcache"] + sys.argv[1:]
run()
"""


def build(spec: str, model_path: str, cache_dir: str, workers: int, name: str,
          num_shards: int | None = None, details: dict | None = None,
          extra: tuple[str, ...] = (), cpus: set[int] | None = None) -> tuple[float, dict, float]:
    """Runs ``seqcache build`` in a child process; returns (seconds, statistics,
    peak RSS of the build process tree in MB). ``details``, when given, gets
    ``cpu_s`` (user + system CPU seconds of the build and its waited-for
    workers) and ``build_task_s`` (the seconds ``build_task`` itself reports:
    planning, the pipeline and the manifest, without interpreter start-up and
    imports before it). ``cpus``: the CPUs the build (and its worker
    processes) may run on (``os.sched_setaffinity``), or None for all."""
    args = ["build", "--source", spec, "--vocabulary", model_path, "--name", name, "--cache-dir", cache_dir, "--json"]
    # The bound encodes every record: keep them all (the content checks still run).
    args += ["--on-error", "empty=keep", "--on-error", "whitespace=keep", "--on-error", "control_characters=keep"]
    if workers > 1:
        args += ["--direct_running_mode=multi_processing", f"--direct_num_workers={workers}"]
    if num_shards:
        args += ["--num-shards", str(num_shards)]
    args += list(extra)
    peak_file = tempfile.NamedTemporaryFile(prefix="peak-rss-", delete=False)
    peak_file.close()
    code = BUILD_CHILD.format(peak_file=peak_file.name)
    start = time.perf_counter()
    log = tempfile.TemporaryFile()
    pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=log, stderr=subprocess.STDOUT,
                            cwd=tempfile.gettempdir(), preexec_fn=pin)
    _, status, usage = os.wait4(proc.pid, 0)  # this build's own peak RSS (and its waited-for workers')
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    log.seek(0)
    output = log.read().decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(output)
    with open(peak_file.name) as f:
        peak_mb = int(f.read()) / 1024
    os.unlink(peak_file.name)
    if details is not None:
        details["cpu_s"] = usage.ru_utime + usage.ru_stime
        report = json.loads(output[output.index("[\n"):output.rindex("]") + 1])
        details["build_task_s"] = float(report[0]["seconds"])
    manifest = json.load(open(os.path.join(cache_dir, name, "train", "manifest.json")))
    return seconds, manifest["statistics"], peak_mb


# ---------------------------------------------------------------- T5 builds
# Span corruption and first-fit packing of the C4 documents, each as a ratio of
# raw MB/s to the plain LM build (targets = the text, no sequence length) of the
# same files in the same run, with the packing efficiency per feature.
T5_LENGTHS = "inputs=512,targets=114"
T5_VARIANTS = {
    "lm": (),
    "lm, packed 512": ("--sequence-length", "512", "--pack", "lm"),
    "span_corruption": ("--objective", "span_corruption", "--extra-ids", "100", "--sequence-length", T5_LENGTHS),
    "span_corruption, first_fit": ("--objective", "span_corruption", "--extra-ids", "100", "--sequence-length",
                                   T5_LENGTHS, "--pack", "first_fit"),
}


def t5_rows(tmp: pathlib.Path, model_path: str, target_bytes: int, workers: int) -> list[dict]:
    """Builds the documents corpus once per ``T5_VARIANTS`` entry; per variant:
    raw MB/s, the ratio to the ``lm`` build, examples (rows), segments, and the
    packing efficiency per feature (non-padding tokens / all tokens of the rows
    the feeder makes: tokens / (rows x sequence length); None without a
    sequence length)."""
    from seqcache import format as fmt
    from seqcache.cli.commands.inspect import packing_efficiency

    spec, records = make_documents(tmp / "t5-documents", target_bytes)
    raw_mb = sum(len(r.encode()) for r in records) / 1e6
    del records
    rows = []
    for k, (variant, extra) in enumerate(T5_VARIANTS.items()):
        cache = tmp / f"cache-t5-{k}"
        s, stats, peak_mb = build(spec, model_path, str(cache), workers, "t5", extra=extra)
        manifest = fmt.read_manifest(str(cache / "t5" / "train"))
        eff = packing_efficiency(manifest)
        rows.append({
            "variant": variant, "raw_mb": round(raw_mb, 1), "cores": workers, "build_s": round(s, 2),
            "build_mb_s": round(raw_mb / s, 2), "examples": manifest.num_examples,
            "segments": stats.get("segments"), "tokens": stats["tokens"],
            "packing_efficiency": {f: round(e, 4) for f, e in eff.items()} if eff else None,
            "peak_rss_mb": round(peak_mb),
        })
        shutil.rmtree(cache, ignore_errors=True)
    for r in rows:
        r["ratio_to_lm"] = round(r["build_mb_s"] / rows[0]["build_mb_s"], 3)
    return rows


def print_t5(rows: list[dict]) -> None:
    print(f"\n{'T5 build (documents)':28} {'MB':>6} {'build MB/s':>11} {'/ lm build':>11} {'rows':>8} "
          f"{'efficiency inputs':>18} {'efficiency targets':>19}")
    for r in rows:
        eff = r["packing_efficiency"] or {}
        cell = lambda f: f"{eff[f]:.1%}" if f in eff else "-"  # noqa: E731
        print(f"{r['variant']:28} {r['raw_mb']:6.1f} {r['build_mb_s']:11.2f} {r['ratio_to_lm']:11.1%} "
              f"{r['examples']:8,d} {cell('inputs'):>18} {cell('targets'):>19}")


def child_cpu(code: str) -> tuple[float, float]:
    """(wall seconds, user + system CPU seconds) of ``python -c code`` in a child."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-W", "ignore", "-c", code], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"python -c {code!r} failed")
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


# What a build's fixed cost is made of, step by step (each a fresh interpreter;
# a step's cost is its CPU time minus the previous step's). Each step exits as
# the ``seqcache`` executable does (the heap frozen, ``seqcache.cli.main.run``) and
# imports Beam as it does (``process.own_process``).
_BEAM = "import seqcache.cli.main, seqcache.pipelines.build; from seqcache import process; process.own_process(); process.import_beam()"
_FREEZE = "; import gc; gc.freeze()"
STARTUP_STEPS = (
    ("interpreter", "pass" + _FREEZE),
    ("seqcache CLI (click, rich, numpy)", "import seqcache.cli.main" + _FREEZE),
    ("Apache Beam, as the build imports it", _BEAM + _FREEZE),
    ("Beam's local engine (FnApiRunner)",
     _BEAM + "; from apache_beam.runners.portability.fn_api_runner import fn_runner" + _FREEZE),
    ("Beam's Dask runner (options only)", _BEAM + "; from apache_beam.runners.portability.fn_api_runner import fn_runner; "
     "import apache_beam.runners.dask.dask_runner" + _FREEZE),
)

# What each of the executable's start-up choices saves: the "Apache Beam" step
# with one choice undone, against the step as it is, as paired differences of
# alternating fresh interpreters (a difference of two medians would drown in
# this machine's noise).
_OWN = "import seqcache.cli.main, seqcache.pipelines.build; from seqcache import process; process.own_process(); "
STARTUP_CHOICES = (
    ("pandas imported with Beam (for its pandas batch types)", _OWN + "import pandas; process.import_beam()" + _FREEZE),
    ("the exit not frozen (cyclic collections at exit)", _BEAM),
)


def startup_choices(rounds: int) -> list[dict]:
    """Per ``STARTUP_CHOICES`` entry: the median over ``rounds`` of (its wall
    and CPU seconds minus those of the "Apache Beam" step run next to it), the
    order alternating every round."""
    codes = [_BEAM + _FREEZE] + [code for _, code in STARTUP_CHOICES]
    runs: list[list[tuple[float, float]]] = [[] for _ in codes]
    for r in range(rounds):
        order = range(len(codes)) if r % 2 == 0 else reversed(range(len(codes)))
        for k in order:
            runs[k].append(child_cpu(codes[k]))
    out = []
    for (label, _), mine in zip(STARTUP_CHOICES, runs[1:]):
        wall = [a[0] - b[0] for a, b in zip(mine, runs[0])]
        cpu = [a[1] - b[1] for a, b in zip(mine, runs[0])]
        out.append({"choice_undone": label, "extra_wall_s": round(statistics.median(wall), 3),
                    "extra_cpu_s": round(statistics.median(cpu), 3), "rounds": rounds})
    return out


def startup(tmp: pathlib.Path, model: str, repeat: int, mb: float = 1.0) -> dict:
    """Where a small build's time goes: import steps (CPU seconds, medians of
    ``repeat`` fresh interpreters), then a one-record build and a build of
    ``mb`` MB of short lines (wall, CPU, and the time ``build_task`` reports).
    Both builds run with one worker and a Beam option on the command line
    (``--direct_running_mode=in_memory``), as users run them."""
    steps = []
    for label, code in STARTUP_STEPS:
        runs = [child_cpu(code) for _ in range(repeat)]
        steps.append({"step": label, "cpu_s": round(statistics.median(c for _, c in runs), 3),
                      "wall_s": round(statistics.median(w for w, _ in runs), 3)})
    one = tmp / "startup-one"
    one.mkdir()
    (one / "a.txt").write_text("one record\n", encoding="utf-8")
    spec_small, records = make_lines(tmp / "startup-lines", int(mb * 1e6), num_files=1)
    raw_mb = sum(len(r.encode()) for r in records) / 1e6
    del records
    builds = []
    for label, spec in (("one-record build", f"text:{one}/*.txt"), (f"{raw_mb:.1f} MB build", spec_small)):
        runs = []
        for k in range(repeat):
            d: dict = {}
            cache = tmp / f"startup-cache-{k}"
            wall, _, _ = build(spec, model, str(cache), 1, "s", details=d,
                               extra=("--direct_running_mode=in_memory",))
            runs.append((wall, d["cpu_s"], d["build_task_s"]))
            shutil.rmtree(cache, ignore_errors=True)
        builds.append({"build": label, "wall_s": round(statistics.median(r[0] for r in runs), 3),
                       "cpu_s": round(statistics.median(r[1] for r in runs), 3),
                       "build_task_s": round(statistics.median(r[2] for r in runs), 3)})
    fixed_cpu = builds[0]["cpu_s"]
    data_cpu = builds[1]["cpu_s"] - fixed_cpu
    return {"steps": steps, "choices": startup_choices(3 * repeat), "builds": builds,
            "fixed_cpu_s": round(fixed_cpu, 3),
            "data_cpu_s": round(data_cpu, 3),
            "total_over_data_cpu": round(builds[1]["cpu_s"] / data_cpu, 2) if data_cpu > 0 else None,
            "wall_over_build_task": round(builds[1]["wall_s"] / builds[1]["build_task_s"], 2)}


# Record kinds for the group-size measurement: (name, mean tokens per record),
# the means of tinyshakespeare lines and of C4 documents under the benchmark's
# 8,000-piece SentencePiece model.
GROUP_KINDS = (("short lines", 12), ("documents", 480))
GROUP_SIZES = (1, 4, 16, 64, None)  # None: the format's rule (fmt.group_size_for)


def file_group_size(path) -> int:
    """The group size an ArrayRecord file's header records."""
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(path))
    try:
        options = dict(o.split(":", 1) for o in reader.writer_options_string().split(",") if ":" in o)
    finally:
        reader.close()
    return int(options["group_size"])


def group_sizes(tmp: pathlib.Path, *, records: int, batch_size: int = 256, steps: int = 200) -> list[dict]:
    """What ArrayRecord's ``group_size`` does to writing and to the feeder's
    random access, for short and long records (uint16 tokens, random lengths
    around the kind's mean): write CPU microseconds per record (data and
    provenance files, as ``write_shard`` writes them), file bytes per record,
    and the feeder's read CPU microseconds per example (``Feeder``, one thread,
    batches of random positions, the cache in the page cache).

    The data file's group size is each given one, then the format's rule
    (``auto``, ``seqcache.format.group_size_for``); provenance files are
    written in groups of ``fmt.PROVENANCE_GROUP_SIZE`` in every row."""
    import resource

    from seqcache import format as fmt
    from seqcache.feeders import Feeder
    from seqcache.pipelines import writer

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    rng = np.random.default_rng(0)
    rows = []
    specs = (fmt.FeatureSpec("targets", "uint16"),)
    for kind, mean in GROUP_KINDS:
        n = records if mean < 100 else max(records // 20, 2000)
        lengths = np.maximum(1, rng.poisson(mean, size=n))
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        data, starts = fmt.encode_batch(specs, {"targets": (rng.integers(3, 8000, size=int(offsets[-1])), offsets)})
        blob = data.tobytes()
        encoded = [blob[a:b] for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
        provenance = fmt.encode_provenance_batch(np.zeros(n, np.uint32), np.arange(n, dtype=np.uint64))
        for g in GROUP_SIZES:
            path = tmp / f"group-{mean}-{g}"
            path.mkdir()
            c0 = cpu()  # what the shard writer does with encoded records: two ArrayRecord writes each
            entry = writer.write_shard(str(path), index=0, num_shards=1, features=specs,
                                       examples=writer.EncodedChunks([(encoded, provenance)]), group_size=g)
            write_us = (cpu() - c0) / n * 1e6
            label = str(g) if g is not None else f"auto ({file_group_size(path / entry['file'])})"
            fmt.Manifest.create(
                task="g", split="train", fingerprint=fmt.fingerprint_of({}), fingerprint_inputs={}, features=[
                    {"name": "targets", "dtype": "uint16"}], shards=[entry], sources=[{"path": "synthetic"}],
                statistics={}, seed=0, sequence_length=None, packing=None, vocabularies={}).write(str(path))
            size = sum(s.num_bytes for s in fmt.read_manifest(str(path)).shards)
            with Feeder(cache=str(path), global_batch_size=batch_size, sequence_length=int(mean * 2),
                        host_index=0, host_count=1, num_threads=1, prefetch=0) as f:
                f.get_batch(0)
                c0 = cpu()
                for step in range(1, steps + 1):
                    f.get_batch(step)
                read_us = (cpu() - c0) / (steps * batch_size) * 1e6
            rows.append({"records": kind, "mean_tokens": mean, "group_size": label, "write_us": round(write_us, 2),
                         "bytes_per_record": round(size / n, 1), "feeder_read_us": round(read_us, 2)})
            shutil.rmtree(path, ignore_errors=True)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="corpus size per case, MB")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--bound-threads", type=int, default=None,
                    help="SentencePiece threads of the bound (default: --workers; 0: the build's own, "
                    "seqcache.tasks.vocabularies.encoding_threads(), the CPUs this process may use)")
    ap.add_argument("--cases", default="lines,documents")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--t5", action="store_true",
                    help="also build the documents corpus with span corruption and first-fit packing "
                    "(ratios to the plain LM build of the same text, packing efficiency per feature)")
    ap.add_argument("--no-tokenizers", dest="tokenizers", action="store_false",
                    help="skip the bound of a tokenizers BPE (same sample, same vocabulary size) next to SentencePiece's")
    ap.add_argument("--bound-only", action="store_true", help="measure the tokenizer bounds only, no builds")
    ap.add_argument("--memory", action="store_true",
                    help="also build the lines corpus with 1, 4 and 16 shards: peak RSS should fall with the shard size")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each bound and build (medians and ranges)")
    ap.add_argument("--startup", action="store_true", help="also break down a small build's fixed cost")
    ap.add_argument("--group-size", action="store_true",
                    help="also measure ArrayRecord group sizes: write cost, bytes, feeder random reads")
    ap.add_argument("--incremental", type=float, metavar="FACTOR", default=0,
                    help="also build each case at FACTOR times --mb, alternating with the --mb build: the "
                    "incremental CPU ratio (bound's CPU seconds for the extra records over the build's), "
                    "which leaves the fixed cost of a build out (replaces the plain throughput table: "
                    "its small builds are the --mb builds)")
    ap.add_argument("--scaling", type=int, metavar="SHARDS", default=0,
                    help="also build each case with 1 and with --workers worker processes (multi_processing), "
                    "SHARDS shards each, alternating, each on as many CPUs as it has workers: wall-clock "
                    "speed-up, and whether the shards are the same bytes (replaces the throughput table)")
    args = ap.parse_args(argv)
    unknown = {c for c in args.cases.split(",") if c} - {"lines", "documents"}
    if unknown:
        ap.error(f"--cases: no case {', '.join(sorted(unknown))} (cases: lines, documents)")
    if args.bound_threads is None:
        args.bound_threads = args.workers
    elif args.bound_threads == 0:
        from seqcache.tasks.vocabularies import encoding_threads

        args.bound_threads = encoding_threads()
    return args


def train_vocabularies(tmp: pathlib.Path, with_tokenizers: bool) -> tuple[str, str | None]:
    """(SentencePiece model path, tokenizers BPE tokenizer.json path or None), both
    trained on tinyshakespeare's lines and the C4 sample, 8,000 ids each."""
    from seqcache import tasks

    model = tmp / "spm.model"
    sample = (DATA / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").split("\n")
    sample += pq.read_table(DATA / "c4" / "c4_validation_2k.parquet", columns=["text"]).column("text").to_pylist()
    tasks.train_sentencepiece(sample, output_path=str(model), vocab_size=8000)
    bpe = train_bpe_like_spm(sample, tmp) if with_tokenizers else None
    return str(model), bpe


def throughput_row(case: str, raw_mb: float, cores: int, runs: list[tuple[float, float, float, float]],
                   bound_tokens: int, build_tokens: int) -> dict:
    """One case's row from its ``runs``: (bound s, build s, build peak RSS MB,
    bound CPU s / build CPU s) each; MB/s, tokens/s, the build/bound ratios in
    wall and CPU time (median, min, max) and the peak RSS (the largest run's)."""
    ratios = [r[0] / r[1] for r in runs]
    cpu_ratios = [r[3] for r in runs]
    b_s = statistics.median(r[0] for r in runs)
    s = statistics.median(r[1] for r in runs)
    peak_mb = max(r[2] for r in runs)
    return {
        "case": case, "raw_mb": round(raw_mb, 1), "cores": cores, "runs": len(runs),
        "bound_mb_s": round(raw_mb / b_s, 2), "bound_tokens_s": round(bound_tokens / b_s),
        "build_mb_s": round(raw_mb / s, 2), "build_tokens_s": round(build_tokens / s),
        "build_s": round(s, 2), "bound_s": round(b_s, 2), "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
        "cpu_ratio": round(statistics.median(cpu_ratios), 3), "cpu_ratio_min": round(min(cpu_ratios), 3),
        "cpu_ratio_max": round(max(cpu_ratios), 3),
        "peak_rss_mb": round(peak_mb), "rss_per_raw_mb": round(peak_mb / raw_mb, 2),
    }


def measure_case(tmp: pathlib.Path, case: str, model: str, bpe: str | None,
                 args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """(throughput row or None with --bound-only, tokenizer row or None without
    ``bpe``) of one corpus (``lines`` or ``documents``) of ``args.mb`` MB."""
    maker = {"lines": make_lines, "documents": make_documents}[case]
    spec, records = maker(tmp / case, int(args.mb * 1e6))
    raw_mb = sum(len(r.encode()) for r in records) / 1e6
    tokenizers = None
    if bpe is not None:
        sp = bound(model, records, args.bound_threads)
        tokenizers = tokenizer_row(case, raw_mb, sp, hf_bound(bpe, records))
    if args.bound_only:
        return None, tokenizers
    runs = []
    for k in range(args.repeat):  # bound and build alternate, so that both see the same load
        bd, d = {}, {}
        b_s, b_tokens = bound(model, records, args.bound_threads, details=bd)
        s, stats, peak_mb = build(spec, model, str(tmp / f"cache-{case}"), args.workers, case, details=d)
        tokens = stats["tokens"]["targets"]
        assert tokens == b_tokens, (tokens, b_tokens)
        runs.append((b_s, s, peak_mb, bd["cpu_s"] / d["cpu_s"]))
        shutil.rmtree(tmp / f"cache-{case}", ignore_errors=True)
    del records
    return throughput_row(case, raw_mb, args.workers, runs, b_tokens, tokens), tokenizers


def memory_rows(tmp: pathlib.Path, model: str, mb: float) -> list[dict]:
    """Peak RSS (MB) and seconds of one-worker builds of ``mb`` MB of lines in 1,
    4 and 16 shards, with the raw MB per shard."""
    spec, records = make_lines(tmp / "memory", int(mb * 1e6))
    raw_mb = sum(len(r.encode()) for r in records) / 1e6
    del records
    memory = []
    for shards in (1, 4, 16):
        s, stats, peak_mb = build(spec, model, str(tmp / f"cache-m{shards}"), 1, "m", num_shards=shards)
        memory.append({"shards": shards, "raw_mb_per_shard": round(raw_mb / shards, 1),
                       "peak_rss_mb": round(peak_mb), "build_s": round(s, 2)})
        shutil.rmtree(tmp / f"cache-m{shards}", ignore_errors=True)
    return memory


def scaling_row(tmp: pathlib.Path, case: str, model: str, args: argparse.Namespace) -> dict:
    """One case built ``args.repeat`` times with one worker on one CPU (the
    local engine in_memory, the fastest way to use one core, pinned to it:
    SentencePiece's own threads would otherwise use the other cores) and with
    ``args.workers`` worker processes on as many CPUs (``multi_processing``;
    ``args.scaling`` shards both, so that the shard count does not follow the
    workers), alternating: the median wall-clock speed-up (1-worker seconds
    over N-worker seconds) with its range, the CPU seconds of each, and whether
    every build's shards have the same sha256 (G1)."""
    from seqcache import format as fmt

    folder = tmp / f"scaling-{case}"
    maker = {"lines": make_lines, "documents": make_documents}[case]
    spec, records = maker(folder / "in", int(args.mb * 1e6))
    raw_mb = sum(len(r.encode()) for r in records) / 1e6
    seconds = {1: [], args.workers: []}
    cpu = {1: [], args.workers: []}
    digests = set()
    for k in range(args.repeat):
        for workers in ((1, args.workers) if k % 2 == 0 else (args.workers, 1)):
            cache = folder / f"cache-{workers}-{k}"
            d = {}
            s, _, _ = build(spec, model, str(cache), workers, case, num_shards=args.scaling, details=d,
                            cpus=set(sorted(os.sched_getaffinity(0))[:workers]))
            seconds[workers].append(s)
            cpu[workers].append(d["cpu_s"])
            out = cache / case / "train"
            digests.add(tuple(map(tuple, fmt.read_shard_checksums(str(out), fmt.read_manifest(str(out))))))
            shutil.rmtree(cache, ignore_errors=True)
    speedups = [a / b for a, b in zip(seconds[1], seconds[args.workers])]
    return {"case": case, "raw_mb": round(raw_mb, 1), "shards": args.scaling, "workers": args.workers,
            "runs": args.repeat, "seconds_1": round(statistics.median(seconds[1]), 2),
            "seconds_n": round(statistics.median(seconds[args.workers]), 2),
            "cpu_s_1": round(statistics.median(cpu[1]), 2), "cpu_s_n": round(statistics.median(cpu[args.workers]), 2),
            "speedup": round(statistics.median(speedups), 3), "speedup_min": round(min(speedups), 3),
            "speedup_max": round(max(speedups), 3), "same_bytes": len(digests) == 1}


def print_scaling(rows: list[dict]) -> None:
    print(f"\n{'case':10} {'MB':>6} {'shards':>6} {'workers':>7} {'1 worker s':>10} {'N workers s':>11} "
          f"{'speed-up':>22} {'same bytes':>10}")
    for r in rows:
        print(f"{r['case']:10} {r['raw_mb']:6.1f} {r['shards']:6d} {r['workers']:7d} {r['seconds_1']:10.2f} "
              f"{r['seconds_n']:11.2f} {r['speedup']:8.3f} [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}] "
              f"{str(r['same_bytes']):>10}")


def incremental_row(tmp: pathlib.Path, case: str, model: str, args: argparse.Namespace) -> dict:
    """The build's CPU cost of the records a corpus ``args.incremental`` times
    larger adds, against the bound's for the same records: for each of
    ``args.repeat`` rounds (small bound, small build, large bound, large
    build), ``(bound CPU large - small) / (build CPU large - small)``. The
    fixed cost of a build (imports, Beam's set-up) cancels out."""
    maker = {"lines": make_lines, "documents": make_documents}[case]
    corpora = []
    for label, mb in (("small", args.mb), ("large", args.mb * args.incremental)):
        spec, records = maker(tmp / f"{case}-{label}", int(mb * 1e6))
        corpora.append((label, spec, records, sum(len(r.encode()) for r in records) / 1e6))
    ratios, cpu, totals = [], {}, {}
    for _ in range(args.repeat):
        seconds = {}
        for label, spec, records, _ in corpora:
            bd, d = {}, {}
            bound(model, records, args.bound_threads, details=bd)
            build(spec, model, str(tmp / f"cache-{case}-{label}"), args.workers, case, details=d)
            shutil.rmtree(tmp / f"cache-{case}-{label}", ignore_errors=True)
            seconds[label] = (bd["cpu_s"], d["cpu_s"])
            cpu.setdefault(label, []).append(seconds[label])
        (b0, s0), (b1, s1) = seconds["small"], seconds["large"]
        ratios.append((b1 - b0) / (s1 - s0))
        totals.setdefault("small", []).append(b0 / s0)
        totals.setdefault("large", []).append(b1 / s1)
    row = {"case": case, "small_mb": round(corpora[0][3], 1), "large_mb": round(corpora[1][3], 1),
           "runs": len(ratios), "ratio": round(statistics.median(ratios), 3),
           "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    for label in cpu:
        row[f"{label}_cpu_ratio"] = [round(statistics.median(totals[label]), 3), round(min(totals[label]), 3),
                                     round(max(totals[label]), 3)]
        row[f"{label}_bound_cpu_s"] = round(statistics.median(b for b, _ in cpu[label]), 2)
        row[f"{label}_build_cpu_s"] = round(statistics.median(s for _, s in cpu[label]), 2)
    return row


def print_incremental(rows: list[dict]) -> None:
    def fmt(m, lo, hi):
        return f"{m:.1%} [{lo:.1%}, {hi:.1%}]"

    print(f"\n{'case':10} {'MB small':>8} {'MB large':>8} {'bound CPU s':>13} {'build CPU s':>13} "
          f"{'CPU ratio small':>22} {'CPU ratio large':>22} {'incremental CPU ratio':>22}")
    for r in rows:
        print(f"{r['case']:10} {r['small_mb']:8.1f} {r['large_mb']:8.1f} "
              f"{r['small_bound_cpu_s']:6.2f}/{r['large_bound_cpu_s']:<6.2f} "
              f"{r['small_build_cpu_s']:6.2f}/{r['large_build_cpu_s']:<6.2f} {fmt(*r['small_cpu_ratio']):>22} "
              f"{fmt(*r['large_cpu_ratio']):>22} {fmt(r['ratio'], r['ratio_min'], r['ratio_max']):>22}")
    print("(bound and build CPU seconds small/large, medians; CPU ratios: the bound's CPU seconds over the "
          "build's, of each size and of the records the large corpus adds; median [min, max] over rounds)")


def measure(args: argparse.Namespace) -> dict:
    """Every measurement the arguments ask for, in a temporary folder removed
    afterwards: the report written by --json (``throughput``, ``memory``, ``t5``,
    ``tokenizers``: lists of rows; ``startup``: a dict or None; ``group_size``: rows)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="seqcache-bench-"))
    results = {"throughput": [], "memory": [], "t5": [], "tokenizers": [], "startup": None, "group_size": []}
    try:
        model, bpe = train_vocabularies(tmp, args.tokenizers)
        for case in [c for c in args.cases.split(",") if c and not (args.incremental or args.scaling)]:
            row, tokenizers = measure_case(tmp, case, model, bpe, args)
            if tokenizers is not None:
                results["tokenizers"].append(tokenizers)
            if row is not None:
                results["throughput"].append(row)
        if args.startup:
            results["startup"] = startup(tmp, model, args.repeat)
        if args.group_size:
            results["group_size"] = group_sizes(tmp, records=200_000)
        if args.memory:
            results["memory"] = memory_rows(tmp, model, args.mb)
        if args.t5:
            results["t5"] = t5_rows(tmp, model, int(args.mb * 1e6), args.workers)
        if args.incremental:
            results["incremental"] = [incremental_row(tmp, case, model, args)
                                      for case in args.cases.split(",") if case]
        if args.scaling:
            results["scaling"] = [scaling_row(tmp, case, model, args) for case in args.cases.split(",") if case]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def print_throughput(rows: list[dict]) -> None:
    print(f"{'case':10} {'MB':>7} {'cores':>5} {'bound MB/s':>11} {'build MB/s':>11} {'build tok/s':>12} "
          f"{'build/bound wall':>24} {'build/bound CPU':>24} {'peak RSS MB':>12}")
    for r in rows:
        ratio = f"{r['ratio']:.1%} [{r['ratio_min']:.1%}, {r['ratio_max']:.1%}]"
        cpu_ratio = f"{r['cpu_ratio']:.1%} [{r['cpu_ratio_min']:.1%}, {r['cpu_ratio_max']:.1%}]"
        print(f"{r['case']:10} {r['raw_mb']:7.1f} {r['cores']:5d} {r['bound_mb_s']:11.2f} {r['build_mb_s']:11.2f} "
              f"{r['build_tokens_s']:12,d} {ratio:>24} {cpu_ratio:>24} {r['peak_rss_mb']:12,d}")
    print("(median [min, max] over runs; CPU: the bound's CPU seconds over the build's, children included)")


def print_startup(fixed: dict) -> None:
    print(f"\n{'start-up step (fresh interpreter)':50} {'CPU s':>7} {'wall s':>7}")
    for st in fixed["steps"]:
        print(f"{st['step']:50} {st['cpu_s']:7.2f} {st['wall_s']:7.2f}")
    rounds = fixed["choices"][0]["rounds"] if fixed["choices"] else 0
    print(f"\n{'the Beam step with one choice undone':66} {'+CPU s':>7} {'+wall s':>7}  (paired, median of {rounds})")
    for c in fixed["choices"]:
        print(f"{c['choice_undone']:66} {c['extra_cpu_s']:+7.2f} {c['extra_wall_s']:+7.2f}")
    print(f"\n{'build':20} {'wall s':>7} {'CPU s':>7} {'build_task s':>13}")
    for b in fixed["builds"]:
        print(f"{b['build']:20} {b['wall_s']:7.2f} {b['cpu_s']:7.2f} {b['build_task_s']:13.2f}")
    print(f"fixed CPU {fixed['fixed_cpu_s']:.2f} s, data CPU {fixed['data_cpu_s']:.2f} s; total/data CPU "
          f"{fixed['total_over_data_cpu']}; wall/build_task {fixed['wall_over_build_task']}")


def print_group_sizes(groups: list[dict]) -> None:
    print(f"\n{'records':12} {'group_size':>10} {'write us/rec':>13} {'bytes/rec':>10} {'feeder read us/ex':>18}")
    for g in groups:
        print(f"{g['records']:12} {g['group_size']:>10} {g['write_us']:13.2f} {g['bytes_per_record']:10.1f} "
              f"{g['feeder_read_us']:18.2f}")


def print_memory(memory: list[dict]) -> None:
    print(f"\n{'shards':>6} {'raw MB/shard':>13} {'peak RSS MB':>12}")
    for m in memory:
        print(f"{m['shards']:6d} {m['raw_mb_per_shard']:13.1f} {m['peak_rss_mb']:12,d}")


def print_report(results: dict) -> None:
    """The tables of ``measure``'s report, the throughput table always, the others
    when they have rows."""
    print_throughput(results["throughput"])
    if results["startup"]:
        print_startup(results["startup"])
    if results["group_size"]:
        print_group_sizes(results["group_size"])
    if results["tokenizers"]:
        print_tokenizer_rows(results["tokenizers"])
    if results["memory"]:
        print_memory(results["memory"])
    if results["t5"]:
        print_t5(results["t5"])
    if results.get("incremental"):
        print_incremental(results["incremental"])
    if results.get("scaling"):
        print_scaling(results["scaling"])


def main(argv=None):
    args = parse_args(argv)
    # tokenizers' thread pool reads this once, at its first use: as many threads as SentencePiece gets.
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.bound_threads))
    results = measure(args)
    results["bound_threads"] = args.bound_threads
    print(f"bounds: {args.bound_threads} encoding thread(s); builds: {args.workers} worker(s)")
    print_report(results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return (results["throughput"] or results["t5"] or results["tokenizers"] or results["startup"]
            or results["group_size"] or results.get("incremental"))


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
