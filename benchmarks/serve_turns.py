# usage: edgespec serve default --port 8765 &  then  python benchmarks/serve_turns.py 8765
"""Time to first token of a conversation's second turn through `edgespec serve`: with the first turn's
cache (the server keeps the last conversation), and the same request after another conversation."""
import sys, time, statistics
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none")
def ask(messages, max_tokens=64):
    started = time.perf_counter(); first = None; text = ""; usage = None
    for c in client.chat.completions.create(model="default", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True}):
        if c.choices and c.choices[0].delta.content and first is None:
            first = time.perf_counter() - started
        if c.choices: text += c.choices[0].delta.content or ""
        if c.usage: usage = c.usage
    return text, usage, first * 1000
ask([{"role": "user", "content": "warm up"}], 4)
cached, fresh = [], []
for q in ["Write a short paragraph about why the sky is blue.", "Explain what a hash map is, briefly.",
          "Give three tips for writing clear emails.", "What is the difference between a list and a tuple in Python?"]:
    messages = [{"role": "user", "content": q}]
    text, usage, _ = ask(messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Now say it in one sentence."}]
    _, u2, t2 = ask(messages, 16)
    ask([{"role": "user", "content": "Something else entirely: name a colour."}], 4)
    _, u3, t3 = ask(messages, 16)
    cached.append(t2); fresh.append(t3)
    print(f"turn 2: {u2.prompt_tokens} prompt tokens, {u2.prompt_tokens_details.cached_tokens} cached: TTFT {t2:.1f} ms; "
          f"after another conversation ({u3.prompt_tokens_details.cached_tokens} cached): {t3:.1f} ms")
print(f"median TTFT of turn 2: {statistics.median(cached):.1f} ms with its cache, {statistics.median(fresh):.1f} ms without")
