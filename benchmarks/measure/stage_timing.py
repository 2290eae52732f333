"""Where a staged target's decoding time goes: per stage, the wait for its fetch and its run, per token.

    python benchmarks/measure/stage_timing.py BUNDLE --weights 0.5 [--max-new-tokens 40] [--threads 2]

The budget is `plan`'s fixed part plus that fraction of the target's weights (as memory_budget.py).
One plain greedy generation warms up, a second is timed.
"""
import argparse
import time
from collections import defaultdict
from pathlib import Path

from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution import staged
from edgespec.runtime.execution.budget import plan_memory
from edgespec.runtime.pipeline import Pipeline

parser = argparse.ArgumentParser()
parser.add_argument("bundle")
parser.add_argument("--weights", type=float, required=True, help="fraction of the target's weights in the budget")
parser.add_argument("--max-new-tokens", type=int, default=40)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--prompt", default="Tell me about the sea.")
parser.add_argument("--evict-page-cache", action="store_true")
args = parser.parse_args()

folder = Path(args.bundle)
full = plan_memory(open_bundle(folder), folder, None)
pipeline = Pipeline(folder, threads=args.threads,
                    memory_budget=int(full.total - full.target_weights + args.weights * full.target_weights),
                    evict_page_cache=args.evict_page_cache)
window = pipeline.target.window
print(f"stages {window.count}, pinned {sorted(window.pinned)}, kinds {sorted({type(s).__name__ for s in window.stages})}")
seconds = defaultdict(float)
get, run_bound, current = window.get, staged.run_bound, [0]


def timed_get(i):
    start = time.perf_counter()
    session = get(i)
    seconds["fetch", i] += time.perf_counter() - start
    current[0] = i
    return session


def timed_run(*args):
    start = time.perf_counter()
    values = run_bound(*args)
    seconds["run", current[0]] += time.perf_counter() - start
    return values


window.get, staged.run_bound = timed_get, timed_run
config = GenerationConfig(max_new_tokens=args.max_new_tokens)
pipeline.generate(prompt=args.prompt, config=config, speculate=False)
seconds.clear()
start = time.perf_counter()
result = pipeline.generate(prompt=args.prompt, config=config, speculate=False)
tokens = len(result.token_ids)
print(f"plain {tokens / (time.perf_counter() - start):.1f} tokens/s")
for i in range(window.count):
    print(f"stage {i:2d}  fetch wait {seconds['fetch', i] / tokens * 1e3:5.2f}  run {seconds['run', i] / tokens * 1e3:5.2f} ms/token")
