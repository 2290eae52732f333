"""Cost of one target pass by the number of tree nodes N (chain masks), at a fixed past length.

    python benchmarks/verify_cost.py [BUNDLE] [--past 256] [--repeats 30]
"""
import argparse
import statistics
import time

import numpy as np

from edgespec.defaults import resolve_bundle
from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import prefill
from edgespec.runtime.pipeline import Pipeline

parser = argparse.ArgumentParser()
parser.add_argument("bundle", nargs="?", default="default")
parser.add_argument("--past", type=int, default=256)
parser.add_argument("--repeats", type=int, default=30)
parser.add_argument("--threads", type=int, default=None)
args = parser.parse_args()

pipeline = Pipeline(resolve_bundle(args.bundle), args.threads)
facts = pipeline.manifest.target.facts
cache = KVCache(facts, facts.max_context)
rng = np.random.default_rng(0)
prefill(pipeline.target, cache, list(rng.integers(100, facts.vocab_size, args.past)), pipeline.manifest.prefill_chunk)
base = None
print(f"past {args.past} tokens, {pipeline.threads} threads")
for n in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16):
    tokens = rng.integers(100, facts.vocab_size, n)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pipeline.target.forward(cache, tokens, range(args.past, args.past + n), np.tril(np.ones((n, n), bool)), range(n))
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1000
    base = base or ms
    print(f"N={n:3d}  {ms:7.2f} ms per pass  ({ms / base:.2f}x of N=1)")
