"""Structured output on the extraction set: how many outputs parse and validate, constrained speculative against
constrained plain decoding, the tokens the grammar supplies, what the grammar costs a pass, and time to first
token with a 2 KB schema.

    python benchmarks/measure/structured_output.py [BUNDLE] [--prompts benchmarks/workloads/extraction.jsonl]
        [--count 8] [--max-new-tokens 384] [--ttft-rounds 5] [--json FILE] [--show] [--bounds ITEMS,CHARS]

Per prompt, alternating: unconstrained speculative (does its answer parse as JSON after stripping code fences,
and validate?), constrained plain and constrained speculative with the prompt's own schema in strict form
(runtime/decoding/constraints.py: closed objects). Reported: outputs that parse and validate (jsonschema), tokens/s of
both constrained modes and whether their tokens are identical, tokens per target pass and those the grammar
supplied, and the grammar's seconds per pass (masks per tree node, forced tokens, advancing the parser,
timed around the Guide's methods) against the rest of the pass. TTFT: one extraction prompt, with and
without a schema of at least 2 KB (the prompt's schema with more properties), alternating, the median of
`--ttft-rounds`; the tokenizer as the grammar engine reads it is made once per pipeline, before.
`--show` prints each constrained output. `--bounds ITEMS,CHARS` (an experiment, history.md §63): every array
of the prompt's schema without a `maxItems` gets ITEMS, every free string (no enum, format or maxLength)
CHARS as its `maxLength`, and every number `multipleOf: 0.01`, in the schema the prompt shows and in the
constraint alike; validity is then judged against the bounded schema. Constrained outputs close within
`--max-new-tokens` (runtime/decoding/closing.py): `stop` "closed" where the budget ended one (history.md §67).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import jsonschema
from edgespec.runtime.decoding.constraints import ConstraintSpec, Guide
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.bench import prompt_schema
from edgespec.defaults import resolve_bundle

WORKLOAD = Path(__file__).resolve().parents[1] / "workloads" / "extraction.jsonl"


class GrammarClock:
    """Seconds spent in the Guide's per-step methods (wrapped on the class, for this process only)."""

    def __init__(self):
        self.seconds = 0.0
        for name in ("admit", "advance", "forced", "mask"):
            setattr(Guide, name, self._timed(getattr(Guide, name)))

    def _timed(self, method):
        def outer(guide, *args, **kwargs):  # admit calls mask: the outermost call is counted, once
            if getattr(guide, "_inside", False):
                return method(guide, *args, **kwargs)
            guide._inside = True
            started = time.perf_counter()
            try:
                return method(guide, *args, **kwargs)
            finally:
                guide._inside = False
                self.seconds += time.perf_counter() - started
        return outer


