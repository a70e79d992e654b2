"""Fuzzing the readers of JSON that seqcache did not write itself (hypothesis).

A real small cache (built by the pipeline) and a feeder state saved from it
are made once per module;
each example mutates one or a few values of the manifest, the state, a config
or a schedule: deep nesting, integers far out of range, negative counts, NaN
and Infinity, wrong types, deleted keys, shard counts that contradict the
totals. Nothing but the documented errors may come out of the library
(``seqcache.format.CacheError``, ``FeederStateError``, ``ConfigError``, and
``ValueError`` where the Feeder documents it for a damaged manifest), and
``info``, ``verify``, ``show`` and ``which`` may print no traceback. A state
that ``Feeder.restore`` or ``set_state`` refuses is refused with
``FeederStateError`` (or ``CacheError`` for a cache that cannot be opened where
the state says), never a bare ``ValueError``, ``KeyError``, ``TypeError`` or
``IndexError``. A mixture schedule with YAML aliases (a "billion laughs" file
of a few hundred bytes) is refused as it is read.

The default suite runs a bounded number of examples (a few seconds); the
``slow`` tests run many more.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import os
import pathlib
import re
import shutil
from typing import Sequence

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from click.testing import CliRunner  # noqa: E402

from seqcache import format as fmt  # noqa: E402
from seqcache.cli.main import main  # noqa: E402
from seqcache.feeders import Feeder, FeederStateError  # noqa: E402
from seqcache.training import config as config_lib  # noqa: E402

B = 4
FAST = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
FAST_PARSE = settings(FAST, max_examples=100)
SLOW = settings(FAST, max_examples=1500, derandomize=False)


class Raw:
    """A JSON value given as text (NaN, Infinity, nesting deeper than Python
    builds comfortably), put in place when the document is written."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return f"Raw({self.text[:30]!r})"


def render(doc) -> str:
    """JSON text of ``doc`` with every ``Raw`` replaced by its text."""
    raws: list[Raw] = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(value)
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(doc))
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw.text)
    return text


# --- values a hostile file holds ------------------------------------------------

huge_ints = st.one_of(st.integers(min_value=2**31, max_value=10**40), st.integers(min_value=-10**40, max_value=-1),
                      st.sampled_from([2**53, 2**62, 2**63, 2**64, 10**30, -2**63, -1]))
special = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" + "0" * 5000])
nested = st.integers(min_value=60, max_value=20_000).map(lambda d: "[" * d + "]" * d)
values = st.one_of(
    huge_ints,
    st.integers(min_value=-3, max_value=300),
    special.map(Raw),
    nested.map(Raw),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.none(),
    st.booleans(),
    st.lists(st.integers(min_value=-2, max_value=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(min_value=-1, max_value=2), max_size=2),
)
DELETE = object()


def paths_of(doc, prefix=()):
    """Every path (tuple of keys and indices) into a JSON document, at most 3
    deep and 6 items per list."""
    out = [prefix] if prefix else []
    if len(prefix) >= 3:
        return out
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths_of(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:6]):
            out += paths_of(v, prefix + (i,))
    return out


def mutate(doc, path, value):
    """``doc`` with the value at ``path`` replaced (or deleted: ``DELETE``)."""
    doc = copy.deepcopy(doc)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        if isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    return doc


