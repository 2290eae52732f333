"""What the step controller and suffix drafting cost per step outside onnxruntime: propose + observe on a
conversation of random tokens, with the store of earlier outputs filled to a given size (no model runs).

    python benchmarks/measure/suffix_overhead.py [--conversation 1500] [--store 34000] [--steps 400]
"""
import argparse
import time

import numpy as np
from edgespec.runtime.contract.drafting import SuffixConfig
from edgespec.runtime.decoding.controller import Controller, Measurements
from edgespec.runtime.decoding.suffix import SuffixDrafter, SuffixStore

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--conversation", type=int, default=1500, help="tokens of the conversation")
parser.add_argument("--store", type=int, default=34000, help="tokens in the store of earlier outputs")
parser.add_argument("--steps", type=int, default=400)
args = parser.parse_args()

rng = np.random.default_rng(0)
store = SuffixStore(65536)
while store.array.length < args.store:
    store.add(list(rng.integers(0, 2000, 110)))
committed = list(rng.integers(0, 2000, args.conversation))
controller = Controller(SuffixDrafter(SuffixConfig(), store), None, 1, Measurements.fresh(1))
started = time.perf_counter()
for _ in range(args.steps):
    tree = controller.propose(committed, 64, None)
    controller.observe([int(rng.integers(0, 2000))], tree.tokens, None)
    committed.append(int(rng.integers(0, 2000)))
print(f"{(time.perf_counter() - started) / args.steps * 1e6:.0f} us per step (conversation {args.conversation} "
      f"tokens, store {store.array.length} tokens)")
