"""The server's sampling fields, logprobs, echo and the llama.cpp-style endpoints, on a tiny bundle."""
import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.logprobs import Scores, scored
from edgespec.runtime.pipeline import Pipeline

from tests.test_serve import KEY, MESSAGES, MODEL, Server


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3"), threads=1)


@pytest.fixture(scope="module")
def server(pipeline):
    running = Server(pipeline, api_keys=(KEY,), queue=2)
    yield running
    running.stop()


def chat(server, **fields):
    status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    assert status == 200, reply
    return reply["choices"][0]


def test_chat_logprobs_are_the_pipelines_streamed_or_not(server, pipeline):
    fields = dict(max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = chat(server, **fields)
    scores = Scores(top=2)
    direct = pipeline.generate(messages=MESSAGES, config=GenerationConfig(max_new_tokens=12), scores=scores)
    content = whole["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [e.logprob for e in direct.logprobs]
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [[lp for _, lp in e.top]
                                                                            for e in direct.logprobs]
    assert len(content) == len(direct.token_ids)
    chunks = server.stream_chunks("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
    streamed = [c for chunk in chunks if chunk["choices"] for c in (chunk["choices"][0].get("logprobs") or {})
                .get("content", [])]
    assert streamed == content


def test_echo_scores_the_prompt_as_one_pass_does(server, pipeline):
    prompt = "the quick brown fox jumps over the lazy dog"
    status, _, reply = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                                                       "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234})
    assert status == 200, reply
    choice = reply["choices"][0]
    ids = pipeline.encode(prompt)
    n = len(ids)
    out = pipeline.target.forward(pipeline.target.new_cache(pipeline.context), ids, range(n),
                                  np.tril(np.ones((n, n), dtype=bool)), range(n))
    one_pass = scored(out.logits, ids[1:] + [pipeline.generate(prompt, config=GenerationConfig(max_new_tokens=1))
                                               .token_ids[0]], 1)
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [e.logprob for e in one_pass]
    assert choice["text"].startswith(prompt) and len(logprobs["tokens"]) == n + 1
    # what lm-evaluation-harness's local-completions reads: the continuation's sum and whether it is greedy
    top = logprobs["top_logprobs"][1:]
    assert all(len(t) == 1 for t in top)


def test_the_same_seed_gives_one_text_and_top_k_one_the_greedy_text(server):
    fields = dict(max_tokens=16, temperature=0.8, seed=1234)
    assert len({chat(server, **fields)["message"]["content"] for _ in range(8)}) == 1
    greedy = chat(server, max_tokens=16, temperature=0)["message"]["content"]
    assert chat(server, max_tokens=16, temperature=1, top_k=1, seed=5)["message"]["content"] == greedy


def test_sampling_fields_are_taken_and_checked(server):
    chat(server, max_tokens=4, temperature=0.7, top_k=20, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.5,
         presence_penalty=-0.5, logit_bias={"5": -100, "7": 3}, seed=1)
    for fields, param in [(dict(temperature=0, frequency_penalty=0.5), "frequency_penalty"),
                          (dict(temperature=0.5, logit_bias={"x": 1}), "logit_bias"),
                          (dict(temperature=0.5, logit_bias={"1": 101}), "logit_bias"),
                          (dict(temperature=0.5, logit_bias={"999999": 1}), None),
                          (dict(temperature=0.5, top_k=-2), "top_k"), (dict(top_logprobs=2), "top_logprobs"),
                          (dict(logprobs=True, top_logprobs=21), "top_logprobs"), (dict(n=17), "n")]:
        status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **fields})
        assert status == 400 and reply["error"]["param"] == param, (fields, reply)
    assert chat(server, max_tokens=4, temperature=0, frequency_penalty=0, presence_penalty=0.0)  # neutral: fine


def test_models_by_id_tokenize_and_detokenize(server, pipeline):
    import urllib.request

    request = urllib.request.Request(f"{server.url}/v1/models/{MODEL}", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        assert reply.status == 200
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(urllib.request.Request(f"{server.url}/v1/models/other",
                                                      headers={"Authorization": f"Bearer {KEY}"}), timeout=10)
    assert missing.value.code == 404
    status, _, reply = server.post("/tokenize", {"content": "hello world"})
    ids = pipeline.codec.tokenizer.encode("hello world", add_special_tokens=False).ids
    assert status == 200 and reply["tokens"] == ids
    status, _, pieces = server.post("/tokenize", {"content": "hello world", "with_pieces": True})
    assert "".join(p["piece"] for p in pieces["tokens"]) == "hello world"
    status, _, reply = server.post("/detokenize", {"tokens": ids})
    assert status == 200 and reply["content"] == "hello world"
    assert server.post("/detokenize", {"tokens": [10**9]})[0] == 400
    assert server.post("/tokenize", {"content": 3})[0] == 400
