"""One single-device training run: metrics lines, resolved config, checkpoints
with feeder state, learning, and exactly-once evaluation."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import model as M
from seqcache.training import step as S
from seqcache.training import trainer as T
from seqcache.training.checkpoints import Checkpointer, CheckpointError
from seqcache.training.metrics import read_metrics
from seqcache_training_test_fakes import FEEDER_KWARGS, FakeFeeder, tiny_config_dict

EVAL_EXAMPLES = 37  # not a multiple of the batch size 16: the last batch has 11 padding rows


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("run")
    cfg = C.config_from_dict(
        tiny_config_dict(checkpoint={"directory": str(ckpt_dir), "every_steps": 4, "max_to_keep": 2})
    )
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    feeder = FakeFeeder(**FEEDER_KWARGS)

    def eval_feeder():
        return FakeFeeder(global_batch_size=16, sequence_length=16, seed=9, num_epochs=1, num_examples=EVAL_EXAMPLES)

    result = trainer.fit(feeder, eval_feeder_fn=eval_feeder)
    return cfg, trainer, result, ckpt_dir


def test_metrics_file_has_one_line_per_step(run):
    cfg, _, result, ckpt_dir = run
    lines = read_metrics(str(ckpt_dir / "metrics.jsonl"))
    train_lines = [x for x in lines if "loss" in x]
    assert [x["step"] for x in train_lines] == list(range(6))
    for line in train_lines:
        for key in ("loss", "learning_rate", "grad_norm", "tokens_per_s", "step_time_s", "data_wait_s"):
            assert math.isfinite(line[key]), key
        assert line["tokens_per_s"] == pytest.approx(16 * 16 / line["step_time_s"])
    # Linear warmup over 2 steps then cosine decay: step 0 uses rate 0, step 1 half.
    assert train_lines[0]["learning_rate"] == 0.0
    assert train_lines[1]["learning_rate"] == pytest.approx(0.5e-2)
    assert train_lines[2]["learning_rate"] == pytest.approx(1e-2)
    assert [x["loss"] for x in train_lines] == pytest.approx(result.losses)
    eval_lines = [x for x in lines if "eval_loss" in x]
    assert len(eval_lines) == 1 and eval_lines[0]["step"] == 5


def test_resolved_config_is_written_beside_checkpoints(run):
    cfg, _, _, ckpt_dir = run
    written = json.loads((ckpt_dir / "config.json").read_text())
    assert C.config_from_dict(written) == cfg


def test_loss_goes_down(run):
    _, _, result, _ = run
    assert result.losses[-1] < result.losses[0] - 0.2


def test_checkpoints_hold_feeder_state_at_their_step(run):
    _, trainer, result, ckpt_dir = run
    with Checkpointer(str(ckpt_dir), max_to_keep=2) as ckpt:
        assert ckpt.all_steps() == [4, 6]
        restored = ckpt.restore(None, abstract_state=trainer.abstract_state(), global_batch_size=16)
    assert restored.feeder_state["step"] == 6 and restored.feeder_state["global_batch_size"] == 16
    assert int(restored.state["step"]) == 6
    assert int(restored.state["opt_state"][1][0].count) == 6  # AdamW's update count
    for a, b in zip(jax.tree.leaves(restored.state["params"]), jax.tree.leaves(result.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_eval_reads_every_example_once(run):
    _, trainer, result, _ = run
    ev = result.eval
    assert ev["eval_batches"] == 3
    # Reference: all 21 eval examples in one batch, no padding rows.
    fake = FakeFeeder(global_batch_size=16, sequence_length=16, seed=9, num_epochs=1, num_examples=EVAL_EXAMPLES)
    rows = [fake.example(i) for i in range(EVAL_EXAMPLES)]
    batch = {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in S.BATCH_KEYS}
    params = jax.device_get(result.params)
    sums = jax.jit(lambda p, b: S.loss_sums(trainer.graphdef, p, b, None))(params, batch)
    assert ev["eval_tokens"] == float(sum(r["targets_loss_weights"].sum() for r in rows))
    assert ev["eval_loss"] == pytest.approx(float(sums["loss_sum"]) / float(sums["weight_sum"]), rel=1e-5)
    assert ev["eval_accuracy"] == pytest.approx(float(sums["correct_sum"]) / float(sums["weight_sum"]), rel=1e-5)


def test_describe_and_compile_report(run):
    _, trainer, result, _ = run
    d = trainer.describe()
    assert d["tokens_per_step"] == 256 and d["parameters"] == M.count_params(result.params)
    assert result.compile_time_s > 0
    assert result.memory_analysis.get("argument_size_in_bytes", 0) > 0


def test_feeder_with_other_global_batch_is_refused(tmp_path):
    cfg = C.config_from_dict(tiny_config_dict())
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="feeder has global batch size 8, the config has global_batch_size=16"):
        trainer.fit(FakeFeeder(global_batch_size=8, sequence_length=16))


def test_batch_not_divisible_over_shards_is_refused():
    cfg = C.config_from_dict(tiny_config_dict(mesh={"data": 8}, global_batch_size=8, num_microbatches=2))
    with pytest.raises(C.ConfigError, match=r"microbatch size 4 \(global_batch_size=8 / num_microbatches=2\) is not divisible by the 8 batch shards"):
        T.Trainer(cfg)


def test_checkpoint_of_another_data_stream_is_refused(run):
    cfg, _, _, ckpt_dir = run
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    other = FakeFeeder(**{**FEEDER_KWARGS, "seed": FEEDER_KWARGS["seed"] + 1})
    with pytest.raises(CheckpointError, match=r"feeder state has seed=4, but this run's feeder has seed=5"):
        trainer.fit(other)
    assert other.closed and other.batches_read == 0


def test_checkpoint_restores_onto_another_mesh(run):
    """A 1-device checkpoint restores into an 8-device fsdp+tp layout, same values."""
    cfg, _, result, ckpt_dir = run
    other = T.Trainer(
        dataclasses.replace(cfg, rules="fsdp+tp", mesh=C.MeshConfig(data=1, fsdp=2, model=4)), devices=jax.devices()
    )
    with Checkpointer(str(ckpt_dir)) as ckpt:
        restored = ckpt.restore(6, abstract_state=other.abstract_state(), global_batch_size=16)
    wq = restored.state["params"]["blocks"][0]["attn"]["wq"]
    assert wq.sharding == other.param_shardings["blocks"][0]["attn"]["wq"]
    assert wq.addressable_shards[0].data.shape == (32 // 2, 4 // 4, 8)
    for a, b in zip(jax.tree.leaves(restored.state["params"]), jax.tree.leaves(result.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def _seqcache_state(path, fingerprint, rate=1.0, seed=0):
    """A seqcache.feeders.Feeder state of one cache (the fields the check compares)."""
    return {"kind": "seqcache.feeders.Feeder", "version": 1, "cache_format_version": 1,
            "mixture": [{"path": path, "rate": rate, "weight": 1, "task": "t", "split": "train",
                         "num_examples": 10, "fingerprint": fingerprint}],
            "seed": seed, "global_batch_size": 8, "sequence_length": 16, "feature": "targets",
            "num_epochs": None, "position": 16}


def test_another_data_stream_is_named_by_its_real_difference():
    saved = _seqcache_state("caches/t/train", "a" * 64)
    # The same cache reached by another path (absolute, moved): the same stream.
    T.check_same_stream("ckpt/2", saved, {**_seqcache_state("/abs/caches/t/train", "a" * 64), "position": 0})
    with pytest.raises(CheckpointError) as e:
        T.check_same_stream("ckpt/2", saved, _seqcache_state("/abs/caches/t/train", "b" * 64))
    assert str(e.value).startswith(
        f"ckpt/2: the cache at /abs/caches/t/train was rebuilt (fingerprint {'b' * 64}, the state was saved with "
        f"fingerprint {'a' * 64} at caches/t/train)")
    assert "another data stream" in str(e.value) and "'path'" not in str(e.value)
    with pytest.raises(CheckpointError, match=r"ckpt/2: feeder state has seed=0, but this run has seed=3; the "
                                              r"checkpoint belongs to another data stream"):
        T.check_same_stream("ckpt/2", saved, _seqcache_state("/abs/caches/t/train", "a" * 64, seed=3))
    with pytest.raises(CheckpointError, match=r"saved with rate 1\.0 for the cache at /x \(mixture entry 0\), but "
                                              r"this run has rate 2\.0"):
        T.check_same_stream("ckpt/2", saved, _seqcache_state("/x", "a" * 64, rate=2.0))


def test_schedule_changes_name_each_field_and_both_values():
    saved = C.to_dict(C.config_from_dict(tiny_config_dict()))
    cfg = C.config_from_dict(tiny_config_dict(steps=10, optimizer={"lr": 2e-2, "warmup_steps": 2, "decay_steps": 8},
                                              seed=3))
    assert T.schedule_changes(saved, cfg) == [("steps", 6, 10), ("optimizer.lr", 1e-2, 2e-2),
                                              ("optimizer.decay_steps", None, 8)]
    assert T.schedule_changes(saved, C.config_from_dict(tiny_config_dict(seed=3))) == []


def test_memory_analysis_is_logged_in_one_compact_line(run, caplog):
    memory = {"argument_size_in_bytes": 7_512_345, "output_size_in_bytes": 7_400_000, "alias_size_in_bytes": 0,
              "temp_size_in_bytes": 1_396_912_345, "generated_code_size_in_bytes": 0,
              "host_temp_size_in_bytes": 0, "peak_memory_in_bytes": 7_500_000}
    assert T.format_memory_analysis(memory) == \
        "arguments 7.5 MB, outputs 7.4 MB, temporaries 1,396.9 MB, peak 7.5 MB"
    assert T.format_memory_analysis({}) == "unavailable"
    # The line the trainer logs after compiling (a fresh trainer: the compiled
    # program comes from the session's compilation cache).
    cfg, _, result, _ = run
    trainer = T.Trainer(dataclasses.replace(cfg, checkpoint=C.CheckpointConfig()), devices=jax.devices()[:1])
    with caplog.at_level("INFO", logger="seqcache.training"):
        trainer.compile()
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled train step")]
    assert line == (f"compiled train step in {trainer.compile_time_s:.2f} s; memory: "
                    f"{T.format_memory_analysis(trainer.memory_analysis)}")
    assert "_in_bytes" not in line and "arguments " in line and line.endswith(" MB")
