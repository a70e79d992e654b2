"""ParallelTextSource: line-aligned files (Multi30k, NTREX) and misalignment errors."""

import gzip

import pytest

from seqcache import tasks


def test_multi30k_pairs_lines(corpora):
    d = corpora.multi30k
    src = tasks.ParallelTextSource({"en": str(d / "val.en.gz"), "de": str(d / "val.de.gz")})
    records = list(src.read_all())
    en = gzip.open(d / "val.en.gz", "rt", encoding="utf-8").read().split("\n")
    de = gzip.open(d / "val.de.gz", "rt", encoding="utf-8").read().split("\n")
    en, de = en[:-1] if en[-1] == "" else en, de[:-1] if de[-1] == "" else de
    assert len(records) == len(en) == len(de) == 1014
    assert [r.record_number for r in records] == list(range(1014))
    assert records[5].data == {"en": en[5], "de": de[5]}
    assert records[0].raw == tasks.canonical_json_bytes({"en": en[0], "de": de[0]})
    assert src.locator == "line"
    assert tasks.describe_record(str(d / "val.en.gz"), src.locator, 11) == "line 12"
    (f,) = src.list_files()
    assert f.path.endswith("val.en.gz")
    assert f.num_bytes == (d / "val.en.gz").stat().st_size + (d / "val.de.gz").stat().st_size


def test_ntrex_source_and_reference(corpora):
    d = corpora.ntrex
    src = tasks.ParallelTextSource({"en": str(d / "newstest2019-src.eng.txt"),
                                    "de": str(d / "newstest2019-ref.deu.txt")})
    records = list(src.read_all())
    assert len(records) == 1997
    assert all(r.data["en"] and r.data["de"] for r in records)


def test_misaligned_files_name_both_files_and_the_line(tmp_path):
    a, b = tmp_path / "a.en", tmp_path / "b.de"
    a.write_text("one\ntwo\nthree\n")
    b.write_text("eins\nzwei\n")
    src = tasks.ParallelTextSource({"en": str(a), "de": str(b)})
    with pytest.raises(ValueError, match=rf"not line-aligned: {a} has line 3 but {b} ends after line 2"):
        list(src.read_all())
    src = tasks.ParallelTextSource({"de": str(b), "en": str(a)})
    with pytest.raises(ValueError, match=rf"{a} has line 3 but {b} ends after line 2"):
        list(src.read_all())


def test_bad_sources_refused(tmp_path):
    (tmp_path / "x.en").write_text("a\n")
    with pytest.raises(ValueError, match="at least two fields"):
        tasks.ParallelTextSource({"en": str(tmp_path / "x.en")})
    (tmp_path / "y.en").write_text("b\n")
    (tmp_path / "x.de").write_text("c\n")
    src = tasks.ParallelTextSource({"en": str(tmp_path / "*.en"), "de": str(tmp_path / "*.de")})
    with pytest.raises(ValueError, match=r"different numbers of files \({'en': 2, 'de': 1}\)"):
        src.list_files()


def test_empty_line_follows_the_policy(tmp_path):
    (tmp_path / "a.en").write_text("one\n\nthree\n")
    (tmp_path / "a.de").write_text("eins\nzwei\ndrei\n")
    files = {"en": str(tmp_path / "a.en"), "de": str(tmp_path / "a.de")}
    with pytest.raises(ValueError, match="line 2"):
        list(tasks.ParallelTextSource(files, on_error={"empty": "raise"}).read_all())
    assert list(tasks.ParallelTextSource(files).read_all()) == list(
        tasks.ParallelTextSource(files, on_error={"empty": "skip"}).read_all())  # skip is the default
    records = list(tasks.ParallelTextSource(files, on_error={"empty": "skip"}).read_all())
    assert [r.record_number for r in records if not tasks.is_error_record(r)] == [0, 2]


def test_a_listing_serves_the_fingerprint_and_the_pairs(tmp_path, monkeypatch):
    """The build lists a parallel source once: its fingerprint and each pair's
    paths come from that listing, not from a listing per pair; a list that
    is not the last listing is listed again."""
    from seqcache.tasks.sources import parallel

    for k in range(6):
        (tmp_path / f"p{k}.en").write_text(f"one {k}\ntwo\n")
        (tmp_path / f"p{k}.de").write_text(f"eins {k}\nzwei\n")
    src = tasks.ParallelTextSource({"en": str(tmp_path / "*.en"), "de": str(tmp_path / "*.de")})
    calls = []
    real = parallel.match_files
    monkeypatch.setattr(parallel, "match_files", lambda patterns: calls.append(patterns) or real(patterns))
    files = src.list_files()
    assert len(calls) == 2
    assert src.fingerprint_of_files(files) == src.fingerprint()  # the second lists again
    assert len(calls) == 4
    records = [r for i in range(len(files)) for r in src.read_file(i, files[i].path)]
    assert len(calls) == 4 and len(records) == 12
    assert records[2].data == {"en": "one 1", "de": "eins 1"}
    assert src.fingerprint_of_files(list(files)) == src.fingerprint_of_files(files) and len(calls) == 6
