"""A process that runs builds for the tests of builds that die (test_resume.py).

It imports seqcache once, then reads jobs from its standard input, one JSON
object a line, and forks a fresh child per job, so that each build is a new
process (killed, stopped, or resumed from what is on disk only) without an
interpreter's start and Beam's import each time:

    {"run": {"folder": ..., "cache_dir": ..., "fault": "<point>:<n>:<action>" or null,
             "log": path or null, "result": path, "build": {build_task keywords}}}
        -> {"pid": n}: the child's process id
    {"wait": pid, "untraced": bool}
        -> {"exited": code or null, "signal": n or null, "stopped": bool}

The child builds ``task(folder)``: the lines of the ``*.txt`` files in
``folder`` as bytes, blank lines skipped, lines of bad UTF-8 skipped (both
quarantined), packed to rows of 96 tokens; ``build`` may set ``num_shards``,
``split_size``, ``overwrite``, ``resume``, ``keep_work``; every checkpoint
holds ``CHECKPOINT_BYTES`` of examples and a preprocessing batch
``BATCH_BYTES`` of text (small values: many checkpoints a unit, whatever the
shard count). It
writes ``{"ok": true, "work": manifest's work, "reused": bool}`` or ``{"ok":
false, "error": "..."}`` to ``result``.
"""

from __future__ import annotations

import json
import os
import sys

from seqcache import process, tasks
from seqcache.pipelines import BuildConfig, build_task
from seqcache.pipelines import transforms, work as work_mod

CHECKPOINT_BYTES = 16 << 10
BATCH_BYTES = 8 << 10


def task(folder: str):
    source = tasks.TextLineSource(os.path.join(folder, "*.txt"), on_error={"empty": "skip", "invalid_utf8": "skip"})
    P = tasks.preprocessors
    return tasks.Task("lines", source=source, output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[P.rekey({"targets": "text"}), P.tokenize(), P.append_eos()], packing="lm")


def child(job: dict) -> None:
    for name in (process.FAULT_VARIABLE, process.FAULT_LOG_VARIABLE):
        os.environ.pop(name, None)
    if job.get("fault"):
        os.environ[process.FAULT_VARIABLE] = job["fault"]
    if job.get("log"):
        os.environ[process.FAULT_LOG_VARIABLE] = job["log"]
    work_mod.CHECKPOINT_BYTES, work_mod.MIN_SECTION_BYTES = CHECKPOINT_BYTES, CHECKPOINT_BYTES // 8
    # Preprocessing batches of 8 KiB of text (a checkpoint falls between two batches): several a unit.
    transforms.ReadPreprocess.__init__.__kwdefaults__["batch_bytes"] = BATCH_BYTES
    options = dict(job.get("build") or {})
    config = BuildConfig(num_shards=options.pop("num_shards", 2), sequence_length={"targets": 96})
    try:
        result = build_task(task(job["folder"]), cache_dir=job["cache_dir"], config=config, **options)
        work = result.manifest.work
        out = {"ok": True, "reused": result.reused,
               "work": None if work is None else {f: getattr(work, f) for f in work.__struct_fields__}}
    except BaseException as e:  # noqa: BLE001  (the test reads it)
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump(out, f)


def main() -> None:
    for line in sys.stdin:
        job = json.loads(line)
        if "run" in job:
            pid = os.fork()
            if pid == 0:
                try:
                    child(job["run"])
                finally:
                    os._exit(0)
            reply = {"pid": pid}
        else:
            _, status = os.waitpid(job["wait"], os.WUNTRACED if job.get("untraced") else 0)
            reply = {"exited": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                     "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                     "stopped": os.WIFSTOPPED(status)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
