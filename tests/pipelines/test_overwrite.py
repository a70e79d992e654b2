"""Replacing a cache (overwrite=True, ``--overwrite``): the old cache stays intact
and readable until the new one is complete (G7). A build that fails, is killed,
or is killed while publishing never costs the old cache; a build that succeeds
replaces it with exactly the bytes of a fresh build and leaves nothing behind."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

from seqcache import format as fmt
from seqcache.feeders.reader import CacheReader
from seqcache.pipelines import BuildConfig, BuildError, build_task, writer
from seqcache.cli.verify import verify_cache
from testsupport import lines_task as _task
from testsupport import write_lines

NUM_LINES = 300


@pytest.fixture
def corpus(shakespeare_halves):
    """A corpus of this test's own, which it may change."""
    return shakespeare_halves(NUM_LINES)


class _Shared:
    """A corpus no test changes, its cache (3 shards, seed 0) and the fresh
    builds the tests compare replacements with, each built once per module."""

    def __init__(self, root, lines):
        self.root = root
        write_lines(root / "in" / "a.txt", lines[:len(lines) // 2])
        write_lines(root / "in" / "b.txt", lines[len(lines) // 2:])
        self.pattern = str(root / "in" / "*.txt")
        self.old = build_task(_task(self.pattern), cache_dir=str(root / "old"), config=BuildConfig(num_shards=3))
        self._fresh = {}

    def old_cache(self, root) -> str:
        """A copy of the cache built from ``pattern`` (3 shards, seed 0) in the
        caches root ``root``, byte for byte; returns its folder."""
        cache_dir = os.path.join(root, os.path.relpath(self.old.cache_dir, self.root / "old"))
        shutil.copytree(self.old.cache_dir, cache_dir)
        return cache_dir

    def fresh(self, num_shards: int, seed: int):
        """A fresh build of ``pattern`` into a caches root of its own."""
        if (num_shards, seed) not in self._fresh:
            self._fresh[num_shards, seed] = build_task(
                _task(self.pattern), cache_dir=str(self.root / f"fresh-{num_shards}-{seed}"),
                config=BuildConfig(num_shards=num_shards, seed=seed))
        return self._fresh[num_shards, seed]


@pytest.fixture(scope="module")
def shared(tmp_path_factory, corpora):
    return _Shared(tmp_path_factory.mktemp("shared"), corpora.shakespeare_lines(NUM_LINES))


def _hashes(folder) -> dict[str, str]:
    """sha256 of every file under ``folder``, by relative path."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def _read_all(cache_dir):
    with CacheReader(cache_dir) as r:
        return [e["targets"].tobytes() for e in r.read_examples(range(len(r)))]


@pytest.mark.parametrize("failure", ["first record raises", "zero examples"])
def test_a_failing_overwrite_leaves_the_old_cache_byte_for_byte(tmp_path, shared, failure):
    root = str(tmp_path / "c")
    old_dir = shared.old_cache(root)
    before = _hashes(old_dir)
    examples = _read_all(old_dir)
    corpus = tmp_path / "in"  # the old cache's input, changed below (so the fingerprint changes)
    shutil.copytree(os.path.dirname(shared.pattern), corpus)
    if failure == "first record raises":
        # The new build fails on its first line (byte 0).
        (corpus / "a.txt").write_bytes(b"\xff broken first line\n" + (corpus / "a.txt").read_bytes())
        with pytest.raises(ValueError, match=r"a\.txt: line 1 \(byte 0\) is not valid UTF-8"):
            build_task(_task(str(corpus / "*.txt")), cache_dir=root, config=BuildConfig(num_shards=3), overwrite=True)
    else:
        (corpus / "a.txt").write_bytes(b"\n\n")
        (corpus / "b.txt").write_bytes(b"\n")
        with pytest.raises(BuildError, match="zero examples from 3 source records"):
            build_task(_task(str(corpus / "*.txt"), on_error={"empty": "skip"}), cache_dir=root,
                       config=BuildConfig(num_shards=3), overwrite=True)
    assert _hashes(old_dir) == before
    assert _read_all(old_dir) == examples and verify_cache(old_dir).ok
    if failure == "zero examples":  # the pipeline ran to its end: the same build would fail again
        assert sorted(os.listdir(os.path.dirname(old_dir))) == ["train"]  # no staging or work folder left
    else:  # a build that died leaves its work for the rerun, beside the old cache, never in it
        assert sorted(os.listdir(os.path.dirname(old_dir))) == [".train.staging", ".train.work", "train"]
        assert not os.path.exists(os.path.join(os.path.dirname(old_dir), ".train.staging", fmt.MANIFEST_NAME))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_successful_overwrite_replaces_the_cache(tmp_path, shared, monkeypatch, exchange):
    """Published by one atomic exchange of the folders, or, where the file system
    cannot, by two renames: the same result."""
    if not exchange:
        monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    root = str(tmp_path / "c")
    pattern = shared.pattern
    old_dir = shared.old_cache(root)
    replaced = build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=2, seed=7), overwrite=True)
    fresh = shared.fresh(2, 7)
    assert replaced.cache_dir == old_dir and not replaced.reused
    assert fmt.read_manifest(replaced.cache_dir).seed == 7
    now, want = _hashes(replaced.cache_dir), _hashes(fresh.cache_dir)
    assert sorted(now) == sorted(want)  # the old cache's three shards are gone
    assert {k: v for k, v in now.items() if k != fmt.MANIFEST_NAME} == \
        {k: v for k, v in want.items() if k != fmt.MANIFEST_NAME}
    assert sorted(os.listdir(os.path.dirname(replaced.cache_dir))) == ["train"]
    assert build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=2, seed=7)).reused


@pytest.mark.parametrize("store", ["exchange", "two-renames", "object store"])
def test_an_overwrite_writes_into_no_file_of_the_old_cache(tmp_path, shared, monkeypatch, store):
    """A reader of the old cache may hold any of its files open, or open it
    later by its name: a replacement writes no byte into any of them. The new
    cache is made of new files (other inodes) under the same names, and the old
    ones are only unlinked, so a file held open reads its old bytes to the end
    (a reader's check at each shard's first open refuses the new ones:
    tests/feeders/test_snapshot.py)."""
    if store == "two-renames":
        monkeypatch.setattr(writer, "_exchange", lambda a, b: False)
    root = f"objtest://{tmp_path}/c" if store == "object store" else str(tmp_path / "c")
    local = shared.old_cache(str(tmp_path / "c"))
    pattern = shared.pattern
    before = _hashes(local)
    held = {name: open(os.path.join(local, name), "rb") for name in before}
    try:
        build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3, seed=7), overwrite=True)
        after = _hashes(local)
        assert sorted(after) == sorted(before)  # the same names ...
        assert after[fmt.SHARD_CHECKSUMS_NAME] != before[fmt.SHARD_CHECKSUMS_NAME]  # ... for other bytes
        for name, f in held.items():
            assert hashlib.sha256(f.read()).hexdigest() == before[name], name
            assert os.fstat(f.fileno()).st_ino != os.stat(os.path.join(local, name)).st_ino, name
    finally:
        for f in held.values():
            f.close()


def test_a_killed_overwrite_keeps_the_old_cache_and_the_rerun_cleans_up(tmp_path, shared, kill_a_build_at_shard_2):
    root = str(tmp_path / "c")
    pattern = shared.pattern
    old_dir = shared.old_cache(root)
    before = _hashes(old_dir)
    kill_a_build_at_shard_2(pattern, root, seed=7, overwrite=True)
    staging = writer.staging_path(old_dir)
    assert "data.array_record-00000-of-00003" in os.listdir(staging)  # the new build got that far ...
    assert fmt.MANIFEST_NAME not in os.listdir(staging)  # ... and never looked complete
    assert _hashes(old_dir) == before and verify_cache(old_dir).ok  # the old cache is untouched
    # Everything the killed build left beside the cache (its staged folder, its
    # lock file), kept for the second case below.
    task_dir, left = os.path.dirname(old_dir), tmp_path / "left"
    shutil.copytree(task_dir, left, ignore=lambda folder, names: ["train"] if folder == task_dir else [])
    assert ".train.staging" in os.listdir(left)

    # The next build cleans the leftovers up: reusing the old cache, or replacing it.
    assert build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3)).reused
    assert not os.path.exists(staging)
    shutil.copytree(left, task_dir, dirs_exist_ok=True)  # the same leftovers again, as a second kill leaves them
    again = build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3, seed=7), overwrite=True)
    fresh = shared.fresh(3, 7)
    assert (fmt.read_shard_checksums(again.cache_dir, again.manifest)
            == fmt.read_shard_checksums(fresh.cache_dir, fresh.manifest))
    assert sorted(os.listdir(os.path.dirname(again.cache_dir))) == ["train"]


def test_a_publish_killed_between_its_two_renames_is_undone_by_the_next_build(tmp_path, shared):
    """Without an atomic exchange, publishing renames the old cache aside, then the
    new one into place. Killed in between, there is no cache folder; the next build
    puts the old cache back (it was never replaced) and removes the staged one."""
    root = str(tmp_path / "c")
    old_dir = shared.old_cache(root)
    before = _hashes(old_dir)
    new = shared.fresh(3, 7)
    os.rename(old_dir, writer.replaced_path(old_dir))  # the first rename ...
    shutil.copytree(new.cache_dir, writer.staging_path(old_dir))  # ... and the complete staged cache
    assert not os.path.exists(old_dir)

    again = build_task(_task(shared.pattern), cache_dir=root, config=BuildConfig(num_shards=3))
    assert again.reused and _hashes(old_dir) == before
    assert sorted(os.listdir(os.path.dirname(old_dir))) == ["train"]


# ---------------------------------------------------------------------------
# Object stores: no folders to rename. A file system behind Beam's FileSystems
# with object-store semantics plays one (objtest:// + a local path).

from apache_beam.io.filesystem import BeamIOError, FileMetadata  # noqa: E402
from apache_beam.io.localfilesystem import LocalFileSystem  # noqa: E402


class _ObjectStoreForTests(LocalFileSystem):
    """``objtest://<local path>``: objects are files; there are no folders (a
    prefix does not exist, listing is by prefix, rename moves single objects)."""

    PREFIX = "objtest://"

    @classmethod
    def scheme(cls):
        return "objtest"

    def _local(self, url):
        return url[len(self.PREFIX):]

    def join(self, basepath, *paths):
        return "/".join([basepath.rstrip("/"), *(p.strip("/") for p in paths)])

    def split(self, path):
        head, _, tail = path.rstrip("/").rpartition("/")
        return head, tail

    def has_dirs(self):
        return False

    def _url_dirname(self, url):
        return self.split(url)[0]

    def mkdirs(self, path):
        pass

    def _list(self, prefix):
        local = self._local(prefix)
        top = local if os.path.isdir(local) else os.path.dirname(local)
        for dirpath, _, names in os.walk(top):
            for name in names:
                path = os.path.join(dirpath, name)
                if path.startswith(local):
                    yield FileMetadata(self.PREFIX + path, os.path.getsize(path), os.path.getmtime(path))

    def create(self, path, *args, **kwargs):
        return super().create(self._local(path), *args, **kwargs)

    def open(self, path, *args, **kwargs):
        return super().open(self._local(path), *args, **kwargs)

    def exists(self, path):
        return os.path.isfile(self._local(path))

    def size(self, path):
        return super().size(self._local(path))

    def rename(self, sources, destinations):
        for s, d in zip(sources, destinations):
            os.makedirs(os.path.dirname(self._local(d)), exist_ok=True)
            os.replace(self._local(s), self._local(d))

    def delete(self, paths):
        for p in paths:
            if not os.path.isfile(self._local(p)):
                raise BeamIOError("Delete operation failed", {p: FileNotFoundError(p)})
            os.unlink(self._local(p))


def test_overwrite_on_an_object_store(tmp_path, corpus):
    """The old cache survives a failing replacement there too; a successful one
    leaves the bytes of a fresh build and no staged object."""
    root = f"objtest://{tmp_path}/store"
    pattern = str(corpus / "*.txt")
    old = build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3))
    local = str(tmp_path / "store" / "lines" / "train")
    before = _hashes(local)
    # manifest, shard checksum file, source table file, 3 data and 3 provenance shards
    assert {fmt.MANIFEST_NAME, fmt.SHARD_CHECKSUMS_NAME, fmt.SOURCE_TABLE_NAME} <= set(before) and len(before) == 9

    # Leftovers of a killed replacement are removed by the next build, here one that reuses the cache.
    staged = str(tmp_path / "store" / "lines" / ".train.staging")
    os.makedirs(os.path.join(staged, "_tmp"))
    open(os.path.join(staged, "_tmp", "leftover.bin"), "wb").write(b"x")
    assert build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3)).reused
    assert _hashes(staged) == {}

    (corpus / "b.txt").write_bytes(b"\xff broken\n")
    with pytest.raises(ValueError, match=r"b\.txt: line 1 \(byte 0\) is not valid UTF-8"):
        build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3), overwrite=True)
    assert _hashes(local) == before and verify_cache(local).ok
    # No object of a cache left there: only the record of the build that died, for its rerun.
    assert set(_hashes(staged)) <= {os.path.join("_tmp", "build.json")}

    replaced = build_task(_task(pattern, on_error={"empty": "keep", "invalid_utf8": "replace"}), cache_dir=root,
                          config=BuildConfig(num_shards=2, seed=7), overwrite=True)
    assert replaced.cache_dir == old.cache_dir and replaced.manifest.statistics.replaced_records == 1
    fresh = build_task(_task(pattern, on_error={"empty": "keep", "invalid_utf8": "replace"}), cache_dir=str(tmp_path / "fresh"),
                       config=BuildConfig(num_shards=2, seed=7))
    now, want = _hashes(local), _hashes(fresh.cache_dir)
    assert sorted(now) == sorted(want)
    assert {k: v for k, v in now.items() if k != fmt.MANIFEST_NAME} == \
        {k: v for k, v in want.items() if k != fmt.MANIFEST_NAME}
    assert verify_cache(local).ok
    assert not os.path.exists(staged) or _hashes(staged) == {}


def test_a_cache_of_a_format_version_no_longer_read_is_refused_and_rebuilt_with_overwrite(tmp_path, shared):
    """A version-1 cache (one JSON object per shard) is refused with the advice to
    rebuild; ``--overwrite`` rebuilds it, with the same shard bytes and fingerprint."""
    import json

    root, pattern, built = str(tmp_path / "c"), shared.pattern, shared.old
    cache_dir = shared.old_cache(root)
    want = _hashes(cache_dir)
    mpath = os.path.join(cache_dir, fmt.MANIFEST_NAME)
    raw = json.load(open(mpath))
    raw["format_version"] = 1
    raw["shards"] = [{"file": s.file, "num_records": s.num_records, "num_bytes": s.num_bytes,
                      "sha256": "0" * 64, "provenance_file": s.provenance_file,
                      "provenance_num_bytes": s.provenance_num_bytes, "provenance_sha256": "0" * 64}
                     for s in built.manifest.shards]
    json.dump(raw, open(mpath, "w"))
    os.unlink(os.path.join(cache_dir, fmt.SHARD_CHECKSUMS_NAME))
    with pytest.raises(fmt.CacheError, match=r"format_version is 1, this seqcache reads format version 2 or 3: .*"
                                             r"rebuild it with this one \(seqcache build \.\.\. --overwrite\)"):
        build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3))
    rebuilt = build_task(_task(pattern), cache_dir=root, config=BuildConfig(num_shards=3), overwrite=True)
    assert not rebuilt.reused and rebuilt.manifest.fingerprint == built.manifest.fingerprint
    now = _hashes(rebuilt.cache_dir)
    assert {k: v for k, v in now.items() if k != fmt.MANIFEST_NAME} == \
        {k: v for k, v in want.items() if k != fmt.MANIFEST_NAME}
    assert verify_cache(rebuilt.cache_dir).ok
