"""`edgespec serve` against OpenAI's own client, on a tiny bundle, over localhost."""
import asyncio
import dataclasses
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig, with_defaults
from edgespec.runtime.pipeline import Pipeline

from edgespec.cli import main
from edgespec.openai_api import APIError, parse_chat
from edgespec.parser import build_parser
from edgespec.serve import FIRST_GUESS_S, Generations, ServeConfig, make_app
from edgespec.serve_limits import FOLDING, MAX_DEPTH, exposed_without_key, longest_token

MODEL = "tiny"
KEY = "sk-test-key"
MESSAGES = [{"role": "user", "content": "a b c d e f a b c"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn on a thread, for one test module."""

    def __init__(self, pipeline, **options):
        self.port = free_port()
        self.app = make_app(pipeline, ServeConfig(model=MODEL, port=self.port, **options))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str | None = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or "none", max_retries=0)

    def post(self, path: str, body, key: str | None = KEY):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json",
                                                  **({"Authorization": f"Bearer {key}"} if key else {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, reply.headers, json.loads(reply.read())
        except urllib.error.HTTPError as err:
            return err.code, err.headers, json.loads(err.read())

    def stream_chunks(self, path: str, body: dict, key: str | None = KEY) -> list[dict]:
        """A streamed request's chunks as the server sent them, [DONE] left out."""
        request = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                         method="POST", headers={"Content-Type": "application/json",
                                                                 **({"Authorization": f"Bearer {key}"} if key else {})})
        with urllib.request.urlopen(request, timeout=60) as reply:
            lines = [line.decode().strip() for line in reply]
        return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3"), threads=1)


@pytest.fixture(scope="module")
def server(pipeline):
    running = Server(pipeline, api_keys=(KEY,), queue=1)
    yield running
    running.stop()


@pytest.fixture(scope="module", params=["onnx", "coreml-state"])
def served(request, bundle_factory, server, pipeline):
    """(server, its pipeline) on each backend: this module's ONNX one, and the bundle's CoreML packages with the
    saved programs run in numpy (exporters/mil_reference.py), as on a Mac."""
    if request.param == "onnx":
        yield server, pipeline
        return
    from edgespec.exporters.mil_reference import reference_predictor

    coreml = Pipeline(bundle_factory(draft="draft", tree="chain:3", coreml=("state",)), threads=1, backend="coreml",
                      predictor=reference_predictor, coreml_kv="state")
    running = Server(coreml, api_keys=(KEY,), queue=1)
    yield running, coreml
    running.stop()


def test_chat_streamed_equals_unstreamed_equals_the_pipeline(served):
    server, pipeline = served
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=["zz"])
    whole = client.chat.completions.create(**settings)
    pieces = list(client.chat.completions.create(**settings, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    direct = pipeline.generate(messages=MESSAGES, config=GenerationConfig(max_new_tokens=24, stop_strings=("zz",)))
    assert whole.choices[0].message.content == streamed == direct.text
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens == len(direct.token_ids)
    assert whole.usage.prompt_tokens == direct.stats.prompt_tokens
    assert pieces[0].choices[0].delta.role == "assistant"
    assert pieces[-1].choices == [] and pieces[-1].usage.completion_tokens == whole.usage.completion_tokens
    extension = whole.model_extra["edgespec"]
    assert extension["tokens_per_target_pass"] >= 1 and extension["target_passes"] >= 1


def test_sampling_with_a_seed_is_reproducible_and_matches_the_pipeline(served):
    server, pipeline = served
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    first = client.chat.completions.create(**settings).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**settings, stream=True)
                       if c.choices)
    # the fields left unset take the conversation defaults (Pipeline.sampling_defaults: top-k, min-p, repetition)
    sampling = SamplingConfig(temperature=0.8, top_p=0.9, seed=7, top_k=40, min_p=0.05, repetition_penalty=1.1)
    assert with_defaults({"temperature": 0.8, "top_p": 0.9, "seed": 7}, pipeline.sampling_defaults) == sampling
    config = GenerationConfig(max_new_tokens=20, sampling=sampling)
    assert first == streamed == pipeline.generate(messages=MESSAGES, config=config).text


