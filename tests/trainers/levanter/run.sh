#!/usr/bin/env bash
# levanter trains on the packed LM cache of tests/trainers/make_caches.sh through
# seqcache.feeders.trainers.levanter, in a venv of its own ($SEQCACHE_TRAINER_WORK/venvs/levanter:
# marin-levanter from PyPI, whose pins do not fit the main venv, and seqcache from
# this checkout without its dependencies). Runs there the levanter protocol tests
# of tests/feeders/test_levanter.py (skipped in the main venv) and the training
# runs of this folder. Prints "levanter: N passed, N failed".
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../lib.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
export SEQCACHE_TRAINER_WORK=${SEQCACHE_TRAINER_WORK:-$ROOT/build/trainers}
if [ ! -f "$SEQCACHE_TRAINER_WORK/caches.txt" ]; then
  PATH="$ROOT/.venv/bin:$PATH" bash "$HERE/../make_caches.sh" "$SEQCACHE_TRAINER_WORK" > "$SEQCACHE_TRAINER_WORK/caches.txt" || exit 1
fi
VENV=$SEQCACHE_TRAINER_WORK/venvs/levanter
# JAX as the main venv pins it, so both venvs run the same JAX.
PINS=$(grep -E '^(jax|jaxlib)==' "$ROOT/constraints.txt")
STAMP=$( (cat "$HERE/requirements.txt"; echo "$PINS") | sha256sum | cut -c1-16)
if [ ! -f "$VENV/.installed-$STAMP" ]; then
  rm -rf "$VENV"
  PY=${PYTHON:-python3.11}
  "$PY" -m venv "$VENV" || { echo "levanter: 0 passed, 1 failed (cannot make a venv with $PY)"; exit 1; }
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt" -c <(echo "$PINS") \
    || { echo "levanter: 0 passed, 1 failed (pip install)"; exit 1; }
  touch "$VENV/.installed-$STAMP"
fi
# seqcache from this checkout, every run.
install_seqcache levanter "$VENV" "$ROOT"
cd "$ROOT"
# The log is a file of its own: tee to /dev/stderr would reopen (and truncate) a log that
# stderr is redirected to.
mkdir -p "$SEQCACHE_TRAINER_WORK/levanter"; LOG=$SEQCACHE_TRAINER_WORK/levanter/pytest.log
"$VENV/bin/python" -m pytest -q -s -p no:cacheprovider tests/feeders/test_levanter.py "$HERE" 2>&1 | tee "$LOG" >&2
out=$(tail -n 1 "$LOG")
closing_line levanter "$out" skipped-fails  # nothing may be skipped here
