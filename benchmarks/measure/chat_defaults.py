"""Does `edgespec chat` with its defaults loop? Asks "What is the capital of France?" under N seeds with
the conversation defaults (Pipeline.sampling_defaults, as `edgespec chat` and the server use them) and
greedily, and reports, for each answer, whether it ran to its token limit repeating a phrase.

A loop: the answer stopped at the token limit and its last 96 tokens are one phrase of 2..32 tokens
repeated at least 3 times over.

    python benchmarks/measure/chat_defaults.py [BUNDLE] [--seeds 10] [--max-new-tokens 256] [--json]
"""
from __future__ import annotations

import argparse
import json

from edgespec.defaults import resolve_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import with_defaults
from edgespec.runtime.pipeline import Pipeline

QUESTION = "What is the capital of France?"


def loops(token_ids: list[int], stop_reason: str, tail: int = 96) -> bool:
    if stop_reason != "max_new_tokens" or len(token_ids) < tail:
        return False
    end = token_ids[-tail:]
    for size in range(2, 33):
        phrase = end[-size:]
        repeats = 0
        while end[len(end) - (repeats + 1) * size : len(end) - repeats * size] == phrase:
            repeats += 1
        if repeats * size >= tail - size and repeats >= 3:
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    pipeline = Pipeline(resolve_bundle(args.bundle))
    messages = [{"role": "user", "content": QUESTION}]
    runs = [("greedy", with_defaults({"temperature": 0.0}, {}))]
    runs += [(f"seed {s}", with_defaults({"seed": s}, pipeline.sampling_defaults)) for s in range(args.seeds)]
    rows = []
    for name, sampling in runs:
        result = pipeline.generate(messages=messages, config=GenerationConfig(max_new_tokens=args.max_new_tokens,
                                                                               sampling=sampling))
        rows.append({"run": name, "tokens": len(result.token_ids), "stop_reason": result.stop_reason,
                     "loops": loops(result.token_ids, result.stop_reason), "names_paris": "Paris" in result.text,
                     "text": result.text})
    sampled = rows[1:]
    summary = {"defaults": pipeline.sampling_defaults, "seeds": args.seeds,
               "sampled_loops": sum(r["loops"] for r in sampled), "sampled_name_paris": sum(r["names_paris"] for r in sampled),
               "greedy_loops": rows[0]["loops"], "rows": rows}
    if args.json:
        print(json.dumps(summary))
        return
    for r in rows:
        print(f"{r['run']:>8}: {r['tokens']:3d} tokens, {r['stop_reason']:<14} loops={r['loops']!s:<5} "
              f"Paris={r['names_paris']!s:<5} {r['text'][:90]!r}")
    print(f"defaults {summary['defaults']}: {summary['sampled_loops']}/{args.seeds} sampled answers loop, "
          f"{summary['sampled_name_paris']}/{args.seeds} name Paris; greedy loops: {summary['greedy_loops']}")


if __name__ == "__main__":
    main()
