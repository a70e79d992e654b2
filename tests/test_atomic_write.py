"""seqcache.fs.atomic_path, open_write_atomic and write_bytes_atomic: the one
way files are replaced. Readers of the destination see the old file or the
whole new one; a failed write leaves the old file and no temporary file."""

from __future__ import annotations

import os

import pytest

from seqcache import fs


def _listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def test_open_write_atomic_replaces_the_file_whole(tmp_path):
    dest = tmp_path / "manifest.json"
    dest.write_bytes(b"old")
    with fs.open_write_atomic(str(dest)) as f:
        f.write(b"new, ")
        assert dest.read_bytes() == b"old"  # nothing visible before the block ends
        (tmp,) = [n for n in _listing(tmp_path) if n != "manifest.json"]
        assert tmp.startswith(".tmp-") and tmp.endswith("-manifest.json")
        f.write(b"whole")
    assert dest.read_bytes() == b"new, whole"
    assert _listing(tmp_path) == ["manifest.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path):
    dest = tmp_path / "state.json"
    dest.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="interrupted"):
        with fs.open_write_atomic(str(dest), fsync=False) as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    assert dest.read_bytes() == b"old"
    assert _listing(tmp_path) == ["state.json"]
    with pytest.raises(RuntimeError, match="interrupted"):
        with fs.atomic_path(str(tmp_path / "new.bin")) as tmp:
            open(tmp, "wb").write(b"partial")
            raise RuntimeError("interrupted")
    assert _listing(tmp_path) == ["state.json"]


def test_the_new_file_has_the_mode_a_plain_open_gives(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"x")
    fs.write_bytes_atomic(str(tmp_path / "atomic"), b"x")
    assert os.stat(tmp_path / "atomic").st_mode == os.stat(plain).st_mode


def test_fsync_only_where_asked(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    fs.write_bytes_atomic(str(tmp_path / "a"), b"a")
    assert len(synced) == 1
    fs.write_bytes_atomic(str(tmp_path / "b"), b"b", fsync=False)
    with fs.atomic_path(str(tmp_path / "c")) as tmp:
        open(tmp, "wb").write(b"c")
    assert len(synced) == 1
    assert [(tmp_path / n).read_bytes() for n in "abc"] == [b"a", b"b", b"c"]


def test_atomic_path_for_a_writer_that_opens_files_by_name(tmp_path):
    dest = tmp_path / "data.array_record-00000-of-00001"
    with fs.atomic_path("file://" + str(dest)) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and not os.path.exists(tmp)
        with open(tmp, "wb") as f:
            f.write(b"records")
        assert not dest.exists()
    assert dest.read_bytes() == b"records" and _listing(tmp_path) == [dest.name]
    with pytest.raises(FileNotFoundError):
        with fs.atomic_path(str(tmp_path / "never-written")):
            pass
    assert _listing(tmp_path) == [dest.name]
