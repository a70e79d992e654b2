"""Preemption, and bit-exact resume in a fresh process.

Scenario: an uninterrupted run of 2N steps in this process; a second run of the
same config, in this process too, that receives SIGTERM during step N-1 (it must
save a final checkpoint at step N and return, stopped by the signal); a fresh
child process that restores that checkpoint and trains to 2N. The per-step
losses and the final parameter bytes must equal the uninterrupted run's. Dropout
is on and gradients are accumulated over 2 microbatches, so the per-step RNG
(fold_in(seed, step)) and the accumulation are covered too.

The child shares this session's compilation cache (conftest.py): it loads the
executables this process compiled for the same programs instead of compiling
them again; all state comes from the checkpoint on disk.

Both models run the scenario: the decoder-only Transformer and the T5
encoder-decoder (fed packed (inputs, targets) rows, t5x's field names).

The preempted run sends SIGTERM to its own process from the callback of step
N-1, so the signal arrives at an exact step and nothing depends on timing.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from seqcache.training import config as C
from seqcache.training import trainer as T
from seqcache.training.checkpoints import Checkpointer
from seqcache.training.metrics import read_metrics
from seqcache_training_test_fakes import FEEDER_KWARGS, FakeEncDecFeeder, FakeFeeder, t5_config_dict, tiny_config_dict

HERE = pathlib.Path(__file__).resolve().parent
N = 3


# model -> (config dict maker, feeder class)
MODELS = {"decoder": (tiny_config_dict, FakeFeeder), "t5": (t5_config_dict, FakeEncDecFeeder)}


def _config(directory, every_steps=100, model="decoder"):
    return MODELS[model][0](steps=2 * N, checkpoint={"directory": str(directory), "every_steps": every_steps})


def _flat(params):
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def _preempted_here(tmp_path, *, model):
    """The run of ``_child(..., sigterm_at_step=N - 1)`` in this process: SIGTERM
    arrives while step N-1's record is handled. Returns (records, arrays) as
    ``_child`` does."""
    trainer = T.Trainer(C.config_from_dict(_config(tmp_path / "resumed", model=model)), devices=jax.devices()[:1])
    records = []

    def on_step(record):
        records.append(json.loads(json.dumps(record)))
        if record["step"] == N - 1:
            os.kill(os.getpid(), signal.SIGTERM)

    result = trainer.fit(MODELS[model][1](**FEEDER_KWARGS), on_step=on_step)
    records.append({"done": True, "end_step": result.end_step, "stopped_by_signal": result.stopped_by_signal})
    arrays = {f"param:{k}": v for k, v in _flat(result.params).items()}
    arrays["losses"] = np.asarray(result.losses, dtype=np.float32)
    return records, arrays


def _child(tmp_path, name, compilation_cache_env, *, model):
    """Trains the config in a fresh process (resuming from the checkpoint in
    ``tmp_path / "resumed"``); returns (records, arrays)."""
    spec = {
        "config": _config(tmp_path / "resumed", model=model),
        "feeder": FEEDER_KWARGS,
        "feeder_class": MODELS[model][1].__name__,
        "out": str(tmp_path / f"{name}.npz"),
    }
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    with open(tmp_path / f"{name}.stderr", "w") as stderr:
        proc = subprocess.run(
            [sys.executable, str(HERE / "child_train.py"), str(spec_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=300,
            env={**os.environ, **compilation_cache_env},
        )
    assert proc.returncode == 0, (tmp_path / f"{name}.stderr").read_text()[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    return records, np.load(tmp_path / f"{name}.npz")


# The encoder-decoder preemption runs with the slow tests; test_t5_cli resumes a
# real T5 run in the default suite.
@pytest.fixture(scope="module", params=["decoder", pytest.param("t5", marks=pytest.mark.slow)])
def runs(request, tmp_path_factory, compilation_cache_env):
    model = request.param
    tmp_path = tmp_path_factory.mktemp(f"resume-{model}")
    # The uninterrupted run also saves at step N (asynchronously, while the next
    # steps reuse the donated buffers); that checkpoint must equal the preempted one.
    cfg = C.config_from_dict(_config(tmp_path / "straight", every_steps=N, model=model))
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    straight = trainer.fit(MODELS[model][1](**FEEDER_KWARGS))
    init = _flat(trainer.init_state()[0])
    preempted = _preempted_here(tmp_path, model=model)
    resumed = _child(tmp_path, "resumed", compilation_cache_env, model=model)
    return tmp_path, straight, init, preempted, resumed, model


def test_sigterm_saves_a_final_checkpoint_and_exits_cleanly(runs):
    tmp_path, _, _, (records, out), _, model = runs
    steps = [r["step"] for r in records if "step" in r]
    assert steps == list(range(N))  # stopped right after the step that saw SIGTERM
    assert records[-1] == {"done": True, "end_step": N, "stopped_by_signal": True}
    metrics = read_metrics(str(tmp_path / "resumed" / "metrics.jsonl"))
    assert [m["step"] for m in metrics[:N]] == list(range(N))
    # The checkpoint written on SIGTERM: step N with the feeder positioned at batch N.
    ckpt_dir = tmp_path / "resumed"
    trainer = T.Trainer(C.config_from_dict(_config(ckpt_dir, model=model)), devices=jax.devices()[:1])
    with Checkpointer(str(ckpt_dir)) as ckpt:
        assert N in ckpt.all_steps()
        restored = ckpt.restore(N, abstract_state=trainer.abstract_state(), global_batch_size=16)
    assert restored.feeder_state["step"] == N
    assert int(restored.state["step"]) == N
    for name, value in _flat(restored.state["params"]).items():
        assert value.tobytes() == out[f"param:{name}"].tobytes(), name
    with Checkpointer(str(tmp_path / "straight")) as ckpt:
        assert ckpt.all_steps() == [N, 2 * N]
        straight_n = ckpt.restore(N, abstract_state=trainer.abstract_state(), global_batch_size=16)
    assert straight_n.feeder_state == restored.feeder_state
    for a, b in zip(jax.tree.leaves(straight_n.state), jax.tree.leaves(restored.state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_resume_in_fresh_process_is_bit_exact(runs):
    _, straight, init, (_, preempted), (records, resumed), _ = runs
    assert straight.end_step == 2 * N
    assert int(resumed["start_step"]) == N and int(resumed["end_step"]) == 2 * N
    # Per-step losses: identical floats.
    assert preempted["losses"].tolist() == np.asarray(straight.losses[:N], np.float32).tolist()
    assert resumed["losses"].tolist() == np.asarray(straight.losses[N:], np.float32).tolist()
    assert [r["step"] for r in records if "step" in r] == list(range(N, 2 * N))
    # Parameters: identical bytes.
    expected = _flat(straight.params)
    got = {k[len("param:"):]: resumed[k] for k in resumed.files if k.startswith("param:")}
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].tobytes() == value.tobytes(), name
    # Training really changed them (not a comparison between two initialisations).
    assert any(init[k].tobytes() != v.tobytes() for k, v in expected.items())
