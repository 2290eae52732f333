"""Static-shape graphs beside the dynamic ones, on the CPU provider: a bundle exported for a dynamic and a
static profile (`export ... --profile cpu --profile ai-pc-intel`) decodes the same prompts with each
profile's graphs (the static profile's: a static draft, and a static target where the profile verifies on
its NPU), alternating prompt by prompt in one process; prints tokens/s plain and speculative, tokens per
pass, and whether every output equals the dynamic graphs' plain decoding.

    python benchmarks/measure/static_shapes.py BUNDLE [--static-profile ai-pc-intel] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.bench import load_prompts, prompt_kwargs

HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("--static-profile", default="ai-pc-intel")
    parser.add_argument("--prompts", nargs="+", default=[None, str(HERE / "edit_prompts.jsonl")])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the static profile's NPU is not here
        pipelines = {"dynamic": Pipeline(args.bundle, args.threads),
                     "static": Pipeline(args.bundle, args.threads, profile=args.static_profile)}
    chosen = pipelines["static"]
    roles = {role: runner.static for role, runner in (("target", chosen.target), ("draft", chosen.draft))
             if runner is not None and runner.static is not None}
    if not roles:
        raise SystemExit(f"{args.bundle} has no static graphs for {args.static_profile}")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    for role, static in roles.items():
        print(f"static {role} graph: {static.nodes} nodes per pass, a KV buffer of {static.context} tokens")
    for path in args.prompts:
        name = Path(path).name if path else "prompts.jsonl (built-in)"
        totals = {(form, mode): [0, 0.0, 0, 0] for form in pipelines for mode in ("plain", "speculative")}
        identical = {key: True for key in totals}
        for item in load_prompts(Path(path) if path else None):
            reference = None
            for (form, mode), total in totals.items():
                result = pipelines[form].generate(**prompt_kwargs(item), config=config, speculate=mode != "plain")
                reference = reference if reference is not None else result.token_ids
                identical[(form, mode)] &= result.token_ids == reference
                stats = result.stats
                total[0] += stats.new_tokens - 1
                total[1] += stats.decode_s
                total[2] += stats.target_passes
                total[3] += stats.accepted_drafts
        print(f"\n{name}: {args.max_new_tokens} new tokens, greedy")
        print(f"{'graphs':10s} {'mode':12s} {'tokens/s':>9s} {'tok/pass':>9s}  identical to dynamic plain")
        for (form, mode), (decoded, seconds, passes, accepted) in totals.items():
            print(f"{form:10s} {mode:12s} {decoded / seconds:9.1f} {(accepted + passes) / passes:9.2f}  "
                  f"{identical[(form, mode)]}")


if __name__ == "__main__":
    main()
