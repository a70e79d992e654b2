"""The manifest's one definition (seqcache.manifest): the published JSON Schema
is generated from it, a real build's manifest and checksum file validate
against it, a wrong-typed field fails both the schema and the readers, the
writer writes nothing it lacks, and docs/cache-format.md's tables agree with it."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import pathlib
import pickle
import re
import shutil

import jsonschema
import msgspec
import pytest

from seqcache import format as fmt
from seqcache import lengths as L
from seqcache import manifest as schema, manifest_entries as entries
from seqcache import tasks
from seqcache.pipelines import BuildConfig, build_task

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "cache-format.md"
FIELDS = msgspec.structs.fields(schema.Manifest)
NAMES = [f.encode_name for f in FIELDS]
REQUIRED = {f.encode_name for f in FIELDS if f.required}


def _json_types(node: dict) -> set[str]:
    """The JSON types a (generated) JSON Schema node allows."""
    if "$ref" in node:
        return {"object"}
    if "anyOf" in node:
        return set().union(*map(_json_types, node["anyOf"]))
    if "enum" in node:
        return {{str: "string", int: "integer", type(None): "null"}[type(v)] for v in node["enum"]}
    return set(node["type"]) if isinstance(node["type"], list) else {node["type"]}


def _types(name: str) -> set[str]:
    return _json_types(schema.json_schema()["properties"][name])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A real two-shard packed build of a small text file with blank lines (so
    that it has a quarantine file): its folder, manifest dict and checksum file."""
    root = tmp_path_factory.mktemp("schema")
    lines = [f"line {i} " + "abc" * (i % 7) for i in range(120)]
    (root / "in.txt").write_text("\n".join(lines[:60] + [""] + lines[60:]) + "\n", encoding="utf-8")
    task = tasks.Task("t", source=tasks.TextLineSource(str(root / "in.txt")),
                      output_features={"targets": tasks.Feature(tasks.ByteVocabulary())},
                      preprocessors=[tasks.preprocessors.rekey({"targets": "text"}), tasks.preprocessors.tokenize()],
                      packing="lm")
    cache = build_task(task, cache_dir=str(root / "c"),
                       config=BuildConfig(num_shards=2, sequence_length={"targets": 32})).cache_dir
    raw = json.loads(open(os.path.join(cache, fmt.MANIFEST_NAME), encoding="utf-8").read())
    sums = json.loads(open(os.path.join(cache, fmt.SHARD_CHECKSUMS_NAME), encoding="utf-8").read())
    assert raw["quarantine"] == fmt.QUARANTINE_NAME and raw["sharding"]["num_shards"] == 2
    return cache, raw, sums


# Fields a format-2 manifest has and a build no longer writes (they are in the source table file).
FORMAT_2_ONLY = {"sources"}


@pytest.fixture(scope="module")
def built_v2(built):
    """The manifest of ``built`` as format 2 wrote it: the source table inline."""
    from testsupport import format_2_manifest

    raw = format_2_manifest(built[0])
    assert raw["format_version"] == 2 and "source_table" not in raw and raw["sources"][0]["locator"] == "byte_offset"
    return raw


def _for(dotted: str, raw: dict, raw_v2: dict) -> dict:
    """The manifest a test of the field at ``dotted`` edits: format 2's for the inline source table."""
    return raw_v2 if dotted.startswith(("sources", "statistics.source_files")) else raw


def _validator(sub: str | None = None):
    full = schema.json_schema()
    jsonschema.Draft202012Validator.check_schema(full)
    if sub is not None:
        full = {"$schema": full["$schema"], **full["$defs"][sub]}
    return jsonschema.Draft202012Validator(full)


def test_the_published_schema_is_the_generated_one():
    # Regenerate with: python -m seqcache.manifest --write core/manifest.schema.json
    installed = pathlib.Path(schema.schema_path())
    assert installed.read_text(encoding="utf-8") == schema.schema_text()  # the installed package data
    source = REPO / "core" / schema.SCHEMA_NAME
    assert source.read_text(encoding="utf-8") == schema.schema_text(), "run python -m seqcache.manifest --write"
    assert schema.main(["--check", str(source)]) == 0
    assert json.loads(schema.schema_text())["properties"]["format"] == {
        "description": "the format's name", "enum": ["seqcache"]}


