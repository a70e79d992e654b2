#!/usr/bin/env bash
# t5x's own train.py, from a source checkout, trains on the two caches of
# tests/trainers/make_caches.sh through seqcache.feeders.trainers.t5x, in a venv of its
# own ($SEQCACHE_TRAINER_WORK/venvs/t5x). Prints "t5x: N passed, N failed", or
# "t5x: skipped: why" when no t5x source is given.
#   T5X_SOURCE=/path/to/t5x bash tests/trainers/t5x/run.sh
# t5x and airio (which t5x imports) are not on PyPI, and jestimator's PyPI
# release is too old for today's JAX: all three come from source checkouts,
# AIRIO_SOURCE and JESTIMATOR_SOURCE defaulting to the folders airio and
# jestimator beside T5X_SOURCE. Their other dependencies are on PyPI
# (tests/trainers/t5x/requirements.txt).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../lib.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
export SEQCACHE_TRAINER_WORK=${SEQCACHE_TRAINER_WORK:-$ROOT/build/trainers}
if [ -z "${T5X_SOURCE:-}" ]; then
  echo "t5x: skipped: set T5X_SOURCE to a t5x source checkout"; exit 0
fi
AIRIO_SOURCE=${AIRIO_SOURCE:-$(dirname "$T5X_SOURCE")/airio}
JESTIMATOR_SOURCE=${JESTIMATOR_SOURCE:-$(dirname "$T5X_SOURCE")/jestimator}
for src in "$T5X_SOURCE/t5x/train.py" "$AIRIO_SOURCE/airio/core.py" "$JESTIMATOR_SOURCE/jestimator/amos.py"; do
  if [ ! -f "$src" ]; then
    echo "t5x: 0 passed, 1 failed ($src not found: T5X_SOURCE, AIRIO_SOURCE and JESTIMATOR_SOURCE must be source checkouts of t5x, airio and jestimator)"
    exit 1
  fi
done
if [ ! -f "$SEQCACHE_TRAINER_WORK/caches.txt" ]; then
  PATH="$ROOT/.venv/bin:$PATH" bash "$HERE/../make_caches.sh" "$SEQCACHE_TRAINER_WORK" > "$SEQCACHE_TRAINER_WORK/caches.txt" || exit 1
fi
VENV=$SEQCACHE_TRAINER_WORK/venvs/t5x
STAMP=$( (cat "$HERE/requirements.txt"; echo "$T5X_SOURCE $AIRIO_SOURCE $JESTIMATOR_SOURCE") | sha256sum | cut -c1-16)
if [ ! -f "$VENV/.installed-$STAMP" ]; then
  rm -rf "$VENV"
  PY=${PYTHON:-python3.11}
  "$PY" -m venv "$VENV" || { echo "t5x: 0 passed, 1 failed (cannot make a venv with $PY)"; exit 1; }
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt" || { echo "t5x: 0 passed, 1 failed (pip install)"; exit 1; }
  # airio's setup.py names git URLs for clu, seqio, jestimator: installed
  # above or here, so these go in without deps.
  "$VENV/bin/pip" install -q --no-deps "$AIRIO_SOURCE" "$JESTIMATOR_SOURCE" \
    || { echo "t5x: 0 passed, 1 failed (pip install airio, jestimator)"; exit 1; }
  # t5x is imported from its checkout: its packaging leaves out the folders
  # without __init__.py, t5x/examples/decoder_only among them.
  (cd "$T5X_SOURCE" && pwd) > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/t5x-source.pth"
  touch "$VENV/.installed-$STAMP"
fi
# seqcache from this checkout, every run (its feeders need numpy, array_record and msgspec only).
install_seqcache t5x "$VENV" "$ROOT"
cd "$ROOT"
# The log is a file of its own: tee to /dev/stderr would reopen (and truncate) a log that
# stderr is redirected to.
mkdir -p "$SEQCACHE_TRAINER_WORK/t5x"; LOG=$SEQCACHE_TRAINER_WORK/t5x/pytest.log
"$VENV/bin/python" -m pytest -q -s -p no:cacheprovider "$HERE" 2>&1 | tee "$LOG" >&2
out=$(tail -n 1 "$LOG")
closing_line t5x "$out"
