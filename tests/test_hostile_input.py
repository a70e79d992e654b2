"""Hostile manifests, feeder states, schedules and configs: deeply nested JSON,
integers far out of range, negative counts, NaN, and manifests that contradict
themselves get one line naming the file and the field, from the library (its
documented errors) and from the CLI (no traceback, non-zero exit)."""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache import format as fmt
from seqcache.cli.main import main
from seqcache.feeders import Feeder, FeederStateError
from seqcache.pipelines.writer import write_cache
from seqcache.training import config as config_lib

N, SHARDS, B = 23, 3, 4
DEEP = 100_000  # far past Python's recursion limit


def write_small_cache(path, *, n: int = N, num_shards: int = SHARDS, task: str = "hostile") -> str:
    """An unpacked cache of ``n`` examples (tokens ``[i + 1, ...]``, 6 each),
    written by the real cache writer; returns its folder."""
    shards = [[] for _ in range(num_shards)]
    for i in range(n):
        tokens = np.concatenate([[i + 1], (i * 31 + np.arange(1, 6)) % 250 + 3]).astype(np.int32)
        shards[i * num_shards // n].append(({"targets": tokens}, [(0, 1000 + i, 0)]))
    write_cache(str(path), task=task, split="train", features=(fmt.FeatureSpec("targets", "int32"),),
                shards=shards, sources=[{"path": f"corpus/{task}.txt"}], vocabularies=None,
                fingerprint_inputs={"task": task, "n": n})
    return str(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_small_cache(tmp_path_factory.mktemp("hostile") / "c")


@pytest.fixture
def cache(pristine, tmp_path):
    """A fresh copy of the module's cache, to damage."""
    import shutil

    return shutil.copytree(pristine, tmp_path / "c")


def _manifest_path(cache) -> str:
    return os.path.join(str(cache), fmt.MANIFEST_NAME)


def edit_manifest(cache, edit) -> str:
    """Applies ``edit(raw)`` to the manifest (it may return replacement text)."""
    path = _manifest_path(cache)
    raw = json.load(open(path))
    text = edit(raw)
    with open(path, "w") as f:
        f.write(text if isinstance(text, str) else json.dumps(raw))
    return path


def _column(raw, key, values):
    raw["shards"][key] = base64.b64encode(np.asarray(values, "<i8").tobytes()).decode()


def _records(raw):
    return np.frombuffer(base64.b64decode(raw["shards"]["num_records"]), "<i8").tolist()


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _replace_value(raw, key, text):
    """Manifest text with the value of top-level ``key`` replaced by raw JSON ``text``."""
    raw[key] = "@@"
    return json.dumps(raw).replace('"@@"', text)


def run_cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    output = result.output  # standard output and error
    assert result.exit_code != 0, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in output, output
    if result.exit_code == 1 and not output.startswith("FAILED: "):  # (verify lists its problems)
        # A damaged file: one line on standard error.
        assert output.startswith("error: ") and output.count("\n") == 1, output
    return output


MANIFEST_CASES = [
    # (id, edit, the message's words)
    ("nested", lambda raw: _replace_value(raw, "fingerprint_inputs", _nested(DEEP)), "nested deeper than 64 levels"),
    ("nested-shards", lambda raw: _replace_value(raw, "shards", _nested(3000)), "nested deeper than 64 levels"),
    ("huge-count", lambda raw: raw.update(num_examples=10**30), "out of range"),
    ("big-count", lambda raw: raw.update(num_examples=2**60), "num_examples is 1152921504606846976: expected `int` "
                                                               "<= 9007199254740991"),
    ("negative", lambda raw: raw.update(num_examples=-1), "num_examples is -1: expected `int` >= 0"),
    ("nan", lambda raw: _replace_value(raw, "seed", "NaN"), "NaN is not a JSON number"),
    ("infinity", lambda raw: raw["statistics"].update(mean_length="@") or json.dumps(raw).replace('"@"', "1e999"),
     "overflows to infinity"),
    ("sequence-length", lambda raw: raw.update(sequence_length={"targets": 10**18}), "sequence_length.targets is 1000000000000000000"),
    ("shards-count", lambda raw: raw["shards"].update(num_shards=10**15), "shards.num_shards = 1000000000000000"),
    ("contradiction", lambda raw: _column(raw, "num_records", [8, 8, 10**9]),
     "num_examples = 23, but the shard table's record counts add up to 1,000,000,016"),
    ("too-many-records", lambda raw: _column(raw, "num_records", [8, 8, 10**15]),
     "shards[2].num_records = 1000000000000000, expected an integer in [0, 2^40)"),
    ("shard-records", lambda raw: (_column(raw, "num_records", [8, 8, 2**50]), raw.update(num_examples=16 + 2**50)),
     "shards[2].num_records = 1125899906842624, expected an integer in [0, 2^40)"),
    # Fields that name a feature the cache does not have (was: a 46-line traceback from info, "ok" from verify).
    ("sequence-length-feature", lambda raw: raw.update(sequence_length={"bogus": 1}),
     "sequence_length names the feature 'bogus', which the cache does not have (its features: ['targets'])"),
    ("tokens-feature", lambda raw: raw["statistics"].update(tokens={"targets": 1, **{f"x{i}": 1 for i in range(9)}}),
     "statistics.tokens names the feature 'x0' (and 8 more), which the cache does not have"),
    ("vocabularies-feature", lambda raw: raw.update(vocabularies={"bogus": {"kind": "byte"}}),
     "vocabularies names the feature 'bogus'"),
    ("too-many-keys", lambda raw: raw["statistics"].update(tokens={f"x{i}": 1 for i in range(2**16 + 1)}),
     "an object of the manifest has more than 65,536 keys"),
]


@pytest.mark.parametrize("name, edit, words", MANIFEST_CASES, ids=[c[0] for c in MANIFEST_CASES])
def test_a_hostile_manifest_is_one_line_from_the_library_and_every_command(cache, name, edit, words):
    path = edit_manifest(cache, edit)
    with pytest.raises(fmt.CacheError) as e:
        fmt.read_manifest(str(cache))
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(fmt.CacheError, match=f"^{path}: "):
        Feeder(cache=str(cache), global_batch_size=B, sequence_length=8, host_index=0, host_count=1)
    for args in (["info", cache], ["verify", cache], ["show", cache], ["which", cache, "--step", 0, "--row", 0,
                                                                       "--batch-size", B]):
        out = run_cli(*args)
        assert words in out and path in out, (args, out)


def test_a_manifest_whose_shard_sizes_cannot_hold_its_records_is_refused_by_info_and_verify(cache):
    """A consistent edit (shard counts and totals) still contradicts the shard
    files' byte sizes: a 3 MB cache cannot hold 10^12 examples."""
    path = edit_manifest(cache, lambda raw: (_column(raw, "num_records", [8, 8, 10**12]),
                                             raw.update(num_examples=16 + 10**12)))
    for args in (["info", cache], ["info", cache, "--json"], ["verify", cache]):
        out = run_cli(*args)
        assert f"{path}: shards[2]: 1,000,000,000,000 records need at least 4,000,000,000,000 bytes" in out
    # A feeder opens it (the sizes are checked at a shard's first read) and
    # refuses the shard whose records it cannot find.
    with Feeder(cache=str(cache), global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        with pytest.raises(fmt.CacheError, match="record"):
            for step in range(3):
                f.get_batch(step)


def test_the_checksum_file_is_read_within_bounds(cache):
    """A shard checksum file edited (and re-registered in the manifest, so that
    its sha256 matches) with deep nesting or a wrong shard count."""
    sidecar = os.path.join(str(cache), fmt.SHARD_CHECKSUMS_NAME)
    good = json.load(open(sidecar))
    for text, words in ((_nested(DEEP), "nested deeper than 64 levels"),
                        (json.dumps(dict(good, num_shards=7)), "num_shards = 7, but it lists 3 shard checksums"),
                        (json.dumps(dict(good, sha256=[[0] * 3] * 3)), "not a shard checksum file")):
        data = text.encode()
        with open(sidecar, "wb") as f:
            f.write(data)
        edit_manifest(cache, lambda raw: raw["shards"]["checksums"].update(
            num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
        out = run_cli("verify", cache)
        assert f"{sidecar}: " in out and words in out, out


def test_a_damaged_quarantine_line_is_a_problem_not_a_traceback(cache):
    path = os.path.join(str(cache), fmt.QUARANTINE_NAME)
    data = ('{"action": "skipped", "kind": ' + _nested(DEEP) + "}\n").encode()
    with open(path, "wb") as f:
        f.write(data)
    edit_manifest(cache, lambda raw: raw.update(quarantine=fmt.QUARANTINE_NAME, quarantine_num_bytes=len(data),
                                                quarantine_sha256=hashlib.sha256(data).hexdigest()))
    out = run_cli("verify", cache)
    assert "line 1 is not a quarantine entry" in out


# --- feeder states -----------------------------------------------------------


@pytest.fixture
def state(pristine):
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        f.step = 2
        return json.loads(json.dumps(f.state()))


STATE_CASES = [
    ("num_epochs", -1, "num_epochs: expected `int` >= 1 (got -1)"),
    ("num_epochs", 10**30, "num_epochs = 100000000000"),
    ("sequence_length", 10**15, "sequence_length: expected `int` <= 16777215 (got 1000000000000000)"),
    ("global_batch_size", 10**12, "global_batch_size: expected `int` <= 16777215 (got 1000000000000)"),
    ("seed", float("nan"), "seed = nan, expected a finite number"),
    ("seed", -3, "seed: expected `int` >= 0 (got -3)"),
    ("position", -4, "position: expected `int` >= 0 (got -4)"),
    ("feature", [[["targets"]]], "feature: expected `str` (got [[['targets']]])"),
    ("mixture", "nested", "nested deeper than 64 levels"),
    ("rate", float("inf"), "mixture[0].rate = inf, expected a finite number"),
    ("num_examples", -5, "mixture[0].num_examples: expected `int` >= 0 (got -5)"),
    ("path", "nul", "holds a NUL character"),
]


def _damage(state, field, value):
    state = json.loads(json.dumps(state))
    if value == "nested":
        deep = []
        for _ in range(DEEP):
            deep = [deep]
        state[field] = deep
    elif field == "path":
        state["mixture"][0]["path"] += "\x00"
    elif field in ("rate", "num_examples"):
        state["mixture"][0][field] = value
    else:
        state[field] = value
    return state


@pytest.mark.parametrize("field, value, words", STATE_CASES, ids=[f"{c[0]}={str(c[1])[:12]}" for c in STATE_CASES])
def test_a_hostile_feeder_state_is_one_line_from_the_feeder_and_which(state, tmp_path, field, value, words):
    bad = _damage(state, field, value)
    with pytest.raises(FeederStateError) as e:
        Feeder.restore(bad, host_index=0, host_count=1)
    assert words in str(e.value) and "\n" not in str(e.value)
    # The same state as a file: `which` reads it with the bounded loader.
    path = tmp_path / "state.json"
    text = json.dumps(bad, allow_nan=True) if value != "nested" else json.dumps(
        dict(bad, mixture="@")).replace('"@"', _nested(DEEP))
    path.write_text(text)
    out = run_cli("which", path, "--step", 2, "--row", 0)
    assert str(path) in out and "not a readable feeder state" in out
    if value != "nested" and not (isinstance(value, float) and not np.isfinite(value)):
        assert words in out, out
    if isinstance(value, float) and np.isnan(value):
        assert "NaN is not a JSON number" in out


def test_a_nul_in_a_schedule_s_cache_name_is_one_line_naming_the_file(tmp_path):
    from seqcache.feeders.schedule_file import read_schedule_file

    path = tmp_path / "s.json"
    path.write_text(json.dumps({"0": {"a/train\x00": 1}}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: the cache 'a/train\\x00' at step 0 holds a NUL"):
        read_schedule_file(str(path))


def test_which_refuses_num_epochs_minus_one_instead_of_answering_padding(state, tmp_path):
    """Was: "padding row", exit status 0."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps(dict(state, num_epochs=-1)))
    out = run_cli("which", path, "--step", 1, "--row", 0)
    assert "padding" not in out and "num_epochs: expected `int` >= 1 (got -1)" in out


def test_a_nan_seed_is_refused_before_any_comparison(state):
    """Was: "feeder state has seed=NaN, but this run has seed=NaN"."""
    with pytest.raises(FeederStateError, match=r"seed = nan, expected a finite number") as e:
        Feeder.restore(dict(state, seed=float("nan")), host_index=0, host_count=1, seed=0)
    assert "this run has" not in str(e.value)


def test_which_refuses_a_step_past_the_int64_positions(pristine):
    out = run_cli("which", pristine, "--step", 10**30, "--row", 0, "--batch-size", B)
    assert "global position 2^62" in out


def test_a_schedule_file_is_read_within_bounds(pristine, tmp_path):
    root = os.path.dirname(pristine)
    for text, words in (('{"0": {"c": NaN}}', "NaN is not a JSON number"),
                        ('{"0": ' + _nested(DEEP) + "}", "nested deeper than 64 levels"),
                        ('{"1' + "0" * 30 + '": {"c": 1}}', "is not an integer in [0, 2^62)"),
                        ('{"0": {"c": -1}}', "rate of 'c' at step 0 is -1, expected a number >= 0"),
                        ('{"0": {"c": true}}', "rate of 'c' at step 0 is True, expected a number >= 0"),
                        ('{"0": []}', "the stage at step 0 must map tasks to rates (got [])"),
                        ('{"0": {"c": 1}, "00": {"c": 2}}', "step 0 is given twice"),
                        ('{"0": {"c": 1}, "\u0661": {"c": 2}}', "is not an integer in [0, 2^62)")):
        path = tmp_path / "schedule.json"
        path.write_text(text)
        out = run_cli("which", root, "--mixture-schedule", path, "--step", 0, "--row", 0, "--batch-size", B)
        assert words in out, out


def test_a_training_schedule_file_is_read_within_bounds(tmp_path):
    from seqcache.training import data as data_lib

    for name, text, words in (("s.json", '{"0": {"a": Infinity}}', "Infinity is not a JSON number"),
                              ("s.json", _nested(DEEP), "nested deeper than 64"),
                              ("s.yaml", "0:\n  a: .inf\n", "expected a finite number"),
                              ("s.json", '{"1' + "0" * 30 + '": {"a": 1}}', "is not an integer in [0, 2^62)")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(config_lib.ConfigError, match="^" + str(path)) as e:
            data_lib.load_mixture_schedule(str(path))
        assert words in str(e.value)


# --- train configuration ------------------------------------------------------


@pytest.mark.parametrize("text, words", [
    ('{"optimizer": {"lr": NaN}}', "NaN is not a JSON number"),
    ('{"steps": 1' + "0" * 40 + "}", "out of range"),
    ('{"data": {"mixture": ' + _nested(DEEP) + "}}", "nested deeper than 16 levels"),
    ('{"steps": 1e999}', "overflows to infinity"),
    ('{"global_batch_size": 1099511627776, "model": {"vocab_size": 300}}',
     "global_batch_size: expected `int` <= 16777215 (got 1099511627776)"),
])
def test_a_hostile_config_file_is_a_config_error_naming_it(tmp_path, text, words):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(config_lib.ConfigError, match=f"^{path}: ") as e:
        config_lib.load_config_file(str(path))
    assert words in str(e.value)


@pytest.mark.parametrize("override, words", [
    ("optimizer.lr=NaN", "'NaN' is not a finite number"),
    ("optimizer.lr=-Infinity", "is not a finite number"),
    ("steps=" + "9" * 5000, "out of range"),
    ("steps=1" + "0" * 30, "out of range, expected an integer in (-2^53, 2^53)"),
    ("data.mixture={\"a\": " + _nested(50) + "}", "nested deeper than 8 levels"),
])
def test_a_hostile_override_is_a_config_error(override, words):
    with pytest.raises(config_lib.ConfigError) as e:
        config_lib.apply_overrides(config_lib.TrainConfig(), [override])
    assert words in str(e.value) and len(str(e.value)) < 400


# --- --set with JSON values that contain spaces ----------------------------------


def test_set_keeps_a_json_value_with_spaces_whole():
    docs = 'data.mixture={"caches/wiki/train": 3, "caches/code/train": 1}'
    assert config_lib.split_overrides([docs]) == [docs]
    assert config_lib.split_overrides(["model.d_model=128 optimizer.lr=1e-3", docs + "  steps=5"]) == [
        "model.d_model=128", "optimizer.lr=1e-3", docs, "steps=5"]
    # A string with a space stays one value, and so does a quoted "=" inside JSON.
    assert config_lib.split_overrides(['checkpoint.directory=/runs/my run data.task="a b=c"']) == [
        "checkpoint.directory=/runs/my run", 'data.task="a b=c"']
    config = config_lib.apply_overrides(config_lib.TrainConfig(), config_lib.split_overrides([docs]))
    assert config.data.mixture == {"caches/wiki/train": 3, "caches/code/train": 1}


def test_train_accepts_the_documented_set_of_a_mixture(tmp_path):
    """docs/training.md's ``--set 'data.mixture={...}'`` reaches the config
    whole (it used to exit 2: the value was split on its spaces)."""
    write_small_cache(tmp_path / "caches" / "wiki" / "train", task="wiki")
    write_small_cache(tmp_path / "caches" / "code" / "train", task="code")
    os.chdir(tmp_path)
    result = CliRunner().invoke(main, [
        "train", "--set", 'data.mixture={"caches/wiki/train": 3, "caches/code/train": 1}', "--set",
        "model.vocab_size=300", "--steps", "1", "--batch-size", "8", "--sequence-length", "8", "--dry-run"])
    assert result.exit_code == 0, result.output
    config = json.loads(result.output[result.output.index("\n{\n") + 1:])
    assert config["data"]["mixture"] == {"caches/wiki/train": 3, "caches/code/train": 1}


# --- the shared loader ------------------------------------------------------------


def test_bounded_loader_refuses_what_json_loads_accepts_or_crashes_on():
    from seqcache import bounded_json

    for text, words in ((_nested(DEEP), "nested deeper than 64"), ("NaN", "NaN is not"),
                        ("[1e400]", "overflows"), ("1" + "0" * 5000, "out of range"),
                        ("18446744073709551616", "out of range"), ('"\\ud800"', "lone surrogate"),
                        ('{"a": ["\\udfff"]}', r"a\[0\] holds a lone surrogate")):
        with pytest.raises(ValueError, match=f"^x: .*{words}"):
            bounded_json.loads(text, path="x")
    assert bounded_json.loads("18446744073709551615", path="x") == 2**64 - 1
    assert bounded_json.loads('["\\ud83d\\ude00"]', path="x") == ["\U0001F600"]  # a pair is one character
    with pytest.raises(fmt.CacheError, match="larger than the 10 bytes allowed"):
        bounded_json.loads("[" + "1," * 10 + "1]", path="x", error=fmt.CacheError, max_bytes=10)
    deep: list = []
    for _ in range(DEEP):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        bounded_json.check_tree({"a": deep}, path="x")
    assert len(bounded_json.short(deep)) < 40 and len(bounded_json.short(10**5000)) < 100


def test_the_bounded_loader_counts_values_and_a_shared_one_each_time(tmp_path):
    from seqcache import bounded_json

    # JSON text: at most max_nodes values, the default bounded_json.MAX_NODES.
    for reader in (bounded_json.loads, bounded_json.read_file):
        assert inspect.signature(reader).parameters["max_nodes"].default == bounded_json.MAX_NODES == 2**23
    text = json.dumps({"a": [1, 2, [3, 4]], "b": "x"})  # 8 values: the object, a, its 3 items, 3 and 4, b
    assert bounded_json.loads(text, path="x", max_nodes=8) == json.loads(text)
    # Counted in the text before anything is built, and refused where the bound is passed (the 8th value's comma).
    with pytest.raises(fmt.CacheError, match=r"^x: line 1, column 21: the manifest holds more than 7 values$"):
        bounded_json.loads(text, path="x", error=fmt.CacheError, max_nodes=7, what="manifest")
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"^{path}: line 1, column 14: the JSON file holds more than 5 values"):
        bounded_json.read_file(str(path), max_nodes=5)
    # A decoded value with shared parts (a dict handed over, aliases): ten levels
    # of nine references to the level below stand for 9^10 values; the walk
    # stops after the default MAX_NODES.
    node: list = ["x"] * 9
    for _ in range(9):
        node = [node] * 9
    with pytest.raises(ValueError, match="^s.yaml: the mixture schedule holds more than 8,388,608 values"):
        bounded_json.check_tree({"j": node}, path="s.yaml", what="mixture schedule")
    shared = [1, 2]
    bounded_json.check_tree({"a": shared, "b": shared}, path="x", max_nodes=7)  # 7 values, counted twice
    with pytest.raises(ValueError, match="holds more than 6 values"):
        bounded_json.check_tree({"a": shared, "b": shared}, path="x", max_nodes=6)
    cycle: list = []
    cycle.extend([cycle] * 9)
    with pytest.raises(ValueError, match="^x: the JSON file (is nested deeper|holds more)"):
        bounded_json.check_tree(cycle, path="x")


def test_a_garbage_shard_is_named_once(cache):
    """Was: "cannot open the shard of this shard of cache"."""
    shard = os.path.join(str(cache), fmt.shard_name(fmt.DATA_PREFIX, 0, SHARDS))
    size = os.path.getsize(shard)
    with open(shard, "wb") as f:
        f.write(b"\x07" * size)
    with Feeder(cache=str(cache), global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        with pytest.raises(fmt.CacheError) as e:
            for step in range(6):
                f.get_batch(step)
    message = str(e.value)
    assert message.startswith(f"{shard}: cannot ") and f", in cache {cache}: " in message
    assert "of this shard" not in message and "\n" not in message


@pytest.fixture(scope="module")
def built_lm(shakespeare_lm_cache, tmp_path_factory):
    """A packed cache built by the pipeline (its fingerprint_inputs record the
    features: [['targets', 'uint16'], ['targets_segment_ids', 'uint16']])."""
    return str(shakespeare_lm_cache(tmp_path_factory, num_lines=120, sequence_length=64) / "shakespeare_lm" / "train")


def _duplicate_features_key(raw):
    """The manifest text with a second, reversed "features" member (json.loads keeps the last)."""
    reversed_table = json.dumps(raw["features"][::-1])
    return json.dumps(raw)[:-1] + f', "features": {reversed_table}}}'


_RECORDED = "fingerprint_inputs.record_features = [['targets', 'uint16'], ['targets_segment_ids', 'uint16']]"
IDENTITY_CASES = [
    # (id, edit, the message's words): each edit decodes other data than the build wrote, or names another cache.
    ("reversed-features", lambda raw: raw["features"].reverse(),
     f"features = [['targets_segment_ids', 'uint16'], ['targets', 'uint16']] (name, dtype), but {_RECORDED}"),
    ("renamed-feature", lambda raw: raw["features"][0].update(name="inputs"),
     f"features = [['inputs', 'uint16'], ['targets_segment_ids', 'uint16']] (name, dtype), but {_RECORDED}"),
    ("dtype", lambda raw: raw["features"][0].update(dtype="int32"), "features = [['targets', 'int32'], "),
    ("duplicate-features-key", _duplicate_features_key, "the manifest has the key 'features' twice"),
    ("fingerprint", lambda raw: raw.update(fingerprint="0" * 64),
     f"fingerprint = '{'0' * 64}', but the sha256 of fingerprint_inputs"),
    ("fingerprint-inputs-split", lambda raw: raw["fingerprint_inputs"].update(split="validation"),
     "but the sha256 of fingerprint_inputs"),
]


@pytest.mark.parametrize("name, edit, words", IDENTITY_CASES, ids=[c[0] for c in IDENTITY_CASES])
def test_a_manifest_whose_identity_was_edited_is_refused_by_the_reader_and_verify(built_lm, tmp_path, name, edit,
                                                                                  words):
    import shutil

    cache = str(shutil.copytree(built_lm, tmp_path / "c"))
    fmt.read_manifest(cache)  # the build's manifest agrees with itself
    path = edit_manifest(cache, edit)
    with pytest.raises(fmt.CacheError) as e:
        fmt.read_manifest(cache)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value) and "\n" not in str(e.value)
    for args in (["verify", cache], ["show", cache], ["info", cache],
                 ["which", cache, "--step", 0, "--row", 0, "--batch-size", B]):
        out = run_cli(*args)
        assert words in out and path in out, (args, out)


# --- duplicate keys: one line naming the file and the key, wherever JSON is read ---


def test_a_duplicate_key_is_refused_in_manifests_states_schedules_and_set_values(pristine, state, tmp_path):
    from seqcache import bounded_json
    from seqcache.training import data as data_lib

    with pytest.raises(ValueError, match=r"^x: mixture\[0\] has the key 'rate' twice"):
        bounded_json.loads('{"mixture": [{"rate": 1, "rate": 0}]}', path="x")
    assert bounded_json.loads('{"a": {"b": 1}, "b": {"a": 2}}', path="x") == {"a": {"b": 1}, "b": {"a": 2}}
    # A feeder state whose position appears twice: `which` and load_state refuse it.
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state)[:-1] + ', "position": 40}')
    with pytest.raises(FeederStateError, match=f"^{path}: the feeder state has the key 'position' twice"):
        from seqcache.feeders.state import load_state
        load_state(str(path))
    out = run_cli("which", path, "--step", 2, "--row", 0)
    assert "has the key 'position' twice" in out and str(path) in out
    # A nested manifest key: every command names the manifest and the place.
    cache = tmp_path / "c"
    import shutil
    shutil.copytree(pristine, cache)
    mpath = edit_manifest(cache, lambda raw: json.dumps(raw).replace('"shards": {"num_shards": ',
                                                                     '"shards": {"num_shards": 1, "num_shards": '))
    for args in (["info", cache], ["verify", cache]):
        out = run_cli(*args)
        assert f"{mpath}: shards has the key 'num_shards' twice" in out, out
    # Mixture schedules, JSON (which, train) and YAML (train).
    schedule = tmp_path / "schedule.json"
    schedule.write_text('{"0": {"c": 1}, "0": {"c": 2}}')
    out = run_cli("which", os.path.dirname(pristine), "--mixture-schedule", schedule, "--step", 0, "--row", 0,
                  "--batch-size", B)
    assert f"{schedule}: the mixture schedule has the key '0' twice" in out, out
    with pytest.raises(config_lib.ConfigError, match=f"^{schedule}: the mixture schedule has the key '0' twice"):
        data_lib.load_mixture_schedule(str(schedule))
    yaml_schedule = tmp_path / "schedule.yaml"
    yaml_schedule.write_text("0:\n  wiki: 1\n  wiki: 3\n")
    with pytest.raises(config_lib.ConfigError, match=f"^{yaml_schedule}: line 3, column 3: the key 'wiki' appears twice"):
        data_lib.load_mixture_schedule(str(yaml_schedule))
    # A --set value and a config file.
    with pytest.raises(config_lib.ConfigError, match="the key 'a' appears twice in one object") as e:
        config_lib.apply_overrides(config_lib.TrainConfig(), ['data.mixture={"a": 1, "a": 3}'])
    assert "data.mixture" in str(e.value)
    config = tmp_path / "config.json"
    config.write_text('{"steps": 5, "steps": 50}')
    with pytest.raises(config_lib.ConfigError, match=f"^{config}: the config file has the key 'steps' twice"):
        config_lib.load_config_file(str(config))


# --- one rule for the text of a file; parse errors at their line and column ---------


def test_a_byte_order_mark_is_dropped_at_the_first_byte_of_every_file_and_nowhere_else(pristine, state, tmp_path):
    """The one BOM policy (bounded_json.decode_text; the sources' BOM is the
    same bytes): a manifest, a feeder state, a checkpoint's feeder state, a
    JSON and a YAML schedule and a config file are read with one; one anywhere
    else is a character, outside a string a syntax error at its line and column."""
    import shutil

    from seqcache import bounded_json, bounded_yaml
    from seqcache.feeders import state as state_lib
    from seqcache.tasks.sources import base
    from seqcache.training import data as data_lib

    assert base.BOM == bounded_json.BOM == "\ufeff".encode()
    bom = bounded_json.BOM
    assert bounded_json.loads(bom + b'{"a": 1}', path="x") == {"a": 1} == bounded_yaml.loads(bom + b"a: 1", path="x")
    assert bounded_json.loads("\ufeff[1]", path="x") == [1]
    with pytest.raises(ValueError, match="^x: line 1, column 7: the JSON file is not valid JSON: Expecting value$"):
        bounded_json.loads(b'{"a": ' + bom + b"1}", path="x")
    assert bounded_json.loads(b'{"a": "' + bom + b'"}', path="x") == {"a": "\ufeff"}
    with pytest.raises(ValueError, match="^x: line 2, column 1: the JSON file is not valid JSON"):
        bounded_json.loads(b'{"a": 1}\n' + bom, path="x")
    with pytest.raises(ValueError, match="^x: the JSON file is UTF-16 text .*: save it as UTF-8$"):
        bounded_json.loads('{"a": 1}'.encode("utf-16"), path="x")
    cache = shutil.copytree(pristine, tmp_path / "c")
    manifest = os.path.join(cache, fmt.MANIFEST_NAME)
    with open(manifest, "rb") as f:
        text = f.read()
    with open(manifest, "wb") as f:
        f.write(bom + text)
    assert fmt.read_manifest(str(cache), check_shards=True).num_examples == N
    state_file = tmp_path / "state.json"
    state_file.write_bytes(bom + json.dumps(state).encode())
    assert state_lib.load_state(str(state_file)) == state
    step = tmp_path / "ckpt" / "2"
    (step / "feeder").mkdir(parents=True)
    (step / "feeder" / "metadata").write_bytes(bom + json.dumps(state).encode())
    assert state_lib.load_state(str(step)) == state == state_lib.load_checkpoint_state(str(step))
    for name, text in (("s.json", b'{"0": {"a": 1}}'), ("s.yaml", b"0: {a: 1}\n")):
        (tmp_path / name).write_bytes(bom + text)
        assert data_lib.load_mixture_schedule(str(tmp_path / name)) == {0: {"a": 1.0}}
    config = tmp_path / "config.json"
    config.write_bytes(bom + b'{"steps": 5}')
    assert config_lib.load_config_file(str(config)).steps == 5


@pytest.mark.parametrize("name, text, words", [
    ("s.json", b'{"0": {"a": 1},\n "5": {"a": 2,}}', "line 2, column 15: the mixture schedule is not valid JSON: "
                                                    "Expecting property name enclosed in double quotes"),
    ("s.json", b'{"0": {"a": 1}}\n{"5": {"a": 2}}', "line 2, column 1: the mixture schedule is not valid JSON: "
                                                   "Extra data"),
    ("s.json", b'{"0": {"a": "\xe9"}}', "line 1, column 14: the mixture schedule is not UTF-8 text (byte 0xe9: "),
    ("s.yaml", b"0: {a: 1\n5: {a: 2}\n", "line 2, column 2: the mixture schedule is not valid YAML: … "
                                         "(while parsing a flow mapping at line 1, column 4)"),
    ("s.yaml", b"0:\n  a: 1\n   b: 2\n", "line 3, column 5: the mixture schedule is not valid YAML: mapping "
                                         "values are not allowed"),
    ("s.yaml", b"0: {a: !!float 1}\n", "line 1, column 8: tag tag:yaml.org,2002:float: a mixture schedule may not "
                                      "use YAML tags"),
    ("s.yaml", b"0: {a: 1}\n---\n5: {a: 2}\n", "line 2, column 1: a second YAML document (---)"),
    ("s.yaml", b"0: {? [a]: 1}\n", "line 1, column 7: a mapping key that is not a scalar"),
])
def test_a_file_that_does_not_parse_is_one_line_naming_the_line_and_column(tmp_path, name, text, words):
    from seqcache.training import data as data_lib

    path = tmp_path / name
    path.write_bytes(text)
    with pytest.raises(config_lib.ConfigError) as e:
        data_lib.load_mixture_schedule(str(path))
    head, _, tail = words.partition(" … ")  # the parser's own words between (libyaml's or PyYAML's)
    message = str(e.value)
    assert message.startswith(f"{path}: {head}") and message.endswith(tail) and "\n" not in message, message


def test_yaml_schedules_are_read_as_yaml_1_2_core(tmp_path):
    """What a YAML 1.1 reader (PyYAML's SafeLoader) reads otherwise: base-60
    integers (quadratic), yes/no booleans, octal 010, dates, merge keys."""
    from seqcache import bounded_yaml

    text = "a: 1:59:59\nb: yes\nc: 010\nd: 2024-01-01\ne: 0o10\nf: 0x1F\ng: 1e3\nh: ~\ni: TRUE\nj: '<<'\nk: 0b11\n"
    assert bounded_yaml.loads(text, path="x") == {"a": "1:59:59", "b": "yes", "c": 10, "d": "2024-01-01", "e": 8,
                                                  "f": 31, "g": 1000.0, "h": None, "i": True, "j": "<<", "k": "0b11"}
    for text, words in (("a: {<<: {b: 1}}", "line 1, column 5: merge key <<"),
                        ("a: &x 1\nb: *x", "line 1, column 4: anchor &x"),
                        ("a: " + "[" * 65 + "]" * 65, "line 1, column 67: the YAML file is nested deeper than 64"),
                        ("{" + ", ".join(f"k{i}: 1" for i in range(11)) + "}", "a mapping of the YAML file has more "
                                                                              "than 10 keys"),
                        ("[" + "1, " * 100 + "1]", "the YAML file holds more than 100 values"),
                        ("a: -.inf", "-.inf is not a finite number"),
                        ("a: 18446744073709551616", "18446744073709551616 is out of range (|n| < 2^64)")):
        with pytest.raises(ValueError, match="^x: " + ("line [0-9]+, column [0-9]+: " if "line" not in words else "")
                           + re.escape(words)):
            bounded_yaml.loads(text, path="x", max_keys=10, max_nodes=100)


def test_feeder_restore_file_reads_a_state_file_or_a_checkpoint_step(pristine, state, tmp_path):
    """The documented safe way to restore a state from a file: bounded, no key
    twice; Feeder.restore(dict) cannot know json.load kept the last of two."""
    from seqcache.feeders import restore_feeder

    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    step = tmp_path / "ckpt" / "2"
    (step / "feeder").mkdir(parents=True)
    (step / "feeder" / "metadata").write_text(json.dumps(state))
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        want = f.get_batch(2)
    for source in (path, str(path), step):
        for restore in (Feeder.restore_file, restore_feeder):
            with restore(source, host_index=0, host_count=1) as g:
                assert g.step == 2
                assert all(np.array_equal(g.get_batch(2)[k], want[k]) for k in want)
    twice = json.dumps(state)[:-1] + ', "seed": 1}'
    path.write_text(twice)
    (step / "feeder" / "metadata").write_text(twice)
    assert json.loads(twice)["seed"] == 1  # what Python's json (and Orbax's JsonRestore) would restore
    with pytest.raises(FeederStateError, match=f"^{re.escape(str(path))}: the feeder state has the key 'seed' twice"):
        Feeder.restore_file(path, host_index=0, host_count=1)
    metadata = re.escape(str(step / "feeder" / "metadata"))
    with pytest.raises(FeederStateError, match=f"^checkpoint step 2: {metadata}: the feeder state has the key 'seed' "
                                               "twice"):
        restore_feeder(step, host_index=0, host_count=1)
    with pytest.raises(FeederStateError, match=f"^checkpoint step 7: {re.escape(str(tmp_path / 'ckpt' / '7'))}/feeder/"
                                               "metadata: no feeder state here"):
        (tmp_path / "ckpt" / "7").mkdir()
        Feeder.restore_file(tmp_path / "ckpt" / "7", host_index=0, host_count=1)


def test_info_and_show_bound_their_tables(pristine, tmp_path):
    """A table shows at most MAX_ROWS rows (a cell at most MAX_ROWS items), then
    "… and K more"; --json gives every one."""
    import shutil

    from seqcache.cli.commands import common

    cache = shutil.copytree(pristine, tmp_path / "c")
    kinds = {f"kind{i:04d}": 1 for i in range(250)}
    edit_manifest(cache, lambda raw: raw["statistics"].update(
        skipped_records=250, bad_input_records={"skipped": kinds, "records": {"skipped": 250}},
        excluded_by_benchmark={f"bench{i:04d}": 0 for i in range(150)}))
    out = CliRunner().invoke(main, ["info", str(cache)], terminal_width=10_000).output
    assert "kind0099 1, … and 150 more" in out and "kind0100" not in out, out
    assert "bench0099" in out and "bench0100" not in out and "… and 50 more benchmarks" in out, out
    assert common.head(range(5), 3) == ([0, 1, 2], "… and 2 more") and common.head([1], 3) == ([1], None)
    out = CliRunner().invoke(main, ["info", str(cache), "--json"]).output
    assert len(json.loads(out)["statistics"]["bad_input_records"]["skipped"]) == 250


def test_verify_refuses_token_ids_at_or_above_the_manifests_vocab_size(built_lm, tmp_path):
    """Was: "ok" for a manifest whose vocab_size was lowered; training on it
    then gathers embeddings out of range (a NaN loss)."""
    import shutil

    from seqcache.cli.verify import verify_cache

    cache = str(shutil.copytree(built_lm, tmp_path / "c"))
    assert verify_cache(cache).ok
    size = json.load(open(_manifest_path(cache)))["vocabularies"]["targets"]["vocab_size"]
    edit_manifest(cache, lambda raw: raw["vocabularies"]["targets"].update(vocab_size=100))
    report = verify_cache(cache)
    assert not report.ok
    bad = [p for p in report.problems if "outside the vocabulary's [0, 100)" in p]
    assert len(bad) == 2, report.problems  # the first such record of each of the 2 shards
    shard0 = os.path.join(cache, fmt.shard_name(fmt.DATA_PREFIX, 0, 2))
    assert bad[0].startswith(f"{shard0} record 0: feature 'targets' holds token id ")
    assert "vocabularies.targets.vocab_size in the manifest" in bad[0] and "\n" not in bad[0]
    # The token named is the first one >= 100 in shard 0's first record.
    from seqcache.feeders.reader import CacheReader

    with CacheReader(cache) as r:
        first = r.read_examples([0])[0]["targets"]
    assert f"token id {int(first[first >= 100][0])}," in bad[0]
    out = CliRunner().invoke(main, ["verify", cache])
    assert out.exit_code == 1 and "outside the vocabulary's [0, 100)" in out.output
    # The build's own size passes: every id is below it.
    edit_manifest(cache, lambda raw: raw["vocabularies"]["targets"].update(vocab_size=size))
    assert verify_cache(cache).ok


# --- `which` answers only for what a Feeder would feed -----------------------------


def _which_and_restore(state, tmp_path, *which_args):
    """``which STATE_FILE ...``'s one error line, and Feeder.restore's message, for ``state``."""
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    with pytest.raises(FeederStateError) as e:
        Feeder.restore(state, host_index=0, host_count=1)
    return run_cli("which", path, *which_args), str(e.value)


def test_which_refuses_a_mixed_feature_mixture_state_as_restore_does(pristine, tmp_path):
    """Was: an answer (exit 0) for a state whose mixture holds an LM task and a
    translation task, which Feeder.restore refuses."""
    lm = write_small_cache(tmp_path / "wiki" / "train", task="wiki")
    pairs = [[({"inputs": np.arange(1, 5, dtype=np.int32) + i, "targets": np.arange(3, dtype=np.int32) + i},
               [(0, i, 0)]) for i in range(6)]]
    mt = write_cache(str(tmp_path / "wmt" / "train"), task="wmt", split="train", shards=pairs,
                     features=(fmt.FeatureSpec("inputs", "int32"), fmt.FeatureSpec("targets", "int32")),
                     sources=[{"path": "corpus/wmt.tsv"}], fingerprint_inputs={"task": "wmt"})
    other = write_small_cache(tmp_path / "code" / "train", task="code")
    with Feeder(mixture={lm: 1, other: 1}, global_batch_size=B, sequence_length=8, host_index=0, host_count=1) as f:
        state = json.loads(json.dumps(f.state()))
    state["mixture"][1].update(path=str(tmp_path / "wmt" / "train"), task="wmt", fingerprint=mt.fingerprint,
                               num_examples=6)
    out, restored = _which_and_restore(state, tmp_path, "--step", 0, "--row", 0)
    assert "the mixture's caches have different features" in restored
    assert out == f"error: {restored}\n"
    steps = run_cli("which", tmp_path / "state.json", "--steps", "0:2", "--output", tmp_path / "t.parquet")
    assert "different features" in steps and not os.path.exists(tmp_path / "t.parquet")
    where = run_cli("which", tmp_path / "state.json", "--example", 0, "--task", 0)
    assert "different features" in where


def test_which_refuses_a_state_longer_than_its_packed_cache_as_restore_does(built_lm, tmp_path):
    with Feeder(cache=built_lm, global_batch_size=B, sequence_length=64, host_index=0, host_count=1) as f:
        state = json.loads(json.dumps(f.state()))
    out, restored = _which_and_restore(dict(state, sequence_length=128), tmp_path, "--step", 0, "--row", 0)
    assert "sequence length 128 for feature 'targets' is longer than the cache's, 64 tokens" in restored
    assert out == f"error: {restored}\n"


def test_which_refuses_a_step_past_the_end_of_a_finite_run_as_get_batch_does(pristine, tmp_path):
    """Was: "padding row" and exit 0 for step 6 of a 6-step run (23 examples, B=4)."""
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=8, num_epochs=1, host_index=0,
                host_count=1) as f:
        assert f.num_steps == 6
        with pytest.raises(ValueError) as e:
            f.get_batch(6)
        state = json.loads(json.dumps(f.state()))
    message = str(e.value)
    assert message == "step 6 is past the end of this finite run: 1 epoch(s) take 6 steps (0..5)"
    path = tmp_path / "state.json"
    path.write_text(json.dumps(state))
    assert run_cli("which", path, "--step", 6, "--row", 0) == f"error: {message}\n"
    assert run_cli("which", pristine, "--batch-size", B, "--num-epochs", 1, "--step", 6, "--row", 0) == \
        f"error: {message}\n"
    out = run_cli("which", path, "--steps", "4:7", "--output", tmp_path / "t.parquet")
    assert out == f"error: {message}\n"
    # The last step's last row is padding (24 positions, 23 examples): an answer, exit 0.
    result = CliRunner().invoke(main, ["which", str(path), "--step", "5", "--row", "3"])
    assert result.exit_code == 0 and "padding row" in result.output


def test_which_refuses_a_global_batch_no_feeder_state_holds(pristine):
    out = run_cli("which", pristine, "--batch-size", 100_000_000, "--step", 0, "--row", 0)
    assert "100000000 is not below 2^24" in out and "--batch-size" in out


# --- messages that name the caches and what would work ------------------------------


def test_train_refuses_a_mixed_feature_mixture_with_the_feeders_message(tmp_path):
    """Was: "the caches have different features, so one model cannot read them
    all: {...}", a dict's repr without task names or what would work."""
    write_small_cache(tmp_path / "caches" / "wiki" / "train", task="wiki")
    pairs = [[({"inputs": np.arange(1, 5, dtype=np.int32) + i, "targets": np.arange(3, dtype=np.int32) + i},
               [(0, i, 0)]) for i in range(6)]]
    write_cache(str(tmp_path / "caches" / "wmt" / "train"), task="wmt", split="train", shards=pairs,
                features=(fmt.FeatureSpec("inputs", "int32"), fmt.FeatureSpec("targets", "int32")),
                sources=[{"path": "corpus/wmt.tsv"}], fingerprint_inputs={"task": "wmt"})
    os.chdir(tmp_path)
    result = CliRunner().invoke(main, [
        "train", "--set", 'data.mixture={"caches/wiki/train": 1, "caches/wmt/train": 1}', "--set",
        "model.vocab_size=300", "--steps", "1", "--batch-size", "8", "--sequence-length", "8", "--dry-run"])
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("task 'wiki' (caches/wiki/train) has ['targets']; task 'wmt' (caches/wmt/train) has "
            "['inputs', 'targets']") in result.output, result.output
    assert "Mix tasks with ['targets'] only (read with ConvertedFeeder(converter='lm'))" in result.output
    assert "{'caches/" not in result.output


def test_a_bad_mixture_rate_names_the_cache_and_the_state_file(pristine, tmp_path, state):
    root = os.path.dirname(pristine)
    out = run_cli("which", root, "--mixture-rate", "c=-1", "--batch-size", B, "--step", 0, "--row", 0)
    assert f"mixture rate of {pristine} is -1.0, expected a finite number > 0" in out, out
    with pytest.raises(ValueError, match=f"^mixture rate of {pristine} is 0 .*remove the task"):
        Feeder(mixture={pristine: 0}, global_batch_size=B, sequence_length=8, host_index=0, host_count=1)
    path = tmp_path / "state.json"
    state["mixture"][0]["rate"] = 0
    path.write_text(json.dumps(state))
    out = run_cli("which", path, "--step", 0, "--row", 0)
    assert f"{path}: mixture[0].rate = 0 (cache '{pristine}'), expected a number > 0" in out, out


def test_the_report_page_bounds_its_lists():
    """The HTML report shows at most MAX_ROWS features, kinds and tasks a list,
    then "… and K more" (``--json`` keeps every one): a manifest of 250
    features' statistics or a quarantine of 250 kinds makes a page of 100."""
    from seqcache.cli import report_html
    from seqcache.cli.commands import common

    many = {f"f{i:03d}": i for i in range(250)}
    report = {"caches": [{"summary": {"statistics": {"tokens": many, "mean_length": many, "examples": 3}},
                          "lengths": dict(many), "packing": dict(many),
                          "quarantine": {"kinds": [{"kind": f"k{i}"} for i in range(250)], "file": None}}],
              "mixture": {"tasks": [{"task": f"t{i}"} for i in range(250)]}}
    page = report_html.bounded(report)
    (cache,) = page["caches"]
    assert list(cache["summary"]["statistics"]["tokens"]) == [f"f{i:03d}" for i in range(common.MAX_ROWS)]
    assert cache["summary"]["statistics"]["examples"] == 3
    assert len(cache["lengths"]) == len(cache["packing"]) == len(cache["quarantine"]["kinds"]) == common.MAX_ROWS
    assert cache["more"] == {key: "… and 150 more" for key in ("tokens", "mean_length", "lengths", "packing", "kinds")}
    assert len(page["mixture"]["tasks"]) == common.MAX_ROWS and page["mixture"]["more_tasks"] == "… and 150 more"
    assert len(report["caches"][0]["lengths"]) == 250  # the report itself (and --json) keeps every one
