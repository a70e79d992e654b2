"""Checkpoints: model/optimizer/step and feeder state together, retention,
atomicity, and the refusals (no feeder state, changed global batch size)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from seqcache.training import config as C
from seqcache.training import trainer as T
from seqcache.training.checkpoints import Checkpointer, CheckpointError
from seqcache_training_test_fakes import FakeFeeder, tiny_config_dict


def _state(value: float):
    return {"params": {"w": jnp.full((4, 2), value, jnp.float32)}, "step": jnp.int32(int(value))}


def _abstract():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), _state(0))


def _feeder_state(step, gbs=8):
    return {"global_batch_size": gbs, "step": step, "kind": "fake"}


def test_round_trip_and_retention(tmp_path):
    with Checkpointer(str(tmp_path), max_to_keep=2, async_save=True) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, state=_state(step), feeder_state=_feeder_state(step))
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
        restored = ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8)
    assert restored.step == 3
    assert restored.feeder_state == _feeder_state(3)
    np.testing.assert_array_equal(np.asarray(restored.state["params"]["w"]), np.full((4, 2), 3.0, np.float32))
    assert {"feeder", "state"} <= set(os.listdir(tmp_path / "3"))


def test_uncommitted_tmp_dir_is_not_the_latest(tmp_path):
    with Checkpointer(str(tmp_path), max_to_keep=5) as ckpt:
        ckpt.save(1, state=_state(1), feeder_state=_feeder_state(1))
        ckpt.save(2, state=_state(2), feeder_state=_feeder_state(2))
    # An interrupted save of step 3: Orbax writes into a temporary folder and
    # renames it only when complete. Even a fully written tmp folder must be ignored.
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1234567")
    (tmp_path / "4.orbax-checkpoint-tmp-7654321" / "state").mkdir(parents=True)  # a partial one
    with Checkpointer(str(tmp_path), max_to_keep=5) as ckpt:
        assert ckpt.latest_step() == 2
        assert ckpt.all_steps() == [1, 2]
        restored = ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8)
    assert restored.step == 2 and restored.feeder_state["step"] == 2


def test_checkpoint_without_feeder_state_is_refused(tmp_path):
    # A checkpoint written by some other tool: model state only.
    manager = ocp.CheckpointManager(str(tmp_path))
    manager.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(5))))
    manager.wait_until_finished()
    manager.close()
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError, match=r"/5: checkpoint has no feeder state \(item 'feeder'"):
            ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8)


def test_changed_global_batch_size_is_refused(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(1, state=_state(1), feeder_state=_feeder_state(1, gbs=8))
        ckpt.wait()
        with pytest.raises(CheckpointError, match=r"saved with global batch size 8, the current config has global_batch_size=16"):
            ckpt.restore(None, abstract_state=_abstract(), global_batch_size=16)


def test_save_refuses_feeder_state_without_global_batch_size(tmp_path):
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError, match="global_batch_size"):
            ckpt.save(1, state=_state(1), feeder_state={"step": 1})


def test_trainer_refuses_checkpoints_it_cannot_resume(tmp_path):
    """The trainer checks the checkpoint before compiling or training anything."""
    missing = tmp_path / "missing"
    manager = ocp.CheckpointManager(str(missing))
    manager.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(2))))
    manager.wait_until_finished()
    manager.close()
    cfg = C.config_from_dict(tiny_config_dict(checkpoint={"directory": str(missing)}))
    trainer = T.Trainer(cfg, devices=jax.devices()[:1])
    feeder = FakeFeeder(global_batch_size=16, sequence_length=16)
    with pytest.raises(CheckpointError, match="no feeder state"):
        trainer.fit(feeder)
    assert feeder.closed and feeder.batches_read == 0

    changed = tmp_path / "changed"
    with Checkpointer(str(changed)) as ckpt:
        ckpt.save(2, state=_state(2), feeder_state=_feeder_state(2, gbs=8))
    feeder = FakeFeeder(global_batch_size=16, sequence_length=16)
    cfg = C.config_from_dict(tiny_config_dict(checkpoint={"directory": str(changed)}))
    with pytest.raises(CheckpointError, match="global batch size 8, the current config has global_batch_size=16"):
        T.Trainer(cfg, devices=jax.devices()[:1]).fit(feeder)
    assert feeder.batches_read == 0


@pytest.mark.parametrize("damage, words", [
    (lambda text: text[:-1] + b', "global_batch_size": 16}', "the feeder state has the key 'global_batch_size' twice"),
    (lambda text: b"\xef\xbb\xbf" + text, None),  # a byte order mark at the first byte: read as the rest
    (lambda text: text[:-1] + b', "x": "\xff"}', "is not UTF-8 text"),
    (lambda text: text[:-1] + b', "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper than 64 levels"),
    (lambda text: text[:-1] + b', "x": ' + b"1" * 100_001 + b"}", "is out of range"),
    (lambda text: text[:-1], "is not valid JSON"),
])
def test_a_damaged_feeder_state_is_refused_naming_the_step_and_file(tmp_path, damage, words):
    """Was: Orbax's JsonRestore (Python's json) read <step>/feeder/metadata: a
    traceback of about 100 lines for a BOM, bad UTF-8, deep nesting or a long
    integer, and a key given twice read silently (the last one won)."""
    with Checkpointer(str(tmp_path)) as ckpt:
        ckpt.save(5, state=_state(5), feeder_state=_feeder_state(5))
        ckpt.wait()
    metadata = tmp_path / "5" / "feeder" / "metadata"
    text = metadata.read_bytes().rstrip()
    assert json.loads(text) == _feeder_state(5) and text.endswith(b"}")  # what the reader is given: Orbax's file as it wrote it
    metadata.write_bytes(damage(text))
    with Checkpointer(str(tmp_path)) as ckpt:
        if words is None:
            assert ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8).feeder_state == _feeder_state(5)
            return
        with pytest.raises(CheckpointError) as e:
            ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8)
    message = str(e.value)
    assert message.startswith(f"checkpoint step 5: {metadata}: ") and words in message, message
    assert "\n" not in message and len(message) < 400, message


def test_a_damaged_step_is_one_line_that_says_so(tmp_path):
    """A step folder whose array files are gone, or whose state holds no arrays:
    one CheckpointError naming the step and the damage, not Orbax's traceback
    or advice to change settings."""
    with Checkpointer(str(tmp_path), async_save=False) as ckpt:
        ckpt.save(1, state=_state(1), feeder_state=_feeder_state(1))
        ckpt.save(2, state=_state(2), feeder_state=_feeder_state(2))
        ckpt.wait()
    shutil.rmtree(tmp_path / "2" / "state" / "d")
    with Checkpointer(str(tmp_path)) as ckpt:
        with pytest.raises(CheckpointError) as e:
            ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8)
    message = str(e.value)
    assert message.startswith(f"{tmp_path / '2'}: cannot read its arrays") and "\n" not in message
    assert message.endswith("the step folder is damaged or partly deleted: move it away to resume from the step "
                            "before, or start a new run in another checkpoint directory")
    shutil.move(tmp_path / "2", tmp_path.parent / "moved-away")  # as the message says: step 1 restores
    with Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.restore(None, abstract_state=_abstract(), global_batch_size=8).step == 1