def test_text_completions_models_and_health(server, pipeline):
    client = server.client()
    done = client.completions.create(model=MODEL, prompt="a b c d", max_tokens=12, temperature=0)
    assert done.choices[0].text == pipeline.generate("a b c d", config=GenerationConfig(max_new_tokens=12)).text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="a b c d", max_tokens=12, temperature=0, stream=True))
    assert streamed == done.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.url + "/health") as reply:
        assert json.loads(reply.read())["status"] == "ok"


def test_a_follow_up_turn_reuses_the_cached_prefix(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    follow = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "f e d"}]
    second = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": MESSAGES}, "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "n": 17}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "n": True}, "n"),  # == 1 in Python, not "not used"
    ({"model": MODEL, "messages": MESSAGES, "logprobs": 0}, "logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stop": [""]}, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": MODEL, "messages": MESSAGES, "seed": -1}, "seed"),
    ({"model": MODEL, "messages": MESSAGES, "whatever": 1}, "whatever"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": 5}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a " * 400}]}, "messages"),
])
def test_bad_requests_get_400_with_an_openai_error_body(server, body, param):
    status, _, reply = server.post("/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error"


def test_malformed_json_and_unknown_routes(server):
    status, _, reply = server.post("/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    status, _, reply = server.post("/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and reply["error"]["type"] == "not_found_error"
    # and it keeps serving
    assert server.client().models.list().data[0].id == MODEL


def test_a_key_is_required_when_configured(server):
    status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, key=None)
    assert status == 401 and reply["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()


class SlowPipeline:
    """The pipeline, with every streamed piece of text taking 20 ms: a generation that lasts long enough
    to queue behind and to leave. Records each generation's stop reason."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline, self.reasons = pipeline, []
        self.generating = threading.Event()

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def generate(self, *args, on_text=None, **kwargs):
        def slow(piece):
            self.generating.set()
            time.sleep(0.02)
            if on_text is not None:
                on_text(piece)
        result = self.pipeline.generate(*args, on_text=slow, **kwargs)
        self.reasons.append(result.stop_reason)
        return result


def test_a_full_queue_answers_429_and_a_disconnect_frees_the_worker(pipeline):
    """queue=1, one in flight: one generating, one waiting, the third refused with Retry-After. A streamed
    client that leaves stops its generation at the next pass, so the one waiting does not sit out the rest of
    it."""
    slow = SlowPipeline(pipeline)
    server = Server(slow, queue=1, interleave=1)
    try:
        client = server.client()
        long = dict(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=0.9, seed=1)
        stream = client.chat.completions.create(**long, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)  # generating now
        waiting = threading.Thread(target=lambda: client.chat.completions.create(**{**long, "max_tokens": 4}))
        waiting.start()
        deadline = time.time() + 10
        while server.app.state.generations.pending < 2 and time.time() < deadline:
            time.sleep(0.01)
        status, headers, reply = server.post("/v1/chat/completions", {**long, "max_tokens": 4})
        assert status == 429 and reply["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) > 0
        left = time.time()
        stream.close()  # the client goes away mid-stream
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        assert time.time() - left < 200 * 0.02 / 2  # well before the long one could have finished
        assert slow.reasons[0] == "cancelled" and len(slow.reasons) == 2
        status, _, reply = server.post("/v1/chat/completions", {**long, "max_tokens": 2})
        assert status == 200 and reply["usage"]["completion_tokens"] <= 2
    finally:
        server.stop()


def test_parse_keeps_what_was_asked():
    request = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}],
                          "stop": "x", "max_tokens": 5, "temperature": 0.0, "user": "me", "n": 1}, "m")
    assert request.messages == ({"role": "system", "content": "hi"},)
    assert request.stop == ("x",) and request.max_tokens == 5 and request.sampling.greedy
    with pytest.raises(APIError, match="context"):
        request.config(prompt_tokens=100, context=100)


def test_serve_refuses_bad_options(tmp_path, capsys):
    assert main(["serve", str(tmp_path), "--queue", "-1"]) == 2
    assert "--queue" in capsys.readouterr().err


def test_sixteen_clients_at_once_get_an_answer_or_a_clean_429(pipeline):
    server = Server(pipeline, queue=4)
    try:
        outcomes = []

        def client(i: int):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"a b c {i}"}], "max_tokens": 8,
                    "temperature": 0}
            if i % 2:  # half of them streamed, through OpenAI's client
                try:
                    pieces = list(server.client().chat.completions.create(**body, stream=True))
                    outcomes.append(("stream", 200, pieces[-1].choices[0].finish_reason))
                except openai.RateLimitError as err:
                    outcomes.append(("stream", err.status_code, err.response.headers.get("retry-after")))
            else:
                status, headers, reply = server.post("/v1/chat/completions", body)
                outcomes.append(("plain", status, reply["choices"][0]["finish_reason"] if status == 200
                                 else headers.get("Retry-After")))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        started = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a client hangs"
        assert time.time() - started < 120
        assert len(outcomes) == 16
        for kind, status, detail in outcomes:
            assert (status == 200 and detail in ("stop", "length")) or (status == 429 and int(detail) > 0), (kind, status)
        assert sum(status == 200 for _, status, _ in outcomes) >= 5  # the running one and the queue's 4 at least
        with urllib.request.urlopen(server.url + "/health") as reply:
            assert json.loads(reply.read()) == {"status": "ok", "model": MODEL, "pending": 0}
    finally:
        server.stop()


# --- per-client conversations ------------------------------------------------------------------------

def ask(server, content: str, key: str | None = None, **labels) -> dict:
    status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, **labels}, key=key)
    assert status == 200, reply
    return reply["usage"]


SECRET = "a b c d e f g h a b c d e f g h a b c d"  # client A's prompt, which B guesses


def test_a_client_never_reuses_another_clients_prefix(pipeline):
    """Two keys: B sending exactly A's prompt gets no cached token (nor A's prefill time); each client
    reuses its own conversation."""
    server = Server(pipeline, api_keys=("sk-a", "sk-b"))
    try:
        first = ask(server, SECRET, key="sk-a")
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        guess = ask(server, SECRET, key="sk-b")
        assert guess["prompt_tokens"] == first["prompt_tokens"]
        assert guess["prompt_tokens_details"]["cached_tokens"] == 0
        again = ask(server, SECRET, key="sk-a")  # A's conversation was kept while B generated
        assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 1
        own = ask(server, SECRET, key="sk-b")  # and B's own history is B's to reuse
        assert own["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 1
        kept = server.app.state.generations.conversations.kept
        assert len(kept) == 2 and not any("sk-" in client for client in kept)  # digests only
    finally:
        server.stop()


def test_without_keys_user_and_cache_salt_name_the_client_and_no_label_shares_nothing(pipeline):
    server = Server(pipeline, kept_conversations=2)
    try:
        assert ask(server, SECRET)["prompt_tokens_details"]["cached_tokens"] == 0
        assert ask(server, SECRET)["prompt_tokens_details"]["cached_tokens"] == 0  # anonymous: nothing kept
        assert len(server.app.state.generations.conversations) == 0
        tokens = ask(server, SECRET, user="ann")["prompt_tokens"]
        assert ask(server, SECRET, user="ann")["prompt_tokens_details"]["cached_tokens"] >= tokens - 1
        assert ask(server, SECRET, user="bob")["prompt_tokens_details"]["cached_tokens"] == 0
        assert ask(server, SECRET, user="ann", cache_salt="s1")["prompt_tokens_details"]["cached_tokens"] == 0
        # three clients, two places: ann, the least recently used, was dropped
        assert len(server.app.state.generations.conversations) == 2
        assert ask(server, SECRET, user="ann")["prompt_tokens_details"]["cached_tokens"] == 0
        assert ask(server, SECRET, user="ann", cache_salt="s1")["prompt_tokens_details"]["cached_tokens"] >= tokens - 1
    finally:
        server.stop()


# --- no request takes the server down ------------------------------------------------------------------

def asgi_post(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """POSTs `chunks` straight to the ASGI app: (status, how many chunks it read)."""
    read = 0
    sent = []

    async def receive():
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        await asyncio.sleep(60)  # the client stays: nothing more to receive

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start"), read


def test_a_body_over_the_limit_gets_413_before_it_is_read(pipeline):
    app = make_app(pipeline, ServeConfig(model=MODEL, max_body_bytes=4096))
    chunks = [b" " * 1024] * 100
    assert asgi_post(app, chunks, [(b"content-length", b"102400")]) == (413, 0)  # declared: nothing read
    assert asgi_post(app, chunks, [(b"content-length", b"9" * 5000)]) == (413, 0)  # a header past int()'s limit
    status, read = asgi_post(app, chunks, [])  # chunked, or more than declared: counted as it comes
    assert status == 413 and read == 5
    assert app.state.generations.pending == 0


def test_a_body_over_the_limit_gets_413_over_http(pipeline):
    server = Server(pipeline, max_body_bytes=4096)
    try:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a " * 4000}]}).encode()
        status, _, reply = server.post("/v1/chat/completions", body, key=None)
        assert status == 413 and reply["error"]["code"] == "request_too_large"
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        connection.request("POST", "/v1/chat/completions", body=(body[i:i + 1024] for i in range(0, len(body), 1024)),
                           headers={"Content-Type": "application/json"}, encode_chunked=True)
        reply = connection.getresponse()
        assert reply.status == 413 and json.loads(reply.read())["error"]["code"] == "request_too_large"
        connection.close()
        assert ask(server, "a b c", user="x")["completion_tokens"] >= 1  # and it keeps serving
    finally:
        server.stop()


@pytest.mark.parametrize("body,words", [
    (b"[" * 10_000 + b"]" * 10_000, f"deeper than {MAX_DEPTH}"),  # past Python's recursion limit
    (json.dumps({"model": MODEL, "messages": MESSAGES, "metadata": json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH)})
     .encode(), f"deeper than {MAX_DEPTH}"),  # parses, and is refused before any check walks it
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"9" * 5000 + b"}",
     "5000 digits"),  # past Python's int conversion limit
    (b'{"model": "tiny", "seed": -' + b"1" * 30 + b"}", "30 digits"),
])
def test_deep_json_and_huge_integers_get_400_not_500(server, body, words):
    status, _, reply = server.post("/v1/chat/completions", body)
    assert status == 400 and words in reply["error"]["message"], reply
    assert server.client().models.list().data[0].id == MODEL


def test_the_depth_counted_on_the_text_is_the_parsed_values_depth():
    """parse_json counts nesting on the body's brackets outside strings: quotes, escaped quotes, backslash
    runs and brackets inside strings, any encoding json.loads reads, against a walk of the parsed value."""
    import random

    from edgespec.serve_limits import _depth

    def walked(value, depth=0):
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        return depth if children is None else max([walked(c, depth + 1) for c in children], default=depth + 1)

    rng = random.Random(0)
    pieces = ["[", "]", "{", "}", '"', "\\", '\\"', "\\\\", "a", "é", "\u2028", "\U0001f600"]

    def value(depth):
        kind = rng.random()
        if depth > 6 or kind < 0.3:
            return rng.choice([1, None, True, "".join(rng.choice(pieces) for _ in range(rng.randrange(6)))])
        if kind < 0.65:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {"".join(rng.choice(pieces) for _ in range(rng.randrange(4))): value(depth + 1)
                for _ in range(rng.randrange(4))}

    for _ in range(500):
        item = value(0)
        for text in (json.dumps(item), json.dumps(item, ensure_ascii=False), json.dumps(item, indent=1)):
            assert _depth(text) == walked(item), text
    assert json.loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) and _depth("[" * MAX_DEPTH + "]" * MAX_DEPTH) == MAX_DEPTH


class CountingPipeline(SlowPipeline):
    """Records the thread each prompt was tokenised on."""

    def __init__(self, pipeline: Pipeline):
        super().__init__(pipeline)
        self.encoded_on = []

    def encode(self, *args, **kwargs):
        self.encoded_on.append(threading.current_thread().name)
        return self.pipeline.encode(*args, **kwargs)


def test_prompts_are_tokenised_off_the_event_loop_and_a_huge_one_not_at_all(pipeline):
    counting = CountingPipeline(pipeline)
    server = Server(counting)
    try:
        assert ask(server, "a b c", user="x")["completion_tokens"] >= 1
        assert counting.encoded_on[0].startswith("edgespec-read")  # the check; the generation encodes again
        counting.encoded_on.clear()
        most = pipeline.context * longest_token(pipeline.codec.tokenizer) * FOLDING
        status, _, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "a" * (most + 1)}, key=None)
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
        assert f"context is {pipeline.context} tokens" in reply["error"]["message"]
        assert counting.encoded_on == []
    finally:
        server.stop()


def test_very_many_short_messages_are_refused_in_under_a_second_without_tokenising(pipeline):
    """Short messages pass the characters check, but the chat template adds its markers to each: its text is
    measured before the tokenizer sees it (tokenising 100,000 messages took seconds); a prompt that fits
    still gets its answer."""
    counting = CountingPipeline(pipeline)
    server = Server(counting)
    try:
        roles = ("user", "assistant")
        body = json.dumps({"model": MODEL, "messages": [{"role": roles[i % 2], "content": ""}
                                                        for i in range(100_001)]}).encode()  # 3.5 MB: within --max-body
        started = time.perf_counter()
        status, _, reply = server.post("/v1/chat/completions", body, key=None)
        took = time.perf_counter() - started
        assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
        assert "chat template come to" in reply["error"]["message"] and counting.encoded_on == []
        assert took < 1.0, f"refused in {took:.2f}s"
        assert ask(server, "a b c", user="x")["completion_tokens"] >= 1
    finally:
        server.stop()


class EndlessPipeline(SlowPipeline):
    """Generates to max_new_tokens whatever the tiny model samples: only a cancel ends it sooner."""

    def generate(self, *args, config: GenerationConfig, **kwargs):
        return super().generate(*args, config=dataclasses.replace(config, stop_at_eos=False), **kwargs)


def test_a_non_streamed_request_stops_when_its_client_leaves(pipeline):
    slow = EndlessPipeline(pipeline)
    server = Server(slow)
    try:
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0.9, "seed": 1})
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        assert slow.generating.wait(timeout=30)
        left = time.time()
        client.close()
        deadline = time.time() + 30
        while not slow.reasons and time.time() < deadline:
            time.sleep(0.01)
        assert slow.reasons == ["cancelled"]
        assert time.time() - left < 200 * 0.02 / 2  # well before the 200 tokens could have been generated
        deadline = time.time() + 5
        while server.app.state.generations.pending and time.time() < deadline:
            time.sleep(0.01)
        assert server.app.state.generations.pending == 0
    finally:
        server.stop()


def test_a_client_leaving_while_it_sends_its_body_is_one_line_in_the_log(server, caplog):
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            client = socket.create_connection(("127.0.0.1", server.port))
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n{\"mod")
            time.sleep(0.2)
            client.close()
            deadline = time.time() + 10
            while not any("disconnected while sending" in r.getMessage() for r in caplog.records):
                assert time.time() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.02)
            time.sleep(0.1)
        lines = [r for r in caplog.records if "disconnected while sending" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0].getMessage() and lines[0].exc_info is None
        assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records]
        assert server.app.state.generations.pending == 0
    finally:
        uvicorn_log.removeHandler(caplog.handler)


def test_retry_after_is_the_queues_expected_wait(pipeline):
    generations = Generations(pipeline, ServeConfig(model=MODEL, queue=2, interleave=1))
    generations.pending = 3
    with pytest.raises(APIError) as refused:
        generations.admit()
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": str(math.ceil(3 * FIRST_GUESS_S))}
    generations.mean_s = 4.2  # generations have taken 4.2 s of late
    with pytest.raises(APIError) as refused:
        generations.admit()
    assert refused.value.headers == {"Retry-After": "13"}
    generations.pending, generations.mean_s = 1, 0.01
    assert generations.expected_wait() == 1  # never 0: a client would retry at once


def test_the_mean_generation_time_is_measured(server):
    ask(server, "a b c", key=KEY)
    mean = server.app.state.generations.mean_s
    assert mean is not None and 0 < mean < 60


@pytest.mark.parametrize("host,warned", [("0.0.0.0", True), ("192.168.1.2", True), ("::", True), ("my.host", True),
                                         ("127.0.0.1", False), ("::1", False), ("localhost", False)])
def test_listening_beyond_loopback_without_a_key_is_warned(host, warned):
    assert (exposed_without_key(host, ()) is not None) == warned
    assert exposed_without_key(host, ("k",)) is None


def test_make_app_logs_the_exposure_warning(pipeline, caplog):
    with caplog.at_level(logging.WARNING, logger="edgespec.serve"):
        make_app(pipeline, ServeConfig(model=MODEL, host="0.0.0.0"))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["listening on 0.0.0.0 without --api-key"]


# --- OpenAI conformance ----------------------------------------------------------------------------------

def test_usage_is_on_the_final_chunk_only_and_only_when_asked(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
    asked = server.stream_chunks("/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in asked] == [False] * (len(asked) - 1) + [True]
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] >= 1
    assert asked[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    plain = server.stream_chunks("/v1/chat/completions", body)
    assert not any("usage" in c for c in plain) and plain[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = server.stream_chunks("/v1/completions", {"model": MODEL, "prompt": "a b", "max_tokens": 4,
                                                    "stream_options": {"include_usage": True}})
    assert [("usage" in c) for c in text] == [False] * (len(text) - 1) + [True]


def test_an_unknown_model_gets_404(server):
    status, _, reply = server.post("/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
    assert status == 404
    assert reply["error"]["code"] == "model_not_found" and reply["error"]["param"] == "model"
    assert reply["error"]["type"] == "invalid_request_error" and "'tiny'" in reply["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4o", prompt="a")


def test_405_names_the_allowed_methods(server):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(server.url + "/v1/chat/completions")
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "POST"
    assert json.loads(refused.value.read())["error"]["message"]
    status, headers, _ = server.post("/v1/models", {})
    assert status == 405 and "GET" in headers["Allow"]


@pytest.mark.parametrize("field,value,words", [
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tools are for /v1/chat/completions"),
    ("tool_choice", "auto", "tools are for /v1/chat/completions"),
    ("response_format", {"type": "json_object"}, "response_format is for /v1/chat/completions"),
])
def test_text_completions_refuse_structured_output_clearly(server, field, value, words):
    status, _, reply = server.post("/v1/completions", {"model": MODEL, "prompt": "a b", field: value})
    assert status == 400 and reply["error"]["param"] == field and words in reply["error"]["message"]


def test_response_format_text_is_what_it_does_anyway(server):
    status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 2,
                                                            "response_format": {"type": "text"}})
    assert status == 200, reply


def test_serve_options(tmp_path, capsys):
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "--kept-conversations", "2",
                                      "--max-body", "1MiB"])
    assert (args.api_key, args.kept_conversations, args.max_body) == (["a", "b"], 2, "1MiB")
    assert main(["serve", str(tmp_path), "--kept-conversations", "-1"]) == 2
    assert "--kept-conversations" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-body", "lots"]) == 2
    assert "--max-body" in capsys.readouterr().err
    assert main(["serve", str(tmp_path), "--max-body", "10"]) == 2
    assert "--max-body" in capsys.readouterr().err


def test_kept_conversations_stay_within_the_budgets_room():
    """With a memory budget, idle conversations live on what it leaves beyond the one conversation it
    plans for: the least recently used go first, and the one about to generate is never dropped."""
    from types import SimpleNamespace

    import numpy as np

    from edgespec.serve_clients import KeptConversations

    def new_session(**learned):
        return SimpleNamespace(cache=SimpleNamespace(data=np.zeros(600, np.uint8), features=None), committed=[])

    fake = SimpleNamespace(memory=SimpleNamespace(budget=5000, total=4000, draft_kv_per_token=0),
                           new_session=new_session,
                           new_suffix_store=lambda: None, new_recycling_table=lambda: None)
    kept = KeptConversations(fake, bound=4)
    for client in "abc":
        kept.keep(client, kept.take(client))
    assert list(kept.kept) == ["b", "c"]  # a and b (1200 bytes) did not fit in 1000 beside c
    b = kept.kept["b"]
    assert kept.take("b") is b and list(kept.kept) == ["c"]


def test_in_process_clients_are_not_taken_for_gone(pipeline):
    """Starlette's TestClient (as tests/test_fuzz.py drives the app) holds the request open until the
    answer: the disconnect check must not cancel it."""
    from starlette.testclient import TestClient

    with TestClient(make_app(pipeline, ServeConfig(model=MODEL))) as client:
        reply = client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 6,
                                                          "temperature": 0})
        assert reply.status_code == 200
        direct = pipeline.generate(messages=MESSAGES, config=GenerationConfig(max_new_tokens=6))
        assert reply.json()["choices"][0]["message"]["content"] == direct.text
        assert client.get("/health").json()["pending"] == 0
