"""`edgespec serve` against OpenAI's own client, on a tiny bundle, over localhost."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import uvicorn

from edgespec.cli import main
from edgespec.openai_api import APIError, parse_chat
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
from edgespec.runtime.sampling import SamplingConfig
from edgespec.serve import ServeConfig, make_app

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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3"), threads=1)


@pytest.fixture(scope="module")
def server(pipeline):
    running = Server(pipeline, api_key=KEY, queue=1)
    yield running
    running.stop()


def test_chat_streamed_equals_unstreamed_equals_the_pipeline(server, pipeline):
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


def test_sampling_with_a_seed_is_reproducible_and_matches_the_pipeline(server, pipeline):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_completion_tokens=20, temperature=0.8, top_p=0.9, seed=7)
    first = client.chat.completions.create(**settings).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**settings, stream=True)
                       if c.choices)
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=7))
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
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"model": "gpt-4o", "messages": MESSAGES}, "model"),
    ({"messages": MESSAGES}, "model"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "n": 2}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "n": True}, "n"),  # == 1 in Python, not "not used"
    ({"model": MODEL, "messages": MESSAGES, "logprobs": 0}, "logprobs"),
    ({"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
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

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def generate(self, *args, on_text=None, **kwargs):
        def slow(piece):
            time.sleep(0.02)
            if on_text is not None:
                on_text(piece)
        result = self.pipeline.generate(*args, on_text=slow, **kwargs)
        self.reasons.append(result.stop_reason)
        return result


def test_a_full_queue_answers_429_and_a_disconnect_frees_the_worker(pipeline):
    """queue=1: one generating, one waiting, the third refused with Retry-After. A streamed client that
    leaves stops its generation at the next pass, so the one waiting does not sit out the rest of it."""
    slow = SlowPipeline(pipeline)
    server = Server(slow, queue=1)
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
