"""Can several conversations share one target pass and each keep the bits it gets alone? (issue 42, item 1)

    python benchmarks/measure/batch_bits.py [--model default] [--workdir W] [--steps 16] [--batch 4] [--threads 2]

Exports the model twice from one loaded source, into W (reused when there): a bundle whose int4 target
graph is the runtime's (one lane; its passes exact: a padding row, two attention slots), and the same
weights in the `sequences` graph form (exporters/llama.py: B independent sequences per pass, each at its
own past length; distill's data engine). Then, for `--batch` conversations of different lengths (the first
prompt of each workload set), greedy decoding of `--steps` one-token steps, each step with the rows plain
decoding runs (the token and a padding row):

  A. the sequences graph, each conversation alone (B = 1), against all of them in one pass (B = batch),
     one new token per sequence: onnxruntime's GroupQueryAttention takes B > 1 with a past only so;
  B. the sequences graph alone with the padding slot (S = 2) against the runtime's graph (what
     `edgespec generate` computes): whether the graph form itself changes bits;
  C. the sequences graph alone with one slot against the runtime's graph: what batching's one query per
     sequence costs in bits;

and counts the passes whose logits differ in any bit, the largest difference, and the greedy tokens that
differ, and times the step passes. history.md §62 has the run.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from edgespec.distill.engine import SequenceEngine, engine_graph
from edgespec.exporters.export import ExportConfig, export
from edgespec.exporters.sources import resolve_source
from edgespec.quant.schemes import HEAD_INT8_POLICY
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import commit, prefill
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.pipeline import Pipeline

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
SETS = ("chat", "rag", "code_edit", "agent", "extraction", "summary", "multiturn")
CONTEXT = 1024


def build(model_spec: str, workdir: Path) -> tuple[Path, Path, object]:
    bundle = workdir / "bundle"
    model, _ = resolve_source(model_spec, workdir / "cache").load()
    if not (bundle / "manifest.json").is_file():
        export(ExportConfig(model=model_spec, draft="ngram", out=bundle, quant="int4", symmetric=False,
                            quant_policy=HEAD_INT8_POLICY, context=CONTEXT, cache_dir=workdir / "cache"))
    graph, facts = engine_graph(model, workdir / "sequences", "int4", context=CONTEXT)
    return bundle, graph, facts


def runtime_logits(pipeline: Pipeline, ids: list[int], steps: int) -> list[np.ndarray]:
    """Greedy decoding in the runtime's graph: the prefill's last logits, then each one-token step's."""
    runner = pipeline.target
    _ = pipeline.exactness  # sets the rows a one-token step runs here
    cache = KVCache(runner.facts, len(ids) + steps + 2, lanes=runner.lanes)
    out = [prefill(runner, cache, ids, pipeline.manifest.prefill_chunk)]
    for _ in range(steps):
        token = int(out[-1].argmax())
        step = runner.forward(cache, [token], [cache.length], np.ones((1, 1), bool), [0])
        commit(cache, step, [0])
        out.append(step.logits[0])
    return out


def sequence_logits(session, facts, prompts: list[list[int]], steps: int, chunk: int,
                    slots: int) -> tuple[list[list[np.ndarray]], float]:
    """Greedy decoding of every prompt at once in the sequences graph: each prefilled alone in its slot, in
    the runtime's chunks, then one pass a step for all, each sequence's token alone (`slots` 1) or with a
    padding slot after it (2: the rows and attention slots a plain step runs; onnxruntime's attention takes
    it only for one sequence). Returns the logits and the mean seconds of a step's pass."""
    engine = SequenceEngine(session, facts, len(prompts), max(map(len, prompts)) + steps + 2)
    out = []
    for slot, ids in enumerate(prompts):
        for start in range(0, len(ids), chunk):
            part = np.array([ids[start:start + chunk]], np.int64)
            logits, _ = engine.run(part, np.array([start]), [part.shape[1] - 1], slot=slot)
        out.append([logits[0]])
    past = np.array([len(p) for p in prompts])
    took = 0.0
    for _ in range(steps):
        tokens = np.array([[int(o[-1].argmax()), 0][:slots] for o in out], np.int64)
        started = time.perf_counter()
        logits, _ = engine.run(tokens, past, np.arange(len(prompts)) * slots)
        took += time.perf_counter() - started
        for i, row in enumerate(logits):
            out[i].append(row.copy())
        past += 1
    return out, took / steps


def compare(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    differ = sum(not np.array_equal(x, y) for x, y in zip(a, b))
    largest = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    tokens = sum(int(x.argmax()) != int(y.argmax()) for x, y in zip(a, b))
    return {"passes": len(a), "passes_with_bits_that_differ": differ, "largest_difference": largest,
            "greedy_tokens_that_differ": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a GGUF file, Hugging Face folder, hub id or 'default'")
    parser.add_argument("--workdir", default=None, help="where the two exports go (kept for the next run)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="batch_bits_"))
    started = time.perf_counter()
    bundle, graph, facts = build(args.model, workdir)
    print(f"exports ready in {time.perf_counter() - started:.0f} s: {workdir}", file=sys.stderr)
    pipeline = Pipeline(bundle, threads=args.threads)
    chunk = pipeline.manifest.prefill_chunk
    prompts = [pipeline.encode(messages=json.loads((WORKLOADS / f"{name}.jsonl").read_text().splitlines()[0])
                               ["messages"]) for name in SETS[: args.batch]]
    session = make_session(graph, ("CPUExecutionProvider",), args.threads)
    alone = {slots: [sequence_logits(session, facts, [p], args.steps, chunk, slots) for p in prompts]
             for slots in (1, 2)}
    together, batched_s = sequence_logits(session, facts, prompts, args.steps, chunk, 1)
    plain = [runtime_logits(pipeline, p, args.steps) for p in prompts]
    report = {"model": args.model, "threads": args.threads, "min_rows": pipeline.target.min_rows,
              "prompt_tokens": [len(p) for p in prompts], "steps": args.steps,
              "A_batched_vs_alone_one_slot": [compare(a[0][0], t) for a, t in zip(alone[1], together)],
              "B_two_slots_vs_runtime": [compare(a[0][0], p) for a, p in zip(alone[2], plain)],
              "C_one_slot_vs_runtime": [compare(a[0][0], p) for a, p in zip(alone[1], plain)],
              "step_s": {"alone_one_slot": [round(a[1], 5) for a in alone[1]],
                         "alone_two_slots": [round(a[1], 5) for a in alone[2]],
                         f"batch_of_{len(prompts)}_one_slot": round(batched_s, 5)}}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
