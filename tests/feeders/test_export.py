"""The MaxText export: ArrayRecord files of tf.train.Example records holding the
Feeder's global stream, in the order MaxText's grain pipeline reads them.

The records are parsed with protobuf's own runtime against tf.train.Example's
schema (example.proto / feature.proto, declared below), independently of the
encoder under test; one slow test checks them against TensorFlow's own parser
and serializer. MaxText's reading is grain's ElasticIterator over an
ArrayRecordDataSource, used here as MaxText uses it."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from click.testing import CliRunner

from seqcache.feeders import Feeder
from seqcache.feeders.trainers import export as ex

B, L = 8, 8


def _example_class():
    """tf.train.Example as a protobuf message class, from its schema (no TensorFlow)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="test_example.proto", package="tensorflow", syntax="proto3")

    def message(name, fields, nested=(), oneof=None):
        m = fdp.message_type.add(name=name)
        if oneof:
            m.oneof_decl.add(name=oneof)
        for n in nested:
            m.nested_type.add().CopyFrom(n)
        for fname, number, ftype, label, type_name in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if oneof:
                f.oneof_index = 0
        return m

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", [("value", 1, F.TYPE_BYTES, rep, None)])
    message("FloatList", [("value", 1, F.TYPE_FLOAT, rep, None)])
    message("Int64List", [("value", 1, F.TYPE_INT64, rep, None)])
    message("Feature", [("bytes_list", 1, F.TYPE_MESSAGE, opt, ".tensorflow.BytesList"),
                        ("float_list", 2, F.TYPE_MESSAGE, opt, ".tensorflow.FloatList"),
                        ("int64_list", 3, F.TYPE_MESSAGE, opt, ".tensorflow.Int64List")], oneof="kind")
    entry = descriptor_pb2.DescriptorProto(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt, type_name=".tensorflow.Feature")
    entry.options.map_entry = True
    message("Features", [("feature", 1, F.TYPE_MESSAGE, rep, ".tensorflow.Features.FeatureEntry")], nested=[entry])
    message("Example", [("features", 1, F.TYPE_MESSAGE, opt, ".tensorflow.Features")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


Example = _example_class()


def _parse(record: bytes) -> dict[str, list[int]]:
    msg = Example.FromString(record)
    return {k: list(v.int64_list.value) for k, v in msg.features.feature.items()}


def _read_records(folder) -> list[bytes]:
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(str(folder / ex.MAXTEXT_FILE), "readahead_buffer_size:0")
    try:
        return reader.read_all()
    finally:
        reader.close()


def _feeder_rows(steps, **kw):
    """Per global position: (tokens, cache_index, task_index, epoch) from the Feeder (one host)."""
    rows = []
    with Feeder(global_batch_size=B, sequence_length=L, host_index=0, host_count=1, **kw) as f:
        for s in range(steps):
            b = f.get_batch(s)
            for r in range(B):
                rows.append((b["targets"][r].tolist(), int(b["cache_index"][r]), int(b["task_index"][r]),
                             int(b["epoch"][r])))
    return rows


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_encode_example_matches_the_schema_and_varint_edges():
    values = np.array([0, 1, 127, 128, 300, 2**31 - 1, 2**62, -1, -(2**63)], dtype=np.int64)
    rec = ex.encode_example({"text": values, "b": 5, "a": np.array([], np.int64)})
    parsed = _parse(rec)
    assert parsed == {"text": values.tolist(), "b": [5], "a": []}
    # Deterministic serialization of the same message by protobuf writes the same bytes.
    assert Example.FromString(rec).SerializeToString(deterministic=True) == rec
    assert ex.varint_lengths(values).tolist() == [1, 1, 1, 2, 2, 5, 9, 10, 10]
    with pytest.raises(ValueError, match="feature 'x': expected an integer"):
        ex.encode_example({"x": np.zeros((2, 2), np.int64)})


def test_layout_maps_positions_to_records_and_back():
    for h in (1, 2, 4, 8):
        rows = ex.record_rows(B, h)
        assert sorted(rows.tolist()) == list(range(B))  # a permutation inside each step
        for p in range(3 * B):
            i = ex.record_index(p, B, h)
            assert p // B == i // B and ex.position_of_record(i, B, h) == p
    # H = 2, B = 8: host 0's rows 0..3 are records 0, 2, 4, 6; host 1's rows 4..7 are records 1, 3, 5, 7.
    assert ex.record_rows(8, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(ValueError, match="host_count 3 must divide the global batch size 8"):
        ex.record_rows(8, 3)


def test_export_is_the_feeder_stream_row_by_row(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "c", n=21, num_shards=3, length=lambda i: 3 + i % 6)
    steps = 7  # 56 rows of a 21-example cache: two epoch boundaries
    done = ex.export_maxtext(tmp_path / "out", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L,
                             seed=3, steps=steps)
    records = _read_records(tmp_path / "out")
    assert len(records) == done["records"] == steps * B
    want = _feeder_rows(steps, cache=str(tmp_path / "c"), seed=3)
    for i, rec in enumerate(records):
        got = _parse(rec)
        tokens, cache_index, task_index, epoch = want[i]
        assert got == {"text": tokens, "position": [i], "cache_index": [cache_index], "task_index": [task_index],
                       "epoch": [epoch]}, i
        assert rec == ex.encode_example(got)  # the batch encoder writes what the one-record encoder writes
        assert Example.FromString(rec).SerializeToString(deterministic=True) == rec
    # The first token of fixture example i is i + 1: the rows are the cache's examples, each once per epoch.
    firsts = [_parse(r)["text"][0] - 1 for r in records[:21]]
    assert sorted(firsts) == list(range(21))
    assert done["sha256"] == _sha256(tmp_path / "out" / ex.MAXTEXT_FILE)
    side = json.loads((tmp_path / "out" / ex.EXPORT_NAME).read_text())
    assert side["feeder_state"]["position"] == 0 and side["feeder_state"]["seed"] == 3
    assert "grain_use_elastic_iterator=true" in side["maxtext_flags"]
    assert "enable_data_shuffling=false" in side["maxtext_flags"]
    assert ex.read_export(tmp_path / "out") == side
    # Read by the bounded reader: a key given twice (Python's json keeps the last) is refused in one line.
    sidecar = tmp_path / "out" / ex.EXPORT_NAME
    sidecar.write_text(json.dumps(side)[:-1] + ', "version": 0}')
    with pytest.raises(ValueError, match=f"^{sidecar}: the export file has the key 'version' twice"):
        ex.read_export(tmp_path / "out")


def test_export_is_written_with_group_size_1_as_grain_requires(tmp_path, fx, caplog):
    """grain's ArrayRecordDataSource (what MaxText reads with) logs an error for
    a file whose group size is not 1; the export's records are large enough
    that the caches' own rule would choose 8 here."""
    import logging

    grain = pytest.importorskip("grain.python")
    from array_record.python.array_record_module import ArrayRecordReader

    fx.write_fixture_cache(tmp_path / "c", n=20, num_shards=1, length=L)
    done = ex.export_maxtext(tmp_path / "out", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L,
                             steps=2)
    assert done["writer_options"] == "group_size:1,uncompressed"
    reader = ArrayRecordReader(str(tmp_path / "out" / ex.MAXTEXT_FILE))
    try:
        assert reader.writer_options_string().startswith("group_size:1,")
    finally:
        reader.close()
    with caplog.at_level(logging.ERROR):
        source = grain.ArrayRecordDataSource([str(tmp_path / "out" / ex.MAXTEXT_FILE)])
        assert len(source) == 2 * B and _parse(source[3])["position"] == [3]
    assert not [r for r in caplog.records if "group size" in r.getMessage()], caplog.text


def test_export_bytes_are_deterministic_and_depend_on_the_seed(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "c", n=30, num_shards=2, length=L)
    kw = dict(cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L, steps=5)
    a = ex.export_maxtext(tmp_path / "a", seed=1, **kw)
    b = ex.export_maxtext(tmp_path / "b", seed=1, num_threads=1, **kw)
    c = ex.export_maxtext(tmp_path / "c2", seed=2, **kw)
    assert _sha256(tmp_path / "a" / ex.MAXTEXT_FILE) == _sha256(tmp_path / "b" / ex.MAXTEXT_FILE) == a["sha256"]
    assert a["sha256"] == b["sha256"] != c["sha256"]
    with pytest.raises(ValueError, match="already holds an export"):
        ex.export_maxtext(tmp_path / "a", seed=1, **kw)
    again = ex.export_maxtext(tmp_path / "a", seed=1, overwrite=True, **kw)
    assert again["sha256"] == a["sha256"]


def test_mixture_export_is_the_mixed_stream(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "x", n=13, task="x", length=5)
    fx.write_fixture_cache(tmp_path / "y", n=40, task="y", length=7)
    mixture = [(str(tmp_path / "x"), 1.0), (str(tmp_path / "y"), 3.0)]
    steps = 6
    ex.export_maxtext(tmp_path / "out", mixture=mixture, global_batch_size=B, sequence_length=L, seed=4, steps=steps)
    want = _feeder_rows(steps, mixture=mixture, seed=4)
    got = [_parse(r) for r in _read_records(tmp_path / "out")]
    assert [(g["text"], g["cache_index"][0], g["task_index"][0], g["epoch"][0]) for g in got] == want
    assert {g["task_index"][0] for g in got} == {0, 1}


def test_finite_run_exports_every_example_once_with_padding_rows(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "c", n=19, num_shards=2, length=4)
    done = ex.export_maxtext(tmp_path / "out", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L,
                             num_epochs=1)
    got = [_parse(r) for r in _read_records(tmp_path / "out")]
    assert done["steps"] == 3 and len(got) == 24
    assert sorted(g["cache_index"][0] for g in got if g["cache_index"][0] >= 0) == list(range(19))
    pads = [g for g in got if g["cache_index"][0] == -1]
    assert len(pads) == 5 and all(g["text"] == [0] * L and g["epoch"] == [-1] for g in pads)


def _elastic_batches(folder, *, process_count, steps, state=None):
    """What MaxText's grain pipeline (grain_use_elastic_iterator=true, no
    shuffling) gives each process: grain's ElasticIterator over the records, one
    per process, each restored from ``state`` when given. Returns per step the
    list over processes of that process's rows (positions), and the final state."""
    grain = pytest.importorskip("grain.python")
    from grain.experimental import ElasticIterator

    source = grain.ArrayRecordDataSource([str(folder / ex.MAXTEXT_FILE)])
    ds = grain.MapDataset.source(source).repeat(1).map(lambda r: _parse(r)["position"][0])
    its = []
    for p in range(process_count):
        it = iter(ElasticIterator(ds, global_batch_size=B,
                                  shard_options=grain.ShardOptions(shard_index=p, shard_count=process_count)))
        if state is not None:
            it.set_state(state)
        its.append(it)
    out = [[np.asarray(next(it)).tolist() for it in its] for _ in range(steps)]
    states = [it.get_state() for it in its]
    assert all(s == states[0] for s in states)  # every process checkpoints the same global state
    return out, states[0]


@pytest.mark.parametrize("host_count", [1, 2])
def test_maxtext_processes_read_the_feeder_steps_and_resume_on_another_count(tmp_path, fx, host_count):
    fx.write_fixture_cache(tmp_path / "c", n=50, num_shards=2, length=L)
    ex.export_maxtext(tmp_path / "out", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L, seed=0,
                      steps=6, host_count=host_count)
    k = 2
    first, state = _elastic_batches(tmp_path / "out", process_count=1, steps=k)
    assert state == {"global_next_index": k * B}  # the Feeder's position after k steps
    after, _ = _elastic_batches(tmp_path / "out", process_count=2, steps=6 - k, state=state)
    for s, per_process in enumerate(first + after):
        rows = [r for rows in per_process for r in rows]
        assert sorted(rows) == list(range(s * B, (s + 1) * B)), s  # exactly the Feeder's step s
        n = len(per_process)
        if n == host_count:  # the processes hold the Feeder's host slices, in row order
            for h, got in enumerate(per_process):
                assert got == [s * B + h * (B // n) + j for j in range(B // n)]


def test_cli_export_writes_the_same_file(tmp_path, fx):
    from seqcache.cli.main import main

    fx.write_fixture_cache(tmp_path / "c", n=30, num_shards=2, length=L)
    api = ex.export_maxtext(tmp_path / "api", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L,
                            seed=5, steps=4, host_count=2)
    args = ["export", "--format", "maxtext", str(tmp_path / "c"), "--output", str(tmp_path / "cli"),
            "--global-batch-size", str(B), "--sequence-length", str(L), "--seed", "5", "--steps", "4",
            "--host-count", "2"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "32 records (steps 0..3: 4 steps x 8 rows" in res.output and "grain_use_elastic_iterator=true" in res.output
    assert "starts at step" not in res.output
    assert _sha256(tmp_path / "cli" / ex.MAXTEXT_FILE) == api["sha256"]
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 1
    assert again.output == (f"error: {tmp_path / 'cli'} already holds an export (export.json); pass --overwrite or "
                            "choose another folder\n")
    slash = CliRunner().invoke(main, args[:5] + [str(tmp_path / "cli") + "/", *args[6:], "--overwrite"])
    assert slash.exit_code == 0, slash.output
    assert slash.output.startswith(f"{tmp_path / 'cli' / ex.MAXTEXT_FILE}: 32 records"), slash.output
    bad = CliRunner().invoke(main, args[:-2] + ["--host-count", "3", "--overwrite"])
    assert bad.exit_code == 1 and "host_count 3 must divide the global batch size 8" in bad.output
    endless = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "c"), "--output",
                                        str(tmp_path / "x"), "--batch-size", "8", "--sequence-length", "8"])
    assert endless.exit_code == 2 and "--steps is required" in endless.output
    # A length longer than a packed cache's: the refusal names the flag, not the Python argument.
    fx.write_packed_cache(tmp_path / "p", n=20, sequence_length=12)
    long = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "p"), "--output",
                                     str(tmp_path / "y"), "--batch-size", "4", "--sequence-length", "13", "--steps",
                                     "1"])
    assert long.exit_code == 1
    assert long.output == (f"error: {tmp_path / 'p'}: sequence length 13 for feature 'targets' is longer than the "
                           "cache's, 12 tokens; leave --sequence-length out to read rows of 12, or give at most 12\n")
    # A length for a feature the export does not write: a usage error naming the flag.
    other = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "p"), "--output",
                                      str(tmp_path / "z"), "--batch-size", "4", "--sequence-length", "inputs=8",
                                      "--steps", "1"])
    assert other.exit_code == 2 and not (tmp_path / "z").exists()
    assert ("--sequence-length: the export writes feature 'targets' only, not inputs (give N or targets=N; "
            "--feature picks the feature)") in other.output
    absent = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "p"), "--output",
                                       str(tmp_path / "z"), "--batch-size", "4", "--feature", "inputs", "--steps", "1"])
    assert absent.exit_code == 1 and absent.output == (
        f"error: {tmp_path / 'p'}: the cache has no feature 'inputs' (its token features: targets); choose one of "
        "them (feature= in Python, --feature on the command line)\n")
    segments = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "p"), "--output",
                                         str(tmp_path / "z"), "--batch-size", "4", "--feature", "targets_segment_ids",
                                         "--sequence-length", "12", "--steps", "1"])
    assert segments.exit_code == 1 and not (tmp_path / "z").exists()
    assert ("feature 'targets_segment_ids' holds another feature's segment ids or positions (its token features: "
            "targets)") in segments.output


