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

bundles = [Path(b) for b in sys.argv[1:]]
if not bundles:
    raise SystemExit(__doc__)
pipeline = Pipeline(bundles[0])
config = GenerationConfig(max_new_tokens=128)
for name, prompts_file in [("built-in", None), ("edit prompts", Path(__file__).parent / "edit_prompts.jsonl")]:
    greedy = [t for item in load_prompts(prompts_file)
              for t in pipeline.generate(**prompt_kwargs(item), config=config, speculate=False).token_ids]
    for bundle in bundles:
        head = set(json.loads((bundle / "draft_head_tokens.json").read_text()))
        covered = sum(t in head for t in greedy) / len(greedy)
        print(f"{name}: {bundle}: {covered:.3f} of {len(greedy)} greedy tokens in the head")
