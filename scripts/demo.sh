#!/usr/bin/env bash
# The main job on real input, on a fresh machine with nothing downloaded beyond
# packages: a code corpus made of the Python standard library of the running
# interpreter (about 1,800 files, 34 MB; site-packages excluded).
#   1. train a SentencePiece vocabulary on a deterministic sample of its lines,
#   2. build the deterministic, globally shuffled, packed cache,
#   3. print `info`, verify every shard, and show two examples with provenance,
#   4. train a tiny model (straight, and preempted then resumed),
#   5. write the cache's report (report.html) and name the TensorBoard folders.
set -euo pipefail
DEMO=${DEMO:-build/demo}
STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
CACHES="$DEMO/caches"
CACHE="$CACHES/stdlib_code/train"
mkdir -p "$DEMO"

echo "== corpus: $STDLIB/**/*.py (without site-packages)"
if [ ! -f "$DEMO/stdlib-8k.model" ]; then
  seqcache vocab train --source "text:$STDLIB/**/*.py" --exclude "*/site-packages/*" --on-error skip \
    --normalization identity --vocab-size 8000 --max-records 200000 --output "$DEMO/stdlib-8k.model"
fi

echo "== build: SentencePiece tokens, packed to 1024, seed 0"
seqcache build --source "files:$STDLIB/**/*.py" --exclude "*/site-packages/*" --on-error skip \
  --vocabulary "$DEMO/stdlib-8k.model" --name stdlib_code \
  --sequence-length 1024 --pack --seed 0 --num-shards 8 --cache-dir "$CACHES"

seqcache info "$CACHE"
seqcache verify "$CACHE"
seqcache show "$CACHE" --index 0 --index 1 --max-chars 400

echo "== train: the tiny model, 30 steps in one go"
TRAIN=(seqcache train --cache-dir "$CACHES" --task stdlib_code --model tiny --batch-size 4
       --sequence-length 1024 --steps 30 --set 'checkpoint.every_steps=10 optimizer.warmup_steps=5')
rm -rf "$DEMO/run-full" "$DEMO/run-resumed"
"${TRAIN[@]}" --checkpoint-dir "$DEMO/run-full" | tee "$DEMO/full.json"

echo "== train: the same run stopped at step 15; a new process resumes it from the checkpoint"
"${TRAIN[@]}" --checkpoint-dir "$DEMO/run-resumed" --stop-at-step 15 > /dev/null
"${TRAIN[@]}" --checkpoint-dir "$DEMO/run-resumed" | tee "$DEMO/resumed.json"
python scripts/compare_runs.py "$DEMO/run-full" "$DEMO/full.json" "$DEMO/run-resumed" "$DEMO/resumed.json"

echo "== report: the cache in pictures, and the training curves"
seqcache report "$CACHE" --output "$DEMO/report.html"
echo "cache report:      $DEMO/report.html (one self-contained file: open it in any browser)"
echo "TensorBoard:       $DEMO/run-full/tensorboard (tensorboard --logdir $DEMO/run-full/tensorboard)"
echo "                   $DEMO/run-resumed/tensorboard (the preempted and resumed run)"