def test_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "s.json"
    stale.write_text(schema.schema_text().replace('"seqcache"', '"other"'), encoding="utf-8")
    assert schema.main(["--check", str(stale)]) == 1
    assert "not up to date" in capsys.readouterr().err
    assert schema.main(["--write", str(stale)]) == 0 and schema.main(["--check", str(stale)]) == 0


def test_a_real_builds_manifest_and_checksum_file_validate(built):
    cache, raw, sums = built
    assert list(_validator().iter_errors(raw)) == []
    assert list(_validator("shard_checksums").iter_errors(sums)) == []
    table = json.loads(open(os.path.join(cache, fmt.SOURCE_TABLE_NAME), encoding="utf-8").read())
    assert list(_validator("source_table").iter_errors(table)) == []
    assert table["num_files"] == raw["source_table"]["num_files"] == 1 and table["locator"] == "byte_offset"
    # The writer wrote every field in the definition's order.
    assert list(raw) == [n for n in NAMES if n in raw]
    assert set(raw) == set(NAMES) - FORMAT_2_ONLY


def test_the_model_s_attributes_are_the_fields_typed_and_defaulted(built):
    _, raw, _ = built
    m = fmt.parse_manifest(raw)
    assert [f.name for f in FIELDS] == NAMES  # the attributes are the fields, by their JSON names
    assert [n for n in NAMES if n not in FORMAT_2_ONLY] == list(raw)
    assert (m.seed, m.packing, m.quarantine, m.sharding, m.created, m.seqcache_version) == \
        (raw["seed"], "lm", fmt.QUARANTINE_NAME, entries.Sharding(**raw["sharding"]), raw["created"],
         raw["seqcache_version"])
    assert m.sharding.num_shards == 2 and m.sequence_length == {"targets": 32} == raw["sequence_length"]
    assert [(f.name, f.dtype, f.np_dtype) for f in m.features] == \
        [(f["name"], f["dtype"], fmt.FeatureSpec(f["name"], f["dtype"]).np_dtype) for f in raw["features"]]
    assert [f.to_json() for f in m.features] == raw["features"]
    assert {k: v.to_json() for k, v in m.vocabularies.items()} == raw["vocabularies"]
    assert (m.statistics.examples, m.statistics.tokens, m.statistics.bad_input_records.skipped) == \
        (raw["statistics"]["examples"], raw["statistics"]["tokens"], raw["statistics"]["bad_input_records"]["skipped"])
    assert m.source_table.to_json() == raw["source_table"] and m.fingerprint_inputs == raw["fingerprint_inputs"]
    assert isinstance(m.shards, fmt.ShardTable) and m.num_examples == raw["num_examples"] == int(m.shards.starts[-1])
    bare = fmt.parse_manifest({k: v for k, v in raw.items() if k in REQUIRED})
    assert (bare.seed, bare.sources, bare.statistics, bare.vocabularies, bare.quarantine, bare.sequence_length) == \
        (None, [], entries.Statistics(), {}, None, None)
    assert bare.num_examples == m.num_examples  # from the shard table when the field is absent
    assert "statistics" not in repr(m) and "ShardTable(2 shards" in repr(m)


def test_a_manifest_with_an_int_sequence_length_reads_as_the_mapping(built, tmp_path):
    """Manifests of earlier releases may hold an int, every feature's length:
    one is read as the mapping the model holds (dict only), and the readers'
    lengths do not change; the file itself is left as it is."""
    cache, raw, _ = built
    old = dict(raw, sequence_length=32)
    m = fmt.parse_manifest(old)
    features = [f["name"] for f in raw["features"]]
    assert m.sequence_length == dict.fromkeys(features, 32) and old["sequence_length"] == 32
    assert L.built_lengths(m)["targets"] == 32 == L.cache_lengths(m)["targets"]
    with pytest.raises(fmt.CacheError, match=r"sequence_length.*: expected `int` >= 1"):
        fmt.parse_manifest(dict(raw, sequence_length=0))
    # A build writes the mapping (read back above: {"targets": 32}).
    assert raw["sequence_length"] == {"targets": 32}


