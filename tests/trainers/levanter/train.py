"""Trains levanter's Llama (tiny, CPU) on a seqcache cache for a few steps and
records, per process, what levanter's training loop consumed.

The data configuration is the one docs/trainers/levanter.md gives: one
``DirectDatasetComponent`` over ``seqcache.feeders.trainers.levanter.cache_dataset``, with
``shuffle=False`` and ``mixture_block_size=1``, built by levanter's own
``LmDataConfig.train_set``. The loop is levanter's ``Trainer`` (as in
``levanter.main.train_lm``, and ``Trainer.train``'s own loop): ``initial_state`` restores the latest checkpoint
under --checkpoints when there is one, and the loader starts at the restored
step (``iter_from_step(state.step)``), with no data state.

Records (JSON lines in --out, one file per process):
  {"kind": "start", "step", "processes", "devices"}
  {"kind": "served", "index", "cache_index", "sha"}   every index the dataset served
  {"kind": "consumed", "step", "row", "sha"}          every row of this process's
                                                      part of each batch the trainer took
  {"kind": "loss", "step", "loss"}                    levanter's StepInfo of each step
sha: the first 16 hex digits of sha1 of the row's int32 tokens.

usage: train.py --cache DIR --steps N --checkpoints DIR --out FILE [--stop-after K]
                [--processes P --process-id I --port PORT] [--batch B] [--seed S]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading

import numpy as np


def sha(tokens) -> str:
    return hashlib.sha1(np.ascontiguousarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (with a checkpoint) after this many steps of a --steps run, as a preempted job")
    ap.add_argument("--checkpoints", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--sequence-length", type=int, default=64)
    args = ap.parse_args()

    import jax
    import haliax as hax
    import levanter
    from levanter.checkpoint import CheckpointerConfig
    from levanter.data import AsyncDataset
    from levanter.data.text import DirectDatasetComponent, LmDataConfig
    from levanter.distributed import DistributedConfig
    from levanter.main.train_lm import TrainLmConfig
    from levanter.models.llama import LlamaConfig
    from levanter.optim import AdamConfig
    from levanter.tracker import NoopConfig
    from levanter.trainer import Trainer, TrainerConfig

    from seqcache.feeders.trainers.levanter import cache_dataset

    out = open(args.out, "a")
    lock = threading.Lock()

    def record(**kw) -> None:
        with lock:
            out.write(json.dumps(kw) + "\n")
            out.flush()

    class Logged(AsyncDataset):
        """The dataset levanter reads, logging each index it serves."""

        def __init__(self, inner):
            self.inner = inner

        def is_finite(self):
            return self.inner.is_finite()

        async def async_len(self):
            return await self.inner.async_len()

        async def get_batch(self, indices):
            indices = list(indices)
            examples = await self.inner.get_batch(indices)
            rows = self.inner.rows(indices)
            for i, ci, ex in zip(indices, rows["cache_index"].tolist(), examples):
                record(kind="served", index=int(i), cache_index=int(ci), sha=sha(ex.tokens))
            return examples

    # --- the configuration docs/trainers/levanter.md gives ------------------------
    train = cache_dataset(cache=args.cache, global_batch_size=args.batch, sequence_length=args.sequence_length,
                          seed=args.seed)
    data = LmDataConfig(
        tokenizer="passthrough", vocab_size=args.vocab_size,
        components={"seqcache": DirectDatasetComponent(datasets={"train": Logged(train)})},
        shuffle=False, mixture_block_size=1,
    )
    distributed = (DistributedConfig(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                                     process_id=args.process_id)
                   if args.processes > 1 else DistributedConfig(initialize_jax_distributed=False))
    config = TrainLmConfig(
        data=data,
        model=LlamaConfig(max_seq_len=args.sequence_length, hidden_dim=32, intermediate_dim=64, num_layers=2,
                          num_heads=2, num_kv_heads=2),
        optimizer=AdamConfig(learning_rate=1e-2, warmup=0.0, weight_decay=0.0),
        trainer=TrainerConfig(
            seed=0, id="seqcache-levanter", log_dir=os.path.dirname(os.path.abspath(args.out)),
            tracker=NoopConfig(), require_accelerator=False, log_jaxprs=False, log_xla_hlo=False,
            train_batch_size=args.batch, num_train_steps=args.steps, steps_per_eval=10**9,
            checkpointer=CheckpointerConfig(base_path=args.checkpoints, append_run_id_to_base_path=False,
                                            save_interval=None, keep=None),
            distributed=distributed,
        ),
    )
    # levanter.initialize(config) would also log the config, which draccus cannot
    # encode with a dataset object in it (it logs that error and goes on).
    config.trainer.initialize()

    def loss_function(model, example, *, key=None):
        return model.compute_next_token_loss(example, key=key)

    with Trainer(config.trainer, config.optimizer.build(config.trainer.num_train_steps), loss_function) as trainer:
        data_key, _, model_key, training_key = jax.random.split(jax.random.PRNGKey(config.trainer.seed), 4)
        Pos = config.model.max_Pos.resize(args.sequence_length)
        Vocab = hax.Axis("vocab", args.vocab_size)
        train_set = config.data.train_set(Pos, config.trainer.batch_schedule, key=data_key)
        state = trainer.initial_state(training_key, model_init=lambda: config.model.build(Vocab, key=model_key))
        start = int(state.step)
        record(kind="start", step=start, processes=jax.process_count(), devices=jax.device_count())
        loader = trainer.data_loader(train_set).iter_from_step(start)

        def consumed():
            step = start
            for batch in loader:
                tokens = batch.tokens.array  # (B, L), global, sharded over the processes' devices
                seen = set()
                for shard in tokens.addressable_shards:
                    first, stop, _ = shard.index[0].indices(args.batch)
                    for r, row in zip(range(first, stop), np.asarray(shard.data)):
                        if r not in seen:
                            seen.add(r)
                            record(kind="consumed", step=step, row=r, sha=sha(row))
                step += 1
                yield batch

        # Trainer.train's own loop, with each step's loss recorded (levanter's
        # hooks skip steps 0 and 1).
        info = None
        for info in trainer.training_steps(state, consumed()):
            record(kind="loss", step=info.step, loss=float(info.loss))
            if args.stop_after is not None and info.next_step >= args.stop_after:
                break
        if info is not None:
            trainer.run_hooks(info, force=True)  # the final checkpoint (levanter's own, as at the end of a run)
    train.close()
    out.close()


if __name__ == "__main__":
    main()
