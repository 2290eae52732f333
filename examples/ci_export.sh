#!/usr/bin/env bash
# A CI job that produces device bundles and checks each one before publishing it.
#   examples/ci_export.sh MODEL DRAFT OUT_DIR [CONTEXT]     e.g.  examples/ci_export.sh default ngram dist/
set -euo pipefail
model=${1:-default}
draft=${2:-ngram}
out=${3:-dist}
context=${4:-2048}
mkdir -p "$out"
for profile in cpu; do
  bundle="$out/bundle-$profile"
  edgespec export "$model" --draft "$draft" --out "$bundle" --profile "$profile" --tree chain:6 --context "$context" --force
  # verifies every checksum, and that this machine gives every token plain decoding's bits in any pass
  # (what makes speculation lossless); fails the job if not. Run it on the device too: kernels differ by CPU.
  edgespec inspect "$bundle" --check-exact
  edgespec generate "$bundle" --prompt "Hello" --max-new-tokens 8 --json > "$bundle.smoke.json"
done