def test_a_read_manifest_pickles_and_copies_with_its_folder(built):
    cache, _, _ = built
    m = fmt.read_manifest(cache)
    for other in (pickle.loads(pickle.dumps(m)), copy.copy(m), copy.deepcopy(m)):
        assert (other.cache_dir, other.task, other.fingerprint, other.statistics, other.features) == \
            (cache, m.task, m.fingerprint, m.statistics, m.features)
        assert [s.num_records for s in other.shards] == [s.num_records for s in m.shards]
        assert len(other.read_source_table()) == 1  # from the folder it was read from


def test_a_version_1_manifest_fails_the_schema_and_the_readers_with_the_advice_to_rebuild(built):
    _, raw, _ = built
    count = raw["shards"]["num_shards"]
    v1 = {**raw, "format_version": 1, "shards": [
        {"file": fmt.shard_name("data", i, count), "num_records": 1, "num_bytes": 1, "sha256": "0" * 64,
         "provenance_file": fmt.shard_name("provenance", i, count), "provenance_num_bytes": 1,
         "provenance_sha256": "0" * 64} for i in range(count)]}
    assert not _validator().is_valid(v1)
    assert not _validator().is_valid({**raw, "shards": v1["shards"]})
    with pytest.raises(fmt.CacheError, match=r"^manifest\.json: format_version is 1, this seqcache reads format "
                                             r"version 2 or 3: .*rebuild it with this one "
                                             r"\(seqcache build \.\.\. --overwrite\)$"):
        fmt.parse_manifest(v1)
    with pytest.raises(fmt.CacheError, match=r"^manifest\.json: shards is list, expected a JSON object"):
        fmt.parse_manifest({**raw, "shards": v1["shards"]})


def _wrong(name: str):
    """A value of a JSON type that the field ``name`` does not allow."""
    types = _types(name)
    for value, json_type in (("x", "string"), (5, "integer"), ([1], "array"), ({"a": 1}, "object"), (True, "boolean")):
        if json_type not in types and not (json_type == "integer" and "number" in types):
            return value
    raise AssertionError(name)


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_typed_field_fails_the_schema_and_the_readers(built, name):
    _, raw, _ = built
    bad = {**raw, name: _wrong(name)}
    errors = list(_validator().iter_errors(bad))
    assert errors and any(name in e.json_path for e in errors), errors
    with pytest.raises(fmt.CacheError) as e:
        fmt.parse_manifest(bad)
    assert name in str(e.value)


@pytest.mark.parametrize("name", [n for n in NAMES if "null" not in _types(n)])
def test_null_where_the_schema_has_no_null_fails_both(built, name):
    _, raw, _ = built
    assert not _validator().is_valid({**raw, name: None})
    with pytest.raises(fmt.CacheError, match=name):
        fmt.parse_manifest({**raw, name: None})


def _set(raw, dotted, value):
    raw = copy.deepcopy(raw)
    obj = raw
    keys = [int(k) if k.isdigit() else k for k in dotted.split(".")]
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value
    return raw