def similar(value):
    """Values of the same JSON type as ``value`` (so that more mutated
    documents pass the type checks and reach the code behind them)."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(min_value=-2, max_value=2 * abs(value) + 3), huge_ints)
    if isinstance(value, float):
        return st.one_of(st.floats(allow_nan=False, allow_infinity=False), special.map(Raw))
    if isinstance(value, str):
        return st.one_of(st.text(max_size=6), st.just(value[:-1]), st.just(value + "x"))
    if isinstance(value, list):
        return st.one_of(st.just(value[:-1]), st.just(value + value[-1:]), st.just([]), nested.map(Raw))
    if isinstance(value, dict) and value:
        key = sorted(value)[0]
        return st.one_of(st.just({k: v for k, v in value.items() if k != key}), st.just({**value, "x": [0]}),
                         st.just({}), st.just({k: "x" for k in value}))
    return values


def value_at(doc, path):
    for key in path:
        doc = doc[key]
    return doc


@st.composite
def mutated(draw, doc, extra_paths=()):
    """``doc`` with one to three of its values replaced (by any value, or by
    one of the same type) or deleted."""
    paths = paths_of(doc) + list(extra_paths)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(paths))
        try:
            same = similar(value_at(doc, path))
        except (KeyError, IndexError, TypeError):
            same = values
        value = draw(st.one_of(same, values, st.just(DELETE)))
        try:
            doc = mutate(doc, path, value)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # an earlier mutation removed or replaced the path
    return doc


def column(values_) -> str:
    return base64.b64encode(np.asarray(values_, "<i8").tobytes()).decode()


@st.composite
def manifests(draw, raw):
    """A mutated manifest; sometimes a shard column made to contradict the totals."""
    doc = draw(mutated(raw))
    if draw(st.booleans()) and isinstance(doc.get("shards"), dict):
        counts = draw(st.lists(st.integers(min_value=-2, max_value=2**62), min_size=3, max_size=3))
        doc["shards"][draw(st.sampled_from(["num_records", "num_bytes", "provenance_num_bytes"]))] = column(counts)
        if draw(st.booleans()):
            doc["num_examples"] = int(sum(c for c in counts if c > 0)) % 2**63
    return doc


# --- fixtures ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, shakespeare_lm_cache):
    """A real cache built by the pipeline (packed, byte vocabulary, statistics,
    source table, a quarantine file), once per module."""
    root = shakespeare_lm_cache(tmp_path_factory, num_lines=300, sequence_length=64, num_shards=3)
    return str(root / "shakespeare_lm" / "train")


@pytest.fixture(scope="module")
def raw_manifest(pristine):
    return json.load(open(os.path.join(pristine, fmt.MANIFEST_NAME)))


@pytest.fixture(scope="module")
def saved_state(pristine):
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=64, host_index=0, host_count=1) as f:
        f.step = 3
        return json.loads(json.dumps(f.state()))


@pytest.fixture(scope="module")
def finite_state(pristine):
    """A state of a one-epoch run (a position past its end is refused)."""
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=64, host_index=0, host_count=1,
                num_epochs=1) as f:
        f.step = 3
        return json.loads(json.dumps(f.state()))


@pytest.fixture(scope="module")
def work(pristine, tmp_path_factory):
    """A copy of the cache whose manifest each example rewrites."""
    return str(shutil.copytree(pristine, tmp_path_factory.mktemp("work") / "c"))


def run_cli(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        args, result.output, repr(result.exception))
    assert "Traceback" not in result.output, result.output
    if result.exit_code:
        assert "error" in result.output.lower() or "FAILED" in result.output or "warning" in result.output, \
            result.output
    return result.output


def check_manifest_text(work, text: str, *, commands=True) -> None:
    with open(os.path.join(work, fmt.MANIFEST_NAME), "w") as f:
        f.write(text)
    try:
        m = fmt.read_manifest(work)
    except fmt.CacheError:
        m = None
    if m is not None:
        try:
            with Feeder(cache=work, global_batch_size=B, sequence_length=64, host_index=0, host_count=1) as f:
                f.get_batch(0)
        except (fmt.CacheError, ValueError):
            pass
    if commands:
        run_cli("info", work)
        run_cli("verify", work)
        run_cli("show", work)
        run_cli("which", work, "--step", 1, "--row", 2, "--batch-size", B)


def decoded(state_doc):
    """The state as ``json.loads`` gives it, or None for what Python's own json
    cannot build (nesting too deep, an integer of over 4,300 digits): only a
    file read through ``bounded_json`` takes those."""
    try:
        return json.loads(render(state_doc))
    except (RecursionError, ValueError):
        return None


def restore_or_refuse(state) -> None:
    """``Feeder.restore(state)`` and a batch from the restored feeder; a refusal
    must be a ``FeederStateError``, or a ``CacheError`` for a cache that cannot
    be opened where the state says (anything else fails the test)."""
    try:
        f = Feeder.restore(state, host_index=0, host_count=1)
    except (FeederStateError, fmt.CacheError):
        return
    with f:
        if f.num_steps is None or f.step < f.num_steps:  # a state at the end of a finite run has no next batch
            f.get_batch(f.step)


def set_state_or_refuse(feeder, state) -> None:
    """``feeder.set_state(state)``; a refusal must be a ``FeederStateError``,
    and leaves the feeder where it was."""
    before = feeder.step
    try:
        feeder.set_state(state)
    except FeederStateError:
        assert feeder.step == before
    else:
        assert feeder.step * feeder.global_batch_size == state["position"]


def check_state_text(pristine, tmp_path, state_doc) -> None:
    state = decoded(state_doc)
    if state is not None:
        restore_or_refuse(state)
    path = tmp_path / "state.json"
    path.write_text(render(state_doc))
    run_cli("which", path, "--step", 3, "--row", 1)


# --- default suite: bounded examples ----------------------------------------------


def test_fuzz_manifest_parser(raw_manifest, work):
    @FAST_PARSE
    @given(manifests(raw_manifest))
    def run(doc):
        check_manifest_text(work, render(doc), commands=False)

    run()


def test_fuzz_info_verify_show_which_on_mutated_manifests(raw_manifest, work):
    @FAST
    @given(manifests(raw_manifest))
    def run(doc):
        check_manifest_text(work, render(doc))

    run()


def test_fuzz_feeder_state(pristine, saved_state, tmp_path):
    @FAST
    @given(mutated(saved_state, extra_paths=[("mixture", 0, "rate"), ("mixture", 0, "num_examples"),
                                             ("num_epochs",), ("position",)]))
    def run(doc):
        check_state_text(pristine, tmp_path, doc)

    run()


def test_fuzz_restore_and_set_state_refuse_only_with_feeder_state_error(pristine, saved_state, finite_state):
    # Forever and one-epoch runs; the two explicit examples were once bare
    # ValueErrors: a feature the cache lacks, a position past a finite run's end.
    extra = [("mixture", 0, "rate"), ("mixture", 0, "num_examples"), ("num_epochs",), ("position",), ("feature",)]
    past_end = B * 10**6
    with Feeder(cache=pristine, global_batch_size=B, sequence_length=64, host_index=0, host_count=1) as forever, \
            Feeder(cache=pristine, global_batch_size=B, sequence_length=64, host_index=0, host_count=1,
                   num_epochs=1) as finite:
        @FAST
        @example(dict(saved_state, feature=""))
        @example(dict(finite_state, position=past_end))
        @example(dict(saved_state, num_epochs=1, position=past_end))
        @given(st.one_of(mutated(saved_state, extra_paths=extra), mutated(finite_state, extra_paths=extra)))
        def run(doc):
            state = decoded(doc)
            if state is None:
                return
            restore_or_refuse(state)
            for feeder in (forever, finite):
                set_state_or_refuse(feeder, state)

        run()
    with pytest.raises(FeederStateError, match="has no feature ''"):
        Feeder.restore(dict(saved_state, feature=""), host_index=0, host_count=1)
    with pytest.raises(FeederStateError, match=f"position={past_end} .* past the end of this finite run"):
        Feeder.restore(dict(finite_state, position=past_end), host_index=0, host_count=1)


CONFIG = {"steps": 10, "global_batch_size": 8, "sequence_length": 16, "optimizer": {"lr": 0.001, "decay_steps": 5},
          "model": {"vocab_size": 300, "d_model": 64}, "data": {"mixture": {"a": 1}, "seed": 3},
          "checkpoint": {"every_steps": 2}, "mesh": {"data": -1}}


def test_fuzz_config_file_and_overrides(tmp_path):
    path = tmp_path / "config.json"

    @FAST_PARSE
    @given(mutated(CONFIG), st.text(max_size=30), st.sampled_from(["steps", "optimizer.lr", "data.mixture",
                                                                   "model.d_model", "data.task", "mesh.data"]))
    def run(doc, text, key):
        path.write_text(render(doc))
        try:
            config_lib.load_config_file(str(path)).validate()
        except config_lib.ConfigError:
            pass
        try:
            config_lib.apply_overrides(config_lib.TrainConfig(), config_lib.split_overrides([f"{key}={text}"]))
        except config_lib.ConfigError:
            pass

    run()


def test_fuzz_schedule_files(pristine, tmp_path):
    from seqcache.training import data as data_lib

    root = os.path.dirname(pristine)
    path = tmp_path / "schedule.json"
    yaml_path = tmp_path / "schedule.yaml"  # JSON text is YAML too: the same documents through the YAML reader

    @FAST
    @given(mutated({"0": {"c": 1}, "5": {"c": 2}}))
    def run(doc):
        path.write_text(render(doc))
        yaml_path.write_text(render(doc))
        for schedule in (path, yaml_path):
            try:
                data_lib.load_mixture_schedule(str(schedule))
            except config_lib.ConfigError:
                pass
        run_cli("which", root, "--mixture-schedule", path, "--step", 1, "--row", 0, "--batch-size", B)

    run()


@st.composite
def yaml_alias_schedules(draw):
    """A YAML schedule with an anchor or alias somewhere: an alias bomb of
    ``width`` aliases per line over ``depth`` lines (each line the aliases of the
    one before: width^depth values once expanded), a merge key, or an anchor on
    a stage, a rate or a key, after a few plain stages."""
    lines = [f"{10 * i}: {{c: {i + 1}}}" for i in range(draw(st.integers(min_value=0, max_value=3)))]
    kind = draw(st.sampled_from(["bomb", "merge", "stage", "rate", "key", "alias"]))
    if kind == "bomb":
        width, depth = draw(st.integers(min_value=1, max_value=16)), draw(st.integers(min_value=1, max_value=16))
        lines.append(f"x0: &x0 [{', '.join(['c'] * width)}]")
        lines += [f"x{d}: &x{d} [{', '.join([f'*x{d - 1}'] * width)}]" for d in range(1, depth)]
    elif kind == "merge":
        lines += ["base: &base {c: 1}", "100: {<<: *base, d: 2}"]
    elif kind == "stage":
        lines += ["100: &s {c: 1}", "200: *s"]
    elif kind == "rate":
        lines += ["100: {c: &r 1, d: *r}"]
    elif kind == "key":
        lines += ["&k 100: {c: 1}"]
    else:
        lines += ["100: {c: *undefined}"]
    return "\n".join(draw(st.permutations(lines))) + "\n"


def test_fuzz_yaml_schedules_with_anchors_or_aliases_are_refused(tmp_path):
    # Before anything is built, whatever the alias stands for (9 aliases over
    # 10 lines once hung `seqcache train` for as long as anyone waited); a merge
    # key met before its alias is refused as a merge key.
    from seqcache.training import data as data_lib

    path = tmp_path / "schedule.yaml"

    @FAST
    @example("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefghi", "bcdefghij")))
    @given(yaml_alias_schedules())
    def run(text):
        path.write_text(text)
        with pytest.raises(config_lib.ConfigError, match=f"^{re.escape(str(path))}: line [0-9]+, column [0-9]+: "
                           "(anchor &|alias \\*|merge key <<)"
                           ".* a mixture schedule may not use YAML (anchors or aliases|merge keys)"):
            data_lib.load_mixture_schedule(str(path))

    run()


def _shared(width: int, depth: int) -> list:
    """A list of ``width`` references to one list, ``depth`` levels deep, over
    ``width`` strings: 1 + width + ... + width^depth values once expanded."""
    node: list = ["x"] * width
    for _ in range(depth - 1):
        node = [node] * width
    return node


def test_fuzz_check_tree_counts_a_shared_value_each_time_it_is_reached():
    from seqcache import bounded_json

    @FAST
    @given(st.integers(min_value=1, max_value=12), st.integers(min_value=1, max_value=12),
           st.integers(min_value=1, max_value=5000))
    def run(width, depth, max_nodes):
        total = sum(width**k for k in range(depth + 1))
        value = {"a": _shared(width, depth)}  # and the dict: one more value
        if total + 1 > max_nodes:
            with pytest.raises(ValueError, match=f"^x: the JSON file holds more than {max_nodes:,} values"):
                bounded_json.check_tree(value, path="x", max_nodes=max_nodes)
        else:
            bounded_json.check_tree(value, path="x", max_nodes=max_nodes)

    run()


# --- slow: many more examples -----------------------------------------------------


@pytest.mark.slow
def test_fuzz_everything_longer(raw_manifest, work, pristine, saved_state, tmp_path):
    @SLOW
    @given(manifests(raw_manifest))
    def manifests_run(doc):
        check_manifest_text(work, render(doc))

    @SLOW
    @given(mutated(saved_state))
    def states_run(doc):
        check_state_text(pristine, tmp_path, doc)

    manifests_run()
    states_run()


# --- the scan that bounds JSON before it is built --------------------------------


def sequential_scan(data: bytes, max_depth: int, max_nodes: int, max_keys: int):
    """What ``bounded_json.scan`` finds, a byte at a time: the first bound
    passed (an object's keys reported at its bracket), or None."""
    in_string = escaped = False
    depth, nodes, open_keys = 0, 1, []
    for i, c in enumerate(data):
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == 0x5C, c != 0x22)
            continue
        if c == 0x22:
            in_string = True
        elif c in b"[{":
            depth, nodes = depth + 1, nodes + 1
            if depth > max_depth:
                return i, "depth"
            if nodes > max_nodes:
                return i, "values"
            open_keys.append([0, i])
        elif c in b"]}":
            depth -= 1
            if open_keys:
                open_keys.pop()
        elif c == 0x2C:
            nodes += 1
            if nodes > max_nodes:
                return i, "values"
        elif c == 0x3A and open_keys:
            open_keys[-1][0] += 1
            if open_keys[-1][0] > max_keys:
                return open_keys[-1][1], "keys"
    return None


