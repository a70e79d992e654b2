"""Compressed files, named by the suffixes of Beam's CompressionTypes in any
case (gzip, bzip2, xz, lzma, deflate, zstd): a local file reads as the text
it holds, record for record what the uncompressed file gives, in the
pipeline's block reading (``read_batches``) as in ``read_split``, for text
lines and parallel text alike; a damaged file still names the line before the
damage."""

import bz2
import gzip
import lzma
import zlib

import pytest

from seqcache import fs
from seqcache.tasks import sources as S
from seqcache.tasks.sources.base import Split

COMPRESSORS = {
    ".gz": gzip.compress,
    ".bz2": bz2.compress,
    ".xz": lzma.compress,
    ".lzma": lambda data: lzma.compress(data, format=lzma.FORMAT_ALONE),
    ".deflate": zlib.compress,
    ".zst": lambda data: pytest.importorskip("zstandard").ZstdCompressor().compress(data),
    ".ZSTD": lambda data: pytest.importorskip("zstandard").ZstdCompressor().compress(data),
    ".BZ2": bz2.compress,
}


@pytest.fixture(scope="module")
def plain(corpora, tmp_path_factory):
    """3,000 lines of Multi30k English (and German), with an empty line and a CRLF
    line in them: the uncompressed files."""
    root = tmp_path_factory.mktemp("compressed")
    out = {}
    for lang in ("en", "de"):
        lines = gzip.decompress((corpora.multi30k / f"train.{lang}.gz").read_bytes()).split(b"\n")[:3000]
        lines[10], lines[11] = b"", lines[11] + b"\r"
        (root / f"plain.{lang}.txt").write_bytes(b"\n".join(lines) + b"\n")
        out[lang] = root / f"plain.{lang}.txt"
    return out


def _records(source, path, *, batches: bool):
    split = Split(0, str(path))
    if batches:
        return [(r.record_number, r.raw, r.data) for b in source.read_batches(split, 512) for r in b]
    return [(r.record_number, r.raw, r.data) for r in source.read_split(split)]


@pytest.mark.parametrize("suffix", list(COMPRESSORS))
def test_a_compressed_file_reads_as_its_text(plain, suffix):
    path = plain["en"].with_name(f"en.txt{suffix}")
    path.write_bytes(COMPRESSORS[suffix](plain["en"].read_bytes()))
    with fs.open_binary(str(path)) as f:
        assert f.read() == plain["en"].read_bytes()
    source = S.TextLineSource(str(path), on_error={"empty": "keep"})
    want = _records(S.TextLineSource(str(plain["en"]), on_error={"empty": "keep"}), plain["en"], batches=False)
    assert len(want) == 3000 and want[10][1] == b""
    assert _records(source, path, batches=False) == want
    assert _records(source, path, batches=True) == want


def test_parallel_text_reads_compressed_files(plain):
    en, de = plain["en"].with_name("p.en.zst"), plain["de"].with_name("p.de.bz2")
    en.write_bytes(COMPRESSORS[".zst"](plain["en"].read_bytes()))
    de.write_bytes(bz2.compress(plain["de"].read_bytes()))
    on_error = {"empty": "keep"}
    got = list(S.ParallelTextSource({"en": str(en), "de": str(de)}, on_error=on_error).read_all())
    want = list(S.ParallelTextSource({"en": str(plain["en"]), "de": str(plain["de"])}, on_error=on_error).read_all())
    assert len(got) == 3000 and [(r.record_number, r.data) for r in got] == [(r.record_number, r.data) for r in want]


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz"])
def test_a_damaged_file_names_the_line_before_the_damage_in_block_reading(plain, suffix):
    whole = COMPRESSORS[suffix](plain["en"].read_bytes() * 8)
    path = plain["en"].with_name(f"cut.txt{suffix}")
    path.write_bytes(whole[: len(whole) // 2])
    source = S.TextLineSource(str(path), on_error={"empty": "keep"})
    with pytest.raises(ValueError) as by_line:
        _records(source, path, batches=False)
    with pytest.raises(ValueError) as by_block:
        _records(source, path, batches=True)
    assert str(by_block.value) == str(by_line.value)
    if suffix != ".bz2":  # bzip2 gives nothing of a block it could not finish (900 kB of text here)
        assert "after line" in str(by_line.value)


@pytest.mark.parametrize("suffix", [".zst", ".deflate", ".xz", ".lzma", ".gz", ".bz2"])
def test_a_truncated_or_corrupt_file_of_every_format_fails_and_names_the_file(plain, suffix):
    """Cut to two thirds, or with bytes flipped in its middle, a compressed file
    is refused with a message that names it: no record of its lost end goes
    missing without a word, and no decompressor's own error escapes."""
    whole = COMPRESSORS[suffix](plain["en"].read_bytes() * 4)
    cut = plain["en"].with_name(f"cut2.txt{suffix}")
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    flipped = bytearray(whole)
    middle = len(whole) * 2 // 3
    flipped[middle:middle + 64] = bytes(b ^ 0xFF for b in flipped[middle:middle + 64])
    bad = plain["en"].with_name(f"bad.txt{suffix}")
    bad.write_bytes(bytes(flipped))
    for path in (cut, bad):
        # Garbage decoded before a checksum fails is skipped as bad text: the
        # damage itself must still stop the file.
        source = S.TextLineSource(str(path), on_error="skip")
        for batches in (False, True):
            with pytest.raises(ValueError, match=rf"{path.name}: (truncated or corrupt|cannot be read)"):
                _records(source, path, batches=batches)


def test_an_empty_compressed_file_has_no_records(plain):
    for suffix in (".zst", ".deflate"):
        path = plain["en"].with_name(f"empty.txt{suffix}")
        path.write_bytes(b"")
        assert _records(S.TextLineSource(str(path)), path, batches=True) == []
    both = plain["en"].with_name("two.txt.zst")
    both.write_bytes(COMPRESSORS[".zst"](b"a\n") + COMPRESSORS[".zst"](b"b\n"))
    assert [r[1] for r in _records(S.TextLineSource(str(both)), both, batches=True)] == [b"a", b"b"]
