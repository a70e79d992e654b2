"""A small build against datatrove's: the CPU (user + system, the command's
waited children included) and wall seconds of ``seqcache build`` and of
datatrove's tokenization pipeline (``JsonlReader`` then ``DocumentTokenizer``,
one task, shuffled documents, EOS after each) on the same JSON lines corpus
of ``--mb`` MB of C4 text with the same BPE ``tokenizer.json``, each in a
fresh interpreter, the pair run in alternating order ``--repeat`` times. The
figure is the per-round ratio seqcache / datatrove (CPU and wall), median
[min, max], after one untimed run of each (bytecode caches written, as an
installed package has them): both pay their start-up (seqcache's is mostly Beam's import), so
at 1 MB the ratio is about start-up, at 50 MB about throughput.

datatrove is not a dependency of seqcache: give the Python of an environment
that has it (``python -m venv dt && dt/bin/pip install datatrove tokenizers``)::

    python benchmarks/small_build_peers.py --datatrove-python dt/bin/python --mb 1 --repeat 7

benchmarks/README.md, "A small build against datatrove".
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

C4 = pathlib.Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "c4" / "c4_validation_2k.parquet"
EOS = "</s>"
DATATROVE = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer

corpus, tokenizer, out, logs = sys.argv[1:5]
LocalPipelineExecutor(pipeline=[
    JsonlReader(corpus, glob_pattern="*.jsonl"),
    DocumentTokenizer(out, tokenizer_name_or_path=tokenizer, eos_token="{eos}", seed=0, shuffle_documents=True),
], tasks=1, workers=1, logging_dir=logs).run()
""".format(eos=EOS)


def corpus(folder: pathlib.Path, mb: float) -> pathlib.Path:
    """``folder/docs/c4.jsonl``: C4's validation texts ({"text": ...} a line),
    repeated until ``mb`` MB; the repeats get a line number so that no two
    records are equal."""
    import pyarrow.parquet as pq

    texts = pq.read_table(C4, columns=["text"]).column("text").to_pylist()
    path = folder / "docs" / "c4.jsonl"
    path.parent.mkdir(parents=True)
    size, i = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < mb * 1e6:
            text = texts[i % len(texts)] + ("" if i < len(texts) else f" ({i})")
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size, i = size + len(line.encode()), i + 1
    return path


def tokenizer(folder: pathlib.Path, corpus_path: pathlib.Path) -> pathlib.Path:
    """A byte-level BPE tokenizer.json of 8,000 ids trained on the corpus, EOS ``</s>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    lines = (json.loads(line)["text"] for line in open(corpus_path, encoding="utf-8"))
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<pad>", EOS]))
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


def timed(command: list[str], cwd: pathlib.Path) -> tuple[float, float]:
    """(CPU seconds of the process and its waited children, wall seconds) of ``command``."""
    # Each with its modules' bytecode cached, as an installed package has it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{err[-2000:]}")
    return usage.ru_utime + usage.ru_stime, wall


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datatrove-python", required=True, help="a Python whose environment has datatrove")
    parser.add_argument("--mb", type=float, default=1.0, help="corpus size (MB of JSON lines)")
    parser.add_argument("--repeat", type=int, default=5, help="alternating pairs (median, min, max)")
    parser.add_argument("--json", help="write the rounds here")
    args = parser.parse_args()
    seqcache = shutil.which("seqcache") or sys.exit("seqcache is not on PATH")
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp:
        work = pathlib.Path(tmp)
        path = corpus(work, args.mb)
        tok = tokenizer(work, path)
        runs = {
            "seqcache": lambda r: [seqcache, "build", "--source", f"jsonl:{path}#text", "--vocabulary",
                                   f"{tok}#eos={EOS}", "--name", "c4", "--cache-dir", str(work / f"sc{r}")],
            "datatrove": lambda r: [args.datatrove_python, "-c", DATATROVE, str(path.parent), str(tok),
                                    str(work / f"dt{r}"), str(work / f"dtlogs{r}")],
        }
        for name, command in runs.items():  # untimed: writes each one's bytecode caches
            timed(command("warm"), work)
        rounds = []
        for r in range(args.repeat):
            order = ["seqcache", "datatrove"] if r % 2 == 0 else ["datatrove", "seqcache"]
            got = {name: timed(runs[name](r), work) for name in order}
            rounds.append({name: {"cpu_s": c, "wall_s": w} for name, (c, w) in got.items()})
            print(f"round {r}: " + ", ".join(f"{n} {c:.2f} CPU s {w:.2f} s" for n, (c, w) in got.items()), flush=True)
    print(f"{args.mb:g} MB, {args.repeat} alternating pairs; seqcache / datatrove, median [min, max]:")
    for what in ("cpu_s", "wall_s"):
        ratios = [r["seqcache"][what] / r["datatrove"][what] for r in rounds]
        each = {n: statistics.median(r[n][what] for r in rounds) for n in ("seqcache", "datatrove")}
        print(f"  {what}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]  "
              f"(medians: seqcache {each['seqcache']:.2f}, datatrove {each['datatrove']:.2f})")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"mb": args.mb, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
