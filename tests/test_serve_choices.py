"""`n` > 1 and a list of prompts on the server, on a tiny speculative bundle: each choice is the text plain
decoding gives it (greedy, or seeded under seed + j), streamed or not, counted in usage and in the queue."""
import dataclasses
import threading
import time
from collections import defaultdict

import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig, with_defaults
from edgespec.runtime.pipeline import Pipeline

from edgespec.openai_api import MOST_CHOICES, parse_completion
from edgespec.serve_choices import choice_config
from tests.test_serve import KEY, MESSAGES, MODEL, Server, SlowPipeline

PROMPTS = ["a b c d", "the quick brown fox"]
SEEDED = dict(temperature=0.8, top_p=0.9, seed=7)


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3"), threads=1)


@pytest.fixture(scope="module")
def server(pipeline):
    running = Server(pipeline, api_keys=(KEY,), queue=4)  # 8 places with the 4 in flight
    yield running
    running.stop()


def plain(pipeline, max_tokens: int, j: int = 0, prompt: str | None = None, **sampling) -> str:
    """What plain decoding (no speculation) gives choice j: the server's sampling defaults under the request's
    fields, the seed moved by j."""
    config = GenerationConfig(max_new_tokens=max_tokens,
                              sampling=with_defaults(sampling, pipeline.sampling_defaults) if sampling else
                              SamplingConfig())
    config = choice_config(config, j)
    if prompt is None:
        return pipeline.generate(messages=MESSAGES, config=config, speculate=False).text
    return pipeline.generate(prompt, config=config, speculate=False).text


def by_index(chunks) -> tuple[dict, dict]:
    """A stream's text and finish reason by choice index (each chunk carries one choice)."""
    texts, finishes = defaultdict(str), {}
    for chunk in chunks:
        assert len(chunk.choices) <= 1
        for choice in chunk.choices:
            texts[choice.index] += getattr(choice, "text", None) or getattr(getattr(choice, "delta", None),
                                                                            "content", None) or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return dict(texts), finishes


def test_greedy_choices_are_all_the_plain_greedy_text(server, pipeline):
    client = server.client()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, n=3)
    greedy = plain(pipeline, 16)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [greedy] * 3
    direct = pipeline.generate(messages=MESSAGES, config=GenerationConfig(max_new_tokens=16))
    assert reply.usage.prompt_tokens == direct.stats.prompt_tokens  # the prompt once
    assert reply.usage.completion_tokens == 3 * len(direct.token_ids)  # every choice's tokens
    assert reply.model_extra["edgespec"]["stop_reasons"] == [direct.stop_reason] * 3


def test_seeded_choices_are_reproducible_and_each_the_plain_text_under_seed_plus_j(server, pipeline):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=16, n=4, **SEEDED)
    first = [c.message.content for c in client.chat.completions.create(**settings).choices]
    again = [c.message.content for c in client.chat.completions.create(**settings).choices]
    assert first == again == [plain(pipeline, 16, j, **SEEDED) for j in range(4)]
    assert len(set(first)) > 1  # the seeds differ, so do the draws
    alone = client.chat.completions.create(**{**settings, "n": 1}).choices[0].message.content
    assert alone == first[0]  # choice 0 is the request's answer with n = 1
    streamed, finishes = by_index(client.chat.completions.create(**settings, stream=True))
    assert [streamed[j] for j in range(4)] == first and set(finishes) == {0, 1, 2, 3}


def test_a_clients_choices_share_its_conversation_and_keep_their_texts(server, pipeline):
    """Choices of one client run beside each other, one continuing its kept conversation (a cached prefix, a
    drafter that learned), the others their own: what they answer stays each choice's own text."""
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=12, n=3, user="choices", **SEEDED)
    expected = [plain(pipeline, 12, j, **SEEDED) for j in range(3)]
    for _ in range(2):
        assert [c.message.content for c in client.chat.completions.create(**settings).choices] == expected


def test_streamed_choices_carry_their_index_and_usage_counts_them_all(server, pipeline):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=10, n=2, **SEEDED)
    chunks = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    whole = client.chat.completions.create(**settings)
    texts, finishes = by_index(chunks)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert {c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role} == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert whole.usage.prompt_tokens == chunks[-1].usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_list_of_prompts_gets_n_choices_each_indexed_as_openai_does(server, pipeline):
    client = server.client()
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, n=2, **SEEDED)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    expected = [plain(pipeline, 10, j, prompt=p, **SEEDED) for p in PROMPTS for j in range(2)]
    assert [c.text for c in reply.choices] == expected
    assert reply.usage.prompt_tokens == sum(len(pipeline.encode(p)) for p in PROMPTS)
    streamed, _ = by_index(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, n=2, stream=True,
                                                     **SEEDED))
    assert [streamed[i] for i in range(4)] == expected
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=10, temperature=0)
    assert [c.text for c in greedy.choices] == [plain(pipeline, 10, prompt=p) for p in PROMPTS]


