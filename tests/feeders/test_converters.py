"""Feature converters with t5x field names: values, exactly once, resume, hosts."""

import os

import numpy as np
import pytest

from seqcache import tasks
from seqcache.feeders import ConvertedFeeder, autoregressive_inputs
from seqcache.feeders import converters as C
from seqcache.lengths import SequenceLengthError
from seqcache.pipelines.build import BuildConfig, build_task
from seqcache.tasks import preprocessors as P

V = tasks.ByteVocabulary(extra_ids=10)


def _task(d, packing=None):
    return tasks.Task(
        "multi30k" + ("_packed" if packing else ""),
        source=tasks.ParallelTextSource({"en": str(d / "val.en.gz"), "de": str(d / "val.de.gz")}),
        output_features={"inputs": tasks.Feature(V), "targets": tasks.Feature(V)},
        preprocessors=[P.rekey({"inputs": "en", "targets": "de"}), P.tokenize(), P.append_eos_after_trim()],
        packing=packing,
    )


@pytest.fixture(scope="module")
def caches(tmp_path_factory, corpora):
    root = tmp_path_factory.mktemp("conv")
    d = corpora.multi30k
    lengths = {"inputs": 96, "targets": 96}
    plain = build_task(_task(d), cache_dir=str(root), config=BuildConfig(num_shards=2, sequence_length=lengths))
    packed = build_task(_task(d, "first_fit"), cache_dir=str(root),
                        config=BuildConfig(num_shards=2, sequence_length={"inputs": 256, "targets": 256}))
    return plain.cache_dir, packed.cache_dir


def test_autoregressive_inputs_restart_per_segment():
    t = np.array([[5, 6, 7, 8, 9, 0]])
    s = np.array([[1, 1, 2, 2, 2, 0]])
    assert autoregressive_inputs(t, s).tolist() == [[0, 5, 0, 7, 8, 0]]


def test_encdec_fields_and_values(caches):
    plain, _ = caches
    with ConvertedFeeder(converter="encdec", cache=plain, sequence_length={"inputs": 96, "targets": 96},
                         global_batch_size=8, host_index=0, host_count=1) as f:
        b = f.get_batch(0)
    assert set(b) >= {"encoder_input_tokens", "encoder_segment_ids", "encoder_positions", "decoder_target_tokens",
                      "decoder_input_tokens", "decoder_loss_weights", "decoder_segment_ids", "decoder_positions"}
    assert b["encoder_input_tokens"].shape == (8, 96) and b["decoder_target_tokens"].shape == (8, 96)
    assert (b["decoder_input_tokens"][:, 0] == 0).all()
    assert (b["decoder_input_tokens"][:, 1:] == b["decoder_target_tokens"][:, :-1]
            * (b["decoder_segment_ids"][:, 1:] == b["decoder_segment_ids"][:, :-1])).all()
    assert ((b["decoder_loss_weights"] > 0) == (b["decoder_target_tokens"] > 0)).all()
    # Every row ends its targets with EOS; the encoder row is the English line.
    for row in range(8):
        n = int(b["decoder_segment_ids"][row].sum())
        assert b["decoder_target_tokens"][row, n - 1] == V.eos_id


def test_packed_encdec_segments_pair_up(caches):
    _, packed = caches
    with ConvertedFeeder(converter="encdec", cache=packed, sequence_length={"inputs": 256, "targets": 256},
                         global_batch_size=4, host_index=0, host_count=1) as f:
        batches = [f.get_batch(s) for s in range(3)]
    # Which rows first-fit packing filled with one example or several depends on
    # the cache order (its fingerprint); every row pairs up, and most hold several.
    several = 0
    for b in batches:
        for row in range(4):
            enc, dec = b["encoder_segment_ids"][row], b["decoder_segment_ids"][row]
            assert enc.max() == dec.max() >= 1  # the same examples on both sides, numbered alike
            if enc.max() >= 2:
                several += 1
                assert b["encoder_positions"][row][enc == 2][0] == 0
            assert (b["decoder_input_tokens"][row][np.flatnonzero(np.diff(dec) != 0) + 1] == 0).all()
    assert several >= 6


