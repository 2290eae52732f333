"""`edgespec serve`: one bundle behind a local OpenAI-compatible HTTP API (Starlette on uvicorn).

One pipeline serves every request, one generation at a time on a single worker thread (the target
pass already uses every core), in arrival order; at most `queue` requests wait, more get 429 with
Retry-After. The conversation the last request left is kept, so a follow-up turn that repeats the
earlier messages prefills only what is new (`usage.prompt_tokens_details.cached_tokens`). A streamed
request whose client goes away stops at its next target pass.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from edgespec.openai_api import (
    APIError,
    Completion,
    chunk,
    new_id,
    parse_chat,
    parse_completion,
    response,
)
from edgespec.runtime.engine import GenerationConfig, Result
from edgespec.runtime.errors import EdgespecError
from edgespec.runtime.pipeline import Pipeline

RETRY_AFTER_S = 2


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the id clients name in "model"
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    queue: int = 8  # requests that may wait while one generates

    def __post_init__(self):
        if self.queue < 0:
            raise ValueError(f"--queue must be >= 0 (got {self.queue})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535 (got {self.port})")
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key cannot be empty")


class Generations:
    """The one pipeline, its worker thread, and the conversation it keeps between requests."""

    def __init__(self, pipeline: Pipeline, queue: int):
        self.pipeline = pipeline
        self.limit = queue + 1  # the running request and the waiting ones
        self.pending = 0  # touched on the event loop only
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-generate")
        self._fresh_conversation()

    def _fresh_conversation(self) -> None:
        self.session = self.pipeline.new_session()
        self.drafter = self.pipeline.make_drafter(speculate=True)

    def admit(self) -> None:
        """Takes a place in the queue (`release` gives it back), or refuses with 429."""
        if self.pending >= self.limit:
            raise APIError(f"the server is busy: {self.limit - 1} requests are already waiting; retry shortly",
                           code="queue_full", status=429, kind="rate_limit_error")
        self.pending += 1

    def release(self) -> None:
        self.pending -= 1

    def prepare(self, request: Completion) -> GenerationConfig:
        """The generation config, checked against the context before the request queues."""
        try:
            ids = self.pipeline.encode(request.prompt, list(request.messages) if request.messages else None)
        except (ValueError, EdgespecError) as err:
            raise APIError(f"the prompt cannot be encoded: {err}", "messages" if request.messages else "prompt") from err
        return request.config(len(ids), self.pipeline.context)

    async def run(self, request: Completion) -> Result:
        """Generates in turn, the whole answer at once."""
        config = self.prepare(request)
        self.admit()
        try:
            return await self.execute(request, config)
        finally:
            self.release()

    def execute(self, request: Completion, config: GenerationConfig, on_text=None, cancel: threading.Event | None = None):
        """An awaitable of the generation on the worker thread, in turn: None when `cancel` was set before
        its turn came."""
        return asyncio.get_running_loop().run_in_executor(self.worker, self._generate, request, config, on_text,
                                                          cancel)

    def _generate(self, request: Completion, config, on_text, cancel) -> Result | None:
        if cancel is not None and cancel.is_set():
            return None
        try:
            return self.pipeline.generate(request.prompt, messages=list(request.messages) if request.messages else None,
                                          config=config, session=self.session, drafter=self.drafter, on_text=on_text,
                                          should_stop=cancel.is_set if cancel is not None else None)
        except BaseException:
            self._fresh_conversation()  # a generation that failed midway leaves no state to trust
            raise


class Routes:
    """The HTTP side: each route checks its request, hands it to `Generations`, and shapes the answer."""

    def __init__(self, generations: Generations, config: ServeConfig):
        self.generations, self.config = generations, config

    def authorize(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.encode(), self.config.api_key.encode()):
            raise APIError("a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           status=401)

    async def completions(self, request: Request, chat: bool):
        self.authorize(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(f"the request body is not valid JSON: {err}") from err
        completion = (parse_chat if chat else parse_completion)(body, self.config.model)
        request_id = new_id(chat)
        if completion.stream:
            return self.stream(completion, request_id, chat)
        try:
            result = await self.generations.run(completion)
        except EdgespecError as err:
            raise APIError(str(err), code="generation_failed") from err
        return JSONResponse(response(request_id, chat, self.config.model, result))

    def stream(self, completion: Completion, request_id: str, chat: bool) -> StreamingResponse:
        """Takes the queue place and starts the generation here, so that a place is never counted twice
        and always given back, whatever the client does with the stream."""
        config = self.generations.prepare(completion)  # a prompt too long is refused before the stream starts
        self.generations.admit()
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        try:
            task = asyncio.ensure_future(self.generations.execute(
                completion, config, lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text), cancel))
        except BaseException:
            self.generations.release()
            raise

        def done(_) -> None:
            self.generations.release()
            pieces.put_nowait(None)

        task.add_done_callback(done)
        events = stream_events(task, pieces, cancel, completion, request_id, chat, self.config.model)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def chat_completions(self, request: Request):
        return await self.completions(request, chat=True)

    async def text_completions(self, request: Request):
        return await self.completions(request, chat=False)

    async def models(self, request: Request):
        self.authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.config.model, "object": "model", "created": 0,
                                                         "owned_by": "edgespec"}]})

    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.config.model, "pending": self.generations.pending})

    @staticmethod
    async def api_error(request: Request, err: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    @staticmethod
    async def http_error(request: Request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(f"{request.method} {request.url.path}: {err.detail}", kind=kind).body(),
                            status_code=err.status_code)


def make_app(pipeline: Pipeline, config: ServeConfig) -> Starlette:
    generations = Generations(pipeline, config.queue)
    routes = Routes(generations, config)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        generations.worker.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=[Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
                            Route("/v1/completions", routes.text_completions, methods=["POST"]),
                            Route("/v1/models", routes.models, methods=["GET"]),
                            Route("/health", routes.health, methods=["GET"])],
                    exception_handlers={APIError: routes.api_error, HTTPException: routes.http_error},
                    lifespan=lifespan)
    app.state.generations = generations
    return app


async def stream_events(task: asyncio.Future, pieces: asyncio.Queue, cancel: threading.Event, completion: Completion,
                        request_id: str, chat: bool, model: str):
    """Server-sent events: the text as it comes, the last chunk with the finish reason, usage if asked,
    then [DONE]. A client that goes away cancels the generation at its next target pass."""
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    try:
        yield event(chunk(request_id, chat, model, first=True))
        while (text := await pieces.get()) is not None:
            yield event(chunk(request_id, chat, model, text=text))
        try:
            result = task.result()
        except EdgespecError as err:
            yield event(APIError(str(err), code="generation_failed").body())
            return
        yield event(chunk(request_id, chat, model, result=result))
        if completion.include_usage:
            yield event(chunk(request_id, chat, model, result=result, usage_only=True))
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # a no-op once the generation ended; stops it at the next pass if the client left


def serve(pipeline: Pipeline, config: ServeConfig) -> None:
    import uvicorn

    uvicorn.run(make_app(pipeline, config), host=config.host, port=config.port, log_level="info")