json_values = st.recursive(
    st.one_of(st.integers(-5, 5), st.none(), st.booleans(),
              st.sampled_from(['a"b', "x:y,{[", "\\", "\\\\", '\\"', "q\\", "]}", ""])),
    lambda children: st.one_of(st.lists(children, max_size=6),
                               st.dictionaries(st.sampled_from(["k", "a:b", '"', "c,d", "[", "\\", "k2", "k3"]),
                                               children, max_size=6)),
    max_leaves=40)


def test_fuzz_the_scan_finds_each_bound_where_a_sequential_reader_does(monkeypatch):
    """Strings full of quotes, backslashes, brackets, colons and commas, cut
    into blocks of any size: the numpy scan agrees with a byte-at-a-time one."""
    from seqcache import bounded_json

    @FAST_PARSE
    @given(json_values, st.integers(1, 8), st.integers(1, 60), st.integers(0, 5), st.sampled_from([1, 2, 3, 7, 64]),
           st.booleans())
    def run(value, max_depth, max_nodes, max_keys, block, indent):
        data = json.dumps(value, indent=1 if indent else None).encode()
        monkeypatch.setattr(bounded_json, "SCAN_BLOCK", block)
        assert bounded_json.scan(data, max_depth=max_depth, max_nodes=max_nodes, max_keys=max_keys) == \
            sequential_scan(data, max_depth, max_nodes, max_keys)

    run()