def test_exactly_once_resume_and_hosts(caches):
    plain, _ = caches
    kw = dict(converter="encdec", cache=plain, sequence_length={"inputs": 96, "targets": 96}, global_batch_size=8,
              seed=3, num_epochs=1)
    with ConvertedFeeder(host_index=0, host_count=1, **kw) as f:
        batches = list(f)
    seen = np.concatenate([b["cache_index"] for b in batches])
    assert sorted(seen[seen >= 0].tolist()) == list(range(1014))  # exactly once over the epoch
    with ConvertedFeeder(host_index=0, host_count=1, **kw) as f:
        f.step = 50
        state = f.state()
    with ConvertedFeeder(host_index=0, host_count=1, **kw) as g:  # a fresh feeder
        g.set_state(state)
        resumed = next(g)
    for k, v in batches[50].items():
        assert np.array_equal(resumed[k], v), k
    halves = []
    for h in range(2):
        with ConvertedFeeder(host_index=h, host_count=2, **kw) as f:
            halves.append(f.get_batch(7))
    for k, v in batches[7].items():
        assert np.array_equal(np.concatenate([halves[0][k], halves[1][k]]), v), k
    with ConvertedFeeder(host_index=0, host_count=1, **{**kw, "converter": "lm",
                                                        "sequence_length": {"targets": 96}}) as g:
        with pytest.raises(ValueError, match="saved with converter"):
            g.set_state(state)


def test_converted_steps_are_read_ahead_whole_and_equal_those_read_on_demand(caches, tmp_path, monkeypatch):
    """The feeder reads and converts steps ahead on its own threads (its
    features' feeders read none ahead); any prefetch depth gives the same
    batches, and a state names the cache where it was opened, wherever the
    process runs from later."""
    plain, _ = caches
    kw = dict(converter="encdec", cache=plain, sequence_length={"inputs": 96, "targets": 96}, global_batch_size=8,
              seed=1, host_index=0, host_count=1)
    with ConvertedFeeder(prefetch=0, **kw) as on_demand:
        want = [on_demand.get_batch(s) for s in range(6)]
    with ConvertedFeeder(prefetch=3, num_threads=2, **kw) as f:
        assert all(g.prefetch == 0 for g in f.feeders.values())
        first = f.get_batch(0)
        ahead = f._prefetch.pending()
        assert len(ahead) == 3
        ready = [fut.result() for fut in ahead]  # steps 1..3, converted on the feeder's threads
        assert all("decoder_input_tokens" in b for b in ready)
        got = [first] + [f.get_batch(s) for s in range(1, 6)]
        state = f.state()
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w) and all(np.array_equal(g[k], w[k]) for k in w)
    relative = tmp_path / "here"
    relative.mkdir()
    monkeypatch.chdir(relative)
    with ConvertedFeeder(prefetch=0, **{**kw, "cache": os.path.relpath(plain)}) as f:
        monkeypatch.chdir(tmp_path)
        assert f.state()["mixture"][0]["path"] == state["mixture"][0]["path"] == os.path.abspath(plain)


def test_lm_and_prefix_lm(caches):
    plain, _ = caches
    with ConvertedFeeder(converter="lm", cache=plain, sequence_length={"targets": 96}, global_batch_size=4,
                         host_index=0, host_count=1) as f:
        lm = f.get_batch(0)
    assert sorted(k for k in lm if k.startswith("decoder")) == [
        "decoder_input_tokens", "decoder_loss_weights", "decoder_positions", "decoder_segment_ids",
        "decoder_target_tokens"]
    with ConvertedFeeder(converter="prefix_lm", cache=plain, sequence_length={"inputs": 96, "targets": 96},
                         global_batch_size=4, host_index=0, host_count=1) as f:
        b = f.get_batch(0)
        enc = f.feeders["inputs"].get_batch(0)
        dec = f.feeders["targets"].get_batch(0)
    for r in range(4):
        n_in = int(enc["inputs_segment_ids"][r].sum())
        n_tg = int(dec["targets_segment_ids"][r].sum())
        row = b["decoder_target_tokens"][r]
        assert row[:n_in].tolist() == enc["inputs"][r][:n_in].tolist()
        assert row[n_in:n_in + n_tg].tolist() == dec["targets"][r][:n_tg].tolist()
        assert b["decoder_causal_attention"][r].tolist() == [1] * (n_in + 1) + [0] * (192 - n_in - 1)
        assert b["decoder_loss_weights"][r].tolist() == [0] * n_in + [1] * n_tg + [0] * (192 - n_in - n_tg)
    with pytest.raises(ValueError, match="unknown feature converter 'bert'"):
        ConvertedFeeder(converter="bert", cache=plain, sequence_length={}, global_batch_size=4)
    # A feature left out reads the cache's own length; a longer one is refused.
    with ConvertedFeeder(converter="encdec", cache=plain, sequence_length={"targets": 8}, global_batch_size=4,
                         host_index=0, host_count=1) as f:
        assert f.sequence_length == {"inputs": 96, "targets": 8}
        assert f.get_batch(0)["encoder_input_tokens"].shape == (4, 96)
    with pytest.raises(SequenceLengthError, match="sequence length 97 for feature 'inputs' is longer than the "
                                                  "cache's, 96 tokens"):
        ConvertedFeeder(converter="encdec", cache=plain, sequence_length=97, global_batch_size=4)


