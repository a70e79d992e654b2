"""Every file a manifest names is a plain name inside its cache, checked before
anything opens it (seqcache.layout.cache_file): verify, info, show, which and
the feeder refuse a name that leads elsewhere, and a link that leads out of the
cache, even when the file it leads to is byte for byte the right one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache import layout, tasks
from seqcache.cli.main import main
from seqcache.feeders import Feeder
from seqcache.pipelines import BuildConfig, build_task

PASSWD = "/etc/passwd"


@pytest.fixture(scope="module")
def built(tmp_path_factory, corpora):
    """A two-shard cache of botchan lines (its blank lines skipped, so it has a
    quarantine file) with a small SentencePiece model stored in it."""
    root = tmp_path_factory.mktemp("paths")
    lines = corpora.botchan.read_text(encoding="utf-8").splitlines()
    vocab = tasks.train_sentencepiece(lines[:2000], output_path=str(root / "m.model"), vocab_size=400)
    src = root / "in.txt"
    src.write_text("\n".join(lines[:150] + ["", "  "] + lines[150:300]) + "\n", encoding="utf-8")
    task = tasks.Task("sp", source=tasks.TextLineSource(str(src)), output_features={"targets": tasks.Feature(vocab)},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()])
    cache = build_task(task, cache_dir=str(root / "c"), config=BuildConfig(num_shards=2)).cache_dir
    m = fmt.read_manifest(cache)
    assert m.quarantine and m.vocabularies["targets"].file and len(m.shards) == 2
    return cache


# field -> (how to read it from the manifest, how to set it). Shard and
# provenance file names are not stored (format version 2: they follow from the
# shard's index and count), so those files are attacked through links only.
SHARD_FIELDS = ("file", "provenance_file")


def _get(raw, field):
    if field == "quarantine":
        return raw["quarantine"]
    if field == "vocabulary":
        return raw["vocabularies"]["targets"]["file"]
    return raw["shards"]["checksums"]["file"]


def _set(raw, field, value):
    if field == "quarantine":
        raw["quarantine"] = value
    elif field == "vocabulary":
        raw["vocabularies"]["targets"]["file"] = value
    else:
        raw["shards"]["checksums"]["file"] = value


def _cases(fields):
    return [(f, a) for f in fields for a in (["symlink"] if f in SHARD_FIELDS else ["absolute", "parent", "symlink"])]


FIELDS = ["file", "provenance_file", "vocabulary", "quarantine", "checksums"]


def _attack(built, tmp_path, field, attack) -> tuple[str, str]:
    """A copy of the cache whose manifest field ``field`` leads out of it, and
    the outside path it leads to (a byte-identical copy of the right file, so
    that only the path check can refuse it)."""
    cache = str(tmp_path / "sp" / "train")
    shutil.copytree(built, cache)
    manifest_path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.loads(open(manifest_path, encoding="utf-8").read())
    table = fmt.read_manifest(cache).shards
    names = {"file": table.files, "provenance_file": table.provenance_files}.get(field)
    name = names[0] if names else _get(raw, field)
    outside = str(tmp_path / "outside.model")
    shutil.copyfile(os.path.join(cache, name), outside)
    if attack == "absolute":
        target = PASSWD if field == "vocabulary" else outside
        _set(raw, field, target)
    elif attack == "parent":
        _set(raw, field, os.path.join("..", "..", "outside.model"))
    else:  # every shard's file, so that whichever shard a command reads is a link
        for k, each in enumerate(names or [name]):
            there = outside if k == 0 else f"{outside}.{k}"
            shutil.copyfile(os.path.join(cache, each), there)
            os.remove(os.path.join(cache, each))
            os.symlink(there, os.path.join(cache, each))
        target = outside
    open(manifest_path, "w", encoding="utf-8").write(json.dumps(raw))
    return cache, (target if attack != "parent" else outside)


# (quarantine is the one name quarantine.jsonl: any other is not a value of the field)
REFUSED = ("not a plain file name", "outside the cache folder", "file name", "quarantine is ")


def _refused(text: str) -> bool:
    return any(r in text for r in REFUSED)


@pytest.mark.parametrize(("field", "attack"), _cases(FIELDS))
def test_verify_refuses_and_never_opens_a_file_outside_the_cache(built, tmp_path, field, attack):
    cache, target = _attack(built, tmp_path, field, attack)
    out = CliRunner().invoke(main, ["verify", cache])
    assert out.exit_code == 1 and "Traceback" not in out.output, out.output
    assert _refused(out.output), out.output
    assert "ok" not in out.output.split(":")[0]
    # The outside file was never read: its sha256 appears nowhere.
    for path in {target, PASSWD}:
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() not in out.output


@pytest.mark.parametrize(("field", "attack"), _cases(["file", "provenance_file", "vocabulary", "quarantine"]))
def test_info_and_show_refuse_a_file_outside_the_cache(built, tmp_path, field, attack):
    cache, _ = _attack(built, tmp_path, field, attack)
    info = CliRunner().invoke(main, ["info", cache])
    assert info.exit_code == 1 and _refused(info.output) and "Traceback" not in info.output, info.output
    if field == "quarantine":
        return  # show does not read the quarantine file (report does: below)
    shown = CliRunner().invoke(main, ["show", cache, "--index", "0"])
    assert shown.exit_code == 1 and _refused(shown.output) and "Traceback" not in shown.output, shown.output


@pytest.mark.parametrize(("field", "attack"), _cases(["file", "provenance_file", "vocabulary"]))
def test_which_refuses_a_file_outside_the_cache(built, tmp_path, field, attack):
    cache, target = _attack(built, tmp_path, field, attack)
    out = CliRunner().invoke(main, ["which", cache, "--step", "0", "--row", "0", "--batch-size", "4", "--json"])
    if field == "vocabulary" and out.exit_code == 0:
        # which still locates the row; the text is left out, saying why.
        segments = json.loads(out.output)["segments"]
        assert segments and all(s.get("text") is None and _refused(s["vocabulary_error"]) for s in segments)
    else:
        assert out.exit_code != 0 and _refused(out.output) and "Traceback" not in out.output, out.output


@pytest.mark.parametrize(("field", "attack"), _cases(["file", "provenance_file"]))
def test_the_feeder_refuses_a_shard_outside_the_cache(built, tmp_path, field, attack):
    cache, _ = _attack(built, tmp_path, field, attack)
    with pytest.raises(fmt.CacheError, match="|".join(REFUSED)):
        with Feeder(cache=cache, global_batch_size=4, sequence_length=16, host_index=0, host_count=1) as f:
            f.get_batch(0)
            if field == "provenance_file":
                f.readers[0].read_sources(list(range(len(f.readers[0]))))


@pytest.mark.parametrize("attack", ["symlink"])
def test_report_refuses_a_quarantine_link_outside_the_cache(built, tmp_path, attack):
    from seqcache.cli.report import quarantine_summary

    cache, _ = _attack(built, tmp_path, "quarantine", attack)
    with pytest.raises(fmt.CacheError, match="outside the cache folder"):
        quarantine_summary(cache, fmt.read_manifest(cache))


def test_links_inside_the_cache_and_a_linked_cache_folder_are_fine(built, tmp_path):
    cache = str(tmp_path / "sp" / "train")
    shutil.copytree(built, cache)
    m = fmt.read_manifest(cache)
    model = m.vocabularies["targets"].file
    os.rename(os.path.join(cache, model), os.path.join(cache, "real.model"))
    os.symlink("real.model", os.path.join(cache, model))  # a relative link inside the cache
    linked = str(tmp_path / "linked")
    os.symlink(cache, linked)  # the cache folder itself through a link
    for path in (cache, linked):
        assert CliRunner().invoke(main, ["verify", path]).exit_code == 0
        layout.check_named_files(path, fmt.read_manifest(path))
    for bad in ("", ".", "..", "a/b", "a\\b", "/abs", "C:x", "x\x00y", None, 3):
        assert not layout.is_plain_name(bad)
        with pytest.raises(layout.UnsafeCachePathError):
            layout.cache_file(cache, bad)
    # Object-store URLs: the plain-name check, before any file system is asked.
    for bad in ("../x.model", "/etc/passwd", "gs://other/x.model"):
        with pytest.raises(layout.UnsafeCachePathError, match="not a plain file name"):
            layout.cache_file("gs://bucket/c/sp/train", bad)


@pytest.mark.parametrize(("field", "value"), [("vocabularies", [1, 2]), ("sources", "x"), ("statistics", 5),
                                              ("sequence_length", "abc"), ("vocabularies", {"targets": {"kind": 1}})])
def test_a_descriptive_field_of_the_wrong_type_is_one_clear_error(built, tmp_path, field, value):
    cache = str(tmp_path / "sp" / "train")
    shutil.copytree(built, cache)
    manifest_path = os.path.join(cache, fmt.MANIFEST_NAME)
    raw = json.loads(open(manifest_path, encoding="utf-8").read())
    raw[field] = value
    open(manifest_path, "w", encoding="utf-8").write(json.dumps(raw))
    for args in (["verify", cache], ["info", cache], ["show", cache, "--index", "0"],
                 ["which", cache, "--step", "0", "--row", "0", "--batch-size", "4"],
                 ["report", cache, "--output", str(tmp_path / "r.html")]):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 1 and "Traceback" not in out.output and field in out.output, (args, out.output)
