"""`edgespec serve`: one bundle behind a local OpenAI-compatible HTTP API (Starlette on uvicorn).

One pipeline serves every request. Up to `interleave` generations are in flight, each on a worker
thread of its own, and take target passes in turn, one pass at a time (the target pass already uses
every core; edgespec/serve_turns.py: a new request's prefill waits one pass of each, not their ends).
A request takes its place in the queue as it arrives, before its body is read; at most `queue` wait
beside those in flight, more get 429 with a Retry-After from the queue's expected wait; a request of several
choices (`n`, a list of prompts) takes a place for each (edgespec/serve_choices.py). Each client's conversation is kept
(edgespec/serve_clients.py), so a follow-up turn that repeats the earlier messages prefills only what
is new (`usage.prompt_tokens_details.cached_tokens`), and no client continues another's. Every request
meets the limits of edgespec/serve_limits.py; bodies are parsed and prompts tokenised on a thread of
their own, so that the event loop answers /health throughout. A client that goes away, streamed or
not, stops its generation at the next target pass.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.openai_api import (
    APIError,
    Completion,
    new_id,
    parse_chat,
    parse_completion,
    response,
)
from edgespec.runtime.contract.errors import ConstraintError, EdgespecError, InputError
from edgespec.openai_logprobs import detokenized, tokenized
from edgespec.runtime.decoding.engine import GenerationConfig, Result
from edgespec.runtime.decoding.logprobs import Scores
from edgespec.runtime.pipeline import Pipeline
from edgespec.serve_choices import answered, prepared_choices, start_choices
from edgespec.serve_clients import KeptConversations, client_of, in_flight, key_digest
from edgespec.serve_limits import (
    check_length,
    check_rendered,
    exposed_without_key,
    longest_token,
    parse_json,
    read_body,
)
from edgespec.serve_stream import stream_events
from edgespec.serve_turns import Turn, Turns, generate_sharing, shared_passes_of
from edgespec.tool_calls import told

LOG = logging.getLogger("edgespec.serve")
FIRST_GUESS_S = 2.0  # a generation's turns, in seconds, until one has been timed
MEAN_WEIGHT = 0.25  # of the latest generation in the running mean of their turns' seconds
DISCONNECT_POLL_S = 0.1  # how often a non-streamed request looks whether its client is still there


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the id clients name in "model"
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()  # any one is accepted; each is a client of its own
    queue: int = 8  # requests that may wait beside those in flight
    interleave: int = 4  # generations in flight, taking target passes in turn (with a budget: what fits)
    kept_conversations: int = 4  # clients whose conversation (its KV caches) is kept between requests
    max_body_bytes: int = 4 * 2**20
    # with shared passes, a greedy step's tree priced as alone (the default: pricing it against the whole
    # pass, "batch", lost on 2 cores, history.md §68) or against the whole pass
    shared_speculation: str = "alone"
    # with shared passes, a prompt's prefill chunks back to back, alone ("apart": first tokens sooner) or
    # in the shared passes ("together"; runtime/execution/shared_passes.py; history.md §68)
    shared_prefill: str = "apart"

    def __post_init__(self):
        if self.queue < 0:
            raise InputError(f"--queue must be >= 0 (got {self.queue})")
        if not 0 <= self.port <= 65535:
            raise InputError(f"--port must be in 0..65535 (got {self.port})")
        if not isinstance(self.api_keys, tuple) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise InputError("api_keys must be a tuple of keys, none of them empty (--api-key cannot be empty)")
        if isinstance(self.interleave, bool) or not isinstance(self.interleave, int) or self.interleave < 1:
            raise InputError(f"--interleave must be >= 1 (got {self.interleave})")
        if self.kept_conversations < 0:
            raise InputError(f"--kept-conversations must be >= 0 (got {self.kept_conversations})")
        if self.max_body_bytes < 1024:
            raise InputError(f"--max-body must be at least 1 KiB (got {self.max_body_bytes} bytes)")
        if self.shared_speculation not in ("batch", "alone"):
            raise InputError(f"--shared-speculation must be batch or alone (got {self.shared_speculation!r})")
        if self.shared_prefill not in ("together", "apart"):
            raise InputError(f"--shared-prefill must be together or apart (got {self.shared_prefill!r})")


class Generations:
    """The one pipeline, the generations in flight and their turns, the conversations it keeps, and the
    queue in front of them."""

    def __init__(self, pipeline: Pipeline, config: ServeConfig):
        self.pipeline = pipeline
        self.in_flight = in_flight(config.interleave, pipeline.memory)
        self.limit = config.queue + self.in_flight  # the generations in flight and the waiting ones
        self.pending = 0  # touched on the event loop only
        # the seconds a generation holds the turns (its cost to the queue): written by the workers under
        # the turn, read for Retry-After (one float)
        self.mean_s: float | None = None
        self.worker = ThreadPoolExecutor(max_workers=self.in_flight, thread_name_prefix="edgespec-generate")
        self.turns = Turns()
        # parsing and tokenising: off the event loop, and never queued behind a generation
        self.reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-read")
        self.conversations = KeptConversations(pipeline, config.kept_conversations, self.in_flight)
        # None: the generations in flight take turns instead
        self.shared = shared_passes_of(pipeline, config.shared_prefill == "apart")
        self.batch_priced = config.shared_speculation == "batch"
        self.book = threading.Lock()  # with shared passes: the kept conversations and the mean
        self.longest_token = longest_token(pipeline.codec.tokenizer)
        self.sampling_defaults = pipeline.sampling_defaults  # what a request leaves unset takes

    def admit(self) -> None:
        """Takes a place in the queue, or refuses with 429. The generation `start` begins gives it back
        when it ends; a request refused before that gives it back with `release`."""
        if self.pending >= self.limit:
            raise APIError(f"the server is busy: {self.limit - 1} requests are already waiting; retry shortly",
                           code="queue_full", status=429, kind="rate_limit_error",
                           headers={"Retry-After": str(self.expected_wait())})
        self.pending += 1

    def admit_more(self, completion: Completion) -> None:
        """The further places a request of several choices takes (one each: `admit` took the first), or 429;
        400 for one that could never fit (more choices than the queue and the generations in flight)."""
        extra = completion.choices - 1
        if extra and completion.choices > self.limit:
            raise APIError(f"this request asks for {completion.choices} choices (n for each prompt); this server takes "
                           f"at most {self.limit} generations at a time, in flight or waiting: lower 'n', send fewer "
                           "prompts, or start the server with a longer --queue", "n" if completion.n > 1 else "prompt",
                           "too_many_choices")
        if self.pending + extra > self.limit:
            raise APIError(f"the server is busy: this request's {completion.choices} choices do not fit in the queue; "
                           "retry shortly", code="queue_full", status=429, kind="rate_limit_error",
                           headers={"Retry-After": str(self.expected_wait())})
        self.pending += extra

    def release(self, places: int = 1) -> None:
        self.pending -= places

    def expected_wait(self) -> int:
        """Seconds until the queue has likely drained: the requests in it times the mean seconds a
        generation holds the turns (interleaved or not, the passes run one at a time)."""
        return max(1, math.ceil(self.pending * (self.mean_s if self.mean_s is not None else FIRST_GUESS_S)))

    async def off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.reader, function, *args)

    async def prepare(self, completion: Completion) -> tuple[GenerationConfig, list[int]]:
        """The generation config and the prompt's token ids (encoded once: the generation takes them as
        they are), checked against the context before the request's turn: by its length in characters
        first, so that a prompt far too long is never tokenised."""
        check_length(completion, self.pipeline.context, self.longest_token)
        if completion.constraint is not None:
            await self.off_loop(self._compiles, completion)
        ids = await self.off_loop(self._encode, completion)
        try:
            return completion.config(len(ids), self.pipeline.context), ids
        except APIError:
            await self.off_loop(self.pipeline.trim_heap)  # what tokenising a refused prompt took goes back
            raise

    def _compiles(self, completion: Completion) -> None:
        """A 400 before the request's turn, not a failed stream, for a schema or tools the engine cannot compile,
        or a `max_tokens` in which no output the constraint admits can complete (a context too small for one
        is refused as the generation starts)."""
        try:
            self.pipeline.grammars.start(completion.constraint)
        except ConstraintError as err:
            raise APIError(str(err), "tools" if completion.tool_choice else "response_format",
                           "invalid_schema") from err
        if completion.max_tokens is not None:
            try:
                self.pipeline.grammars.within(completion.constraint, completion.max_tokens, "max_tokens")
            except InputError as err:
                raise APIError(str(err), "max_tokens", "max_tokens_too_small") from err

    def _encode(self, completion: Completion) -> list[int]:
        try:
            if completion.tool_choice is not None:  # the tools are told to the model (edgespec/tool_calls.py)
                messages, tools = told(list(completion.messages), completion.tools, self.pipeline.codec.takes_tools)
            else:
                messages, tools = (list(completion.messages) if completion.messages else None), None
            if messages is not None:
                check_rendered(self.pipeline.codec.render_chat(messages, tools), self.pipeline.context,
                               self.longest_token)
                return self.pipeline.encode(messages=messages, tools=tools)
            return self.pipeline.encode(completion.prompt)
        except (ValueError, EdgespecError) as err:
            raise APIError(f"the prompt cannot be encoded: {err}",
                           "messages" if completion.messages else "prompt") from err

    def start(self, ids: list[int], config: GenerationConfig, client: str | None, on_text,
              cancel: threading.Event, scores: Scores | None = None) -> asyncio.Future:
        """The generation after the prompt's `ids` on the worker thread, in turn (None when `cancel` was set
        before its turn came); its end gives the queue place back, whatever the client does meanwhile.
        `scores`: where its log-probabilities go, when asked."""
        task = asyncio.get_running_loop().run_in_executor(self.worker, self._generate, ids, config, client,
                                                          on_text, cancel, scores)
        task.add_done_callback(lambda _: self.release())
        return task

    def _generate(self, ids: list[int], config, client, on_text, cancel, scores=None) -> Result | None:
        """Holds the turn from the start to the end, but for the passes of the others between its own; the
        kept conversations and the mean are touched only under it. With shared passes: `_generate_shared`."""
        if self.shared is not None:
            return self._generate_shared(ids, config, client, on_text, cancel, scores)
        turn = Turn(self.turns)

        def should_stop() -> bool:  # asked before each target pass
            turn.pass_on()
            return cancel.is_set()

        with turn:
            if cancel.is_set():
                return None
            # no one's request gets a conversation of its own too: what drafters learn is never shared
            conversation = self.conversations.take(client) if client is not None else self.conversations.new()
            result = self.pipeline.generate(ids=ids, config=config, session=conversation.session, on_text=on_text,
                                            should_stop=should_stop, scores=scores)
            # only now: a generation that failed midway leaves a conversation no one should continue
            if client is not None:
                self.conversations.keep(client, conversation)
            if result.stop_reason != "cancelled":
                took = turn.held_s + time.perf_counter() - turn.since
                self.mean_s = took if self.mean_s is None else (1 - MEAN_WEIGHT) * self.mean_s + MEAN_WEIGHT * took
        return result


    def _generate_shared(self, ids: list[int], config, client, on_text, cancel, scores=None) -> Result | None:
        """Generates beside the others in flight, its target passes shared with theirs; the kept
        conversations and the mean are touched under `book`. A generation's cost to the queue: its seconds
        over the conversations a pass holds."""
        if cancel.is_set():
            return None
        with self.book:
            conversation = self.conversations.take(client) if client is not None else self.conversations.new()
        started = time.perf_counter()
        result = generate_sharing(self.pipeline, self.shared, ids=ids, config=config, session=conversation.session,
                                  on_text=on_text, should_stop=cancel.is_set,
                                  batch_priced=self.batch_priced, scores=scores)
        with self.book:
            if client is not None:
                self.conversations.keep(client, conversation)
            if result.stop_reason != "cancelled":
                took = (time.perf_counter() - started) / min(self.in_flight, self.shared.slots.slots)
                self.mean_s = took if self.mean_s is None else (1 - MEAN_WEIGHT) * self.mean_s + MEAN_WEIGHT * took
        return result


class Routes:
    """The HTTP side: each route checks its request, hands it to `Generations`, and shapes the answer."""

    def __init__(self, generations: Generations, config: ServeConfig):
        self.generations, self.config = generations, config
        self.key_digests = [key_digest(key) for key in config.api_keys]

    def authorize(self, request: Request) -> str | None:
        """The digest of the request's key (None when the server has no keys), or 401."""
        if not self.key_digests:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        digest = key_digest(key)
        # every key compared, each in constant time: the answer's timing says nothing of which came close
        if scheme.lower() != "bearer" or not any([secrets.compare_digest(digest, d) for d in self.key_digests]):
            raise APIError("a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           status=401)
        return digest

    async def completions(self, request: Request, chat: bool):
        key = self.authorize(request)
        self.generations.admit()  # before the body is read: a full queue costs nothing to refuse
        held = 1  # the queue places this request holds that no generation of it has taken yet
        pieces: asyncio.Queue | None = None
        cancel = threading.Event()
        try:
            body = await read_body(request, self.config.max_body_bytes)
            completion = await self.generations.off_loop(self.parse, body, chat)
            self.generations.admit_more(completion)  # a place for each choice (edgespec/serve_choices.py)
            held = completion.choices
            choices = await prepared_choices(self.generations, completion)
            pieces = asyncio.Queue() if completion.stream else None
            client = client_of(key, completion.user, completion.cache_salt)
            held = 0  # each generation gives its place back as it ends
            start_choices(self.generations, choices, client, cancel, pieces)
        except BaseException:
            cancel.set()  # choices already started stop at their next pass
            self.generations.release(held)
            raise
        request_id = new_id(chat)
        tasks = [one.task for one in choices]
        if completion.stream:
            events = stream_events(tasks, pieces, cancel, completion, request_id, chat, self.config.model,
                                   self.token_text)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            results = await self.answer(request, tasks, cancel)
        except EdgespecError as err:
            raise APIError(str(err), code="generation_failed") from err
        return JSONResponse(response(request_id, chat, self.config.model, results,
                                     answered(choices, results, chat, self.token_text), completion.n))

    def token_text(self, token: int) -> str:
        return self.generations.pipeline.codec.tokenizer.decode([token], skip_special_tokens=False)

    def parse(self, body: bytes, chat: bool) -> Completion:
        return (parse_chat if chat else parse_completion)(parse_json(body), self.config.model,
                                                          self.generations.sampling_defaults)

    @staticmethod
    async def answer(request: Request, tasks: list[asyncio.Future], cancel: threading.Event) -> list[Result]:
        """The generations' results once they end; a client that leaves meanwhile cancels them (at their next
        target pass, or before their turn) and is answered 499, which no one reads. One that fails stops the
        others: its error is the answer."""
        left = False
        try:
            while not all(task.done() for task in tasks):
                # asyncio.wait, not await: a cancelled handler must not cancel the futures, whose ends
                # give the queue places back only when the worker is done with them
                await asyncio.wait(set(tasks), timeout=DISCONNECT_POLL_S)
                if any(task.done() and not task.cancelled() and task.exception() is not None for task in tasks):
                    cancel.set()
                elif not all(task.done() for task in tasks) and not left and await request.is_disconnected():
                    left = True
                    cancel.set()
        finally:
            cancel.set()  # a no-op once they ended; stops them if this handler itself was cancelled
        if left:
            raise APIError("the client closed the request", code="client_closed_request", status=499)
        return [task.result() for task in tasks]

    async def chat_completions(self, request: Request):
        return await self.completions(request, chat=True)

    async def text_completions(self, request: Request):
        return await self.completions(request, chat=False)

    async def models(self, request: Request):
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model", "created": 0,
                                                         "owned_by": "edgespec"}]})

    async def model(self, request: Request):
        """GET /v1/models/{id}: this server's model, or OpenAI's 404 for another."""
        self.authorize(request)
        if request.path_params["model_id"] != self.config.model:
            raise APIError(f"the model {request.path_params['model_id']!r} does not exist here: this server serves "
                           f"{self.config.model!r}", "model", "model_not_found", status=404)
        return JSONResponse({"id": self.config.model, "object": "model", "created": 0, "owned_by": "edgespec"})

    async def tokenize(self, request: Request):
        """POST /tokenize as llama.cpp's server has it: {"content", "add_special", "with_pieces"} -> {"tokens"}."""
        self.authorize(request)
        body = parse_json(await read_body(request, self.config.max_body_bytes))
        ids, pieces = await self.generations.off_loop(tokenized, self.generations.pipeline.codec, body)
        return JSONResponse({"tokens": [{"id": t, "piece": p} for t, p in zip(ids, pieces)] if pieces else ids})

    async def detokenize(self, request: Request):
        """POST /detokenize as llama.cpp's server has it: {"tokens": [ids]} -> {"content"}."""
        self.authorize(request)
        body = parse_json(await read_body(request, self.config.max_body_bytes))
        codec = self.generations.pipeline.codec
        return JSONResponse({"content": detokenized(codec, body, self.generations.pipeline.manifest.target.facts.vocab_size)})

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.config.model, "pending": self.generations.pending})

    @staticmethod
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @staticmethod
    async def http_error(request: Request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(f"{request.method} {request.url.path}: {err.detail}", kind=kind).body(),
                            status_code=err.status_code, headers=err.headers)  # a 405's Allow

    @staticmethod
    async def client_left(request: Request, err: ClientDisconnect):
        """A client gone while sending its body: a line in the log, not a traceback; the answer goes nowhere."""
        peer = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        LOG.warning("%s disconnected while sending %s %s; the request was dropped", peer, request.method,
                    request.url.path)
        return Response(status_code=400)


def make_app(pipeline: Pipeline, config: ServeConfig) -> Starlette:
    warning = exposed_without_key(config.host, config.api_keys)
    if warning:
        LOG.warning(warning)
    generations = Generations(pipeline, config)
    routes = Routes(generations, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        generations.worker.shutdown(wait=False, cancel_futures=True)
        generations.reader.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=[Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                            Route("/v1/completions", routes.text_completions, methods=["POST"]),
                            Route("/v1/models", routes.models, methods=["GET"]),
                            Route("/v1/models/{model_id:path}", routes.model, methods=["GET"]),
                            Route("/tokenize", routes.tokenize, methods=["POST"]),
                            Route("/detokenize", routes.detokenize, methods=["POST"]),
                            Route("/health", routes.health, methods=["GET"])],
                    exception_handlers={APIError: routes.api_error, HTTPException: routes.http_error,
                                        ClientDisconnect: routes.client_left},
                    lifespan=lifespan)
    app.state.generations = generations
    return app


def serve(pipeline: Pipeline, config: ServeConfig) -> None:
    import uvicorn

    uvicorn.run(make_app(pipeline, config), host=config.host, port=config.port, log_level="info")
