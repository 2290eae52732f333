"""What `edgespec serve` adds to one client, measured from OpenAI's client: a single streamed request's
tokens/s against `edgespec generate` on the same prompt, and the time to first token of a conversation's
turn 2 against its turn 1 (load and abuse: benchmarks/measure/serve_load.py).

    pip install -e ".[serve,dev]"
    python benchmarks/measure/serve_overhead.py [BUNDLE] [--port 8765] [--threads 2] [--json FILE]

Starts the server itself (a process of its own) and stops it at the end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from importlib import resources

import openai

SYSTEM = ("You are a careful assistant for a small engineering team. Answer in plain English, keep answers "
          "short, say when you are unsure, prefer concrete examples, and never invent facts, names or numbers. "
          "When asked about code, show a minimal example and explain each step in one sentence. ") * 3


def start_server(bundle: str, port: int, threads: int, model: str) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "serve", bundle, "--port", str(port),
                               "--threads", str(threads), "--queue", "64", "--model-name", model],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600  # the default bundle may be built on first use
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return server
        except OSError:
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the server did not come up")


def streamed(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed request: latency, time to first token, decode tokens/s at the client, usage."""
    started = time.perf_counter()
    first = last = None
    text, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            first = first if first is not None else now
            last = now
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    done = time.perf_counter()
    tokens = usage.completion_tokens
    return {"latency_s": done - started, "ttft_s": (first or done) - started, "text": text, "tokens": tokens,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "tokens_per_s": (tokens - 1) / (last - first) if first is not None and last > first else 0.0}


def generate_tokens_per_s(bundle: str, prompt: str, max_tokens: int, threads: int) -> float:
    out = subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", bundle, "--prompt", prompt, "--chat",
                          "--max-new-tokens", str(max_tokens), "--threads", str(threads), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["stats"]["tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundle", nargs="?", default="default")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    model = "bench"
    lines = resources.files("edgespec").joinpath("data/prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line)["messages"] for line in lines]
    server = start_server(args.bundle, args.port, args.threads, model)
    report = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0,
                               timeout=600)
        streamed(client, model, prompts[0], 8)  # warm up
        # 1. one streamed request against `edgespec generate`, alternating, same prompt
        server_rates, generate_rates = [], []
        for round_ in range(3):
            for messages in prompts[:3]:
                server_rates.append(streamed(client, model, messages, args.max_tokens)["tokens_per_s"])
        server.send_signal(subprocess.signal.SIGSTOP)  # the idle server keeps no core, but take no chances
        try:
            for round_ in range(3):
                for messages in prompts[:3]:
                    generate_rates.append(generate_tokens_per_s(args.bundle, messages[-1]["content"], args.max_tokens,
                                                                args.threads))
        finally:
            server.send_signal(subprocess.signal.SIGCONT)
        report["single_stream"] = {"server_tokens_per_s": round(statistics.median(server_rates), 2),
                                   "generate_tokens_per_s": round(statistics.median(generate_rates), 2)}
        report["single_stream"]["ratio"] = round(report["single_stream"]["server_tokens_per_s"]
                                                 / report["single_stream"]["generate_tokens_per_s"], 3)
        # 2. turn 2 against turn 1, with a system prompt a real assistant carries
        turns = []
        for messages in prompts[:4]:
            conversation = [{"role": "system", "content": SYSTEM}, *messages]
            streamed(client, model, [{"role": "user", "content": "unrelated: name a colour"}], 4)  # no shared cache
            first = streamed(client, model, conversation, args.max_tokens)
            conversation += [{"role": "assistant", "content": first["text"]},
                             {"role": "user", "content": "Now say that in one sentence."}]
            second = streamed(client, model, conversation, 16)
            turns.append({"turn1_ttft_s": round(first["ttft_s"], 4), "turn1_prompt": first["prompt_tokens"],
                          "turn2_ttft_s": round(second["ttft_s"], 4), "turn2_prompt": second["prompt_tokens"],
                          "turn2_cached": second["cached_tokens"]})
        report["turns"] = turns
        report["turn2_over_turn1_ttft"] = round(statistics.median(t["turn2_ttft_s"] for t in turns)
                                                / statistics.median(t["turn1_ttft_s"] for t in turns), 3)
    finally:
        server.terminate()
        server.wait(timeout=30)
    single = report["single_stream"]
    print(f"one streamed request: {single['server_tokens_per_s']} tokens/s through the server, "
          f"{single['generate_tokens_per_s']} with edgespec generate ({single['ratio']}x)")
    for t in report["turns"]:
        print(f"turn 1: {t['turn1_prompt']} prompt tokens, TTFT {t['turn1_ttft_s'] * 1000:.0f} ms; turn 2: "
              f"{t['turn2_prompt']} prompt tokens, {t['turn2_cached']} cached, TTFT {t['turn2_ttft_s'] * 1000:.0f} ms")
    print(f"turn 2 / turn 1 time to first token (medians): {report['turn2_over_turn1_ttft']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
