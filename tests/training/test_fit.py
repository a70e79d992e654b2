"""The fit (``seqcache.training.fit``): the candidates, the choice against a
device memory size given by the test, the probe, the bounds on compiling, the
resume, and that on a CPU it changes nothing."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import fit as F
from seqcache.training import partitioning
from seqcache.training import trainer as T
from seqcache_training_test_fakes import tiny_config_dict
from testsupport import train_shakespeare_lm

GB = 10**9


def _config(**overrides):
    return C.config_from_dict(tiny_config_dict(**{"num_microbatches": 1, **overrides}))


# -- candidates ----------------------------------------------------------------------


def _triples(settings):
    return [(s.num_microbatches, s.remat, s.scan_layers) for s in settings]


def test_candidates_start_with_the_configs_own_then_the_ladder():
    cfg = C.apply_overrides(_config(), ["num_microbatches=4", "model.remat=dots", "model.scan_layers=true"])
    assert _triples(F.candidates(cfg)) == [
        (4, "dots", True), (1, "none", True), (1, "dots", True), (2, "dots", True), (8, "dots", True),
        (2, "full", True), (4, "full", True), (8, "full", True)]


def test_candidates_keep_pinned_fields_and_split_the_batch_over_its_shards():
    cfg = _config()  # B = 16, 1 microbatch, remat none
    assert _triples(F.candidates(cfg, pinned={"model.remat"})) == [(1, "none", False), (2, "none", False),
                                                                   (4, "none", False), (8, "none", False)]
    # 4 batch shards: a microbatch of 16 / 8 = 2 rows cannot be split over them.
    assert [s.num_microbatches for s in F.candidates(cfg, pinned={"model.remat"}, batch_shards=4)] == [1, 2, 4]
    assert _triples(F.candidates(cfg, pinned={"num_microbatches", "model.remat"})) == [(1, "none", False)]
    with pytest.raises(ValueError, match="pinned fields"):
        F.candidates(cfg, pinned={"steps"})


def test_pinned_fields_come_from_overrides_and_the_config_file():
    assert F.pinned_fields(["model.remat=full", "optimizer.lr=1"], None) == {"model.remat"}
    assert F.pinned_fields([], {"num_microbatches": 2, "model": {"scan_layers": True, "d_model": 8}}) == {
        "num_microbatches", "model.scan_layers"}


def test_a_setting_dominates_those_that_recompute_and_split_more():
    a = F.Setting(2, "dots", False)
    assert a.dominates(F.Setting(4, "full", False)) and a.dominates(F.Setting(2, "dots", False))
    assert not a.dominates(F.Setting(1, "full", False)) and not a.dominates(F.Setting(2, "none", False))
    assert not a.dominates(F.Setting(4, "full", True))


# -- the choice, with fake trainers ----------------------------------------------------


class FakeTrainer:
    """A Trainer whose compile reports the memory of ``NEEDS`` for its setting."""

    def __init__(self, config, needs, compiled):
        self.config = config
        self.mesh = partitioning.make_mesh({"data": 1, "fsdp": 1, "model": 1}, jax.devices()[:1])
        self.setting = F.Setting.of(config)
        self.needs, self.compiled = needs, compiled
        self.memory_analysis, self.compile_time_s = {}, 0.0

    def compile(self):
        self.compiled.append(self.setting)
        need = self.needs[self.setting]
        if need is None:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        # On the CPU (these fakes' devices) program_bytes reads the sum of the parts.
        self.memory_analysis = {"peak_memory_in_bytes": need, "temp_size_in_bytes": need}
        self.compile_time_s = 1.5


def _fake(needs, times=None, seconds_per_compile=1.0):
    compiled, probed = [], []
    now = [0.0]

    def make(config):
        return FakeTrainer(config, needs, compiled)

    def probe(trainer):
        probed.append(trainer.setting)
        return times[trainer.setting]

    def clock():  # the fit reads the clock before and after each compile
        now[0] += seconds_per_compile
        return now[0]

    return make, probe, clock, compiled, probed


def _S(m, remat, scan=False):
    return F.Setting(m, remat, scan)


def _needs(default=20 * GB, **given):
    """Every ladder setting needs ``default`` bytes unless given (name 'M_remat')."""
    out = {s: default for s in [_S(m, r) for m, r in F.LADDER]}
    for name, need in given.items():
        m, remat = name[1:].split("_")
        out[_S(int(m), remat)] = need
    return out


def test_on_a_cpu_the_fit_chooses_nothing_and_changes_nothing():
    cfg = _config()
    make, probe, clock, compiled, _ = _fake(_needs())
    result = F.fit(cfg, platform="cpu", device_kind="cpu", memory_limit=16 * GB, make_trainer=make, probe=probe)
    assert result.config == cfg and result.config.fit is None and result.trainer is None
    assert result.record["chosen"] is None and "no TPU or GPU" in result.record["by"]
    assert compiled == []


def test_from_an_own_setting_that_fits_the_fit_walks_towards_the_faster_ones():
    """The config's own setting fits: the slower settings are not compiled; the
    faster ones are, from the nearest; one that does not fit rules out those
    that need more memory; the probe decides among those that fit."""
    cfg = C.apply_overrides(_config(), ["num_microbatches=4", "model.remat=dots"])
    needs = _needs(**{"m4_dots": 15 * GB, "m2_full": 12 * GB, "m2_dots": 14 * GB, "m1_dots": 17 * GB})
    times = {_S(4, "dots"): 1.0, _S(2, "full"): 0.95, _S(2, "dots"): 0.9}
    make, probe, clock, compiled, probed = _fake(needs, times)
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock)
    # (8, full), (4, full) and (8, dots): slower than (4, dots); (1, none): larger than (1, dots).
    assert compiled == [_S(4, "dots"), _S(2, "full"), _S(2, "dots"), _S(1, "dots")]
    # Every one that fits is probed, in the order compiled.
    assert probed == [_S(4, "dots"), _S(2, "full"), _S(2, "dots")]
    assert (result.config.num_microbatches, result.config.model.remat) == (2, "dots")
    assert result.trainer.setting == _S(2, "dots") and result.trainer.config is result.config
    record = result.config.fit
    assert record["chosen"] == {"num_microbatches": 2, "model.remat": "dots", "model.scan_layers": False}
    assert record["by"] == "probe" and record["budget_bytes"] == int(16 * GB * F.MEMORY_FRACTION)
    rows = {(r["num_microbatches"], r["model.remat"]): r for r in record["candidates"]}
    assert rows[(1, "dots")] == {"num_microbatches": 1, "model.remat": "dots", "model.scan_layers": False,
                                 "fits": False, "program_bytes": 17 * GB, "compile_time_s": 1.5}
    assert rows[(2, "dots")]["probe_step_time_s"] == 0.9 and rows[(4, "dots")]["probe_step_time_s"] == 1.0
    assert rows[(2, "full")]["probe_step_time_s"] == 0.95
    assert record["compile_time_s"] == pytest.approx(4.0)


def test_from_an_own_setting_that_does_not_fit_the_fit_walks_towards_the_smaller_ones():
    """A compile that runs out of memory does not fit and is recorded; the first
    that fits rules out the slower ones."""
    cfg = _config()  # (1, none)
    needs = _needs(**{"m1_none": None, "m1_dots": 17 * GB, "m2_dots": 14 * GB})
    make, probe, clock, compiled, probed = _fake(needs, {})
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock)
    assert compiled == [_S(1, "none"), _S(1, "dots"), _S(2, "dots")] and probed == []
    assert result.config.fit["by"] == "the only candidate that fits"
    (row,) = [r for r in result.config.fit["candidates"] if r["model.remat"] == "none"]
    assert row["fits"] is False and row["program_bytes"] is None and "RESOURCE_EXHAUSTED" in row["error"]


def test_one_candidate_that_fits_is_taken_without_a_probe():
    cfg = _config()
    make, probe, clock, compiled, probed = _fake(_needs(m1_none=8 * GB))
    result = F.fit(cfg, platform="gpu", device_kind="NVIDIA H100", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock)
    assert compiled == [_S(1, "none")] and probed == []
    assert result.config.fit["by"] == "the only candidate that fits"
    assert dataclasses.replace(result.config, fit=None) == cfg


def test_at_most_four_candidates_are_compiled_and_none_that_fits_keeps_the_own():
    cfg = _config()
    make, probe, clock, compiled, probed = _fake(_needs())  # nothing fits in 16 GB
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock)
    assert len(compiled) == F.MAX_CANDIDATES == 4
    assert result.config.fit["by"] == "none fits: the config's own" and result.trainer is None
    assert dataclasses.replace(result.config, fit=None) == cfg


@pytest.mark.parametrize("seconds, count", [(50.0, 1), (40.0, 2), (30.0, 3), (20.0, 4)])
def test_once_one_fits_no_compile_starts_that_would_end_past_the_budget(seconds, count):
    """At the pace of the compiles so far: 50 s each, the own setting alone
    (a second would end at 100 s); 30 s each, three (90 s)."""
    cfg = C.apply_overrides(_config(), ["num_microbatches=4", "model.remat=dots"])  # everything fits
    times = {s: 1.0 for s in _needs()}
    make, probe, clock, compiled, _ = _fake(_needs(default=8 * GB), times, seconds_per_compile=seconds)
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock, compile_budget_s=90.0)
    assert len(compiled) == count and result.config.fit["compile_time_s"] == pytest.approx(seconds * count)
    assert result.config.fit["compile_time_s"] <= 90.0


def test_while_none_fits_the_fit_compiles_on_past_the_budget():
    """50 s a compile and nothing fits: the budget does not end the search
    (a run with none that fits fails anyway); at most four compiles."""
    cfg = _config()
    make, probe, clock, compiled, _ = _fake(_needs(m2_dots=8 * GB), seconds_per_compile=50.0)
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock, compile_budget_s=90.0)
    assert compiled == [_S(1, "none"), _S(1, "dots"), _S(2, "dots")]
    assert result.config.fit["by"] == "the only candidate that fits"
    assert (result.config.num_microbatches, result.config.model.remat) == (2, "dots")


def test_several_hosts_decide_on_process_0s_compile_times(monkeypatch):
    """Whether another candidate is compiled is decided on process 0's compile
    times, broadcast, so that every host compiles and probes the same ones: a
    host whose own clock says 50 s a compile goes on as process 0, at 10 s a
    compile, does (four compiles, 40 s); alone it would stop after one."""
    calls = []

    def broadcast_one_to_all(values):
        calls.append(len(values))
        return np.full_like(values, 10.0) if len(values) == 1 else values  # process 0's

    monkeypatch.setattr(F.jax, "process_count", lambda: 2)
    monkeypatch.setattr(F.multihost_utils, "broadcast_one_to_all", broadcast_one_to_all)
    cfg = C.apply_overrides(_config(), ["num_microbatches=4", "model.remat=dots"])  # everything fits
    times = {s: 1.0 for s in _needs()}
    make, probe, clock, compiled, probed = _fake(_needs(default=8 * GB), times, seconds_per_compile=50.0)
    result = F.fit(cfg, platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB, make_trainer=make,
                   probe=probe, clock=clock, compile_budget_s=90.0)
    assert len(compiled) == 4 and result.config.fit["compile_time_s"] == pytest.approx(40.0)
    assert calls == [1, 1, 1, 1, 4] and len(probed) == 4  # one broadcast a compile, one of the probe times


def test_an_error_that_is_not_out_of_memory_is_raised():
    class Broken(FakeTrainer):
        def compile(self):
            raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        F.fit(_config(), platform="tpu", device_kind="TPU v5 lite", memory_limit=16 * GB,
              make_trainer=lambda c: Broken(c, {}, []), probe=lambda t: 1.0)


# -- the choice, with real compiles on the CPU and a device memory size given -------------


def test_real_compiles_against_a_given_memory_size():
    """The tiny model's train steps compiled on the CPU, as if it were an
    accelerator of the given memory: with room for the config's own program
    it alone is compiled and taken; with room for none, up to four are tried
    and their compiled sizes recorded."""
    cfg = _config(model={"dropout_rate": 0.0})
    made = []

    def make(config):
        made.append(T.Trainer(config, devices=jax.devices()[:1]))
        return made[-1]

    roomy = F.fit(cfg, platform="tpu", device_kind="fake", memory_limit=10 * GB, make_trainer=make,
                  probe=lambda t: pytest.fail("one candidate fits: no probe"))
    (row,) = roomy.record["candidates"]
    assert row["fits"] and 0 < row["program_bytes"] < 10 * GB
    assert row["program_bytes"] == F.program_bytes(made[0].memory_analysis, "cpu")
    assert roomy.trainer is made[0] and roomy.trainer.config == roomy.config
    assert dataclasses.replace(roomy.config, fit=None) == cfg

    tight = F.fit(cfg, platform="tpu", device_kind="fake", memory_limit=1000, make_trainer=make,
                  probe=lambda t: pytest.fail("nothing fits: no probe"))
    assert [r["fits"] for r in tight.record["candidates"]] == [False] * 4
    assert all(r["program_bytes"] > 1000 for r in tight.record["candidates"])


def test_the_probe_times_real_steps():
    cfg = _config(model={"dropout_rate": 0.0})
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    batch = F.synthetic_batch(trainer)
    assert sorted(batch) == sorted(trainer.batch_fields)
    assert batch["targets_positions"][3].tolist() == list(range(16)) and batch["targets_segment_ids"].min() == 1
    assert F.time_probe(trainer, steps=2) > 0


# -- resume ---------------------------------------------------------------------------


def test_a_resumed_run_takes_the_saved_settings_unless_pinned():
    cfg = _config()
    saved = C.to_dict(C.apply_overrides(cfg, ["num_microbatches=4", "model.remat=dots"]))
    saved["fit"] = {"mode": "auto", "chosen": {"num_microbatches": 4}, "by": "probe"}
    result = F.resumed(cfg, saved)
    assert (result.config.num_microbatches, result.config.model.remat) == (4, "dots")
    assert result.config.fit["resumed"] is True and result.config.fit["by"] == "probe"
    pinned = F.resumed(cfg, saved, pinned={"model.remat"})
    assert (pinned.config.num_microbatches, pinned.config.model.remat) == (4, "none")
    # A run saved without a fit (a CPU run): the settings, and no record.
    del saved["fit"]
    plain = F.resumed(cfg, saved)
    assert plain.config.fit is None and plain.config.num_microbatches == 4
    assert F.resumed(cfg, {"not": "a config"}) is None


# -- seqcache train ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory, shakespeare_lm_cache):
    return shakespeare_lm_cache(tmp_path_factory, num_lines=600, sequence_length=64)


def _summary(result) -> dict:
    return json.loads([line for line in result.output.splitlines() if line.startswith("{")][-1])


def test_seqcache_train_on_a_cpu_fits_nothing_and_a_resume_keeps_the_saved_settings(cache, tmp_path):
    ckpt = tmp_path / "run"
    first = train_shakespeare_lm(cache, ckpt, "--steps", "2", "--batch-size", "16", "--fit", "auto", "--set",
                                 "num_microbatches=2 optimizer.warmup_steps=2", sequence_length=64)
    assert first.exit_code == 0, first.output
    config = json.loads((ckpt / "config.json").read_text())
    assert config["fit"] is None and config["num_microbatches"] == 2 and config["model"]["remat"] == "none"
    assert "fit" not in _summary(first)
    # Resumed without the override: the run's own settings, not the command's defaults.
    second = train_shakespeare_lm(cache, ckpt, "--steps", "3", "--batch-size", "16", "--set",
                                  "optimizer.warmup_steps=2", sequence_length=64)
    assert second.exit_code == 0, second.output
    assert _summary(second)["start_step"] == 2
    assert json.loads((ckpt / "config.json").read_text())["num_microbatches"] == 2
    bad = train_shakespeare_lm(cache, tmp_path / "other", "--fit", "always", sequence_length=64)
    assert bad.exit_code == 2 and "'always' is not one of 'auto', 'off'" in bad.output
