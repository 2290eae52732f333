"""The limits that keep one request from taking `edgespec serve` down, in the order a request meets them:
its body's size (413, the rest left unread), its JSON (nesting depth and integer size: 400, where Python's
parser would raise RecursionError or refuse the int conversion), and its prompt's length in characters
against the context, then its chat template's text (400 before the tokenizer sees it). Stateless: the
server owns the settings.
"""
from __future__ import annotations

import ipaddress
import json

import numpy as np
from starlette.requests import Request

from edgespec.openai_api import APIError, Completion

MAX_DEPTH = 32  # a chat request nests 5 levels (body, messages, a message, content parts, a part)
MAX_INT_DIGITS = 20  # the largest an API field takes is a 64-bit seed
# A normalizer may fold several characters into one (NFC composes a Hangul syllable from 3 jamo), so a token
# covers at most this many times the characters of its vocabulary entry: the bound never refuses what fits.
FOLDING = 4


def too_large(limit: int) -> APIError:
    return APIError(f"the request body is larger than this server accepts ({limit} bytes; --max-body)",
                    code="request_too_large", status=413)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit`: from its Content-Length before
    a byte is read, or counted as it arrives (chunked, or a client that sends more than it declared)."""
    declared = request.headers.get("content-length", "")
    # int() of a header thousands of digits long is itself refused by Python: its length says enough
    if declared.isdigit() and (len(declared) > len(str(limit)) or int(declared) > limit):
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(body: bytes):
    """The body's JSON value, within MAX_DEPTH levels and MAX_INT_DIGITS-digit integers (else 400)."""
    try:
        text = body.decode(json.detect_encoding(body))  # as json.loads reads bytes: UTF-8, -16 or -32
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise APIError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON: {err}") from None
    if _depth(text) > MAX_DEPTH:
        raise APIError(f"the request body nests deeper than {MAX_DEPTH} levels")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise APIError(f"the request body holds an integer of {len(text.lstrip('-'))} digits; at most "
                       f"{MAX_INT_DIGITS} are accepted")
    return int(text)


_STEP = np.zeros(256, np.int8)  # by byte: +1 opens a container, -1 closes one
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1


def _depth(text: str) -> int:
    """How deep the valid JSON `text` nests, counted on its brackets outside strings, never by walking the
    parsed value: a value just under the parser's recursion limit must not reach it in the checks that
    follow, and a walk over 100,000 small objects took a second. In UTF-8 the bytes of `"`, `\\` and the
    brackets occur only as those characters."""
    codes = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    counts = np.int32 if len(codes) < 2**31 else np.int64
    quotes = codes == ord('"')
    backslashes = codes == ord("\\")
    if backslashes.any():  # a quote after an odd run of backslashes is escaped
        count = np.cumsum(backslashes, dtype=counts)
        run = count - np.maximum.accumulate(np.where(backslashes, 0, count))  # backslashes in a row, ending here
        quotes[1:] &= run[:-1] % 2 == 0
    outside = np.cumsum(quotes, dtype=counts) % 2 == 0  # a string's brackets lie after an odd number of quotes
    return int(np.cumsum(np.where(outside, _STEP[codes], 0), dtype=counts).max(initial=0))


def longest_token(tokenizer) -> int:
    """Characters of the longest vocabulary entry (a `tokenizers.Tokenizer`), special tokens included."""
    return max(map(len, tokenizer.get_vocab(with_added_tokens=True)), default=1)


def check_length(completion: Completion, context: int, longest: int) -> None:
    """Refuses a prompt that cannot fit in `context` tokens whatever the tokenizer makes of it (each token
    covers at most `longest` x FOLDING characters), so that a huge prompt is never tokenised."""
    _check_characters(completion.characters, "a prompt of", "messages" if completion.messages else "prompt",
                      context, longest)


def check_rendered(text: str, context: int, longest: int) -> None:
    """The same bound on the chat template's text for the messages, before it is tokenised: many short
    messages pass `check_length`, but the template adds its markers to each (tokenising the text is what
    takes the time; rendering it is cheap)."""
    _check_characters(len(text), "the messages in its chat template come to", "messages", context, longest)


def _check_characters(characters: int, what: str, param: str, context: int, longest: int) -> None:
    most = context * longest * FOLDING
    if characters > most:
        raise APIError(f"this model's context is {context} tokens; {what} {characters} characters, which cannot fit "
                       f"in it (at most {most} could): shorten the messages", param, "context_length_exceeded")


def exposed_without_key(host: str, api_keys: tuple[str, ...]) -> str | None:
    """The warning for a server other machines can reach with no key, or None."""
    if api_keys:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        loopback = False
    if loopback:
        return None
    return (f"listening on {host} without --api-key: anyone who can reach this address can use the model; "
            "give --api-key KEY or listen on 127.0.0.1")