@pytest.mark.parametrize(("dotted", "value", "message"), [
    ("sharding.num_shards", "2", r"sharding\.num_shards is '2': expected `int`$"),
    ("sharding.shard_size", "big", r"sharding\.shard_size is 'big': expected `int \| null`$"),
    ("features.0.add_eos", "yes", r"features\[0\]\.add_eos is 'yes': expected `bool`$"),
    ("features.0.name", 3, r"features\[0\]\.name is 3: expected `str`$"),
    ("features.0.dtype", "int4", r"features\[0\]\.dtype is 'int4': invalid enum value$"),
    ("shards.checksums.num_bytes", -1, r"shards\.checksums: num_bytes is -1, expected a byte count"),
    ("shards.num_shards", 2**30, r"shards\.num_shards = 1073741824, expected an integer in \[0, 2\^20\)$"),
    ("seed", 2**70, r"seed is 1180591620717411303424: expected `int` <= 9223372036854775807$"),
    ("source_table.sha256", "x", r"source_table\.sha256 is 'x': expected `str` matching regex '\^\[0-9a-f\]\{64\}\$'$"),
    ("evaluation", 5, r"evaluation is 5: expected `object \| null`$"),
    ("shards.encoding", 7, r"shards\.encoding is 7: expected `str`$"),
    ("vocabularies.targets.kind", 1, r"vocabularies\.targets\.kind is 1: expected `str`$"),
    ("vocabularies.targets", 5, r"vocabularies\.targets is 5: expected `object`$"),
    ("vocabularies.targets.vocab_size", "259", r"vocabularies\.targets\.vocab_size is '259': expected `int`$"),
    ("vocabularies.targets.extra_ids", -1, r"vocabularies\.targets\.extra_ids is -1: expected `int` >= 0$"),
    ("packing", "weird", r"packing is 'weird': invalid enum value$"),
    ("sources.0", 1, r"sources\[0\] is 1: expected `object`$"),
    ("sources.0.path", 1, r"sources\[0\]\.path is 1: expected `str`$"),
    ("sources.0.num_bytes", "12", r"sources\[0\]\.num_bytes is '12': expected `int`$"),
    ("sources.0.locator", None, r"sources\[0\]\.locator is None: expected `str`$"),
    ("statistics.tokens", "x", r"statistics\.tokens is 'x': expected `object`$"),
    ("statistics.tokens.targets", "many", r"statistics\.tokens\.targets is 'many': expected `int`$"),
    ("statistics.examples", 1.5, r"statistics\.examples is 1\.5: expected `int`$"),
    ("statistics.mean_length.targets", None, r"statistics\.mean_length\.targets is None: expected `float`$"),
    ("statistics.skipped_records", -2, r"statistics\.skipped_records is -2: expected `int` >= 0$"),
    ("statistics.length_histogram.targets.0", [1, 2],
     r"statistics\.length_histogram\.targets\[0\] is \[1, 2\]: expected `array` of length >= 3$"),
    ("statistics.length_histogram.targets.0.2", "7",
     r"statistics\.length_histogram\.targets\[0\]\[2\] is '7': expected `int`$"),
    ("statistics.source_files.examples.0", -1, r"statistics\.source_files\.examples\[0\] is -1: expected `int` >= 0$"),
    ("statistics.source_files.tokens.targets", 5, r"statistics\.source_files\.tokens\.targets is 5: expected `array`$"),
    ("statistics.bad_input_records.skipped.empty", "1",
     r"statistics\.bad_input_records\.skipped\.empty is '1': expected `int`$"),
    ("sequence_length.targets", 0, r"sequence_length\.targets is 0: expected `int` >= 1$"),
    ("quarantine_sha256", "ABC", r"quarantine_sha256 is 'ABC': expected `str` matching regex"),
])
def test_a_bad_nested_value_fails_the_schema_and_the_readers_with_its_message(built, built_v2, dotted, value,
                                                                             message):
    _, raw, _ = built
    bad = _set(_for(dotted, raw, built_v2), dotted, value)
    assert not _validator().is_valid(bad)
    with pytest.raises(fmt.CacheError, match=rf"^{fmt.MANIFEST_NAME}: {message}"):
        fmt.parse_manifest(bad)