def parses(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses as JSON after stripping a code fence, validates against `schema`)."""
    fenced = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def bounded(schema, items: int, chars: int):
    """`schema` with its arrays, free strings and numbers bounded (`--bounds`)."""
    if isinstance(schema, list):
        return [bounded(s, items, chars) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: bounded(value, items, chars) for key, value in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if "array" in kinds:
        out.setdefault("maxItems", items)
    if "string" in kinds and not {"enum", "format", "maxLength", "pattern"} & set(out):
        out["maxLength"] = chars
    if "number" in kinds:
        out.setdefault("multipleOf", 0.01)
    return out


def bounded_item(item: dict, items: int, chars: int) -> dict:
    """The prompt with its stated schema bounded, as the prompt shows it (2-space indented)."""
    schema = prompt_schema(item)
    shown, bigger = json.dumps(schema, indent=2), json.dumps(bounded(schema, items, chars), indent=2)
    messages = json.loads(json.dumps(item["messages"]))
    if shown not in messages[-1]["content"]:
        raise ValueError("--bounds: the prompt does not show its schema 2-space indented")
    messages[-1]["content"] = messages[-1]["content"].replace(shown, bigger)
    return {**item, "messages": messages}


def two_kb_schema(schema: dict) -> dict:
    """`schema` with more string properties until its JSON text is at least 2 KB."""
    bigger = json.loads(json.dumps(schema))
    n = 0
    while len(json.dumps(bigger)) < 2048:
        bigger["properties"][f"extra_field_{n}"] = {"type": ["string", "null"], "description": "not in the text: null"}
        bigger.setdefault("required", []).append(f"extra_field_{n}")
        n += 1
    return bigger


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--prompts", default=str(WORKLOAD))
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--ttft-rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--show", action="store_true", help="print each constrained output")
    parser.add_argument("--bounds", help="ITEMS,CHARS: bound the prompts' schemas (an experiment)")
    args = parser.parse_args(argv)
    pipeline = Pipeline(resolve_bundle(args.bundle))
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.count]
    if args.bounds:
        limits = [int(n) for n in args.bounds.split(",")]
        items = [bounded_item(item, *limits) for item in items]
    pipeline.generate("Hello", config=GenerationConfig(max_new_tokens=8), remember=False)
    _ = pipeline.grammars
    clock = GrammarClock()
    rows = []
    for number, item in enumerate(items):
        schema = prompt_schema(item)
        free = GenerationConfig(max_new_tokens=args.max_new_tokens)
        constrained = GenerationConfig(max_new_tokens=args.max_new_tokens,
                                       constraint=ConstraintSpec.json_schema(schema, strict=True))
        unconstrained = pipeline.generate(messages=item["messages"], config=free, remember=False)
        plain = pipeline.generate(messages=item["messages"], config=constrained, speculate=False, remember=False)
        clock.seconds = 0.0
        fast = pipeline.generate(messages=item["messages"], config=constrained)
        grammar_s = clock.seconds
        s, p = fast.stats, plain.stats
        row = {"prompt": number, "identical": fast.token_ids == plain.token_ids, "stop": fast.stop_reason,
               "tokens": s.new_tokens, "unconstrained_parses": parses(unconstrained.text, schema),
               "constrained_parses": parses(fast.text, schema), "plain_tokens_per_s": round(p.tokens_per_s, 2),
               "speculative_tokens_per_s": round(s.tokens_per_s, 2), "passes": s.target_passes,
               "tokens_per_pass": round(s.mean_accepted_per_pass, 3),
               "grammar_tokens_per_pass": round(s.grammar_tokens / s.target_passes, 3) if s.target_passes else 0.0,
               "grammar_ms_per_pass": round(1000 * grammar_s / max(1, s.target_passes), 3),
               "grammar_share_of_pass": round(grammar_s / max(1e-9, s.decode_s - grammar_s), 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.show:
            print("   ", fast.text, flush=True)
    # time to first token: the first prompt, without a schema and with a 2 KB one, alternating
    item = items[0]
    big = two_kb_schema(prompt_schema(item))
    ttft = {"none": [], "2KB": []}
    for _ in range(args.ttft_rounds):
        for label, constraint in (("none", None), ("2KB", ConstraintSpec.json_schema(big, strict=True))):
            config = GenerationConfig(max_new_tokens=2, constraint=constraint, close_within_budget=False)
            ttft[label].append(pipeline.generate(messages=item["messages"], config=config, speculate=False,
                                                 remember=False).stats.first_token_s)
    ttft_ms = {label: round(1000 * statistics.median(v), 1) for label, v in ttft.items()}
    plain_rate = sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["plain_tokens_per_s"] for r in rows)
    fast_rate = sum(r["tokens"] for r in rows) / sum(r["tokens"] / r["speculative_tokens_per_s"] for r in rows)
    passes = sum(r["passes"] for r in rows)
    summary = {
        "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "unconstrained_parse": sum(r["unconstrained_parses"][0] for r in rows),
        "unconstrained_valid": sum(r["unconstrained_parses"][1] for r in rows),
        "constrained_parse": sum(r["constrained_parses"][0] for r in rows),
        "constrained_valid": sum(r["constrained_parses"][1] for r in rows),
        "finished": sum(r["stop"] == "eos" for r in rows), "closed": sum(r["stop"] == "closed" for r in rows),
        "identical": all(r["identical"] for r in rows),
        "plain_tokens_per_s": round(plain_rate, 2), "speculative_tokens_per_s": round(fast_rate, 2),
        "speedup": round(fast_rate / plain_rate, 3),
        "tokens_per_pass": round(sum(r["tokens_per_pass"] * r["passes"] for r in rows) / passes, 3),
        "grammar_tokens_per_pass": round(sum(r["grammar_tokens_per_pass"] * r["passes"] for r in rows) / passes, 3),
        "grammar_share_of_pass": round(statistics.median(r["grammar_share_of_pass"] for r in rows), 4),
        "ttft_ms": ttft_ms, "ttft_ratio": round(ttft_ms["2KB"] / ttft_ms["none"], 3),
        "schema_bytes": len(json.dumps(big)),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
