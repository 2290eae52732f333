"""S conversations in one slots pass against the same S conversations' passes one after another (issue 42).

    python benchmarks/measure/slot_passes.py [--bundle B] [--slots 4] [--steps 32] [--threads 2] [--json FILE]

Without --bundle, exports the default bundle's recipe again with a slots graph of `--slots` conversations per
pass into ~/.cache/edgespec/bundles/default-slots{S} (reused when there; `slots_bundle`). Then, for 1..S
conversations (the workload sets' first prompts, 45 to 747 tokens), each prefilled alone, greedy decoding
of `--steps` one-token steps two ways, alternating round by round on the same machine: (a) every
conversation's step alone in the target graph, one pass after another (what interleaving runs), and (b) all
of them in one pass of the slots graph (runtime/execution/slots.py). Reports the median seconds of a round
each way, the ratio (aggregate throughput of the shared pass over the passes alone), and the rounds whose
logits differ in any bit between (a) and (b) (must be 0). With --generate N, the S prompts' greedy answers
of N tokens, one after another and then all at once through shared passes (runtime/execution/shared_passes.py),
speculative (trees priced against the whole shared pass, then as alone) and plain: aggregate tokens/s each
way and answers that differ. history.md §65 and §68 have the runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
SETS = ("chat", "rag", "code_edit", "agent", "extraction", "summary", "multiturn")


def slots_bundle(slots: int) -> Path:
    """The default bundle's recipe with a slots graph of `slots` conversations per pass, exported once."""
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.quant.schemes import HEAD_INT8_POLICY
    from edgespec.runtime.execution.paths import cache_dir

    from edgespec.defaults import DEFAULT_RECIPE, _default_draft_folder

    out = cache_dir() / "bundles" / f"default-slots{slots}"
    if not (out / "manifest.json").is_file():
        export(ExportConfig(**{**DEFAULT_RECIPE, "draft": str(_default_draft_folder())}, quant_policy=HEAD_INT8_POLICY,
                            out=out, cache_dir=cache_dir(), slots=slots))
    return out


def generations(pipeline, shared, prompts, tokens: int, speculate: bool, batch_priced: bool = True) -> dict:
    """The prompts' greedy answers of `tokens` tokens, one after another and then all at once through shared
    passes, speculative or not (speculative: each step's tree priced against the whole shared pass, or as
    alone, `batch_priced`; history.md §68): aggregate generated tokens/s (prefill included) each way, and
    whether the answers together equal the answers alone."""
    import threading

    from edgespec.runtime.decoding.engine import GenerationConfig

    from edgespec.serve_turns import generate_sharing

    config = GenerationConfig(max_new_tokens=tokens, stop_at_eos=False)
    pipeline.forget_outputs()  # no run copies an answer from the store of earlier outputs: remember=False
    started = time.perf_counter()
    alone = [pipeline.generate(ids=ids, config=config, speculate=speculate, remember=False) for ids in prompts]
    alone_s = time.perf_counter() - started
    together = [None] * len(prompts)

    def run(i):
        together[i] = generate_sharing(pipeline, shared, ids=prompts[i], config=config, speculate=speculate,
                                       batch_priced=batch_priced, remember=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    together_s = time.perf_counter() - started
    made = sum(len(r.token_ids) for r in alone)
    return {"speculate": speculate, "batch_priced": batch_priced, "tokens": made,
            "one_after_another_tokens_per_s": round(made / alone_s, 2),
            "shared_tokens_per_s": round(made / together_s, 2), "ratio": round(alone_s / together_s, 3),
            "answers_differ": sum(a.token_ids != b.token_ids for a, b in zip(alone, together))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bundle", default=None, help="a bundle exported with --slots (default: slots_bundle)")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--generate", type=int, default=0,
                        help="also generate this many tokens per conversation, one after another and together "
                             "through shared passes, speculative and plain")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from edgespec.runtime.execution.model import commit, prefill
    from edgespec.runtime.execution.sessions import make_session
    from edgespec.runtime.execution.slots import SlotRunner
    from edgespec.runtime.pipeline import Pipeline

    bundle = Path(args.bundle) if args.bundle else slots_bundle(args.slots)
    pipeline = Pipeline(bundle, threads=args.threads)
    single = pipeline.target
    _ = pipeline.exactness  # the device's min_rows, as generation runs
    slots = SlotRunner(make_session(bundle / pipeline.manifest.target.slots.file, ("CPUExecutionProvider",),
                                    args.threads), single)
    prompts = [pipeline.encode(messages=json.loads((WORKLOADS / f"{name}.jsonl").read_text().splitlines()[0])
                               ["messages"]) for name in SETS[: slots.slots]]
    report = {"bundle": str(bundle), "threads": args.threads, "min_rows": single.min_rows, "steps": args.steps,
              "prompt_tokens": [len(p) for p in prompts], "levels": []}
    for count in range(1, slots.slots + 1):
        alone, shared, last = [], [], []
        for ids in prompts[:count]:
            a, b = single.new_cache(len(ids) + args.steps + 4), single.new_cache(len(ids) + args.steps + 4)
            last.append(prefill(single, a, ids, pipeline.manifest.prefill_chunk))
            prefill(single, b, ids, pipeline.manifest.prefill_chunk)
            alone.append(a), shared.append(b)
        one_by_one, together, differ = [], [], 0
        for _ in range(args.steps):
            tokens = [int(x.argmax()) for x in last]
            started = time.perf_counter()
            outs_a = [single.forward(c, [t], [c.length], np.ones((1, 1), bool), [0]) for c, t in zip(alone, tokens)]
            one_by_one.append(time.perf_counter() - started)
            started = time.perf_counter()
            outs_b = slots.run([slots.layout(c, [t], [c.length], np.ones((1, 1), bool), [0])
                                for c, t in zip(shared, tokens)])
            together.append(time.perf_counter() - started)
            differ += sum(not np.array_equal(x.logits, y.logits) for x, y in zip(outs_a, outs_b))
            for c, out in zip(alone, outs_a):
                commit(c, out, [0])
            for c, out in zip(shared, outs_b):
                commit(c, out, [0])
            last = [o.logits[0] for o in outs_a]
        level = {"conversations": count, "alone_round_s": round(statistics.median(one_by_one), 5),
                 "shared_round_s": round(statistics.median(together), 5),
                 "throughput_ratio": round(statistics.median(one_by_one) / statistics.median(together), 3),
                 "passes_with_bits_that_differ": differ, "passes": count * args.steps}
        report["levels"].append(level)
        print(json.dumps(level), file=sys.stderr)
    if args.generate:
        from edgespec.runtime.execution.shared_passes import SharedPasses

        shared = SharedPasses(single, slots)
        report["generations"] = [generations(pipeline, shared, prompts, args.generate, speculate, priced)
                                 for speculate, priced in ((True, True), (True, False), (False, True))]
        for row in report["generations"]:
            print(json.dumps(row), file=sys.stderr)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