def test_echo_and_logprobs_work_per_prompt_as_for_one(server):
    fields = dict(model=MODEL, max_tokens=3, temperature=0, logprobs=2, echo=True)
    status, _, several = server.post("/v1/completions", {**fields, "prompt": PROMPTS, "n": 2})
    assert status == 200, several
    for p, prompt in enumerate(PROMPTS):
        status, _, alone = server.post("/v1/completions", {**fields, "prompt": prompt})
        assert status == 200, alone
        for j in range(2):
            choice = several["choices"][p * 2 + j]
            assert choice["index"] == p * 2 + j and choice["text"].startswith(prompt)
            assert choice["text"] == alone["choices"][0]["text"]
            assert choice["logprobs"] == alone["choices"][0]["logprobs"]  # the prompt's tokens lead, first null


def test_chat_logprobs_per_choice(server):
    fields = dict(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    status, _, alone = server.post("/v1/chat/completions", fields)
    status, _, several = server.post("/v1/chat/completions", {**fields, "n": 2})
    assert status == 200, several
    assert [c["logprobs"] for c in several["choices"]] == [alone["choices"][0]["logprobs"]] * 2


@pytest.mark.parametrize("fields,param,code", [
    ({"n": MOST_CHOICES + 1}, "n", None), ({"n": 0}, "n", None), ({"n": True}, "n", None), ({"n": 2.0}, "n", None),
    ({"n": 9}, "n", "too_many_choices"),  # 9 generations > the 8 places this server has
    ({"prompt": ["a"] * 5, "n": 2}, "n", "too_many_choices"), ({"prompt": ["a"] * 9}, "prompt", "too_many_choices"),
    ({"prompt": [1, 2, 3]}, "prompt", None), ({"prompt": ["a", ""]}, "prompt", None), ({"prompt": []}, "prompt", None),
])
def test_choices_beyond_the_limits_get_400_naming_the_field(server, fields, param, code):
    status, _, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 2, **fields})
    assert status == 400 and reply["error"]["param"] == param and reply["error"]["code"] == code, reply
    assert server.app.state.generations.pending == 0  # every place given back


def test_each_choice_takes_a_place_in_the_queue(pipeline):
    """queue=1, one in flight: 2 places. One long request generating holds one; a request of 2 choices then
    gets 429, one of 1 choice is still taken; when all end, every place is back."""
    server = Server(SlowPipeline(pipeline), queue=1, interleave=1)
    try:
        client = server.client()
        long = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=100, temperature=0.9,
                                              seed=1, stream=True)
        chunks = iter(long)
        next(chunks), next(chunks)  # generating now
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0}
        status, headers, reply = server.post("/v1/chat/completions", {**body, "n": 2})
        assert status == 429 and int(headers["Retry-After"]) > 0, reply
        assert server.app.state.generations.pending == 1
        answered = []
        waiting = threading.Thread(target=lambda: answered.append(server.post("/v1/chat/completions", body)[0]))
        waiting.start()
        long.close()
        waiting.join(timeout=60)
        assert answered == [200]
        status, _, reply = server.post("/v1/chat/completions", {**body, "n": 2})  # now both places are free
        assert status == 200 and len(reply["choices"]) == 2
        deadline = time.time() + 10
        while server.app.state.generations.pending and time.time() < deadline:
            time.sleep(0.01)
        assert server.app.state.generations.pending == 0
    finally:
        server.stop()


def test_a_list_of_prompts_is_one_request_per_prompt_and_one_prompt_stays_as_it_was():
    body = {"model": "m", "prompt": PROMPTS, "n": 3, "temperature": 0.5, "seed": 3, "echo": True}
    completion = parse_completion(body, "m")
    assert completion.choices == 6 and completion.prompt == PROMPTS[0]
    each = completion.per_prompt()
    assert [c.prompt for c in each] == PROMPTS and all(c.prompts == () and c.n == 3 and c.echo for c in each)
    one = parse_completion({"model": "m", "prompt": ["only"]}, "m")
    assert one.per_prompt() == [one] and one.choices == 1 and one.prompt == "only"
    config = GenerationConfig(sampling=SamplingConfig(temperature=0.5, seed=3))
    assert choice_config(config, 0) is config and choice_config(config, 2).sampling.seed == 5
    assert choice_config(config, 2) == dataclasses.replace(config, sampling=dataclasses.replace(config.sampling,
                                                                                                seed=5))
    unseeded = GenerationConfig(sampling=SamplingConfig(temperature=0.5))
    assert choice_config(unseeded, 2) is unseeded


def test_tool_calls_per_choice_streamed_as_unstreamed(bundle_factory):
    """Under tools each choice has its own watch on what could open a call: every choice's call comes whole, with
    its index, the same streamed or not."""
    from tests.test_serve_structured import TOOLS

    server = Server(Pipeline(bundle_factory(draft="draft", tree="chain:3", context=512), threads=1), api_keys=(KEY,))
    try:
        client = server.client()
        settings = dict(model=MODEL, messages=MESSAGES, max_tokens=70, tools=TOOLS, tool_choice="required", n=2,
                        temperature=0.8, seed=3)
        whole = client.chat.completions.create(**settings)
        calls = {c.index: [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
                 for c in whole.choices}
        assert set(calls) == {0, 1} and all(calls.values())
        assert all(c.finish_reason == "tool_calls" for c in whole.choices)
        streamed, finishes = defaultdict(list), {}
        for chunk in client.chat.completions.create(**settings, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += [(t.function.name, t.function.arguments)
                                           for t in choice.delta.tool_calls or []]
                finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        assert dict(streamed) == calls and finishes == {0: "tool_calls", 1: "tool_calls"}
    finally:
        server.stop()