def test_a_bad_value_of_a_key_the_definition_lists_fails_both_and_other_keys_are_open(built_v2):
    raw = built_v2
    bad = _set(raw, "statistics.source_files", {"tokens": {}})
    assert not _validator().is_valid(bad)
    with pytest.raises(fmt.CacheError, match=r"^manifest\.json: statistics\.source_files: object missing required field `examples`$"):
        fmt.parse_manifest(bad)
    bad = copy.deepcopy(raw)
    del bad["sources"][0]["path"]
    assert not _validator().is_valid(bad)
    with pytest.raises(fmt.CacheError, match=r"^manifest\.json: sources\[0\]: object missing required field `path`$"):
        fmt.parse_manifest(bad)
    # Keys no definition lists are allowed (readers ignore them), at every level.
    extra = _set(_set(_set(raw, "statistics.colour", "red"), "sources.0.colour", [1]), "vocabularies.targets.colour", 2)
    assert list(_validator().iter_errors(extra)) == []
    fmt.parse_manifest(extra)


def test_the_enums_are_the_codes(tmp_path):
    from seqcache.tasks import task as task_mod
    from seqcache.tasks import vocabulary_from_json

    assert set(entries.PACKINGS) == set(task_mod.PACKING_MODES)
    for kind in entries.VOCABULARY_KINDS:  # each kind is known (a missing model file is another error)
        try:
            vocabulary_from_json({"kind": kind}, str(tmp_path))
        except ValueError as e:
            assert "unknown vocabulary kind" not in str(e), kind
    with pytest.raises(ValueError, match="unknown vocabulary kind 'foo'"):
        vocabulary_from_json({"kind": "foo"}, str(tmp_path))


# The hand edits a person may make to a real manifest: (dotted field, value, the reader's message).
HAND_EDITS = [
    ("statistics.tokens", "x", "statistics.tokens is 'x': expected `object`"),
    ("sources.0.path", 1, "sources[0].path is 1: expected `str`"),
    ("packing", "weird", "packing is 'weird': invalid enum value"),
    ("vocabularies.targets.kind", "foo", "vocabularies.targets.kind is 'foo': invalid enum value"),
]


@pytest.mark.parametrize(("dotted", "value", "message"), HAND_EDITS, ids=[e[0] for e in HAND_EDITS])
def test_a_hand_edited_manifest_is_one_error_line_from_every_command(built, built_v2, tmp_path, dotted, value,
                                                                   message):
    from click.testing import CliRunner

    from seqcache.cli.main import main

    cache, raw, _ = built
    bad = _set(_for(dotted, raw, built_v2), dotted, value)
    errors = list(_validator().iter_errors(bad))
    assert errors and all(e.json_path.startswith("$." + dotted.split(".")[0]) for e in errors), errors
    copy_dir = tmp_path / "c"
    shutil.copytree(cache, copy_dir)
    manifest_path = copy_dir / fmt.MANIFEST_NAME
    manifest_path.write_text(json.dumps(bad), encoding="utf-8")
    for args in (["info", str(copy_dir)], ["verify", str(copy_dir)], ["show", str(copy_dir), "--index", "0"],
                 ["which", str(copy_dir), "--step", "0", "--row", "0", "--batch-size", "4"],
                 ["report", str(copy_dir), "--output", str(tmp_path / "r.html")]):
        out = CliRunner().invoke(main, args)
        assert out.exit_code == 1, (args, out.output)
        assert out.output.strip().splitlines() == [f"error: {manifest_path}: {message}"], (args, out.output)


def test_a_missing_required_field_fails_both(built):
    _, raw, _ = built
    for name in NAMES:
        bad = {k: v for k, v in raw.items() if k != name}
        assert _validator().is_valid(bad) == (name not in REQUIRED), name
        if name in REQUIRED and name not in ("format", "format_version"):
            with pytest.raises(fmt.CacheError, match=rf"missing field {name!r}"):
                fmt.parse_manifest(bad)
        elif name == "source_table":  # optional (format 2 has none), but this one's inputs lack the files
            with pytest.raises(fmt.CacheError, match=r"but the sha256 of fingerprint_inputs is"):
                fmt.parse_manifest(bad)
        elif name not in REQUIRED:
            fmt.parse_manifest(bad)


