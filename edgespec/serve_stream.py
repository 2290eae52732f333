"""A streamed answer as server-sent events (edgespec/serve.py): each choice's text as it is decoded, with
its logprobs, under tools all but what could still open a call (edgespec/tool_calls.py `CallWatch`), then
the call or the text held back and the finish of that choice; once every choice has ended, the usage and
[DONE]. Chunks of several choices interleave as their generations do, each naming its choice's index."""
from __future__ import annotations

import asyncio
import json
import threading

from edgespec.openai_api import APIError, Completion, chunk, usage_chunk
from edgespec.openai_logprobs import chat_logprobs, completion_logprobs
from edgespec.runtime.contract.errors import EdgespecError
from edgespec.tool_calls import CallWatch, read_call


async def stream_events(tasks: list[asyncio.Future], pieces: asyncio.Queue, cancel: threading.Event,
                        completion: Completion, request_id: str, chat: bool, model: str, token_text=None):
    """Server-sent events: the text of each choice (`tasks` by choice index) as it comes, as `pieces` holds it:
    (index, text, its logprobs), and (index, None, None) once that choice's generation has ended. Then each
    ended choice's last chunk with its finish reason, the usage chunk if asked, then [DONE]. A client that
    goes away cancels every choice's generation at its next target pass."""
    def event(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    def shaped(scored):
        return None if not scored else chat_logprobs(scored, token_text) if chat else \
            completion_logprobs(scored, token_text)

    # a call is sent whole, once read at the end
    watches = [CallWatch() if completion.tool_choice else None for _ in tasks]
    sent = [0] * len(tasks)  # tokens whose logprobs went with their text
    held: list[list] = [[] for _ in tasks]  # logprobs of text a watch holds back: they go with it when it is sent
    results = [None] * len(tasks)
    try:
        for index in range(len(tasks)):
            yield event(chunk(request_id, chat, model, first=True, index=index))
        ended = 0
        while ended < len(tasks):
            index, text, scored = await pieces.get()
            if text is not None:
                held[index] += scored or ()
                if watches[index] is not None:
                    text = watches[index].feed(text)
                if text:
                    sent[index] += len(held[index])
                    yield event(chunk(request_id, chat, model, text=text, logprobs=shaped(held[index]), index=index))
                    held[index] = []
                continue
            ended += 1
            try:
                result = results[index] = tasks[index].result()
            except EdgespecError as err:
                yield event(APIError(str(err), code="generation_failed").body())
                return
            # logprobs not sent yet: of text held back, or of tokens of no text of their own (a split character)
            rest = list(result.logprobs[sent[index]:]) if result.logprobs else []
            calls = read_call(result.text) if completion.tool_choice else None
            watch = watches[index]
            if calls:
                yield event(chunk(request_id, chat, model, tool_calls=calls, index=index))
            elif watch is not None and watch.held:  # held back in case it was a call: it was text (or a cut call)
                yield event(chunk(request_id, chat, model, text=watch.held, logprobs=shaped(rest), index=index))
                rest = []
            if rest:
                yield event(chunk(request_id, chat, model, text="", logprobs=shaped(rest), index=index))
            yield event(chunk(request_id, chat, model, result=result, called=bool(calls), index=index))
        if completion.include_usage:
            yield event(usage_chunk(request_id, chat, model, results, completion.n))
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # a no-op once the generations ended; stops them at the next pass if the client left
