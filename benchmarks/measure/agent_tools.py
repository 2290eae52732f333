"""Tool calls on the agent set: how many calls the model makes, and how many of their arguments validate
against their tool's schema, through the server's own path (edgespec/openai_api.py, edgespec/tool_calls.py).

    python benchmarks/measure/agent_tools.py [BUNDLE] [--prompts benchmarks/workloads/agent.jsonl] [--count 8]
        [--max-tokens 256] [--modes auto,required,named] [--parallel] [--json FILE] [--show]

benchmarks/workloads/agent.jsonl states each conversation's tools in its system message ("- name: what it
does" then "arguments schema: {...}") with a protocol of its own ({"tool": ..., "arguments": ...} answers,
results as "Tool result:" turns). Here each becomes the request an OpenAI client would send: the tools as
`tools`, the system message without the tool list and protocol, earlier calls as `tool_calls` and results as
`tool` messages. Per conversation, greedy: `tool_choice` "auto", "required", and each offered tool by name
("named"); `--parallel` sends `parallel_tool_calls: true` (several calls an answer). Counted: answers that
are calls, the calls and those whose arguments parse and validate (jsonschema), calls of the named tool, and
the stop reason; speculative against plain decoding, identical or not.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import jsonschema
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.defaults import resolve_bundle
from edgespec.openai_api import parse_chat
from edgespec.tool_calls import read_call, told

WORKLOAD = Path(__file__).resolve().parents[1] / "workloads" / "agent.jsonl"
TOOL_LINE = re.compile(r"^- (\w+): (.*)\n  arguments schema: (\{.*\})$", re.M)


def openai_request(item: dict) -> tuple[list[dict], list[dict]]:
    """(messages, tools) of one agent-set conversation, as an OpenAI client sends them."""
    system = item["messages"][0]["content"]
    tools = [{"type": "function", "function": {"name": name, "description": description,
                                                "parameters": json.loads(schema)}}
             for name, description, schema in TOOL_LINE.findall(system)]
    if not tools:
        raise ValueError("a conversation of the agent set states no tools")
    messages = [{"role": "system", "content": system[: system.index("\n\nTools:")].strip()}]
    last_call = None
    for n, message in enumerate(item["messages"][1:]):
        content = message["content"]
        if message["role"] == "assistant" and content.startswith("{\"tool\""):
            call = json.loads(content)
            last_call = f"call_{n}"
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": last_call, "type": "function",
                 "function": {"name": call["tool"], "arguments": json.dumps(call["arguments"])}}]})
        elif message["role"] == "user" and content.startswith("Tool result: ") and last_call:
            messages.append({"role": "tool", "tool_call_id": last_call, "content": content[len("Tool result: "):]})
        else:
            messages.append({"role": message["role"], "content": content})
    return messages, tools


def answer(pipeline: Pipeline, messages: list[dict], tools: list[dict], choice, max_tokens: int, speculate: bool,
           parallel: bool = False):
    """The answer to one request, as `edgespec serve` makes it: (the result, the tool calls or None)."""
    completion = parse_chat({"model": "m", "messages": messages, "tools": tools, "tool_choice": choice,
                             "max_tokens": max_tokens, "temperature": 0, "parallel_tool_calls": parallel}, "m")
    shown, template_tools = told(list(completion.messages), completion.tools, pipeline.codec.takes_tools)
    ids = pipeline.encode(messages=shown, tools=template_tools)
    config = GenerationConfig(max_new_tokens=max_tokens, constraint=completion.constraint)
    result = pipeline.generate(ids=ids, config=config, speculate=speculate, remember=False)
    # a complete answer: the model's own end, or one the budget closed (history.md §67), as the server reads it
    return result, (read_call(result.text) if result.stop_reason in ("eos", "closed") else None)


def validates(call: dict, schemas: dict) -> bool:
    try:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    except jsonschema.ValidationError:
        return False
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--prompts", default=str(WORKLOAD))
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--modes", default="auto,required,named")
    parser.add_argument("--parallel", action="store_true", help="parallel_tool_calls: true")
    parser.add_argument("--json", help="also write the report to this file")
    parser.add_argument("--show", action="store_true", help="print each answer's text")
    args = parser.parse_args(argv)
    pipeline = Pipeline(resolve_bundle(args.bundle))
    items = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()][: args.count]
    rows = []
    for number, item in enumerate(items):
        messages, tools = openai_request(item)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        choices = []
        for mode in args.modes.split(","):
            choices += ([("named", {"type": "function", "function": {"name": name}}) for name in schemas]
                        if mode == "named" else [(mode, mode)])
        for mode, choice in choices:
            fast, calls = answer(pipeline, messages, tools, choice, args.max_tokens, True, args.parallel)
            plain, _ = answer(pipeline, messages, tools, choice, args.max_tokens, False, args.parallel)
            made = [call["function"] for call in calls or []]
            row = {"prompt": number, "mode": mode, "named": choice["function"]["name"] if mode == "named" else None,
                   "stop": fast.stop_reason, "tokens": fast.stats.new_tokens, "call": bool(made),
                   "calls": len(made), "tool": made[0]["name"] if made else None,
                   "valid": sum(validates(call, schemas) for call in made),
                   "identical": fast.token_ids == plain.token_ids,
                   "tokens_per_pass": round(fast.stats.mean_accepted_per_pass, 3),
                   "grammar_tokens_per_pass": round(fast.stats.grammar_tokens / max(1, fast.stats.target_passes), 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.show:
                print("   ", fast.text[:600].replace("\n", "\\n"), flush=True)
    summary = {"requests": len(rows), "max_tokens": args.max_tokens, "parallel_tool_calls": args.parallel,
               "identical": sum(r["identical"] for r in rows)}
    for mode in {r["mode"] for r in rows}:
        some = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"requests": len(some), "answers_that_call": sum(r["call"] for r in some),
                         "calls": sum(r["calls"] for r in some), "valid_calls": sum(r["valid"] for r in some),
                         "cut": sum(r["stop"] not in ("eos", "closed") for r in some),
                         "closed": sum(r["stop"] == "closed" for r in some),
                         "named_tool_called": sum(r["tool"] == r["named"] for r in some) if mode == "named" else None}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
