"""`edgespec bench`: plain and speculative decoding of one bundle, same prompts, same threads, one run (or
plain decoding alone)."""
from __future__ import annotations

import json
import resource
import sys
from importlib import resources
from pathlib import Path

from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig, Stats
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline

# getrusage's ru_maxrss is in kilobytes on Linux, in bytes on macOS
RU_MAXRSS_PER_MB = 1024 * 1024 if sys.platform == "darwin" else 1024


def load_prompts(path: Path | None) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8") if path else \
            resources.files("edgespec").joinpath("data/prompts.jsonl").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read the prompts file {path}: {err}") from err
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputError(f"{path}:{number}: not JSON ({err.msg})") from err
        if not isinstance(item, dict) or not (isinstance(item.get("messages"), list) or isinstance(item.get("prompt"), str)):
            raise InputError(f"{path}:{number}: each line needs a 'messages' list or a 'prompt' string")
        prompts.append(item)
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def one_prompt(text: str, chat: bool) -> dict:
    """`--prompt TEXT` as a prompts-file item: a user message where the bundle has a chat template (`chat`), as
    `generate --prompt --chat` sends it, else plain text."""
    if not text.strip():
        raise InputError("--prompt is empty: give the text to decode from")
    return {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}


def prompt_kwargs(item: dict) -> dict:
    """A prompts-file item as Pipeline.generate's keyword arguments."""
    return {"messages": item["messages"]} if "messages" in item else {"prompt": item["prompt"]}


def prompt_schema(item: dict) -> dict:
    """The JSON schema a prompt states after "Schema:" (benchmarks/workloads/extraction.jsonl's form)."""
    text = item["messages"][-1]["content"] if "messages" in item else item["prompt"]
    at = text.find("Schema:")
    try:
        if at < 0:
            raise InputError("no 'Schema:' in the prompt")
        schema = json.JSONDecoder().raw_decode(text[at + len("Schema:"):].lstrip())[0]
    except ValueError as err:
        raise InputError(f"--schema-in-prompt: a prompt states no JSON schema after 'Schema:' ({err})") from err
    return schema


def _summary(stats: list[Stats]) -> dict:
    tokens = sum(s.new_tokens for s in stats)
    decoded = sum(max(0, s.new_tokens - 1) for s in stats)  # the first token of each run comes from prefill
    decode_s = sum(s.decode_s for s in stats)
    passes = sum(s.target_passes for s in stats)
    accepted = sum(s.accepted_drafts for s in stats)
    by_choice: dict[str, dict[str, int]] = {}  # the step controller's choices (runtime/decoding/controller.py)
    for s in stats:
        for choice, counts in s.steps_by_choice.items():
            total = by_choice.setdefault(choice, {"steps": 0, "tokens": 0})
            total["steps"] += counts["steps"]
            total["tokens"] += counts["tokens"]
    grammar = [s.grammar_tokens for s in stats if s.grammar_tokens is not None]
    return {**({"steps_by_choice": by_choice} if by_choice else {}),
            **({"grammar_tokens_per_pass": round(sum(grammar) / passes, 3) if passes else 0.0} if grammar else {}),
            "tokens": tokens, "tokens_per_s": round(decoded / decode_s, 2) if decode_s else 0.0,
            "mean_accepted_per_pass": round((accepted + passes) / passes, 3) if passes else 0.0,
            "time_to_first_token_s": round(sum(s.first_token_s for s in stats) / len(stats), 4),
            "target_passes": passes}


