"""A build that dies resumes, byte for byte: killed with SIGKILL at seeded
random moments (while reading, between a checkpoint's files and its ledger,
while writing shards, while writing the manifest, while removing its work
folder), the same build run again reuses every checkpoint committed and every
shard written, and gives the shards, quarantine, source table and statistics
of a build that never died (G1). A bit flip or a truncation in the work folder
is found by its sha256 and redone, never read; two builds of one cache at
once: the second refuses in one line and nothing mixes; a build of a grown
corpus killed in the middle resumes to the bytes of a fresh build.

Each build is a fresh process forked by ``build_server.py`` (seqcache
imported once): the build's moments are its fault points
(``seqcache.process.fault_point``), which ``$SEQCACHE_FAULT`` turns into a
SIGKILL (or a SIGSTOP) at the n-th passage, so every kill lands at the same
place on every machine. The corpus: 9,000 lines of tinyshakespeare in three
files, a run of lines repeated across files (copies spread to their own
keys), blank lines and lines of bad UTF-8 (quarantined), packed to rows of 96
bytes in 2 shards, about 16 units, each checkpointed every 16 KiB of examples.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys

import pytest

from seqcache import format as fmt
from seqcache.pipelines import work as work_mod

HERE = pathlib.Path(__file__).resolve().parent
SEED = 20261206
SPLIT_SIZE = 24_000


class Server:
    """``build_server.py`` running: ``start`` a build (its pid), ``wait`` for it."""

    def __init__(self, tmp: pathlib.Path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
        for name in ("SEQCACHE_FAULT", "SEQCACHE_FAULT_LOG"):
            env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, str(HERE / "build_server.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.tmp, self.count = tmp, 0

    def _ask(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the build server died"
        return json.loads(line)

    def start(self, folder, cache_dir, *, fault=None, log=None, **build) -> tuple[int, pathlib.Path]:
        self.count += 1
        result = self.tmp / f"result-{self.count}.json"
        job = {"folder": str(folder), "cache_dir": str(cache_dir), "fault": fault, "log": log and str(log),
               "result": str(result), "build": build}
        return self._ask({"run": job})["pid"], result

    def wait(self, pid: int, *, untraced: bool = False) -> dict:
        return self._ask({"wait": pid, "untraced": untraced})

    def build(self, folder, cache_dir, **kw) -> dict:
        """Runs a build to its end (or its death): {"status": wait's reply, "result": the child's, or None}."""
        pid, result = self.start(folder, cache_dir, **kw)
        status = self.wait(pid)
        return {"status": status, "result": json.loads(result.read_text()) if result.exists() else None}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    try:
        yield s
    finally:
        s.close()


def _write_corpus(folder: pathlib.Path, lines: list[str], parts: int = 3) -> pathlib.Path:
    folder.mkdir(parents=True)
    repeated = lines[100:160]  # the same 60 lines again in every file: copies of identical records
    for k in range(parts):
        body = lines[k * len(lines) // parts:(k + 1) * len(lines) // parts] + repeated
        data = "\n".join(body).encode() + b"\n"
        if k == 1:
            data += b"\xff\xfe not UTF-8\n\n\n"
        (folder / f"part-{k}.txt").write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpora):
    return _write_corpus(tmp_path_factory.mktemp("corpus") / "in", corpora.shakespeare_lines(9000))


def _cache_bytes(cache_dir) -> dict:
    """What must not depend on how the build went: sha256 of every file of the
    cache but the manifest, and the manifest's statistics."""
    folder = pathlib.Path(cache_dir)
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())
           if p.is_file() and p.name != fmt.MANIFEST_NAME}
    out["statistics"] = json.loads((folder / fmt.MANIFEST_NAME).read_text())["statistics"]
    return out


@pytest.fixture(scope="module")
def reference(server, corpus, tmp_path_factory):
    """The build that never died (keeping no work), and the moments of a build
    that keeps it: ``(cache bytes, [fault point names in order])``."""
    root = tmp_path_factory.mktemp("reference")
    done = server.build(corpus, root / "plain", split_size=SPLIT_SIZE, resume=False)
    assert done["result"]["ok"], done
    log = root / "moments.log"
    logged = server.build(corpus, root / "logged", split_size=SPLIT_SIZE, log=log)
    assert logged["result"]["ok"], logged
    plain = _cache_bytes(root / "plain" / "lines" / "train")
    assert _cache_bytes(root / "logged" / "lines" / "train") == plain
    assert plain["statistics"]["skipped_records"] > 0 and "quarantine.jsonl" in plain
    return plain, log.read_text().split()


