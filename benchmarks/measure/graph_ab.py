"""One-token steps on several graphs of one bundle's target model, for deciding between two ways to write a
graph (an exporter change) without a peers run for each.

    python benchmarks/measure/graph_ab.py BUNDLE A.onnx B.onnx [C.onnx ...] [--past 300] [--rounds 2] [--steps 32]

Every graph takes the bundle's model facts and this device's one-token rows. Two biases had favoured every
variant over the baseline in the earlier step probes (history.md §55): a graph's place in the loop, and
its place in loading — in one process, of byte-identical copies, each loaded after another ran ~2% faster
than the one before it. So the graphs are measured in as many processes as there are graphs, each loading
them in an order rotated by one, and within a process each round runs a block of `steps` steps on every
graph, the order rotated by one each round. Each process gives every graph's median step against the first
graph's (machine drift between processes cancels in the ratio); the report is the mean of those ratios and
their range. Differences inside the range are noise: confirm one that matters with `benchmarks/measure/peers.py`.
"""
import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def measure(bundle: str, graphs: list[Path], past: int, rounds: int, steps: int, threads: int | None) -> dict:
    """{graph: median seconds of a one-token step}, the graphs loaded and first run in the order given."""
    from edgespec.runtime.execution.model import ModelRunner, commit, prefill
    from edgespec.runtime.execution.sessions import make_session
    from edgespec.runtime.pipeline import Pipeline

    from edgespec.defaults import resolve_bundle

    pipeline = Pipeline(resolve_bundle(bundle), threads)
    rows = pipeline.exactness.min_rows
    facts, providers = pipeline.manifest.target.facts, pipeline.manifest.profile.verify
    prompt = [(i * 7919) % (facts.vocab_size - 100) + 100 for i in range(past)]
    runners, caches = {}, {}
    for path in graphs:
        runners[path] = ModelRunner(make_session(path, providers, pipeline.target_threads), facts)
        runners[path].min_rows = rows
        caches[path] = runners[path].new_cache(past + steps + 2)
        prefill(runners[path], caches[path], prompt, pipeline.manifest.prefill_chunk)

    def block(path: Path) -> list[float]:
        model, cache = runners[path], caches[path]
        cache.trim(past)
        token, seconds = prompt[-1], []
        for _ in range(steps):
            started = time.perf_counter()
            out = model.forward(cache, [token], [cache.length], np.ones((1, 1), bool), [0])
            commit(cache, out, [0])
            token = int(out.logits[0].argmax())
            seconds.append(time.perf_counter() - started)
        return seconds

    times = {path: [] for path in graphs}
    for turn in range(rounds * len(graphs)):
        for path in graphs[turn % len(graphs):] + graphs[: turn % len(graphs)]:
            times[path] += block(path)
    return {str(path): float(np.median(seconds)) for path, seconds in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("bundle", help="bundle folder, or 'default': its model facts and this device's rows")
    parser.add_argument("graphs", nargs="+", type=Path, help="target graphs of that model (the first is the baseline)")
    parser.add_argument("--past", type=int, default=300, help="tokens in the cache before each block")
    parser.add_argument("--rounds", type=int, default=2,
                        help="in each process every graph leads this many rounds (so runs rounds x graphs blocks)")
    parser.add_argument("--steps", type=int, default=32, help="one-token steps per block")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one process's measurement
    args = parser.parse_args()
    settings = dict(past=args.past, rounds=args.rounds, steps=args.steps, threads=args.threads)
    if args.child:
        print(json.dumps(measure(args.bundle, args.graphs, **settings)))
        return
    missing = [str(path) for path in args.graphs if not path.is_file()]
    if missing:
        sys.exit(f"no graph at {', '.join(missing)}")
    graphs = [path.absolute() for path in args.graphs]
    ratios = {str(path): [] for path in graphs}
    seconds = {str(path): [] for path in graphs}
    for shift in range(len(graphs)):
        order = graphs[shift:] + graphs[:shift]
        command = [sys.executable, __file__, args.bundle, *map(str, order), "--child", "--past", str(args.past),
                   "--rounds", str(args.rounds), "--steps", str(args.steps)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        medians = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        for path, median in medians.items():
            ratios[path].append(median / medians[str(graphs[0])])
            seconds[path].append(median)
    print(f"past {args.past}; {len(graphs)} processes, each loading the graphs in another order; "
          f"{args.rounds * len(graphs)} blocks of {args.steps} one-token steps a graph in each")
    for i, path in enumerate(graphs):
        r = ratios[str(path)]
        print(f"{i}:{path.name:30s} {np.median(seconds[str(path)]) * 1e3:7.3f} ms a step  "
              f"x{np.mean(r):.3f} of graph 0 (processes {min(r):.3f}-{max(r):.3f})")


if __name__ == "__main__":
    main()
