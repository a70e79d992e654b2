"""``seqcache train`` in a test process that records what it read.

Usage: python child_multihost.py train [seqcache train arguments]

Runs the real command line (``seqcache.cli.main.main``), with the multi-process
settings from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID) and the real feeder, which is only observed:

- ``ROWS_DIR``: every batch this process's feeders return is appended to
  ``ROWS_DIR/<train|eval>-<process>.jsonl`` as one JSON line: the step, this
  host's first row, and per row the cache index, the epoch and the row's loss
  weight sum (0 on padding rows).
- ``PAUSE_AT=N``: before handing the training batch of step N to the trainer
  (it is fetched while step N - 1 runs), the process prints ``PAUSED N`` to
  stdout and reads one byte from stdin. A test delivers SIGTERM while every
  process waits there, then writes the byte, so that the stop does not depend on
  timing: the hosts agree to stop after step N - 1 and save checkpoint N.

A test that runs the command in its own process records the same way with
``recording_next`` (this file imported as a module).
"""

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from seqcache.cli.main import main
from seqcache.feeders import Feeder

_original_next = Feeder.__next__


def recording_next(rows_dir, process, pause_at=None):
    """``Feeder.__next__`` that records every batch in ``rows_dir`` and pauses
    before the training batch of step ``pause_at`` (see the module docstring)."""

    def _recording_next(self):
        step = self.step
        kind = "train" if self.num_epochs is None else "eval"
        if kind == "train" and step == pause_at:
            print(f"PAUSED {step}", flush=True)
            os.read(0, 1)
        batch = _original_next(self)
        if rows_dir:
            record = {
                "step": step,
                "host": self.host_index,
                "hosts": self.host_count,
                "first_row": self.first_row,
                "cache_index": batch["cache_index"].tolist(),
                "epoch": batch["epoch"].tolist(),
                "weight": batch["targets_loss_weights"].sum(axis=1).tolist(),
            }
            with open(os.path.join(rows_dir, f"{kind}-{process}.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        return batch

    return _recording_next


if __name__ == "__main__":
    Feeder.__next__ = recording_next(os.environ.get("ROWS_DIR"), os.environ.get("JAX_PROCESS_ID", "0"),
                                     int(os.environ["PAUSE_AT"]) if os.environ.get("PAUSE_AT") else None)
    main(args=sys.argv[1:], prog_name="seqcache")
