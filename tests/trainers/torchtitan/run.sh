#!/usr/bin/env bash
# torchtitan's own train.py trains llama3's debug model on the packed LM cache of
# tests/trainers/make_caches.sh through seqcache.feeders.trainers.torch.TorchtitanDataLoader
# (--module seqcache_torchtitan --config llama3_seqcache), on CPU, in a venv of its
# own ($SEQCACHE_TRAINER_WORK/venvs/torchtitan), and resumes from its DCP
# checkpoint. Prints "torchtitan: N passed, N failed".
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../lib.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
export SEQCACHE_TRAINER_WORK=${SEQCACHE_TRAINER_WORK:-$ROOT/build/trainers}
fail() { echo "torchtitan: 0 passed, 1 failed ($1)"; exit 1; }
if [ ! -f "$SEQCACHE_TRAINER_WORK/caches.txt" ]; then
  PATH="$ROOT/.venv/bin:$PATH" bash "$HERE/../make_caches.sh" "$SEQCACHE_TRAINER_WORK" \
    > "$SEQCACHE_TRAINER_WORK/caches.txt" || fail "make_caches.sh"
fi
VENV=$SEQCACHE_TRAINER_WORK/venvs/torchtitan
STAMP=$(sha256sum < "$HERE/requirements.txt" | cut -c1-16)
if [ ! -f "$VENV/.installed-$STAMP" ]; then
  rm -rf "$VENV"
  PY=${PYTHON:-python3.11}
  "$PY" -m venv "$VENV" || fail "cannot make a venv with $PY"
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt" || fail "pip install -r requirements.txt"
  touch "$VENV/.installed-$STAMP"
fi
# seqcache from this checkout, every run.
install_seqcache torchtitan "$VENV" "$ROOT"
cd "$ROOT"
# The log is a file of its own: tee to /dev/stderr would reopen (and truncate) a log that
# stderr is redirected to.
mkdir -p "$SEQCACHE_TRAINER_WORK/torchtitan"; LOG=$SEQCACHE_TRAINER_WORK/torchtitan/pytest.log
# With the torch feeder's own tests (tests/feeders/test_torch.py), which the default suite's venv,
# without PyTorch, skips.
"$VENV/bin/python" -m pytest -q -s -p no:cacheprovider "$HERE" "$ROOT/tests/feeders/test_torch.py" 2>&1 | tee "$LOG" >&2
out=$(tail -n 1 "$LOG")
closing_line torchtitan "$out"
