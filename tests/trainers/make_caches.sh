#!/usr/bin/env bash
# The two caches every real-trainer test reads, built with the project's own
# `seqcache` (the main .venv): a packed SentencePiece LM cache (tinyshakespeare)
# and a span-corruption cache (the C4 validation sample). Built once; a second
# run reuses them (same fingerprint). Prints the cache folders.
#   usage: tests/trainers/make_caches.sh OUT_DIR
set -euo pipefail
OUT=${1:?usage: make_caches.sh OUT_DIR}
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${SEQCACHE_DATA:-$HERE/../../../shared/data}
mkdir -p "$OUT"
if [ ! -f "$OUT/spm-1k.model" ]; then
  seqcache vocab train --source "text:$DATA/tinyshakespeare/input.txt" --vocab-size 1000 \
    --output "$OUT/spm-1k.model" >&2
fi
seqcache build --source "text:$DATA/tinyshakespeare/input.txt" --vocabulary "$OUT/spm-1k.model" \
  --name shakespeare_lm --sequence-length 64 --pack --seed 0 --num-shards 4 --cache-dir "$OUT/caches" --overwrite >&2
seqcache build --source "parquet:$DATA/c4/c4_validation_2k.parquet#text" --objective span_corruption \
  --vocabulary "$OUT/spm-1k.model" --extra-ids 100 --sequence-length inputs=64,targets=16 --pack first_fit \
  --name c4_span --seed 0 --num-shards 4 --cache-dir "$OUT/caches" --overwrite >&2
echo "$OUT/caches/shakespeare_lm/train"
echo "$OUT/caches/c4_span/train"
