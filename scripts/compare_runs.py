"""Compares an uninterrupted training run with a stopped-and-resumed one.

Usage: python scripts/compare_runs.py FULL_DIR FULL_SUMMARY.json RESUMED_DIR RESUMED_SUMMARY.json

Reads each run's metrics.jsonl (one JSON line per step) and the final summary that
``seqcache train`` printed (with ``params_sha256``), and prints whether the resumed
run saw the same data and reached the same parameters, bit for bit.
Exits 1 when they differ.
"""

import json
import sys


def losses(run_dir):
    out = {}
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            out[m["step"]] = m["loss"]
    return out


def main(full_dir, full_summary, resumed_dir, resumed_summary):
    a, b = losses(full_dir), losses(resumed_dir)
    sa = json.loads(open(full_summary).read().strip().splitlines()[-1])
    sb = json.loads(open(resumed_summary).read().strip().splitlines()[-1])
    steps = sorted(set(a) | set(b))
    differ = [s for s in steps if a.get(s) != b.get(s)]
    same_params = sa["params_sha256"] == sb["params_sha256"]
    print(f"steps compared: {len(steps)} (resumed run restarted at step {sb['start_step']})")
    print(f"per-step losses identical: {'yes' if not differ else 'NO, first differing step ' + str(differ[0])}")
    print(f"final parameters identical: {'yes' if same_params else 'NO'} (sha256 {sa['params_sha256'][:16]}…)")
    ok = not differ and same_params
    print("resumed run matches the uninterrupted run" if ok else "MISMATCH: the resumed run differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
