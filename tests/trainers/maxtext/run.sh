#!/usr/bin/env bash
# MaxText 0.2.5 (Python 3.12, jax 0.12, grain 0.2.18) trains a tiny decoder on CPU
# from `seqcache export --format maxtext` of the packed LM cache of
# tests/trainers/make_caches.sh, in a venv of its own ($SEQCACHE_TRAINER_WORK/venvs/maxtext),
# stops, and resumes on 2 processes from its own checkpoint (with the workaround
# for its per-process grain state file). Prints "maxtext: N passed, N failed".
#   SEQCACHE_PYTHON312: the Python 3.12 interpreter (default: python3.12 on PATH,
#   else pyenv's 3.12.1).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/../lib.sh"
ROOT=$(cd "$HERE/../../.." && pwd)
export SEQCACHE_TRAINER_WORK=${SEQCACHE_TRAINER_WORK:-$ROOT/build/trainers}
fail() { echo "maxtext: 0 passed, 1 failed ($1)"; exit 1; }
SEQCACHE=${SEQCACHE:-$ROOT/.venv/bin/seqcache}
if [ ! -f "$SEQCACHE_TRAINER_WORK/caches.txt" ]; then
  PATH="$ROOT/.venv/bin:$PATH" bash "$HERE/../make_caches.sh" "$SEQCACHE_TRAINER_WORK" \
    > "$SEQCACHE_TRAINER_WORK/caches.txt" || fail "make_caches.sh"
fi
PY312=
for py in ${SEQCACHE_PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
  if "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$py; break; fi
done
[ -n "$PY312" ] || fail "MaxText needs Python 3.12: none found; set SEQCACHE_PYTHON312"
VENV=$SEQCACHE_TRAINER_WORK/venvs/maxtext
STAMP=$(sha256sum < "$HERE/requirements.txt" | cut -c1-16)
if [ ! -f "$VENV/.installed-$STAMP" ]; then
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV" || fail "cannot make a venv with $PY312"
  "$VENV/bin/pip" install -q -r "$HERE/requirements.txt" || fail "pip install -r requirements.txt"
  touch "$VENV/.installed-$STAMP"
fi
# seqcache from this checkout, every run (the tests use its Feeder; no other dependency is needed).
mkdir -p "$SEQCACHE_TRAINER_WORK/maxtext"
install_seqcache maxtext "$VENV" "$ROOT"
# The export, with the project's own seqcache, as docs/trainers/maxtext.md gives it.
CACHE=$(head -n 1 "$SEQCACHE_TRAINER_WORK/caches.txt")
"$SEQCACHE" export --format maxtext "$CACHE" --output "$SEQCACHE_TRAINER_WORK/maxtext/export" \
  --batch-size 4 --sequence-length 64 --seed 0 --steps 8 --host-count 2 --overwrite || fail "seqcache export"
cd "$ROOT"
LOG=$SEQCACHE_TRAINER_WORK/maxtext/pytest.log
"$VENV/bin/python" -m pytest -q -s -p no:cacheprovider "$HERE" 2>&1 | tee "$LOG" >&2
out=$(tail -n 1 "$LOG")
closing_line maxtext "$out"