def test_export_from_a_saved_state_starts_at_its_step(tmp_path, fx):
    """A feeder state saved after step 3 exports steps 3.. : its records are the
    records 3B.. of the export from step 0, byte for byte (each holds its global
    position), and MaxText's global_next_index g is the position 3B + g."""
    from seqcache.cli.main import main

    fx.write_fixture_cache(tmp_path / "c", n=30, num_shards=2, length=L)
    kw = dict(global_batch_size=B, sequence_length=L, seed=5, host_count=2)
    whole = ex.export_maxtext(tmp_path / "whole", cache=str(tmp_path / "c"), steps=7, **kw)
    assert (whole["start_step"], whole["start_position"]) == (0, 0)
    with Feeder(cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L, seed=5, start_step=3) as f:
        state = f.state()
    assert state["position"] == 3 * B
    part = ex.export_maxtext(tmp_path / "part", state=state, steps=4, host_count=2)
    assert (part["start_step"], part["start_position"], part["steps"], part["records"]) == (3, 3 * B, 4, 4 * B)
    assert part["feeder_state"] == state
    records = _read_records(tmp_path / "part")
    assert records == _read_records(tmp_path / "whole")[3 * B:]
    for i, rec in enumerate(records):
        assert _parse(rec)["position"] == [ex.position_of_record(i, B, 2, start_position=3 * B)]
        assert ex.record_index(_parse(rec)["position"][0], B, 2, start_position=3 * B) == i
    # The CLI, from the state file: the same bytes, and it says where the export starts.
    (tmp_path / "state.json").write_text(json.dumps(state))
    res = CliRunner().invoke(main, ["export", "--format", "maxtext", str(tmp_path / "state.json"), "--output",
                                    str(tmp_path / "cli"), "--steps", "4", "--host-count", "2"])
    assert res.exit_code == 0, res.output
    assert "32 records (steps 3..6: 4 steps x 8 rows" in res.output
    assert "The export starts at step 3 (the state's position 24): MaxText's global_next_index g is the Feeder's " \
           "position 24 + g." in res.output
    assert _sha256(tmp_path / "cli" / ex.MAXTEXT_FILE) == part["sha256"]
    side = json.loads((tmp_path / "cli" / ex.EXPORT_NAME).read_text())
    assert (side["start_step"], side["start_position"], side["feeder_state"]["position"]) == (3, 24, 24)


