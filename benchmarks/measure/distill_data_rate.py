"""Training data per hour: the target's greedy answers to distill's prompts, made by each data engine on
the same prompts in one run (history.md §50).

    python benchmarks/measure/distill_data_rate.py [--prompts 64] [--slots 32] [--engines onnx,torch]

onnx: the target's graph quantized as the default bundle's (int4), `slots` answers per pass, slots refilled as
answers end (distill/engine.py). torch: transformers' generate over batches of `slots` prompts, float32
(what `edgespec distill` used before, and what --device cuda runs). Tokens counted are supervised answer
tokens; each engine answers the same prompts, in shards of 64 as distill makes them.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from edgespec.distill.data import TorchTarget, end_of_turn_ids
from edgespec.distill.engine import OnnxTarget, engine_graph
from edgespec.distill.prompts import default_corpus, training_prompts
from edgespec.exporters.sources import resolve_source
from edgespec.runtime.execution.paths import cache_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engines", default="onnx,torch")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = resolve_source("default", cache_dir()).load()
    texts = training_prompts(args.prompts, args.seed, default_corpus())
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                              add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)[-384:] for t in texts]
    eos = end_of_turn_ids(tokenizer)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.engines.split(","):
            if name == "onnx":
                graph, facts = engine_graph(model, Path(scratch) / "engine", "int4", 2048)
                target = OnnxTarget(graph, facts, args.slots, args.threads)
            else:
                target = TorchTarget(model, "cpu", args.slots, int(tokenizer.pad_token_id or tokenizer.eos_token_id))
            started, tokens = time.perf_counter(), 0
            # distill's shards: sorted by length within each, one stream of answers over them all
            ordered = [p for at in range(0, len(prompts), 64) for p in sorted(prompts[at:at + 64], key=len)]
            tokens += sum(len(s[2]) for _, s in target.answers(ordered, 256, 16, eos))
            seconds = time.perf_counter() - started
            results[name] = {"tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
                             "tokens_per_hour": round(tokens / seconds * 3600)}
            print(f"{name:6s} {tokens} answer tokens in {seconds:.1f} s: {tokens / seconds:.0f} tokens/s, "
                  f"{tokens / seconds * 3600 / 1e6:.2f} M tokens/hour", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
