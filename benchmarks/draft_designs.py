"""Draft designs compared on the same target data: held-out agreement, cost per draft token, and the
tokens/s a chain would give (from both, with the measured target pass cost).

    python benchmarks/draft_designs.py RUN_DIR [--minutes 8] [--designs cut,small] [--target default]

RUN_DIR is an `edgespec distill` folder: its shards are reused (the last chat shard is held out, as in
training). Each design trains for the same minutes from scratch into RUN_DIR/designs/<name>.
"""
import argparse
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from edgespec.defaults import cache_dir
from edgespec.distill.data import shard_paths
from edgespec.distill.train import TrainConfig, train
from edgespec.exporters.export import ExportConfig, export
from edgespec.exporters.sources import resolve_source
from edgespec.runtime.pipeline import Pipeline
from edgespec.tune import pass_seconds

parser = argparse.ArgumentParser()
parser.add_argument("run")
parser.add_argument("--minutes", type=float, default=8.0)
parser.add_argument("--designs", default="cut,small")
parser.add_argument("--target", default="default")
parser.add_argument("--chain", type=int, default=4)
args = parser.parse_args()

run = Path(args.run)
chat = shard_paths(run / "data" / "chat")
target, tokenizer = resolve_source(args.target, cache_dir()).load()
rows = []
for design in args.designs.split(","):
    out = run / "designs" / design
    out.mkdir(parents=True, exist_ok=True)
    report = train(target, tokenizer, chat[:-1] + shard_paths(run / "data" / "corpus"), chat[-1:], out,
                   replace(TrainConfig(), design=design),
                   time.time() + args.minutes * 60, log=print)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = export(ExportConfig(model=args.target, draft=str(out), out=Path(tmp) / "b", cache_dir=cache_dir()))
        pipeline = Pipeline(bundle)
        chunk = pipeline.manifest.prefill_chunk
        verify = pass_seconds(pipeline.target, chunk, (1, args.chain + 1), 256, 20)
        draft = pass_seconds(pipeline.draft, chunk, (1,), 256, 50)[1]
    alpha, k = report["held_out_agreement"], args.chain
    tokens_per_pass = (1 - alpha ** (k + 1)) / (1 - alpha)  # a chain of k, acceptance alpha per token
    estimated = tokens_per_pass / (verify[k + 1] + k * draft)
    rows.append((design, alpha, report["steps"], draft / verify[1], tokens_per_pass, estimated, 1 / verify[1]))
print(f"\n{'design':8s} {'agreement':>9s} {'steps':>6s} {'draft/target':>12s} {'tok/pass':>8s} "
      f"{'est. tok/s':>10s} {'plain tok/s':>11s}")
for design, alpha, steps, cost, per_pass, est, plain in rows:
    print(f"{design:8s} {alpha:9.3f} {steps:6d} {cost:12.3f} {per_pass:8.2f} {est:10.1f} {plain:11.1f}")