def _speedup(plain: dict, speculative: dict) -> float:
    return round(speculative["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else 0.0


def run_bench(pipeline: Pipeline, prompts: list[dict], max_new_tokens: int,
              sampling: SamplingConfig = SamplingConfig(), rounds: int = 1, constraint: ConstraintSpec | None = None,
              schema_in_prompt: bool = False, plain_only: bool = False) -> dict:
    """Greedy by default; with sampling, both modes sample (same seeds) and acceptance is reported.
    `rounds` > 1 runs the prompts that many times: the totals cover every round, and each round's own
    speedup is reported beside them, so the spread of this machine's noise shows next to the figure.
    `constraint`: every output must match it; `schema_in_prompt`: each output must match the JSON schema
    its prompt states (strict); both report the tokens per pass the grammar supplied. `plain_only`: plain
    decoding alone (no speculative runs, no speedup: the report's "speculative" and "speedup" are None)."""
    if rounds < 1:
        raise InputError(f"rounds must be at least 1 (got {rounds})")
    configs = [GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, constraint=(
        ConstraintSpec.json_schema(prompt_schema(item), strict=True) if schema_in_prompt else constraint))
        for item in prompts]
    pipeline.generate("Hello", config=GenerationConfig(max_new_tokens=8), remember=False)  # first-run allocations
    if any(c.constraint is not None for c in configs):
        _ = pipeline.grammars  # the tokenizer as the grammar engine reads it: once per pipeline, not per request
    runs = {"plain": []} if plain_only else {"plain": [], "speculative": []}
    engine_s = {mode: 0.0 for mode in runs}  # inside onnxruntime, target and draft
    runners = [r for r in (pipeline.target, pipeline.draft) if r is not None]
    by_round = []
    identical = True
    for _ in range(rounds):
        # suffix drafting continues earlier outputs: each round, each prompt sees the speculative outputs of the
        # prompts before it, never its own (plain runs, the reference, are not remembered)
        pipeline.forget_outputs()
        this_round = {mode: [] for mode in runs}
        for item, config in zip(prompts, configs):
            ask = prompt_kwargs(item)
            outputs = {}
            for mode in runs:  # alternate per prompt so machine noise falls on both modes alike
                before = sum(r.run_seconds for r in runners)
                result = pipeline.generate(**ask, config=config, speculate=(mode == "speculative"),
                                           remember=(mode == "speculative"))
                engine_s[mode] += sum(r.run_seconds for r in runners) - before
                this_round[mode].append(result.stats)
                outputs[mode] = result.token_ids
            identical &= plain_only or outputs["plain"] == outputs["speculative"]
        for mode, stats in this_round.items():
            runs[mode] += stats
        if not plain_only:
            by_round.append(_speedup(*(_summary(this_round[mode]) for mode in runs)))
    report = {mode: _summary(stats) for mode, stats in runs.items()}
    for mode, stats in runs.items():  # what a generation spends outside onnxruntime: Python, numpy, tokenizer
        total = sum(s.prefill_s + s.decode_s for s in stats)
        report[mode]["python_share"] = round(max(0.0, 1 - engine_s[mode] / total), 4) if total else 0.0
    report.update(
        speculative=report.get("speculative"),
        speedup=None if plain_only else _speedup(report["plain"], report["speculative"]),
        rounds=rounds, speedup_by_round=by_round, plain_only=plain_only,
        identical_greedy=identical if sampling.greedy and not plain_only else None,
        temperature=sampling.temperature,
        constraint="schema in each prompt" if schema_in_prompt else constraint.kind if constraint else None,
        prompts=len(prompts), max_new_tokens=max_new_tokens, threads=pipeline.threads,
        drafter=pipeline.manifest.drafter.value, tree=pipeline.tree.spec(),
        lookup=pipeline.lookup.tokens if pipeline.lookup else 0,
        lookup_quote=pipeline.lookup.quote_tokens if pipeline.lookup else 0,
        ngram=pipeline.manifest.ngram.to_dict() if pipeline.manifest.ngram else None,
        suffix=pipeline.manifest.suffix.to_dict() if pipeline.manifest.suffix else None,
        step_rows=pipeline.target.min_rows,  # 1, or 2 where this device's one-row kernels round differently
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / RU_MAXRSS_PER_MB, 1),
    )
    return report


def _ngram_text(ngram: dict) -> str:
    cut = ngram["partial_match_depth"]
    return (f", n-grams of {ngram['min_n']}..{ngram['max_n']} tokens"
            + (f", depth {cut} unless quoting" if cut is not None else ""))


def print_report(report: dict, out=None) -> None:
    out = out or sys.stdout  # looked up per call: a default bound at import would miss a redirected stdout
    p, s = report["plain"], report["speculative"]
    print(f"prompts: {report['prompts']} x {report['max_new_tokens']} new tokens, {report['threads']} threads, "
          f"drafter: {report['drafter']}, tree: {report['tree']}"
          + (f" + lookup of {report['lookup']} tokens" if report.get("lookup") or report.get("lookup_quote")
             else "")
          + (f" ({report['lookup_quote']} when quoting)" if report.get("lookup_quote") else "")
          + (_ngram_text(report["ngram"]) if report.get("ngram") else "")
          + (", suffix drafting under the step controller" if report.get("suffix") else ""), file=out)
    print(f"plain        {p['tokens_per_s']:8.2f} tokens/s   TTFT {p['time_to_first_token_s'] * 1000:7.1f} ms   "
          f"{100 * p['python_share']:.1f}% outside onnxruntime"
          + (f"   one-token steps of {report['step_rows']} rows (docs/exactness.md)" if report.get("step_rows", 1) > 1
             else ""), file=out)
    if s is None:  # --plain-only
        if p.get("grammar_tokens_per_pass") is not None:
            print(f"constrained ({report['constraint']}): the grammar supplied {p['grammar_tokens_per_pass']:.2f} "
                  "tokens per target pass", file=out)
        print(f"plain decoding only   peak RSS {report['peak_rss_mb']:.0f} MB", file=out)
        return
    print(f"speculative  {s['tokens_per_s']:8.2f} tokens/s   TTFT {s['time_to_first_token_s'] * 1000:7.1f} ms   "
          f"{100 * s['python_share']:.1f}% outside onnxruntime   {s['mean_accepted_per_pass']:.2f} tokens per target pass",
          file=out)
    if s.get("grammar_tokens_per_pass") is not None:
        print(f"constrained ({report['constraint']}): the grammar supplied {s['grammar_tokens_per_pass']:.2f} tokens "
              "per target pass", file=out)
    if s.get("steps_by_choice"):
        print("steps chosen   " + ", ".join(f"{choice} {c['steps']} ({c['tokens'] / c['steps']:.2f} tokens per pass)"
                                            for choice, c in sorted(s["steps_by_choice"].items())), file=out)
    same = "n/a (sampling)" if report["identical_greedy"] is None else report["identical_greedy"]
    spread = f" (rounds: {', '.join(f'{r:.2f}' for r in report['speedup_by_round'])})" if report["rounds"] > 1 else ""
    print(f"speedup {report['speedup']:.2f}x{spread}   identical greedy output: {same}   "
          f"peak RSS {report['peak_rss_mb']:.0f} MB", file=out)
