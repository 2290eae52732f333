"""Answers under tools through `edgespec serve` (issue 57 items 1-2), with OpenAI's client on one bundle:

- "Say hello." under tool_choice "auto" (one tool), beside the same request without tools and with
  tool_choice "none": the text, its finish reason and its last characters;
- tool_choice "required" and named: whether the call is made within the budget;
- a response_format with a free string field at a small budget: the string's punctuation;
- streamed, alternating with and without tools: time to the first text and chunks per token (medians),
  from one client (each prompt prefilled whole) and from a client per kind (the prompt kept, as an agent's).

    python benchmarks/measure/tools_answers.py BUNDLE [--rounds 5] [--max-tokens 24]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import openai
import uvicorn

from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
from edgespec.serve import ServeConfig, make_app
from edgespec.tool_calls import told

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now.",
                                         "parameters": {"type": "object", "properties": {}}}}
HELLO = [{"role": "user", "content": "Say hello."}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]


def start(pipeline: Pipeline, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(make_app(pipeline, ServeConfig(model="m", port=port)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def ask(client, **settings) -> dict:
    try:
        answer = client.chat.completions.create(model="m", temperature=0, **settings)
    except openai.BadRequestError as err:  # a budget no call fits in is refused up front, naming the fewest
        return {"refused": err.body["message"] if isinstance(err.body, dict) else str(err)}
    choice = answer.choices[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls or []]
    return {"text": choice.message.content, "finish": choice.finish_reason, "calls": calls,
            "tokens": answer.usage.completion_tokens}


def streamed(client, **settings) -> dict:
    begun, first, chunks, text, tokens, prompt = time.perf_counter(), None, 0, "", None, None
    for part in client.chat.completions.create(model="m", temperature=0, stream=True,
                                               stream_options={"include_usage": True}, **settings):
        if part.usage is not None:
            tokens, prompt = part.usage.completion_tokens, part.usage.prompt_tokens
        if part.choices and part.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - begun
            chunks += 1
            text += part.choices[0].delta.content
    return {"ttft_s": first, "chunks": chunks, "tokens": tokens, "text": text, "prompt_tokens": prompt}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8757)
    args = parser.parse_args(argv)
    pipeline = Pipeline(args.bundle)
    server = start(pipeline, args.port)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=600)
    report = {}
    for budget in (args.max_tokens, 64):
        report[f"hello_{budget}"] = {
            "auto": ask(client, messages=HELLO, max_tokens=budget, tools=[WEATHER], tool_choice="auto"),
            "none": ask(client, messages=HELLO, max_tokens=budget, tools=[WEATHER], tool_choice="none"),
            "no_tools": ask(client, messages=HELLO, max_tokens=budget)}
    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    now = [{"role": "user", "content": "What time is it?"}]
    report["calls"] = {}
    for name, tool, messages in (("get_weather", WEATHER, weather), ("get_time", TIME, now)):
        for choice in ("required", {"type": "function", "function": {"name": name}}, "auto"):
            key = f"{name} {choice if isinstance(choice, str) else 'named'}"
            report["calls"][key] = ask(client, messages=messages, max_tokens=args.max_tokens, tools=[tool],
                                       tool_choice=choice)
            if "refused" in report["calls"][key]:  # the fewest tokens the refusal names
                fewest = int(report["calls"][key]["refused"].split("raise max_tokens to ")[1].split()[0])
                report["calls"][f"{key} at {fewest}"] = ask(client, messages=messages, max_tokens=fewest,
                                                            tools=[tool], tool_choice=choice)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    report["response_format"] = ask(client, messages=[{"role": "user", "content": "Say hello in one sentence."}],
                                    max_tokens=args.max_tokens, response_format={
                                        "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    # the text the same prompt (the tools told) gives without the call grammar: what "auto" must leave alone
    told_messages, told_tools = told(HELLO, (WEATHER["function"],), pipeline.codec.takes_tools)
    free = pipeline.generate(ids=pipeline.encode(messages=told_messages, tools=told_tools),
                             config=GenerationConfig(max_new_tokens=64), remember=False)
    report["hello_told_without_grammar"] = {"text": free.text, "stop_reason": free.stop_reason}
    # streamed, alternating: "cold" from one client (each prompt prefilled whole: the tools make it longer),
    # "kept" with a client per kind (an agent resends its tools each turn: the prompt is the kept one's)
    report["streamed"] = {}
    for mode, messages in (("cold", HELLO), ("kept", HELLO), ("kept story", STORY)):
        runs = {"tools": [], "no_tools": []}
        for _ in range(args.rounds):
            runs["tools"].append(streamed(client, messages=messages, max_tokens=64, tools=[WEATHER],
                                          **({"user": "tools"} if mode != "cold" else {})))
            runs["no_tools"].append(streamed(client, messages=messages, max_tokens=64,
                                             **({"user": "plain"} if mode != "cold" else {})))
        row = {name: {"ttft_s": statistics.median(r["ttft_s"] for r in rs),
                      "chunks_per_token": statistics.median(r["chunks"] / r["tokens"] for r in rs),
                      "prompt_tokens": rs[-1]["prompt_tokens"], "text": rs[-1]["text"]} for name, rs in runs.items()}
        row["ttft_ratio"] = row["tools"]["ttft_s"] / row["no_tools"]["ttft_s"]
        report["streamed"][mode] = row
    json.dump(report, sys.stdout, indent=1, ensure_ascii=False)
    print()
    server.should_exit = True


if __name__ == "__main__":
    main()