def test_a_mixture_of_an_lm_and_a_translation_task_is_refused_by_every_converter(caches, tmp_path, fx):
    plain, packed = caches
    lm = str(tmp_path / "wiki" / "train")
    fx.write_fixture_cache(lm, n=12, task="wiki")
    both = "['inputs', 'targets']"
    each = f"task 'wiki' ({lm}) has ['targets']; task 'multi30k' ({plain}) has {both}"
    lengths = {"lm": {"targets": 96}, "encdec": {"inputs": 96, "targets": 96},
               "prefix_lm": {"inputs": 96, "targets": 96}}
    for converter, length in lengths.items():
        with pytest.raises(ValueError) as e:
            ConvertedFeeder(converter=converter, mixture={lm: 1, plain: 1}, sequence_length=length,
                            global_batch_size=4, host_index=0, host_count=1)
        msg = str(e.value)
        # Every cache's features, what would work, and no argument ConvertedFeeder refuses.
        assert "different features" in msg and each in msg, msg
        assert "tasks with ['targets'] only (read with ConvertedFeeder(converter='lm'))" in msg
        assert f"tasks with {both} only (read with ConvertedFeeder(converter='encdec' or 'prefix_lm'))" in msg
        assert "feature=" not in msg and "\n" not in msg
    # A converter that needs a feature the caches lack names every cache and the converter that fits.
    lm2 = str(tmp_path / "code" / "train")
    fx.write_fixture_cache(lm2, n=5, task="code")
    for converter in ("encdec", "prefix_lm"):
        with pytest.raises(ValueError) as e:
            ConvertedFeeder(converter=converter, mixture={lm: 1, lm2: 1}, sequence_length=lengths[converter],
                            global_batch_size=4, host_index=0, host_count=1)
        msg = str(e.value)
        assert msg == (f"converter {converter!r} reads features {both}, but task 'wiki' ({lm}) has ['targets']; "
                       f"task 'code' ({lm2}) has ['targets'] (no ['inputs']); use converter='lm'")
    # Translation caches mix: encdec reads both features of both tasks, rows from each.
    with ConvertedFeeder(converter="encdec", mixture={plain: 1, packed: 1}, global_batch_size=8,
                         sequence_length={"inputs": 256, "targets": 256}, host_index=0, host_count=1) as f:
        rows = [f.get_batch(s) for s in range(4)]
    assert sorted(set(np.concatenate([b["task_index"] for b in rows]).tolist())) == [0, 1]
    assert all((b["encoder_segment_ids"] > 0).any(axis=1).all() for b in rows)


# Runs in a fresh interpreter: restore_feeder on each of H hosts, then the digest
# of the next global batch (the hosts' rows concatenated), field by field.
_CONVERTED_RESTORE_CHILD = r"""
import hashlib, json, sys
import numpy as np
from seqcache.feeders import restore_feeder
req = json.load(sys.stdin)
H = req["host_count"]
feeders = [restore_feeder(req["state"], host_index=h, host_count=H, num_threads=1) for h in range(H)]
parts = [next(f) for f in feeders]
h = hashlib.sha256()
for k in sorted(parts[0]):
    h.update(k.encode() + np.concatenate([p[k] for p in parts]).tobytes())
print(json.dumps({"type": type(feeders[0]).__name__, "digest": h.hexdigest(), "step": feeders[0].step,
                  "state": feeders[0].state()}))
"""


def _digest(batch):
    import hashlib

    h = hashlib.sha256()
    for k in sorted(batch):
        h.update(k.encode() + np.asarray(batch[k]).tobytes())
    return h.hexdigest()


def test_restore_feeder_of_a_converted_state_resumes_the_converter_on_another_host_count(caches):
    import json
    import subprocess
    import sys

    plain, _ = caches
    kw = dict(converter="encdec", cache=plain, sequence_length={"inputs": 96, "targets": 96}, global_batch_size=8,
              seed=5)
    with ConvertedFeeder(host_index=0, host_count=1, **kw) as f:
        want = f.get_batch(9)
        f.step = 9
        state = f.state()
    proc = subprocess.run([sys.executable, "-c", _CONVERTED_RESTORE_CHILD], capture_output=True, text=True,
                          timeout=120, input=json.dumps({"state": state, "host_count": 2}))
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    # A ConvertedFeeder (inputs and the converter's fields), at the next step, the same rows.
    assert got["type"] == "ConvertedFeeder" and got["step"] == 10
    assert got["digest"] == _digest(want)
    assert got["state"]["converter"] == state["converter"]
    with ConvertedFeeder.restore(state, host_index=1, host_count=4) as g:
        b = g.get_batch(9)
        assert b["encoder_input_tokens"].shape == (2, 96)
        assert np.array_equal(b["encoder_input_tokens"], want["encoder_input_tokens"][2:4])
    with pytest.raises(ValueError, match="this run has converter 'lm'"):
        ConvertedFeeder.restore(state, host_index=0, host_count=1, converter="lm")