def _moments(names: list[str], how_many: int) -> list[tuple[int, str, int]]:
    """``how_many`` moments of a build, ``(position, point, its n-th passage)``,
    drawn with a fixed seed, among them always the first shard written, the
    manifest's write, a checkpoint between its files and its ledger, and the
    removal of the work folder."""
    seen = collections.Counter()
    every = []
    for position, name in enumerate(names):
        seen[name] += 1
        every.append((position, name, seen[name]))
    forced = [next(m for m in every if m[1] == "write:shard"), next(m for m in every if m[1] == "manifest"),
              [m for m in every if m[1] == "unit:files"][seen["unit:files"] // 2],
              next(m for m in every if m[1] == "work:remove")]
    rest = [m for m in every if m not in forced]
    return sorted(forced + random.Random(SEED).sample(rest, how_many - len(forced)))


def test_a_build_killed_at_ten_moments_resumes_to_the_same_bytes(server, corpus, reference, tmp_path):
    want, names = reference
    moments = _moments(names, 10)
    assert {"read:batch", "write:shard", "manifest", "unit:files", "work:remove"} <= {m[1] for m in moments}
    for position, point, n in moments:
        cache = tmp_path / f"kill-{position}"
        killed = server.build(corpus, cache, split_size=SPLIT_SIZE, fault=f"{point}:{n}:kill")
        assert killed["status"]["signal"] == signal.SIGKILL and killed["result"] is None, (point, n, killed)
        out_dir = cache / "lines" / "train"
        # G7: a build killed before its manifest was written leaves no cache that looks complete.
        assert (out_dir / fmt.MANIFEST_NAME).exists() == (point == "work:remove"), (point, n)
        again = server.build(corpus, cache, split_size=SPLIT_SIZE)
        assert again["result"]["ok"], (point, n, again)
        assert _cache_bytes(out_dir) == want, (point, n)
        assert not (cache / "lines" / ".train.work").exists()  # removed once the cache is complete
        before = names[:position]
        if point == "work:remove":  # the cache was complete: found, not built again
            assert again["result"]["reused"], (point, n)
            continue
        work = again["result"]["work"]
        # Every checkpoint committed before the kill is reused (a kill at "unit:ledger" comes right
        # after a commit), and every shard recorded as written ("write:shard" comes before the record).
        assert work["checkpoints_reused"] == before.count("unit:ledger") + (point == "unit:ledger"), (point, n, work)
        assert work["checkpoints_rejected"] == 0
        assert work["shards_reused"] == before.count("write:shard"), (point, n, work)


def _killed_after_some_units(server, corpus, cache) -> pathlib.Path:
    """A build killed at its 12th ledger commit; returns its work folder."""
    killed = server.build(corpus, cache, split_size=SPLIT_SIZE, fault="unit:ledger:12:kill")
    assert killed["status"]["signal"] == signal.SIGKILL
    return cache / "lines" / ".train.work"


def _run_files(work: pathlib.Path) -> list[pathlib.Path]:
    """The flush files its ledgers name, in the order of the ledgers' names and checkpoints."""
    out = []
    for ledger in sorted((work / "units").iterdir()):
        for cp in json.loads(work_mod.unseal(ledger.read_bytes(), str(ledger)))["checkpoints"]:
            if cp.get("run"):
                out.append(work / "runs" / cp["run"]["name"])
    return out


@pytest.mark.parametrize("damage", ["bit flip", "truncation", "torn ledger", "a ledger's count off by one bit"])
def test_a_damaged_work_folder_is_found_and_redone_never_read(server, corpus, reference, tmp_path, damage):
    want, _ = reference
    cache = tmp_path / "c"
    work = _killed_after_some_units(server, corpus, cache)
    runs = _run_files(work)
    assert len(runs) >= 6
    committed = len(runs)
    if damage == "bit flip":
        target = runs[2]
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "truncation":
        target = runs[2]
        target.write_bytes(target.read_bytes()[:-7])
    elif damage == "torn ledger":
        target = sorted((work / "units").iterdir())[0]
        target.write_bytes(target.read_bytes()[:-20])
    else:  # still valid JSON, a plausible count: only the ledger's own sha256 tells
        target = sorted((work / "units").iterdir())[0]
        data = bytearray(target.read_bytes())
        at = data.index(b'"records":') + len(b'"records":')
        data[at] ^= 0x01  # one digit changed into another
        target.write_bytes(bytes(data))
    again = server.build(corpus, cache, split_size=SPLIT_SIZE)
    assert again["result"]["ok"], again
    assert _cache_bytes(cache / "lines" / "train") == want
    work_done = again["result"]["work"]
    assert work_done["checkpoints_rejected"] >= 1
    assert work_done["checkpoints_reused"] < committed


def test_two_builds_of_one_cache_at_once_one_refuses_in_one_line_and_nothing_mixes(server, corpus, reference,
                                                                                    tmp_path):
    want, _ = reference
    cache = tmp_path / "c"
    first, first_result = server.start(corpus, cache, split_size=SPLIT_SIZE, fault="unit:ledger:3:stop")
    assert server.wait(first, untraced=True)["stopped"]  # the first build holds the cache, mid-way
    second = server.build(corpus, cache, split_size=SPLIT_SIZE)
    error = second["result"]["error"]
    assert second["status"]["exited"] == 0 and not second["result"]["ok"]
    assert "another build of this cache is running" in error and "\n" not in error
    os.kill(first, signal.SIGCONT)
    assert server.wait(first)["exited"] == 0
    assert json.loads(first_result.read_text())["ok"]
    assert _cache_bytes(cache / "lines" / "train") == want


def test_a_build_of_a_grown_corpus_killed_in_the_middle_resumes_to_the_bytes_of_a_fresh_build(
        server, corpus, corpora, tmp_path):
    folder = tmp_path / "in"
    shutil.copytree(corpus, folder)
    cache = tmp_path / "c"
    first = server.build(folder, cache, split_size=SPLIT_SIZE, keep_work=True)
    assert first["result"]["ok"] and (cache / "lines" / ".train.work" / "plan.json").exists()
    # The corpus grows by a file (its name sorts first: every other file's index moves) and loses a line.
    (folder / "0-new.txt").write_text("\n".join(corpora.shakespeare_lines(12000)[9000:10500]) + "\n")
    changed = folder / "part-2.txt"
    changed.write_bytes(changed.read_bytes().replace(b"\n", b"\n\n", 1))
    killed = server.build(folder, cache, split_size=SPLIT_SIZE, overwrite=True, keep_work=True, num_shards=3,
                          fault="unit:ledger:4:kill")
    assert killed["status"]["signal"] == signal.SIGKILL
    grown = server.build(folder, cache, split_size=SPLIT_SIZE, overwrite=True, keep_work=True, num_shards=3)
    assert grown["result"]["ok"], grown
    fresh = server.build(folder, tmp_path / "fresh", split_size=SPLIT_SIZE, resume=False, num_shards=3)
    assert fresh["result"]["ok"]
    assert _cache_bytes(cache / "lines" / "train") == _cache_bytes(tmp_path / "fresh" / "lines" / "train")
    work = grown["result"]["work"]
    # The units of part-0 and part-1 (unchanged) came from the first build, those of the new file
    # from the killed one (4 checkpoints), part-2's were read again.
    assert work["units_reused"] >= 2 and work["units_reused"] + work["units_resumed"] < work["units"]
    assert work["checkpoints_reused"] > 4


def test_a_shard_mark_off_by_one_bit_is_found_and_the_shard_written_again(server, corpus, reference, tmp_path):
    """A build killed while writing its manifest (every shard written and
    marked); one digit of a shard's recorded statistics changed: its mark's
    sha256 no longer matches, so the shard is written again and the
    statistics are right."""
    want, _ = reference
    cache = tmp_path / "c"
    killed = server.build(corpus, cache, split_size=SPLIT_SIZE, fault="manifest:1:kill")
    assert killed["status"]["signal"] == signal.SIGKILL
    marks = sorted((cache / "lines" / "train" / "_tmp" / "shards").iterdir())
    assert len(marks) == 2
    data = bytearray(marks[0].read_bytes())
    at = data.index(b'"examples":') + len(b'"examples":')
    data[at] ^= 0x01
    marks[0].write_bytes(bytes(data))
    again = server.build(corpus, cache, split_size=SPLIT_SIZE)
    assert again["result"]["ok"], again
    assert again["result"]["work"]["shards_reused"] == 1
    assert _cache_bytes(cache / "lines" / "train") == want
