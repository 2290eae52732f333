"""Top-1 agreement of a bundle's draft with its target's greedy token, on prompts never used in training.

For each prompt the target decodes greedily (plain); then the draft reads prompt + answer teacher-forced
and we count the answer positions where the draft's argmax is the token the target chose.

    python benchmarks/measure/draft_agreement.py [BUNDLE] [--prompts FILE.jsonl ...] [--max-new-tokens 128]
"""
import argparse
from pathlib import Path

from edgespec.quant.report import agreement
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.bench import load_prompts, prompt_kwargs
from edgespec.defaults import resolve_bundle

parser = argparse.ArgumentParser()
parser.add_argument("bundle", nargs="?", default="default")
parser.add_argument("--prompts", action="append", help="JSONL prompt files (default: the built-in prompts)")
parser.add_argument("--max-new-tokens", type=int, default=128)
parser.add_argument("--self-check", action="store_true")
args = parser.parse_args()

pipeline = Pipeline(resolve_bundle(args.bundle))
if args.self_check:  # the target as its own draft must agree everywhere: checks the alignment
    pipeline.draft = pipeline.target
if pipeline.draft is None:
    raise SystemExit("this bundle has no draft model")
items = [i for f in (args.prompts or [None]) for i in load_prompts(Path(f) if f else None)]
hits = total = 0
for item in items:
    ask = prompt_kwargs(item)
    result = pipeline.generate(**ask, config=GenerationConfig(max_new_tokens=args.max_new_tokens), speculate=False)
    context = pipeline.encode(ask.get("prompt"), ask.get("messages"))
    share = agreement(pipeline.draft, context, result.token_ids, pipeline.manifest.prefill_chunk, pipeline.target)
    hits += round(share * len(result.token_ids))
    total += len(result.token_ids)
    print(f"{hits / max(total, 1):.3f} cumulative after {total} tokens", flush=True)
print(f"draft top-1 agreement with the target's greedy tokens: {hits / total:.3f} over {total} tokens, "
      f"{len(items)} prompts")
