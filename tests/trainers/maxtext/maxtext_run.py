"""One process of a MaxText pre-training run (``maxtext.trainers.pre_train.train``,
MaxText's own entry point, unchanged) that also records what its train loop
consumed.

Each batch the train loop takes (``DataLoader.load_next_batch``, the call that
feeds the jitted train step) is written as one JSON line: the process, grain's
``global_next_index`` after the batch (the data iterator MaxText checkpoints),
the global rows of the batch this process holds and their ``inputs`` token ids.
Nothing else is changed: the batch is returned as MaxText made it.

Environment: SEQCACHE_MAXTEXT_RECORD (the JSON-lines file, appended to);
SEQCACHE_MAXTEXT_PROCESSES / _PROCESS_ID / _COORDINATOR for a multi-process run
on CPU (jax.distributed on loopback, before MaxText starts). Arguments: MaxText's
(a config file and key=value overrides).
"""

import json
import os
import sys


def _record_batches(path: str, process: int) -> None:
    import numpy as np
    from maxtext.common import data_loader

    load = data_loader.DataLoader.load_next_batch
    out = open(path, "a", encoding="utf-8")

    def load_next_batch(self, *args, **kwargs):
        batch = load(self, *args, **kwargs)
        state = self.data_iterator.local_iterator.get_state()
        for shard in sorted(batch["inputs"].addressable_shards, key=lambda s: s.index[0].start or 0):
            rows = shard.index[0]
            out.write(json.dumps({
                "process": process,
                "global_next_index": int(state["global_next_index"]),
                "first_row": int(rows.start or 0),
                "inputs": np.asarray(shard.data).tolist(),
            }) + "\n")
        out.flush()
        return batch

    data_loader.DataLoader.load_next_batch = load_next_batch


def main() -> None:
    processes = int(os.environ.get("SEQCACHE_MAXTEXT_PROCESSES", "1"))
    process = int(os.environ.get("SEQCACHE_MAXTEXT_PROCESS_ID", "0"))
    import jax

    if processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=os.environ["SEQCACHE_MAXTEXT_COORDINATOR"],
                                   num_processes=processes, process_id=process, initialization_timeout=120)
    _record_batches(os.environ["SEQCACHE_MAXTEXT_RECORD"], process)
    from absl import app
    from maxtext.trainers.pre_train import train

    app.run(train.main, argv=[sys.argv[0], *sys.argv[1:]])


if __name__ == "__main__":
    main()
