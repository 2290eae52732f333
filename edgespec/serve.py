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

from edgespec.defaults import resolve_bundle
from edgespec.openai_api import (
    APIError,
    Completion,
    chunk,
    new_id,
    parse_chat,
    parse_completion,
    response,
)
from edgespec.runtime.engine import Result
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
        if self.pending >= self.limit:
            raise APIError(f"the server is busy: {self.limit - 1} requests are already waiting; retry shortly",
                           code="queue_full", status=429, kind="rate_limit_error")

    def prepare(self, request: Completion):
        """(token ids, generation config): checked against the context before the request queues."""
        try:
            ids = self.pipeline.encode(request.prompt, list(request.messages) if request.messages else None)
        except (ValueError, EdgespecError) as err:
            raise APIError(f"the prompt cannot be encoded: {err}", "messages" if request.messages else "prompt") from err
        return ids, request.config(len(ids), self.pipeline.context)

    async def run(self, request: Completion, on_text=None, cancel: threading.Event | None = None) -> Result | None:
        """Generates on the worker thread, in turn; None when `cancel` was set before its turn came."""
        self.admit()
        ids, config = self.prepare(request)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self.worker, self._generate, request, config, on_text, cancel)
        finally:
            self.pending -= 1

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


def make_app(pipeline: Pipeline, config: ServeConfig) -> Starlette:
    generations = Generations(pipeline, config.queue)

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(key.encode(), config.api_key.encode()):
            raise APIError("a valid API key is required: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                           status=401)

    async def read_json(request: Request):
        try:
            return json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(f"the request body is not valid JSON: {err}") from err

    async def completions(request: Request, chat: bool):
        authorize(request)
        body = await read_json(request)
        completion = (parse_chat if chat else parse_completion)(body, config.model)
        request_id = new_id(chat)
        if completion.stream:
            generations.admit()
            generations.prepare(completion)  # refuse a prompt too long before the stream starts
            return StreamingResponse(stream(generations, completion, request_id, chat, config.model),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            result = await generations.run(completion)
        except EdgespecError as err:
            raise APIError(str(err), code="generation_failed") from err
        return JSONResponse(response(request_id, chat, config.model, result))

    async def chat_completions(request: Request):
        return await completions(request, chat=True)

    async def text_completions(request: Request):
        return await completions(request, chat=False)

    async def models(request: Request):
        authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": config.model, "object": "model", "created": 0,
                                                         "owned_by": "edgespec"}]})

    async def health(request: Request):
        return JSONResponse({"status": "ok", "model": config.model, "pending": generations.pending})

    async def api_error(request: Request, err: APIError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status == 429 else None
        return JSONResponse(err.body(), status_code=err.status, headers=headers)

    async def http_error(request: Request, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(f"{request.method} {request.url.path}: {err.detail}", kind=kind).body(),
                            status_code=err.status_code)

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", text_completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"])]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        generations.worker.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=routes, exception_handlers={APIError: api_error, HTTPException: http_error},
                    lifespan=lifespan)
    app.state.generations = generations
    return app


async def stream(generations: Generations, completion: Completion, request_id: str, chat: bool, model: str):
    """Server-sent events: the text as it comes, the last chunk with the finish reason, usage if asked,
    then [DONE]. A client that goes away cancels the generation at its next target pass."""
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    task = asyncio.ensure_future(generations.run(
        completion, on_text=lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text), cancel=cancel))
    task.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))
    try:
        yield event(chunk(request_id, chat, model, first=True))
        while (text := await pieces.get()) is not None:
            yield event(chunk(request_id, chat, model, text=text))
        try:
            result = task.result()
        except (APIError, EdgespecError) as err:
            body = err.body() if isinstance(err, APIError) else APIError(str(err), code="generation_failed").body()
            yield event(body)
            return
        yield event(chunk(request_id, chat, model, result=result))
        if completion.include_usage:
            yield event(chunk(request_id, chat, model, result=result, usage_only=True))
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # a no-op once the generation ended; stops it at the next pass if the client left


def serve(bundle: str, config: ServeConfig, threads: int | None = None, memory_budget: str | None = None) -> None:
    import uvicorn

    pipeline = Pipeline(resolve_bundle(bundle), threads=threads, memory_budget=memory_budget)
    uvicorn.run(make_app(pipeline, config), host=config.host, port=config.port, log_level="info")
