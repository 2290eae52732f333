"""Share of the target's greedy tokens that each bundle's trimmed draft head can name at all: an upper
bound on the draft's agreement (§34). The first bundle's target decodes the built-in and edit prompts.

    python benchmarks/head_coverage.py BUNDLE [BUNDLE ...]
"""
import json
import sys
from pathlib import Path
from edgespec.bench import load_prompts, prompt_kwargs
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
bundles = sys.argv[1:]
pipeline = Pipeline(Path(bundles[0]))
for f in [None, "benchmarks/edit_prompts.jsonl"]:
    tokens = []
    for item in load_prompts(Path(f) if f else None):
        tokens += pipeline.generate(**prompt_kwargs(item), config=GenerationConfig(max_new_tokens=128), speculate=False).token_ids
    for b in bundles:
        head = set(json.load(open(Path(b) / "draft_head_tokens.json")))
        print(f or "built-in", b, f"{sum(t in head for t in tokens) / len(tokens):.3f} of {len(tokens)} greedy tokens in the head")
