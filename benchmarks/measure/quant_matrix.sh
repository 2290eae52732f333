#!/usr/bin/env bash
# Exports the reference model in several schemes and benchmarks each bundle (plain vs speculative, one run each).
#   benchmarks/measure/quant_matrix.sh MODEL OUT_DIR      (MODEL: default, or a local copy of it for faster loading)
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,3p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
model=${1:-default}
out=${2:-/tmp/edgespec-quant}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
recipes=(
  "fp32|--quant fp32"
  "fp16|--quant fp16"
  "int8|--quant int8"
  "int4|--quant int4"
  "int4-asym-head8|--quant int4 --asymmetric --quant-policy $here/quant/policies/head-int8.json"
  "int8-integer|--quant int8 --integer-matmul"
)
for recipe in "${recipes[@]}"; do
  name=${recipe%%|*}
  flags=${recipe#*|}
  start=$(date +%s)
  # shellcheck disable=SC2086
  edgespec export "$model" --draft ngram --out "$out/$name" $flags --tree chain:4 --force 2>"$out/$name.export.log"
  echo "== $name ($flags): export $(( $(date +%s) - start ))s, $(du -sb "$out/$name/target.weights" | cut -f1) bytes of weights"
  [ -f "$out/$name/quality.json" ] && python -c "import json,sys; q=json.load(open(sys.argv[1])); print('   perplexity', q['perplexity'], 'greedy top-1 agreement', q['greedy_agreement']['top1_agreement'])" "$out/$name/quality.json"
  edgespec bench "$out/$name" --threads 2 --json
done
