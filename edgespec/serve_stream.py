"""A streamed answer as server-sent events (edgespec/serve.py): text as it is decoded, with its logprobs,
under tools all but what could still open a call (edgespec/tool_calls.py `CallWatch`), then the call or
the text held back, the finish, the usage, [DONE]."""
from __future__ import annotations

import asyncio
import json
import threading

from edgespec.openai_api import APIError, Completion, chunk
from edgespec.openai_logprobs import chat_logprobs, completion_logprobs
from edgespec.runtime.contract.errors import EdgespecError
from edgespec.tool_calls import CallWatch, read_call


async def stream_events(task: asyncio.Future, pieces: asyncio.Queue, cancel: threading.Event, completion: Completion,
                        request_id: str, chat: bool, model: str, token_text=None):
    """Server-sent events: the text as it comes, the last chunk with the finish reason, the usage chunk if
    asked, then [DONE]. A client that goes away cancels the generation at its next target pass."""
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    watch = CallWatch() if completion.tool_choice else None  # a call is sent whole, once read at the end
    try:
        yield event(chunk(request_id, chat, model, first=True))
        def shaped(scored):
            return None if not scored else chat_logprobs(scored, token_text) if chat else \
                completion_logprobs(scored, token_text)

        sent = 0  # tokens whose logprobs went with their text
        held = []  # logprobs of text the watch holds back: they go with it when it is sent
        while (piece := await pieces.get()) is not None:
            text, scored = piece
            held += scored or ()
            if watch is not None:
                text = watch.feed(text)
            if text:
                sent += len(held)
                yield event(chunk(request_id, chat, model, text=text, logprobs=shaped(held)))
                held = []
        try:
            result = task.result()
        except EdgespecError as err:
            yield event(APIError(str(err), code="generation_failed").body())
            return
        # logprobs not sent yet: of text held back, or of tokens of no text of their own (a split character)
        rest = list(result.logprobs[sent:]) if result.logprobs else []
        calls = read_call(result.text) if completion.tool_choice else None
        if calls:
            yield event(chunk(request_id, chat, model, tool_calls=calls))
        elif watch is not None and watch.held:  # held back in case it was a call: it was text (or a cut call)
            yield event(chunk(request_id, chat, model, text=watch.held, logprobs=shaped(rest)))
            rest = []
        if rest:
            yield event(chunk(request_id, chat, model, text="", logprobs=shaped(rest)))
        yield event(chunk(request_id, chat, model, result=result, called=bool(calls)))
        if completion.include_usage:
            yield event(chunk(request_id, chat, model, result=result, usage_only=True))
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # a no-op once the generation ended; stops it at the next pass if the client left
