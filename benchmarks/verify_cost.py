"""Cost of one target pass by the number of tree nodes N (chain masks), at a fixed past length, and of
one draft step (one node) when the bundle has a draft model.

    python benchmarks/verify_cost.py [BUNDLE] [--past 256] [--repeats 30]
"""
import argparse

from edgespec.defaults import resolve_bundle
from edgespec.runtime.pipeline import Pipeline
from edgespec.tune import pass_seconds

parser = argparse.ArgumentParser()
parser.add_argument("bundle", nargs="?", default="default")
parser.add_argument("--past", type=int, default=256)
parser.add_argument("--repeats", type=int, default=30)
parser.add_argument("--threads", type=int, default=None)
args = parser.parse_args()

pipeline = Pipeline(resolve_bundle(args.bundle), args.threads)
chunk = pipeline.manifest.prefill_chunk
rows = pipeline.exactness.min_rows  # a one-node pass runs what this device's one-token steps run
seconds = pass_seconds(pipeline.target, chunk, (1, 2, 3, 4, 5, 6, 8, 10, 12, 16), args.past, args.repeats)
print(f"past {args.past} tokens, {pipeline.threads} threads, one-token steps of {rows} row(s)")
for n, s in seconds.items():
    print(f"target N={n:3d}  {s * 1000:7.2f} ms per pass  ({s / seconds[1]:.2f}x of N=1)")
if pipeline.draft is not None:
    draft = pass_seconds(pipeline.draft, chunk, (1, 2, 4), args.past, args.repeats)
    for n, s in draft.items():
        print(f"draft  N={n:3d}  {s * 1000:7.2f} ms per pass  ({s / seconds[1]:.3f} of a target pass with N=1, "
              f"{s / seconds[5]:.3f} of N=5)")
