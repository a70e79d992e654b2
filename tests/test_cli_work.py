"""The work folder on the command line: ``build --work auto|keep|off`` and
``--work-dir``, what a build that died says and what its rerun prints and
reports (``--json``), and ``seqcache clean``."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main
from testsupport import write_lines

CLI = [sys.executable, "-c", "import sys; from seqcache.cli.main import run; sys.argv[0] = 'seqcache'; sys.exit(run())"]


def _build_args(corpus, cache_dir, *extra):
    return ["build", "--source", f"text:{corpus}/*.txt", "--name", "shk", "--split-size", "30000",
            "--cache-dir", str(cache_dir), *extra]


def _corpus(tmp_path, corpora, parts=3):
    lines = corpora.shakespeare_lines(6000)
    for k in range(parts):
        write_lines(tmp_path / "in" / f"part-{k}.txt", lines[k * 2000:(k + 1) * 2000])
    return tmp_path / "in"


def test_keep_off_and_the_work_reported_in_json(tmp_path, corpora):
    corpus = _corpus(tmp_path, corpora)
    runner = CliRunner()
    kept = runner.invoke(main, _build_args(corpus, tmp_path / "c", "--work", "keep", "--json"), catch_exceptions=False)
    assert kept.exit_code == 0, kept.output
    (report,) = json.loads(kept.stdout)
    units = report["work"]["units"]
    assert units >= 3 and report["work"]["units_reused"] == 0 and report["work"]["shards_reused"] == 0
    work_dir = tmp_path / "c" / "shk" / ".train.work"
    assert (work_dir / "plan.json").is_file() and len(list((work_dir / "units").iterdir())) == units

    off = runner.invoke(main, _build_args(corpus, tmp_path / "off", "--work", "off", "--json"), catch_exceptions=False)
    assert off.exit_code == 0, off.output
    assert "work" not in json.loads(off.stdout)[0]
    assert not (tmp_path / "off" / "shk" / ".train.work").exists()
    manifest = json.loads((tmp_path / "off" / "shk" / "train" / fmt.MANIFEST_NAME).read_text())
    assert "work" not in manifest
    sums = [fmt.read_shard_checksums(str(d), fmt.read_manifest(str(d)))
            for d in (tmp_path / "off" / "shk" / "train", tmp_path / "c" / "shk" / "train")]
    assert sums[0] == sums[1] and all(sums[0][0])

    # A corpus grown by a file reads only its units; the line says so.
    write_lines(corpus / "part-3.txt", corpora.shakespeare_lines(6500)[6000:])
    grown = runner.invoke(main, _build_args(corpus, tmp_path / "c", "--overwrite"), catch_exceptions=False)
    assert grown.exit_code == 0, grown.output
    assert f"(from the work folder: {units} of {units + 1} work units)" in grown.output
    assert not work_dir.exists()  # --work auto: removed once the cache is complete

    bad = runner.invoke(main, _build_args(corpus, tmp_path / "x", "--work", "off", "--work-dir", str(tmp_path / "w")))
    assert bad.exit_code == 2 and "--work-dir names the work folder that --work off does without" in bad.output


def test_a_killed_build_says_how_to_finish_it_and_its_rerun_says_what_it_reused(tmp_path, corpora):
    corpus = _corpus(tmp_path, corpora)
    env = {**os.environ, "SEQCACHE_FAULT": "unit:ledger:2:kill"}
    killed = subprocess.run([*CLI, *_build_args(corpus, tmp_path / "c")], env=env, capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9
    env.pop("SEQCACHE_FAULT")
    again = subprocess.run([*CLI, *_build_args(corpus, tmp_path / "c")], env=env, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stderr
    assert "(from the work folder: 2 of " in again.stderr and " work units)" in again.stderr


def test_clean_removes_the_work_folder_and_a_build_that_died_and_refuses_while_a_build_runs(tmp_path, corpora):
    corpus = _corpus(tmp_path, corpora)
    env = {**os.environ, "SEQCACHE_FAULT": "unit:ledger:2:kill"}
    subprocess.run([*CLI, *_build_args(corpus, tmp_path / "c")], env=env, capture_output=True, timeout=300)
    cache, work_dir = tmp_path / "c" / "shk" / "train", tmp_path / "c" / "shk" / ".train.work"
    assert work_dir.is_dir() and cache.is_dir() and not (cache / fmt.MANIFEST_NAME).exists()
    runner = CliRunner()
    lock = open(tmp_path / "c" / "shk" / ".train.lock", "a+")  # a build holding the cache
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    try:
        refused = runner.invoke(main, ["clean", str(cache)])
    finally:
        lock.close()
    assert refused.exit_code == 1 and "another build of this cache is running" in refused.output
    assert refused.output.rstrip().endswith("; wait for it to finish, then clean"), refused.output
    assert len(refused.output.strip().splitlines()) == 1 and work_dir.is_dir()

    dry = runner.invoke(main, ["clean", str(cache), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    lines = dry.output.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"would remove {work_dir}: work folder: 2 work units complete")
    assert lines[1].startswith(f"would remove {cache}: a build that did not finish (no manifest)")
    assert work_dir.is_dir() and cache.is_dir()
    done = runner.invoke(main, ["clean", str(cache)])
    assert done.exit_code == 0 and done.output.count("removed ") == 2
    assert not work_dir.exists() and not cache.exists()
    assert runner.invoke(main, ["clean", str(cache)]).output.strip() == f"nothing to remove beside {cache}"

    # A complete cache stays; the work folder it was kept with goes.
    built = runner.invoke(main, _build_args(corpus, tmp_path / "c", "--work", "keep"), catch_exceptions=False)
    assert built.exit_code == 0 and work_dir.is_dir()
    before = sorted(p.name for p in cache.iterdir())
    out = runner.invoke(main, ["clean", str(cache)])
    assert out.output.startswith(f"removed {work_dir}: work folder kept for a grown corpus: ")
    assert sorted(p.name for p in cache.iterdir()) == before and not work_dir.exists()


def test_a_work_dir_of_its_own_is_used_locked_and_removed(tmp_path, corpora):
    corpus = _corpus(tmp_path, corpora)
    work_dir = tmp_path / "elsewhere"
    env = {**os.environ, "SEQCACHE_FAULT": "unit:ledger:2:kill"}
    subprocess.run([*CLI, *_build_args(corpus, tmp_path / "c", "--work-dir", str(work_dir))], env=env,
                   capture_output=True, timeout=300)
    assert len(list((work_dir / "units").iterdir())) == 2 and not (tmp_path / "c" / "shk" / ".train.work").exists()
    runner = CliRunner()
    lock = open(work_dir / ".lock", "a+")  # another build using this work folder
    fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
    try:
        refused = runner.invoke(main, _build_args(corpus, tmp_path / "other", "--work-dir", str(work_dir)))
    finally:
        lock.close()
    assert refused.exit_code == 1 and "another build of this work folder is running" in refused.output
    done = runner.invoke(main, _build_args(corpus, tmp_path / "c", "--work-dir", str(work_dir), "--json"))
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)[0]["work"]["units_reused"] == 2
    assert not (work_dir / "units").exists()


def test_clean_refuses_a_folder_that_is_not_a_caches_and_removes_nothing(tmp_path, corpora, monkeypatch):
    corpus = _corpus(tmp_path, corpora, parts=1)
    runner = CliRunner()
    assert runner.invoke(main, _build_args(corpus, tmp_path / "c"), catch_exceptions=False).exit_code == 0
    cache = tmp_path / "c" / "shk" / "train"
    before = sorted(str(p) for p in (tmp_path / "c").rglob("*"))
    for wrong in (tmp_path / "c", tmp_path / "c" / "shk", tmp_path):  # folders above the cache
        out = runner.invoke(main, ["clean", str(wrong)])
        assert out.exit_code == 1 and "is neither a cache folder" in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1
    out = runner.invoke(main, ["clean", str(cache), "--work-dir", str(tmp_path / "in")])
    assert out.exit_code == 1 and "is not a work folder" in out.output and (tmp_path / "in").is_dir()
    monkeypatch.chdir(tmp_path / "c")  # a one-part relative path
    out = runner.invoke(main, ["clean", "shk"])
    assert out.exit_code == 1 and "is neither a cache folder" in out.output
    assert sorted(str(p) for p in (tmp_path / "c").rglob("*")) == before


def test_a_work_folder_serves_one_cache_and_a_half_removed_one_is_cleaned(tmp_path, corpora):
    corpus = _corpus(tmp_path, corpora, parts=1)
    runner = CliRunner()
    work_dir = tmp_path / "w"
    assert runner.invoke(main, _build_args(corpus, tmp_path / "a", "--work-dir", str(work_dir), "--work", "keep"),
                         catch_exceptions=False).exit_code == 0
    other = runner.invoke(main, _build_args(corpus, tmp_path / "b", "--work-dir", str(work_dir)))
    assert other.exit_code == 1 and "is the work folder of the cache" in other.output
    assert (work_dir / "plan.json").is_file()  # the first cache's kept work is intact
    # A work folder half removed (its units and plan gone, its runs left) is found and removed.
    default = tmp_path / "a2" / "shk" / ".train.work"
    assert runner.invoke(main, _build_args(corpus, tmp_path / "a2", "--work", "keep"),
                         catch_exceptions=False).exit_code == 0
    for p in (default / "units").iterdir():
        p.unlink()
    (default / "plan.json").unlink()
    assert any((default / "runs").iterdir())
    out = runner.invoke(main, ["clean", str(tmp_path / "a2" / "shk" / "train")])
    assert out.exit_code == 0 and out.output.startswith(f"removed {default}: work folder: 0 work units complete")
    assert not default.exists()
