#!/usr/bin/env bash
# Prepares build/tpu/ for a lent TPU machine (Python 3.11, JAX, a local package
# index without array_record, grain or Apache Beam, no registry): the seqcache
# wheel of this tree (what the machine imports: run this again after changing
# the trainer), array_record's and msgspec's, the setup script that installs them with the
# training dependencies, and the cache benchmarks/accelerator.py reads.
#
# The cache: WikiText-2 (valid and test; its train split is not among the
# shared corpora), the C4 validation sample, tinyshakespeare, Botchan, the NTREX
# English source, the Multi30k English captions and the two dolma Common Crawl
# samples, about 12 MB of text written as one JSON line per document to
# build/tpu-work/corpus (outside build/tpu, which travels); a 16,000-piece
# SentencePiece vocabulary trained on it with `seqcache vocab train`; `seqcache
# build` packed to 1,024 tokens (language-model packing), split train: about
# 2,400 rows, 12 MB; and T5's span corruption of the same text (inputs 512,
# targets 114, first-fit packing; and again with targets padded to 128) for the
# encoder-decoder presets. An existing
# corpus, vocabulary and caches are reused.
#
# Usage: bash scripts/tpu_bundle.sh        (from anywhere; here, not on the TPU)
# On the TPU machine, from the repository root with build/tpu carried along:
#   bash build/tpu/tpu-setup.sh && export PYTHONPATH=$PYTHONPATH:/tmp/site2:/tmp/site
#   python3 benchmarks/accelerator.py --cache build/tpu/caches/wiki_c4_lm/train
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-../shared/data}
SETUP=${SETUP:-../shared/tools/tpu-setup.sh}
OUT=build/tpu
WORK=build/tpu-work
NAME=wiki_c4_lm
PY=.venv/bin/python
SEQCACHE=.venv/bin/seqcache
[ -x "$SEQCACHE" ] || { echo "no $SEQCACHE: run 'make install' first" >&2; exit 1; }
[ -d "$DATA" ] || { echo "corpora not found: $DATA (set DATA=...)" >&2; exit 1; }
[ -f "$SETUP" ] || { echo "setup script not found: $SETUP (set SETUP=...)" >&2; exit 1; }

echo "== wheels: seqcache (this tree), array_record 0.8.6 and msgspec 0.23.0 for CPython 3.11, manylinux x86_64"
mkdir -p "$OUT/wheels"
rm -f "$OUT"/wheels/seqcache-*.whl
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$OUT/wheels" .
# What the wheel build leaves in the tree (as `make install` does).
rm -rf build/lib build/bdist.* ./*.egg-info
.venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux2014_x86_64 -d "$OUT/wheels" array_record==0.8.6 msgspec==0.23.0
cp -f "$SETUP" "$OUT/"  # -f: the copy is read-only, as the original

CACHE="$OUT/caches/$NAME/train"
if [ -f "$CACHE/manifest.json" ]; then
  echo "== cache: $CACHE exists, reused"
else
  echo "== corpus: one JSON line per document in $WORK/corpus"
  mkdir -p "$WORK/corpus" "$OUT/vocab"
  if [ ! -f "$WORK/corpus/.complete" ]; then
    "$PY" - "$DATA" "$WORK/corpus" <<'EOF'
import gzip, json, pathlib, re, sys

import pyarrow.parquet as pq

data, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])


def write(name, docs):
    docs = [d.strip("\n") for d in docs if d.strip()]
    with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    print(f"{name}: {len(docs):,} documents, {sum(len(d.encode()) for d in docs) / 1e6:.2f} MB")


def wiki_articles(path):
    """WikiText lines into articles: a top-level heading " = Title = " starts one."""
    articles, current = [], []
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.fullmatch(r" = [^=].* = ", line) and current:
            articles.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    articles.append("\n".join(current))
    return articles


wiki = data / "wikitext2"
write("wikitext2", wiki_articles(wiki / "wiki.valid.tokens") + wiki_articles(wiki / "wiki.test.tokens"))
write("c4", pq.read_table(data / "c4/c4_validation_2k.parquet", columns=["text"]).column("text").to_pylist())
# Plays and books: paragraphs (blank-line separated) as documents.
write("tinyshakespeare", (data / "tinyshakespeare/input.txt").read_text(encoding="utf-8").split("\n\n"))
# Botchan has no blank lines: 40 lines a document. (read_text turns CRLF into LF.)
botchan = (data / "sentencepiece_data/botchan.txt").read_text(encoding="utf-8-sig").splitlines()
write("botchan", ["\n".join(botchan[i:i + 40]) for i in range(0, len(botchan), 40)])
write("ntrex_eng", (data / "ntrex128/newstest2019-src.eng.txt").read_text(encoding="utf-8").splitlines())
# Image captions, one a document.
write("multi30k_en", gzip.open(data / "multi30k/train.en.gz", "rt", encoding="utf-8").read().splitlines())
write("dolma_cc", [json.loads(line)["text"] for name in ("cc_en_head-0091", "cc_en_head-0174")
                   for line in gzip.open(data / f"dolma_cc/{name}.jsonl.gz", "rt", encoding="utf-8")])
EOF
    touch "$WORK/corpus/.complete"
  fi
  SOURCE="jsonl:$WORK/corpus/*.jsonl#text"
  MODEL="$OUT/vocab/spm16k.model"
  if [ ! -f "$MODEL" ]; then
    echo "== vocabulary: SentencePiece unigram, 16,000 pieces"
    "$SEQCACHE" vocab train --source "$SOURCE" --vocab-size 16000 --output "$MODEL"
  fi
  echo "== build: packed to 1,024 tokens, split train"
  "$SEQCACHE" build --source "$SOURCE" --vocabulary "$MODEL" --name "$NAME" \
    --sequence-length 1024 --pack --seed 0 --cache-dir "$OUT/caches"
fi
"$SEQCACHE" info "$CACHE" | head -30

# T5's objective on the same documents and vocabulary (100 sentinel ids after
# the 16,000 pieces): span corruption, first-fit packing, split train.
span_cache() {  # NAME SEQUENCE_LENGTH
  local cache="$OUT/caches/$1/train"
  if [ -f "$cache/manifest.json" ]; then
    echo "== cache: $cache exists, reused"
  else
    echo "== build: span corruption, --sequence-length $2, first-fit packing, split train"
    "$SEQCACHE" build --source "jsonl:$WORK/corpus/*.jsonl#text" --vocabulary "$OUT/vocab/spm16k.model" \
      --extra-ids 100 --objective span_corruption --sequence-length "$2" --pack first_fit \
      --name "$1" --seed 0 --cache-dir "$OUT/caches"
  fi
  "$SEQCACHE" info "$cache" | head -30
}
# Inputs of 512 and targets of 114 tokens (T5's pair).
span_cache wiki_c4_span inputs=512
# The same with targets padded to 128, a multiple of the fused kernels' block
# (model.attention=splash runs T5's self-attention with its position bias fused
# only there).
span_cache wiki_c4_span128 inputs=512,targets=128

echo "== $OUT"
du -sh "$OUT"/*
du -sh "$OUT"
# What a machine is handed with the working tree is limited (64 MiB in all).
mb=$(du -sm "$OUT" | cut -f1)
if [ "$mb" -gt 60 ]; then
  echo "warning: $OUT takes $mb MB, more than the 60 MB it should stay under" >&2
fi
