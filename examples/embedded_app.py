"""Embedding edgespec in an app: a few lines of the Python API (runtime only: numpy + onnxruntime).

    python examples/embedded_app.py [BUNDLE]     # BUNDLE defaults to the built-in default bundle
"""
import sys

import edgespec
from edgespec.defaults import resolve_bundle

bundle = resolve_bundle(sys.argv[1] if len(sys.argv) > 1 else "default")
model = edgespec.load(bundle)
result = model.generate(
    messages=[{"role": "user", "content": "Name two uses of a paperclip."}],
    config=edgespec.GenerationConfig(max_new_tokens=64),
    on_text=lambda piece: print(piece, end="", flush=True),
)
print(f"\n{result.stats.tokens_per_s:.1f} tokens/s, {result.stats.mean_accepted_per_pass:.2f} tokens per target pass")
