"""Where a streamed target's decoding time goes: onnxruntime runs, stage releases, waits for fetched
stages (RESULTS.md §28). Plain decoding of one prompt under a memory budget, profiled.

    python benchmarks/stage_profile.py STAGED_BUNDLE BUDGET        (e.g. 640MiB)
"""
import cProfile, pstats, sys
from edgespec.runtime.pipeline import Pipeline
from edgespec.runtime.engine import GenerationConfig
bundle, budget = sys.argv[1], sys.argv[2]
p = Pipeline(bundle, memory_budget=budget)
cfg = GenerationConfig(max_new_tokens=48)
ask = dict(messages=[{"role": "user", "content": "Explain what a hash table is to a beginner."}])
p.generate(**ask, config=cfg, speculate=False)
pr = cProfile.Profile(); pr.enable()
r = p.generate(**ask, config=cfg, speculate=False)
pr.disable()
print(r.stats.to_dict()["tokens_per_s"])
pstats.Stats(pr).sort_stats("tottime").print_stats(8)
