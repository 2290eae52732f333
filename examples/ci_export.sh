#!/usr/bin/env bash
# A CI job that produces device bundles for several profiles and checks each one before publishing it.
#   examples/ci_export.sh MODEL DRAFT OUT_DIR [CONTEXT]     e.g.  examples/ci_export.sh default ngram dist/
# PROFILES (default "cpu ai-pc-intel apple") picks the device profiles: ai-pc-intel's graphs have static
# shapes (its NPU needs them; this runner checks them on the CPU provider); the apple bundle also holds
# CoreML packages (needs the [coreml] extra). examples/github-workflow.yml runs the same steps as a matrix, one job per profile.
set -euo pipefail
model=${1:-default}
draft=${2:-ngram}
out=${3:-dist}
context=${4:-2048}
mkdir -p "$out"
for profile in ${PROFILES:-cpu ai-pc-intel apple}; do
  bundle="$out/bundle-$profile"
  formats=onnx
  if [ "$profile" = apple ]; then formats=onnx,coreml; fi
  edgespec export "$model" --draft "$draft" --out "$bundle" --profile "$profile" --format "$formats" \
    --tree chain:6 --context "$context" --force
  # verifies every checksum, and that this machine gives every token plain decoding's bits in any pass
  # (what makes speculation lossless); fails the job if not. Run it on the device too: kernels differ by CPU.
  edgespec inspect "$bundle" --check-exact
  edgespec generate "$bundle" --prompt "Hello" --max-new-tokens 8 --json > "$bundle.smoke.json"
  # what gets published: the bundle as one archive, and its checksum beside it
  tar -C "$out" -czf "$bundle.tar.gz" "bundle-$profile"
  (cd "$out" && sha256sum "bundle-$profile.tar.gz" > "bundle-$profile.tar.gz.sha256")
done
