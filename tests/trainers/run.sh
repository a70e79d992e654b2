#!/usr/bin/env bash
# `make test-trainers`: the real trainers (t5x, levanter, torchtitan, MaxText),
# each in a venv of its own, read the two caches of make_caches.sh and check,
# step by step, that the rows they consumed are the Feeder's, before and after a
# resume on another process count. One folder per trainer, each with a run.sh
# that prints "<trainer>: N passed, N failed" or "<trainer>: skipped: why".
#   TRAINERS="levanter maxtext"  runs only those.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
export SEQCACHE_TRAINER_WORK=${SEQCACHE_TRAINER_WORK:-$ROOT/build/trainers}
mkdir -p "$SEQCACHE_TRAINER_WORK"
bash "$HERE/make_caches.sh" "$SEQCACHE_TRAINER_WORK" > "$SEQCACHE_TRAINER_WORK/caches.txt" || exit 1
failed=0
for t in ${TRAINERS:-t5x levanter torchtitan maxtext}; do
  if [ ! -f "$HERE/$t/run.sh" ]; then echo "$t: no tests/trainers/$t/run.sh"; failed=1; continue; fi
  echo "== $t"
  bash "$HERE/$t/run.sh" || failed=1
done
exit $failed
