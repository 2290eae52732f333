#!/usr/bin/env bash
# Exports the reference model in every scheme and benchmarks each bundle (plain vs speculative, one run each).
#   benchmarks/quant_matrix.sh MODEL OUT_DIR      (MODEL: default, or a local copy of it for faster loading)
set -euo pipefail
model=${1:-default}
out=${2:-/tmp/edgespec-quant}
mkdir -p "$out"
for quant in fp32 fp16 int8 int4; do
  start=$(date +%s)
  edgespec export "$model" --draft ngram --out "$out/$quant" --quant "$quant" --tree chain:4 --force 2>"$out/$quant.export.log"
  echo "== $quant: export $(( $(date +%s) - start ))s, $(du -sb "$out/$quant/target.weights" | cut -f1) bytes of weights"
  [ -f "$out/$quant/quality.json" ] && python -c "import json,sys; q=json.load(open(sys.argv[1])); print('   perplexity', q['perplexity'], 'greedy top-1 agreement', q['greedy_agreement']['top1_agreement'])" "$out/$quant/quality.json"
  edgespec bench "$out/$quant" --threads 2 --json
done
