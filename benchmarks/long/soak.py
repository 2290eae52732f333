"""Soak: mixed generate and chat for a while under the sliding KV policy with random settings, one
pipeline, watching resident memory. Passes when nothing fails and the RSS peak of every window after warm-up stays within 5% of the first's.

The warm-up starts with the largest state the mix can reach, so that later windows are compared with
it: a conversation grown to the length at which the mix starts a new one, and, while it is held, a
generation past the context. Every sample also records the KV caches the conversation holds, so a
rise shows whether it is the conversation's cache (held by design) or memory nobody holds.

    python benchmarks/long/soak.py [BUNDLE] [--minutes 30] [--warmup-minutes 5] [--threads 2] [--seed 0] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from importlib import resources

from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.defaults import resolve_bundle


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def held_mib(session) -> float:
    """The KV caches (and feature rows) the conversation keeps between turns: its own and its drafter's."""
    caches = [session.cache, getattr(session.drafter, "cache", None)]
    return sum(c.data.nbytes + (c.features.nbytes if c.features is not None else 0)
               for c in caches if c is not None) / (1 << 20)


def random_config(rng: random.Random, max_new: int) -> GenerationConfig:
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    sampling = SamplingConfig(temperature=temperature, top_p=rng.choice([1.0, 0.9, 0.5]),
                              top_k=rng.choice([0, 0, 40]), seed=rng.randrange(1 << 30))
    return GenerationConfig(max_new_tokens=max_new, kv_policy="sliding", sampling=sampling,
                            stop_strings=rng.choice([(), (), ("\n\n",)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--warmup-minutes", type=float, default=5)
    parser.add_argument("--window-minutes", type=float, default=3, help="RSS peaks are compared per window")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    pipeline = Pipeline(resolve_bundle(args.bundle), threads=args.threads)
    lines = resources.files("edgespec").joinpath("data/prompts.jsonl").read_text().splitlines()
    questions = [json.loads(line)["messages"][-1]["content"] for line in lines]
    started = time.time()
    end = started + 60 * args.minutes
    session, messages = pipeline.new_session(), []
    counts = {"generate": 0, "chat": 0, "long": 0, "tokens": 0, "slides": 0}
    samples: list[tuple[float, float, float]] = []
    primed = False  # the warm-up's largest state reached
    while time.time() < end:
        full = len(pipeline.encode(messages=messages or [{"role": "user", "content": "x"}])) > pipeline.context * 3 // 4
        if primed:
            kind = rng.choices(["generate", "chat", "long"], weights=[5, 5, 1])[0]
        else:
            kind, primed = ("long", True) if full else ("chat", False)
        if kind == "chat":
            if full:
                session, messages = pipeline.new_session(), []
            messages.append({"role": "user", "content": rng.choice(questions)})
            result = pipeline.generate(messages=messages, config=random_config(rng, rng.randint(16, 160)),
                                       session=session)
            messages.append({"role": "assistant", "content": result.text})
        else:
            # a long one runs past the context: the sliding policy evicts and goes on
            max_new = pipeline.context + 500 if kind == "long" else rng.randint(16, 256)
            result = pipeline.generate(messages=[{"role": "user", "content": rng.choice(questions)}],
                                       config=random_config(rng, max_new), speculate=rng.random() < 0.8)
            counts["slides"] += kind == "long" and result.stats.new_tokens >= pipeline.context
        counts[kind] += 1
        counts["tokens"] += result.stats.new_tokens
        samples.append((time.time() - started, rss_mib(), held_mib(session)))
    # each request builds its own KV cache, grown by doubling to what it needs, so RSS saws between
    # requests; a leak shows in the envelope: the highest RSS of each window after warm-up
    window = 60 * args.window_minutes
    after = [(t, rss, held) for t, rss, held in samples if t >= 60 * args.warmup_minutes]
    starts = [start for start in range(int(60 * args.warmup_minutes), int(60 * args.minutes), int(window))
              if any(start <= t < start + window for t, _, _ in after)]
    peaks = [max(rss for t, rss, _ in after if start <= t < start + window) for start in starts]
    # what nobody holds: RSS less the conversation's caches at the same moment
    unheld = [max(rss - held for t, rss, held in after if start <= t < start + window) for start in starts]
    report = {"minutes": args.minutes, "requests": counts, "window_peaks_mib": [round(p, 1) for p in peaks],
              "window_peaks_less_held_kv_mib": [round(p, 1) for p in unheld],
              "peak_growth_after_warmup": round(max(peaks) / peaks[0] - 1, 4) if peaks else None,
              "rss_range_after_mib": [round(min(r for _, r, _ in after), 1), round(max(r for _, r, _ in after), 1)]
              if after else None,
              "samples": [(round(t), round(r, 1), round(h, 1)) for t, r, h in samples]}
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    flat = bool(peaks) and max(peaks) <= 1.05 * peaks[0]
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