def test_the_writer_writes_no_field_the_schema_lacks(built, tmp_path):
    cache, raw, _ = built
    args = dict(task="t", split="train", fingerprint=fmt.fingerprint_of({}), fingerprint_inputs={}, features=raw["features"],
                shards=[], sources=[], statistics={}, seed=0, sequence_length=None, packing=None, vocabularies={})
    with pytest.raises(ValueError, match=r"\['colour'\] are not in the manifest schema"):
        schema.Manifest.create(**args, colour="red")
    with pytest.raises(ValueError, match=r"^sharding field\(s\) \['colour'\] are not in the manifest schema"):
        schema.Manifest.create(**args, sharding={"num_shards": 0, "colour": "red"})
    made = schema.Manifest.create(**args, sharding={"num_shards": 0})
    written = json.loads(made.to_json())
    assert list(written)[-1] == "sharding" and list(written) == [n for n in NAMES if n in written]
    assert written["packing"] is None and "quarantine" not in written  # given as None: null; not given: absent
    made.write(str(tmp_path))
    assert (tmp_path / fmt.MANIFEST_NAME).read_text(encoding="utf-8") == made.to_json()
    read = fmt.read_manifest(str(tmp_path))
    assert (read.task, read.fingerprint, read.sharding, read.features) == \
        (made.task, made.fingerprint, made.sharding, made.features)
    assert (tmp_path / fmt.SHARD_CHECKSUMS_NAME).read_bytes() == fmt.shard_checksums_json([], [])
    with pytest.raises(ValueError, match="only a manifest from Manifest.create is written"):
        fmt.read_manifest(cache).write(str(tmp_path / "other"))
    assert not os.path.exists(tmp_path / "other")
    with pytest.raises(ValueError, match=r"lacks the required field\(s\) \['task'\]"):
        schema.ordered({k: v for k, v in raw.items() if k != "task"}, schema.Manifest)


def test_the_nested_definitions_name_the_readers_fields():
    names = lambda model, required=False: [f.encode_name for f in msgspec.structs.fields(model)  # noqa: E731
                                           if f.required or not required]
    assert [n for n in names(schema.Shards) if n in fmt.INT_FIELDS] == list(fmt.INT_FIELDS)
    assert names(schema.Feature, required=True) == [f.name for f in dataclasses.fields(fmt.FeatureSpec)]
    assert names(schema.ShardChecksums) == list(json.loads(fmt.shard_checksums_json([], [])))
    assert sorted(schema.json_schema()["$defs"]["Feature"]["properties"]["dtype"]["enum"]) == sorted(fmt.DTYPES)


# --- docs/cache-format.md --------------------------------------------------------------------

def _doc_table(heading: str) -> dict[str, tuple[set[str], bool]]:
    """field -> (JSON types, required) of the first ``| field | type | required |``
    table after ``heading`` in docs/cache-format.md."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(heading)
    rows = {}
    in_table = False
    for line in text[start:].splitlines():
        if line.startswith("| field | type | required |"):
            in_table = True
            continue
        if in_table and not line.startswith("|"):
            break
        if in_table and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            name = re.fullmatch(r"`([a-z0-9_]+)`", cells[0])
            assert name, line
            assert cells[2] in ("yes", "no"), line
            rows[name.group(1)] = (set(re.split(r", | or ", cells[1])), cells[2] == "yes")
    assert rows, heading
    return rows


@pytest.mark.parametrize(("heading", "model"), [("## manifest.json", schema.Manifest),
                                                ("### shards: the shard table", schema.Shards),
                                                ("### source_table: the source table file", schema.SourceTableRecord)])
def test_the_docs_field_table_is_the_definition(heading, model):
    documented = _doc_table(heading)
    full = schema.json_schema()
    properties = full["properties"] if model is schema.Manifest else full["$defs"][model.__name__]["properties"]
    defined = {f.encode_name: (_json_types(properties[f.encode_name]), f.required)
               for f in msgspec.structs.fields(model)}
    assert documented == defined