# --- YAML: the 1.2 core schema, or one line ---------------------------------------

# Plain scalars and what the YAML 1.2 core schema makes of them (a YAML 1.1
# reader makes 5399, False, 8, a date, ...).
YAML_SCALARS = {"1:29:59": "1:29:59", "yes": "yes", "no": "no", "on": "on", "010": 10, "0o10": 8, "0x1f": 31,
                "2024-01-01": "2024-01-01", "1_000": "1_000", "0b101": "0b101", "1e3": 1000.0, ".5": 0.5,
                "true": True, "False": False, "~": None, "null": None, "-7": -7, "+3": 3, "wiki": "wiki"}
# Fragments every one of which is refused, naming the line and column.
YAML_REFUSED = {"anchor": "{c: &a 1}", "alias": "{c: *a}", "merge": "{<<: {c: 1}}", "tag": "{c: !!int 1}",
                "python tag": "{c: !!python/object:os.system 1}", "key twice": "{c: 1, c: 2}",
                "non-scalar key": "{[c]: 1}", "deep": "[" * 80 + "]" * 80, "inf": "{c: .inf}", "nan": "{c: .nan}",
                "long number": "{c: " + "9" * 41 + "}", "huge integer": "{c: 18446744073709551616}",
                "syntax": "{c: [1, 2}", "second document": "{c: 1}\n---\n{c: 2}"}


