"""Placement by measurement, checked: `edgespec calibrate`'s short run predicts each placement's decoding
speed; this runs every placement it measured on whole prompt sets (alternating prompt by prompt, one
process) and prints predicted against measured, with the output checked identical to plain decoding.

    python benchmarks/measure/placement.py [BUNDLE] [--threads N] [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline, default_threads

from edgespec.bench import load_prompts, prompt_kwargs
from edgespec.calibrate import CALIBRATION_PROMPTS, calibrate
from edgespec.defaults import resolve_bundle

HERE = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--threads", type=int, default=None, help="cores to place the roles on (default: all)")
    parser.add_argument("--prompts", nargs="+", default=[None, str(HERE / "edit_prompts.jsonl")],
                        help="JSONL prompt sets (default: the built-in prompts and the edit prompts)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--profile", default=None, help="look for the draft's providers in this profile")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    folder = resolve_bundle(args.bundle)
    cores = args.threads or default_threads()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    say("calibrating (as `edgespec calibrate` does)")
    calibration = calibrate(folder, load_prompts(None)[:CALIBRATION_PROMPTS], cores, say=say,
                            profile=args.profile)
    print(calibration.report())
    pipelines = [Pipeline(folder, placement=m.placement) for m in calibration.measured]
    plain = Pipeline(folder, threads=cores)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, stop_at_eos=False)
    figures = {}
    for path in args.prompts:
        name = Path(path).name if path else "prompts.jsonl (built-in)"
        decoded, seconds, identical = [0] * len(pipelines), [0.0] * len(pipelines), [True] * len(pipelines)
        for item in load_prompts(Path(path) if path else None):
            reference = plain.generate(**prompt_kwargs(item), config=config, speculate=False).token_ids
            for i, pipeline in enumerate(pipelines):
                result = pipeline.generate(**prompt_kwargs(item), config=config)
                decoded[i] += result.stats.new_tokens - 1
                seconds[i] += result.stats.decode_s
                identical[i] &= result.token_ids == reference
        print(f"\n{name}: {args.max_new_tokens} new tokens, greedy, {cores} cores")
        print(f"{'placement':64s} {'predicted':>9s} {'measured':>9s} {'pred/meas':>9s}  identical")
        rows = []
        for m, d, s, same in zip(calibration.measured, decoded, seconds, identical):
            measured = d / s
            rows.append({"placement": m.placement.to_dict(), "predicted": m.tokens_per_s,
                         "measured": round(measured, 2), "identical": same})
            print(f"{m.placement.describe():64s} {m.tokens_per_s:9.1f} {measured:9.1f} "
                  f"{m.tokens_per_s / measured:9.2f}  {same}")
        fastest = max(rows, key=lambda r: r["measured"])["placement"]
        print(f"calibration chose the fastest measured: {fastest == calibration.chosen.placement.to_dict()}")
        figures[name] = rows
    if args.json:
        Path(args.json).write_text(json.dumps({"calibration": calibration.to_dict(), "runs": figures}, indent=1))


if __name__ == "__main__":
    main()