def test_a_finite_run_exports_the_rest_from_a_state(tmp_path, fx):
    fx.write_fixture_cache(tmp_path / "c", n=19, num_shards=2, length=4)
    kw = dict(cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L, num_epochs=1)
    whole = ex.export_maxtext(tmp_path / "whole", **kw)
    assert whole["steps"] == 3
    with Feeder(**kw, start_step=1) as f:
        state = f.state()
    rest = ex.export_maxtext(tmp_path / "rest", state=state)
    assert (rest["start_step"], rest["steps"]) == (1, 2)
    assert _read_records(tmp_path / "rest") == _read_records(tmp_path / "whole")[B:]
    with pytest.raises(ValueError, match="steps 3 from step 1 is past the end of this finite run"):
        ex.export_maxtext(tmp_path / "x", state=state, steps=3)
    with Feeder(**kw, start_step=3) as f:
        end = f.state()
    with pytest.raises(ValueError, match="the feeder state is at step 3, the end of this finite run"):
        ex.export_maxtext(tmp_path / "y", state=end)


@pytest.mark.slow
def test_records_parse_with_tensorflow_to_the_feeder_rows(tmp_path, fx):
    tf = pytest.importorskip("tensorflow")
    fx.write_fixture_cache(tmp_path / "c", n=21, num_shards=3, length=lambda i: 3 + i % 6)
    ex.export_maxtext(tmp_path / "out", cache=str(tmp_path / "c"), global_batch_size=B, sequence_length=L, seed=3,
                      steps=3)
    want = _feeder_rows(3, cache=str(tmp_path / "c"), seed=3)
    spec = {"text": tf.io.FixedLenFeature([L], tf.int64), "cache_index": tf.io.FixedLenFeature([], tf.int64)}
    for i, rec in enumerate(_read_records(tmp_path / "out")):
        proto = tf.train.Example.FromString(rec)
        assert proto.SerializeToString(deterministic=True) == rec  # byte-identical to TensorFlow's serializer
        parsed = tf.io.parse_single_example(rec, spec)
        assert parsed["text"].numpy().tolist() == want[i][0]
        assert int(parsed["cache_index"]) == want[i][1]
