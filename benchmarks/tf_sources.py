"""Reading tf.train.Example records: seqcache's TensorFlow-free reader against
TensorFlow's own, in one run.

On one TFRecord file of ``--records`` Examples (a text feature from
tinyshakespeare lines and an int64 feature), written here, it measures:

  source: ``TFRecordSource(...).read_all()`` (framing with CRC checks, Example
          parsing with protobuf, UTF-8 decoding, the policy's content checks,
          canonical JSON of the value): the records a build's work unit yields;
  framing: ``iter_tfrecords`` alone (framing and CRC checks);
  tf:     ``tf.data.TFRecordDataset`` iterated eagerly, each record parsed with
          ``tf.train.Example.FromString`` and its text feature decoded (what a
          reader built on TensorFlow does for the same values);
  tf_batched: ``tf.data.TFRecordDataset(...).batch(1024)`` parsed with
          ``tf.io.parse_example`` in TensorFlow's graph, each text decoded in Python
          (TensorFlow's fast path);
  tf_raw: ``tf.data.TFRecordDataset`` alone (framing in C++), iterated eagerly.

Rounds alternate the readers; medians of records/s are printed, and the ratios
source/tf, source/tf_batched and framing/tf_raw. The machine is shared: compare the ratios.

Usage: python benchmarks/tf_sources.py [--records 100000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare" / "input.txt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    import tensorflow as tf

    from seqcache.tasks.sources import TFRecordSource
    from seqcache.tasks.sources.tfrecord import encode_example, iter_tfrecords, write_tfrecords

    lines = [line for line in DATA.read_text(encoding="utf-8").split("\n") if line]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.tfrecord")
        write_tfrecords(path, [encode_example({"text": lines[k % len(lines)], "ids": [k, k + 1, k + 2]})
                               for k in range(args.records)])
        print(f"{args.records:,} Examples, {os.path.getsize(path):,} bytes in {path}")

        def source():
            return sum(1 for _ in TFRecordSource(path, feature="text").read_all())

        def framing():
            return sum(1 for _ in iter_tfrecords(path))

        def tf_parse():
            n = 0
            for r in tf.data.TFRecordDataset(path).as_numpy_iterator():
                tf.train.Example.FromString(r).features.feature["text"].bytes_list.value[0].decode("utf-8")
                n += 1
            return n

        def tf_batched():
            spec = {"text": tf.io.FixedLenFeature([], tf.string)}
            ds = tf.data.TFRecordDataset(path).batch(1024).map(lambda b: tf.io.parse_example(b, spec))
            n = 0
            for batch in ds.as_numpy_iterator():
                for text in batch["text"]:
                    text.decode("utf-8")
                    n += 1
            return n

        def tf_raw():
            return sum(1 for _ in tf.data.TFRecordDataset(path).as_numpy_iterator())

        readers = {"source": source, "framing": framing, "tf": tf_parse, "tf_batched": tf_batched, "tf_raw": tf_raw}
        rates: dict[str, list[float]] = {k: [] for k in readers}
        for r in range(args.rounds):
            order = list(readers) if r % 2 == 0 else list(reversed(readers))
            for name in order:
                t = time.perf_counter()
                n = readers[name]()
                assert n == args.records, (name, n)
                rates[name].append(n / (time.perf_counter() - t))
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k, v in med.items():
        print(f"{k:8s} {v:12,.0f} records/s")
    out = {"records_per_s": med, "source/tf": med["source"] / med["tf"],
           "source/tf_batched": med["source"] / med["tf_batched"], "framing/tf_raw": med["framing"] / med["tf_raw"]}
    print("   ".join(f"{k} {out[k]:.2f}" for k in ("source/tf", "source/tf_batched", "framing/tf_raw")))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