def test_fuzz_yaml_schedules_read_as_yaml_1_2_or_refused_in_one_line(tmp_path):
    from seqcache.training import data as data_lib

    path = tmp_path / "schedule.yaml"

    @FAST
    @given(st.lists(st.sampled_from(sorted(YAML_SCALARS)), min_size=1, max_size=4),
           st.one_of(st.none(), st.sampled_from(sorted(YAML_REFUSED))), st.booleans())
    def run(scalars, refused, bom):
        stages = [f"{10 * i}: {{task{i}: {s}}}" for i, s in enumerate(scalars)]
        if refused is not None:
            stages.insert(len(stages) // 2, f"{7 + 10 * len(stages)}: {YAML_REFUSED[refused]}")
        path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "\n".join(stages).encode() + b"\n")
        try:
            schedule = data_lib.load_mixture_schedule(str(path))
        except config_lib.ConfigError as e:
            message = str(e)
            assert message.startswith(f"{path}: ") and "\n" not in message, message
            values = [YAML_SCALARS[s] for s in scalars]
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in values)
            assert refused is not None or not numbers, message  # a refusal has a reason
            if refused is not None and refused not in ("inf", "nan", "huge integer", "long number", "second document"):
                assert re.search(r": line \d+, column \d+: ", message), message
            return
        assert refused is None
        assert schedule == {10 * i: {f"task{i}": float(YAML_SCALARS[s])} for i, s in enumerate(scalars)}

    run()


# --- hostile shapes: time and memory, in a child process per entry point -----------

# The bounds each hostile file is read within, measured in a child process:
# CPU seconds of the read (time.process_time around it; the load of a shared
# machine moves wall time, not this) and the child's peak RSS (VmHWM, which
# starts at the child's own exec; ru_maxrss would count the pages of the
# forking test process). The measured figures are a quarter of these and less
# (docs/bad-input.md, "Time and memory").
MAX_SECONDS = 2.0
MAX_RSS_MB = 300
# The address space the child may add to what its imports mapped (RLIMIT_AS,
# Linux, set once they are done): a reader that builds what it should refuse
# fails the case with MemoryError instead of taking the machine's memory.
MAX_ADDRESS_SPACE = 2 << 30

_CHILD = """
import importlib, json, resource, sys, time
from click.testing import CliRunner
from seqcache.cli.main import main


def function(call):
    module, _, name = call.partition(":")
    fn = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    return fn


spec = json.load(open(sys.argv[1]))
for command in spec.get("warm", []):  # import each command's module before anything is measured
    CliRunner().invoke(main, [command, "--help"])
calls = {case["call"]: function(case["call"]) for case in spec["cases"] if "call" in case}
if sys.platform == "linux":  # whatever a reader does, the child cannot take the machine's memory
    mapped = [int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmSize:")]
    resource.setrlimit(resource.RLIMIT_AS, (mapped[0] + %d,) * 2)
results = []
for case in spec["cases"]:
    out = {"name": case["name"]}
    start, cpu = time.perf_counter(), time.process_time()
    if "cli" in case:
        r = CliRunner().invoke(main, case["cli"])
        out.update(output=r.output, exit_code=r.exit_code,
                   error=None if r.exception is None or isinstance(r.exception, SystemExit) else repr(r.exception))
    else:
        try:
            value = calls[case["call"]](*case["args"], **case.get("kwargs", {}))
            getattr(value, "close", lambda: None)()
            out.update(output="", error=None)
        except Exception as e:
            out.update(output=str(e), error=type(e).__name__)
    out.update(cpu_s=time.process_time() - cpu, wall_s=time.perf_counter() - start)
    results.append(out)
status = open("/proc/self/status").read() if sys.platform == "linux" else ""
hwm = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")]
rss_kb = hwm[0] if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"results": results, "peak_rss_mb": rss_kb / 1024}))
""" % MAX_ADDRESS_SPACE


