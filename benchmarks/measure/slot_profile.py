"""Where a slots pass's time goes: onnxruntime's profiler, per op type, slots graph against single graph (issue 42).

    python benchmarks/measure/slot_profile.py [--bundle B] [--steps 24] [--threads 2] [--json FILE]

The bundle's target graph and its slots graph (default: slot_passes.slots_bundle(4)) are opened again with
onnxruntime's profiler on (the same options as edgespec's sessions otherwise: runtime/execution/sessions.py).
Four conversations of the same prompt (the rag set's first, so every slot attends over the same past length)
are prefilled; then, alternating step by step, four kinds of pass, `--steps` times each: the single graph
with one conversation's one-token step (1 row), the single graph with a 4-row causal chain of one
conversation, the slots graph with one conversation's step in one slot (three empty), and the slots graph
with the four conversations' steps. Each profile's node events are summed by op type and divided by the
passes: ms per pass per op type, the node count, and the run's wall time outside the nodes (onnxruntime's
own per-node overhead and the session's run setup). history.md §70 has the run.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
from slot_passes import WORKLOADS, slots_bundle
from verify_cost import profiled_session

KINDS = ("single_1row", "single_4rows", "slots_1of4", "slots_4of4")


def by_op(trace: list, runs: int) -> dict:
    """ms per pass by op type over a profile's node events, and the passes' mean wall time."""
    ops, counts, model_us = collections.Counter(), collections.Counter(), []
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            ops[event["args"]["op_name"]] += event["dur"]
            counts[event["args"]["op_name"]] += 1
        elif event.get("cat") == "Session" and event["name"] == "model_run":
            model_us.append(event["dur"])
    model_us = model_us[-runs:]
    total = sum(ops.values()) / runs / 1000
    return {"run_ms": round(sum(model_us) / len(model_us) / 1000, 3), "nodes_ms": round(total, 3),
            "ops_ms": {k: round(v / runs / 1000, 3) for k, v in ops.most_common()},
            "nodes_per_pass": {k: counts[k] // runs for k in counts}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=None)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-set", default="rag")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from edgespec.runtime.execution.model import ModelRunner, prefill
    from edgespec.runtime.execution.slots import SlotRunner
    from edgespec.runtime.pipeline import Pipeline

    bundle = Path(args.bundle) if args.bundle else slots_bundle(4)
    pipeline = Pipeline(bundle, threads=args.threads)
    plain = pipeline.target
    _ = pipeline.exactness  # the device's min_rows, as generation runs
    m = pipeline.manifest
    single = ModelRunner(profiled_session(bundle / m.target.graph.file, args.threads, "/tmp/prof_single"),
                         m.target.facts)
    single.min_rows = plain.min_rows
    slots = SlotRunner(profiled_session(bundle / m.target.slots.file, args.threads, "/tmp/prof_slots"), single)
    ids = pipeline.encode(messages=json.loads((WORKLOADS / f"{args.prompt_set}.jsonl").read_text()
                                               .splitlines()[0])["messages"])
    caches = []
    for _ in range(slots.slots):
        cache = single.new_cache(len(ids) + 8)
        prefill(plain, cache, ids, m.prefill_chunk)
        caches.append(cache)
    token, at = int(ids[-1]), len(ids)
    one = np.ones((1, 1), bool)
    chain = np.tril(np.ones((4, 4), bool))
    passes = {
        "single_1row": lambda: single.forward(caches[0], [token], [at], one, [0]),
        "single_4rows": lambda: single.forward(caches[0], [token] * 4, list(range(at, at + 4)), chain, [0, 1, 2, 3]),
        "slots_1of4": lambda: slots.run([slots.layout(caches[0], [token], [at], one, [0])]),
        "slots_4of4": lambda: slots.run([slots.layout(c, [token], [at], one, [0]) for c in caches]),
    }
    wall = {k: [] for k in KINDS}
    for kind in KINDS:  # warm-up, and each kind's first binding, outside what is counted
        passes[kind]()
    # single and slots passes alternate within a round; each session's profile holds its own kinds in
    # order, so the two single kinds (and the two slots kinds) alternate too and are told apart by order
    for _ in range(args.steps):
        for kind in KINDS:
            started = time.perf_counter()
            passes[kind]()
            wall[kind].append(time.perf_counter() - started)
    traces = {"single": json.loads(Path(single.session.end_profiling()).read_text()),
              "slots": json.loads(Path(slots.session.end_profiling()).read_text())}
    report = {"bundle": str(bundle), "threads": args.threads, "past_length": at, "steps": args.steps,
              "min_rows": plain.min_rows, "kinds": {}}
    for graph, (first, second) in (("single", KINDS[:2]), ("slots", KINDS[2:])):
        runs = [e for e in traces[graph] if e.get("cat") == "Session" and e["name"] == "model_run"]
        runs = runs[-2 * args.steps:]  # the counted passes, first and second kind alternating
        for parity, kind in ((0, first), (1, second)):
            windows = [(r["ts"], r["ts"] + r["dur"]) for r in runs[parity::2]]
            events = [e for e in traces[graph] if e.get("cat") == "Node"
                      and any(a <= e.get("ts", -1) <= b for a, b in windows)]
            report["kinds"][kind] = {"wall_ms_median": round(float(np.median(wall[kind])) * 1000, 3),
                                     **by_op(events + runs[parity::2], args.steps)}
    for kind in KINDS:
        row = report["kinds"][kind]
        print(kind, row["wall_ms_median"], row["run_ms"], row["nodes_ms"], json.dumps(row["ops_ms"]), file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