def test_a_plain_feeder_refuses_a_converted_state(caches):
    from seqcache.feeders import Feeder, FeederStateError

    plain, _ = caches
    with ConvertedFeeder(converter="prefix_lm", cache=plain, sequence_length={"inputs": 64, "targets": 96},
                         global_batch_size=4, host_index=0, host_count=1) as f:
        state = f.state()
    with pytest.raises(FeederStateError) as e:
        Feeder.restore(state, host_index=0, host_count=1)
    assert "ConvertedFeeder(converter='prefix_lm')" in str(e.value)
    assert "ConvertedFeeder.restore(state" in str(e.value)
    with Feeder(cache=plain, global_batch_size=4, sequence_length=96, host_index=0, host_count=1) as g:
        with pytest.raises(FeederStateError, match="ConvertedFeeder.restore"):
            g.set_state(state)
    with pytest.raises(FeederStateError, match="restore it with Feeder.restore"):
        ConvertedFeeder.restore({k: v for k, v in state.items() if k != "converter"}, host_index=0, host_count=1)


@pytest.mark.parametrize("converter, expected", [
    ("encdec", "converter: expected `object` (got 'encdec')"),
    ({"name": "bert" * 5000, "sequence_length": {"targets": 96}}, "converter.name = 'bertbert"),
    ({"name": "lm", "sequence_length": {"targets": 10**30}}, "is out of range"),
    ({"name": "lm", "sequence_length": {"targets": 2**40}}, "converter.sequence_length.targets: expected `int` "
                                                             "<= 16777215 (got 1099511627776)"),
    ({"name": "lm", "sequence_length": {"targets": 96.5}}, "converter.sequence_length.targets: expected `int` "
                                                            "(got 96.5)"),
    ({"name": "lm", "sequence_length": {"targets": float("nan")}}, "expected a finite number"),
    ({"name": "lm", "sequence_length": {"targets": 96, "inputs": 96}}, "converter 'lm' reads ['targets']"),
    ({"name": "encdec", "sequence_length": {"inputs": 64, "targets": 48}}, "disagree with converter 'encdec'"),
    ({"name": "lm", "sequence_length": {"targets": 96}, "x": 1}, "converter: object contains unknown field `x`"),
    ({"name": "lm"}, "converter: object missing required field `sequence_length`"),
    ({"name": [[[[[[["lm"] * 100]]]]]], "sequence_length": {"targets": 96}}, "converter.name: expected `str` "
                                                                             "(got [[[[...]]]])"),
])
def test_hostile_converter_fields_are_one_short_line(caches, converter, expected):
    from seqcache.feeders import FeederStateError, restore_feeder

    plain, _ = caches
    with ConvertedFeeder(converter="lm", cache=plain, sequence_length={"targets": 96}, global_batch_size=4,
                         host_index=0, host_count=1) as f:
        state = f.state()
        for restore in (restore_feeder, ConvertedFeeder.restore, lambda s, **kw: f.set_state(s)):
            with pytest.raises(FeederStateError) as e:
                restore({**state, "converter": converter}, host_index=0, host_count=1)
            msg = str(e.value)
            assert expected in msg and "\n" not in msg and len(msg) < 400, msg


def test_deeply_nested_converter_field_is_refused_in_one_line(caches):
    from seqcache.feeders import FeederStateError

    plain, _ = caches
    with ConvertedFeeder(converter="lm", cache=plain, sequence_length={"targets": 96}, global_batch_size=4,
                         host_index=0, host_count=1) as f:
        state = f.state()
        deep = 96
        for _ in range(5000):
            deep = [deep]
        for bad in ({"name": "lm", "sequence_length": {"targets": deep}}, deep):
            for restore in (ConvertedFeeder.restore, lambda s, **kw: f.set_state(s)):
                with pytest.raises(FeederStateError) as e:
                    restore({**state, "converter": bad}, host_index=0, host_count=1)
                assert "nested deeper than 64 levels" in str(e.value) and len(str(e.value)) < 300