def run_child(tmp_path, cases: list[dict], *, warm=()) -> list[dict]:
    """Runs ``cases`` (``{"name", "cli": [args]}`` or ``{"name", "call":
    "module:function", "args": [...]}``) one after the other in one child
    process; asserts its peak RSS; returns each case's result (output, exit
    code or error class, CPU and wall seconds)."""
    import subprocess
    import sys

    spec = tmp_path / "child.json"
    spec.write_text(json.dumps({"cases": cases, "warm": list(warm)}))
    done = subprocess.run([sys.executable, "-c", _CHILD, str(spec)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["peak_rss_mb"] <= MAX_RSS_MB, report
    for r in report["results"]:
        assert r["cpu_s"] <= MAX_SECONDS, r
    return report["results"]


@functools.lru_cache(maxsize=2)
def _keys_text(n: int) -> str:
    return "{" + ",".join(f'"k{i:07d}":1' for i in range(n)) + "}"


def hostile_json(doc: dict, place: Sequence, *, duplicate: str) -> dict[str, bytes]:
    """The hostile shapes of a JSON file: ``doc`` with the value at ``place``
    (a key path) replaced by a million keys (12 MB), nesting 100,000 deep, an
    integer of 100,001 digits, a float of as many; a byte order mark before
    it, a byte that is not UTF-8 in it, a syntax error, and the top-level key
    ``duplicate`` given again with another value."""
    def at(text: str | bytes) -> bytes:
        marked = copy.deepcopy(doc)
        node = marked
        for key in place[:-1]:
            node = node[key]
        node[place[-1]] = "@@"
        return json.dumps(marked).encode().replace(b'"@@"', text if isinstance(text, bytes) else text.encode())

    good = json.dumps(doc).encode()
    again = json.dumps({duplicate: 1 if doc[duplicate] != 1 else 2})[1:-1].encode()
    return {"1e6 keys": at(_keys_text(10**6)), "deep 1e5": at("[" * 10**5 + "]" * 10**5),
            "int 100,001 digits": at("1" * 100_001), "float 100,001 digits": at("0." + "1" * 100_001),
            "NaN": at("NaN"), "syntax error": good[:-1] + b",}", "bad UTF-8": at(b'"\xff"'),
            "duplicate key": good[:-1] + b", " + again + b"}", "BOM": b"\xef\xbb\xbf" + good,
            "lone surrogate": at('"\\ud800"'), "FIFO": None}


def put(path, data: bytes | None) -> None:
    """Writes ``data`` to ``path``; None: a named pipe (FIFO) there, which a
    reader that waited for a writer would wait on for ever."""
    path = pathlib.Path(path)
    if path.exists() or path.is_symlink():
        path.unlink()
    if data is None:
        os.mkfifo(path)
    else:
        path.write_bytes(data)


def hostile_yaml() -> dict[str, bytes]:
    """The hostile shapes of a YAML mixture schedule (of the task ``c``)."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefghi", "bcdefghij"))
    return {"yaml 1e6 keys": ("0:\n" + "".join(f"  k{i:07d}: 1\n" for i in range(10**6))).encode(),
            "yaml base-60 3 MB": ("0: {c: 1}\n5: {c: " + "1" + ":59" * 1_000_000 + "}\n").encode(),
            "yaml deep 1e5": ("0: " + "[" * 10**5 + "]" * 10**5 + "\n").encode(),
            "yaml int 100,001 digits": ("0: {c: " + "1" * 100_001 + "}\n").encode(),
            "yaml syntax error": b"0: {c: 1\n5: {c: 2}\n", "yaml merge key": b"base: {c: 1}\n0: {<<: {c: 2}}\n",
            "yaml alias bomb": bomb.encode(), "yaml tag": b"0: {c: !!python/object:os.system 1}\n",
            "yaml bad UTF-8": b"0: {c: 1}\n# \xff\n", "yaml duplicate key": b"0: {c: 1}\n0: {c: 2}\n",
            "yaml BOM": b"\xef\xbb\xbf0: {c: 1}\n"}


# The shapes every entry point reads in the default suite: one of each kind of
# refusal (a bound counted before anything is built, a number refused by its
# length, text that is not UTF-8, a key twice, YAML 1.1's quadratic base-60,
# merge keys and aliases) and the byte order mark, which is read. ``-m slow``
# reads every shape (a float and NaN, syntax errors, YAML tags, nesting and
# numbers, manifests' other contradicting fields) at every entry point.
REPRESENTATIVE = ("1e6 keys", "deep 1e5", "int 100,001 digits", "bad UTF-8", "duplicate key", "BOM", "yaml 1e6 keys",
                  "lone surrogate", "FIFO",
                  "yaml base-60 3 MB", "yaml merge key", "yaml alias bomb", "yaml BOM", "sequence_length of no feature")
EVERY_SHAPE = pytest.mark.parametrize("every", [pytest.param(False, id="representative"),
                                                pytest.param(True, id="every-shape", marks=pytest.mark.slow)])


def pick(shapes: dict, every: bool) -> dict:
    """``shapes``, or only the ``REPRESENTATIVE`` ones."""
    return shapes if every else {k: v for k, v in shapes.items() if k in REPRESENTATIVE}


def check_refusals(results: list[dict], paths: dict[str, str], *, accepted=("BOM", "yaml BOM")) -> None:
    """Every case refused in one line naming its file (a command: one
    ``error:`` line, exit status 1, no traceback; a function: its documented
    error), but those read as they are (a byte order mark)."""
    for r in results:
        shape = r["name"].split(" @ ")[0]
        if shape in accepted:
            assert r.get("exit_code", 0) == 0 and r["error"] is None, r
            continue
        lines = r["output"].strip().splitlines()
        assert len(lines) == 1 and paths[shape] in lines[0], r
        assert "Traceback" not in r["output"], r
        if "exit_code" in r:
            assert r["exit_code"] == 1 and r["error"] is None and lines[0].startswith("error: "), r
        else:
            assert r["error"] in ("ConfigError", "FeederStateError", "CacheError"), r


def _write_shapes(folder, shapes: dict[str, bytes], suffix: str) -> dict[str, str]:
    folder.mkdir(exist_ok=True)
    paths = {}
    for name, data in shapes.items():
        path = folder / (re.sub(r"\W+", "_", name) + suffix)
        put(path, data)
        paths[name] = str(path)
    return paths


@EVERY_SHAPE
def test_hostile_schedules_end_within_bounds_in_one_line(pristine, tmp_path, every):
    """``seqcache which --mixture-schedule`` and ``seqcache train``'s reader
    (``load_mixture_schedule``), on JSON and YAML schedules."""
    root = os.path.dirname(pristine)
    name = os.path.basename(pristine)
    shapes = pick(hostile_json({"0": {name: 1}, "5": {name: 2}}, ["5"], duplicate="0"), every)
    paths = _write_shapes(tmp_path / "json", shapes, ".json")
    yaml_shapes = {k: v.replace(b"{c:", f"{{{name}:".encode()) for k, v in pick(hostile_yaml(), every).items()}
    paths.update(_write_shapes(tmp_path / "yaml", yaml_shapes, ".yaml"))
    cases = []
    for shape, path in paths.items():
        cases.append({"name": f"{shape} @ which", "cli": ["which", root, "--mixture-schedule", path, "--step", "0",
                                                          "--row", "0", "--batch-size", str(B)]})
        cases.append({"name": f"{shape} @ train", "call": "seqcache.training.data:load_mixture_schedule",
                      "args": [path]})
    results = run_child(tmp_path, cases, warm=["which"])
    check_refusals([r for r in results if not r["name"].startswith(("BOM", "yaml BOM"))], paths)
    for r in results:  # a byte order mark is dropped: the schedule is read (and which answers)
        if r["name"].startswith(("BOM", "yaml BOM")):
            assert r["error"] is None and r.get("exit_code", 0) == 0, r


@EVERY_SHAPE
def test_hostile_feeder_states_end_within_bounds_in_one_line(pristine, saved_state, tmp_path, every):
    """A feeder state file and a checkpoint step's ``feeder/metadata``: read by
    ``seqcache which``, ``Feeder.restore_file`` and the trainer's resume
    (``load_checkpoint_state``), every refusal naming the file (and the step)."""
    shapes = pick(hostile_json(saved_state, ["mixture"], duplicate="seed"), every)
    files = _write_shapes(tmp_path / "states", shapes, ".json")
    cases, paths = [], dict(files)
    for shape, path in files.items():
        step = tmp_path / "ckpt" / re.sub(r"\W+", "_", shape) / "3"
        (step / "feeder").mkdir(parents=True)
        put(step / "feeder" / "metadata", shapes[shape])
        cases += [{"name": f"{shape} @ which", "cli": ["which", path, "--step", "3", "--row", "0"]},
                  {"name": f"{shape} @ restore_file", "call": "seqcache.feeders:Feeder.restore_file", "args": [path],
                   "kwargs": {"host_index": 0, "host_count": 1}},
                  {"name": f"{shape} @ resume", "call": "seqcache.feeders.state:load_checkpoint_state",
                   "args": [str(step)], "kwargs": {"step": 3, "any_feeder": True}}]
    results = run_child(tmp_path, cases, warm=["which"])
    step_files = {shape: str(tmp_path / "ckpt" / re.sub(r"\W+", "_", shape) / "3" / "feeder" / "metadata")
                  for shape in shapes}
    check_refusals([r for r in results if not r["name"].endswith("resume")], paths)
    resumed = [r for r in results if r["name"].endswith("resume")]
    check_refusals(resumed, step_files)
    for r in resumed:  # the trainer's words: the step, then the file
        shape = r["name"].split(" @ ")[0]
        assert shape == "BOM" or r["output"].startswith(f"checkpoint step 3: {step_files[shape]}: "), r


@EVERY_SHAPE
def test_hostile_manifests_end_within_bounds_in_one_line(pristine, raw_manifest, tmp_path, every):
    """``seqcache info``, ``show``, ``verify`` and ``report`` on manifests with
    the hostile shapes, a million vocabularies, and fields naming features the
    cache does not have."""
    shapes = hostile_json(raw_manifest, ["statistics", "tokens"], duplicate="seed")
    if every:
        shapes["1e6 vocabularies"] = hostile_json(raw_manifest, ["vocabularies"], duplicate="seed")["1e6 keys"]
    for field, value in (("sequence_length", {"bogus": 1}), ("vocabularies", {"bogus": {"kind": "byte"}})):
        shapes[f"{field} of no feature"] = json.dumps(dict(raw_manifest, **{field: value})).encode()
    shapes["tokens of no feature"] = json.dumps(dict(raw_manifest, statistics=dict(
        raw_manifest["statistics"], tokens={"bogus": 1}))).encode()
    shapes = pick(shapes, every)
    cases, paths = [], {}
    for shape, data in shapes.items():
        cache = tmp_path / "caches" / re.sub(r"\W+", "_", shape)
        shutil.copytree(pristine, cache)
        put(cache / fmt.MANIFEST_NAME, data)
        paths[shape] = str(cache / fmt.MANIFEST_NAME)
        for command in (["info"], ["show"], ["verify"], ["report", "--json"]):
            cases.append({"name": f"{shape} @ {command[0]}", "cli": [command[0], str(cache)] + command[1:]})
    results = run_child(tmp_path, cases, warm=["info", "show", "verify", "report"])
    check_refusals(results, paths, accepted=("BOM",))  # a byte order mark is dropped: the cache is read


@EVERY_SHAPE
def test_hostile_config_files_end_within_bounds_in_one_line(tmp_path, every):
    """``seqcache train --config``'s reader (``load_config_file``): a config
    file holds at most 1 MiB, so a million keys is refused by its size."""
    shapes = pick(hostile_json({"steps": 5, "seed": 1, "optimizer": {"lr": 0.001}}, ["optimizer", "lr"],
                               duplicate="steps"), every)
    paths = _write_shapes(tmp_path / "configs", shapes, ".json")
    cases = [{"name": f"{shape} @ train --config", "call": "seqcache.training.config:load_config_file",
              "args": [path]} for shape, path in paths.items()]
    results = run_child(tmp_path, cases)
    check_refusals(results, paths)


def test_wide_schedules_and_states_are_read_in_linear_time(pristine, saved_state, tmp_path):
    """A schedule stage of 60,000 caches and a state whose mixture lists one
    cache 40,000 times: within the bounds of size and keys, and each read in
    the time of one pass (a list's membership test made them minutes), refused
    in one line of at most a few thousand characters."""
    root, name = os.path.dirname(pristine), os.path.basename(pristine)
    schedule = tmp_path / "wide.json"
    schedule.write_text(json.dumps({"0": {name: 1}, "5": {f"{name}-{i}": 1 for i in range(60_000)}}))
    state = tmp_path / "many.json"
    state.write_text(json.dumps(dict(saved_state, mixture=[saved_state["mixture"][0]] * 40_000)))
    cases = [{"name": "wide schedule @ which", "cli": ["which", root, "--mixture-schedule", str(schedule), "--step",
                                                       "0", "--row", "0", "--batch-size", str(B)]},
             {"name": "wide schedule @ train", "call": "seqcache.training.data:load_mixture_schedule",
              "args": [str(schedule)]},
             {"name": "many entries @ which", "cli": ["which", str(state), "--step", "3", "--row", "0"]},
             {"name": "many entries @ restore_file", "call": "seqcache.feeders:Feeder.restore_file",
              "args": [str(state)], "kwargs": {"host_index": 0, "host_count": 1}}]
    results = {r["name"]: r for r in run_child(tmp_path, cases, warm=["which"])}
    assert results["wide schedule @ train"]["error"] is None, results  # read: the caches are opened later
    for key in ("wide schedule @ which", "many entries @ which", "many entries @ restore_file"):
        r = results[key]
        lines = r["output"].strip().splitlines()
        assert len(lines) == 1 and len(lines[0]) < 3000 and "Traceback" not in r["output"], r
    assert "more than once" in results["many entries @ which"]["output"], results


def test_info_cuts_a_huge_value_to_one_bounded_cell(pristine, raw_manifest, tmp_path):
    """A manifest whose task name is 100,000 characters: ``info`` prints its
    table with the name cut (first and last characters, then the length)."""
    cache = tmp_path / "cache"
    shutil.copytree(pristine, cache)
    (cache / fmt.MANIFEST_NAME).write_text(json.dumps(dict(raw_manifest, task="t" * 100_000)))
    out = CliRunner().invoke(main, ["info", str(cache)])
    assert out.exit_code == 0, out.output
    assert "[100,006 characters]" in out.output and len(out.output) < 20_000, out.output[:2000]
