"""Runs one training job in a fresh process, for resume tests.

Usage: python child_train.py SPEC.json

SPEC holds ``config`` (a TrainConfig dict), ``feeder`` (FakeFeeder keyword
arguments), optional ``feeder_class`` (a class of fakes.py, default
"FakeFeeder"), optional ``stop_at``, ``devices`` (how many devices to use), ``out``
(an .npz path for the final parameters and the per-step losses). Every step's
metrics record is printed to stdout as one JSON line.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np

from seqcache.training import config as config_lib
from seqcache.training import trainer as trainer_lib

HERE = pathlib.Path(__file__).resolve().parent


def _fakes():
    spec = importlib.util.spec_from_file_location("seqcache_training_test_fakes", HERE / "fakes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat_params(params) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def main(spec_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    config = config_lib.config_from_dict(spec["config"])
    feeder = getattr(_fakes(), spec.get("feeder_class", "FakeFeeder"))(**spec["feeder"])
    devices = jax.devices()[: spec.get("devices", 1)]

    def on_step(record):
        print(json.dumps(record), flush=True)

    result = trainer_lib.Trainer(config, devices=devices).fit(feeder, stop_at=spec.get("stop_at"), on_step=on_step)
    if spec.get("out"):
        arrays = {f"param:{k}": v for k, v in flat_params(result.params).items()}
        arrays["losses"] = np.asarray(result.losses, dtype=np.float32)
        arrays["start_step"] = np.int64(result.start_step)
        arrays["end_step"] = np.int64(result.end_step)
        np.savez(spec["out"], **arrays)
    print(json.dumps({"done": True, "end_step": result.end_step, "stopped_by_signal": result.stopped_by_signal}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
