"""What speculative decoding costs a step beyond its choices: plain decoding against speculative decoding whose
step controller has every source benched (runtime/decoding/controller.py: a plain step that asks no source),
one process, alternating prompt by prompt and the order round by round (history.md §85).

    python benchmarks/measure/controller_idle.py BUNDLE [--prompts FILE.jsonl] [--first 8] [--rounds 2]
        [--max-new-tokens 64] [--threads 2] [--cprofile]

Prints decode tokens/s of each (first token excluded) and their ratio; `--cprofile` instead profiles one
generation of the first few prompts in each mode with cProfile and prints the costliest functions.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
from pathlib import Path

from edgespec.bench import load_prompts, prompt_kwargs
from edgespec.defaults import resolve_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

HOLD = 10**9  # steps each source stays benched: the whole run


def generate(pipeline: Pipeline, item: dict, config: GenerationConfig, idle: bool):
    if idle:
        pipeline.step_measurements.benched.update(suffix=HOLD, draft=HOLD)
    return pipeline.generate(**item, config=config, speculate=idle, remember=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", help="a bundle with suffix drafting (the step controller), or `default`")
    parser.add_argument("--prompts", type=Path, default=Path(__file__).parents[1] / "workloads" / "chat.jsonl")
    parser.add_argument("--first", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cprofile", action="store_true")
    args = parser.parse_args()
    pipeline = Pipeline(resolve_bundle(args.bundle), threads=args.threads)
    items = [prompt_kwargs(i) for i in load_prompts(args.prompts)][: args.first]
    config = GenerationConfig(max_new_tokens=args.max_new_tokens)
    generate(pipeline, items[0], config, False)
    generate(pipeline, items[0], config, True)  # warm, and the controller's measurements made
    if pipeline.step_measurements is None:
        raise SystemExit(f"{args.bundle}: no step controller (a bundle exported with suffix drafting has one)")
    if args.cprofile:
        for mode in ("plain", "idle"):
            profile = cProfile.Profile()
            for item in items[:4]:
                profile.enable()
                generate(pipeline, item, config, mode == "idle")
                profile.disable()
            print(f"===== {mode}")
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        return
    totals = {"plain": [0, 0.0], "idle": [0, 0.0]}
    for round_ in range(args.rounds):
        for item in items:
            for mode in (("plain", "idle") if round_ % 2 == 0 else ("idle", "plain")):
                stats = generate(pipeline, item, config, mode == "idle").stats
                totals[mode][0] += max(0, stats.new_tokens - 1)
                totals[mode][1] += stats.decode_s
    rate = {mode: n / s for mode, (n, s) in totals.items()}
    print(f"plain {rate['plain']:.2f} tokens/s, speculative held plain {rate['idle']:.2f}: "
          f"x{rate['idle'] / rate['plain']:.3f}")


if __name__ == "__main__":
    main()
