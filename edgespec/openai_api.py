"""The OpenAI API's shapes, as `edgespec serve` speaks them: requests checked into a typed `Completion`,
results and stream chunks as the objects OpenAI's clients read. Pure functions, no server here.

Every field a request may carry is known: a field edgespec supports is checked by type and range; a
field it does not support is refused unless it holds the value that means "not used" (of that type:
`n: true` is not `n: 1`), so nothing a client asked for is ignored silently. Labels (`user`, a
message's `name`) and `cache_salt` do not reach the model; `user` and `cache_salt` say whose kept
conversation a request may continue (edgespec/serve_clients.py).
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass

from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig, Result
from edgespec.runtime.decoding.logprobs import Scores
from edgespec.runtime.decoding.sampling import SamplingConfig, with_defaults
from edgespec.tool_calls import ToolsError, read_tools, response_format_constraint, tool_constraint, written_call

# "closed": the budget closed a constrained output (complete and valid, but ended by max_tokens): "length"
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "stop",
                  "closed": "length"}
MAX_STOP_STRINGS = 4  # as OpenAI's API
# fields a client may send with the value that means "not used" (OpenAI's defaults); any other value is refused
INERT_FIELDS = {"best_of": (1, None),
                "suffix": (None, ""), "service_tier": (None, "auto"), "store": (False, None), "metadata": (None,),
                "user": None, "cache_salt": None}  # None: any string (a label, or whose cache a request may use)
# what a client that sends these expects and would not get: said in the 400, so that it does not retry as is
NOT_BUILT = {"tools": "tools are for /v1/chat/completions", "tool_choice": "tools are for /v1/chat/completions",
             "parallel_tool_calls": "tools are for /v1/chat/completions",
             "response_format": "response_format is for /v1/chat/completions"}
# chat's structured output (edgespec/tool_calls.py)
STRUCTURED_FIELDS = ("response_format", "tools", "tool_choice", "parallel_tool_calls")
SAMPLING_FIELDS = ("model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "temperature",
                   "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                   "presence_penalty", "logit_bias", "n")
MOST_CHOICES = 16  # n: choices per prompt (each one generation, taking its own place in the queue)
MOST_LOGPROBS = 20  # top_logprobs (chat) and logprobs (completions): alternatives per token, as vLLM allows


class APIError(Exception):
    """A request the API refuses: answered with `status` and OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Completion:
    """One checked request: chat `messages` or a plain `prompt`, and how to generate."""

    sampling: SamplingConfig
    stop: tuple[str, ...]
    max_tokens: int | None  # None: as many as the context has room for
    stream: bool
    include_usage: bool
    messages: tuple[dict, ...] | None = None
    prompt: str | None = None
    user: str | None = None  # labels: with the API key, whose kept conversation this request may continue
    cache_salt: str | None = None
    constraint: ConstraintSpec | None = None  # response_format, or the tools' call grammar
    tools: tuple[dict, ...] = ()  # the functions offered (edgespec/tool_calls.py)
    tool_choice: str | None = None  # "auto", "required", a function's name; None: no call
    logprobs: int | None = None  # alternatives per token with each token's log-probability; None: none asked
    echo: bool = False  # completions: the prompt leads the text (and its tokens the logprobs)
    n: int = 1  # choices per prompt
    prompts: tuple[str, ...] = ()  # completions sent a list of prompts: all of them (`prompt` is the first)

    def per_prompt(self) -> list[Completion]:
        """The request for each prompt of a list, as if sent alone (its n choices each), or this one."""
        if len(self.prompts) < 2:
            return [self]
        return [dataclasses.replace(self, prompt=prompt, prompts=()) for prompt in self.prompts]

    @property
    def choices(self) -> int:
        """How many generations answer it: n for each prompt."""
        return max(1, len(self.prompts)) * self.n

    def scores(self) -> Scores | None:
        """Where the generation puts the log-probabilities asked for (None: none)."""
        return None if self.logprobs is None else Scores(top=self.logprobs, prompt=self.echo)

    @property
    def characters(self) -> int:
        """The prompt's length in characters, known before it is tokenised."""
        return len(self.prompt) if self.prompt is not None else sum(len(m["content"]) for m in self.messages)

    def config(self, prompt_tokens: int, context: int) -> GenerationConfig:
        """How to generate after a prompt of `prompt_tokens`, within `context` tokens."""
        room = context - prompt_tokens - 1
        if room < 1 or (self.max_tokens is not None and self.max_tokens > room):
            asked = f" and {self.max_tokens} new tokens" if self.max_tokens is not None else ""
            raise APIError(f"this model's context is {context} tokens; the prompt has {prompt_tokens}{asked}: "
                           "shorten the messages or lower max_tokens", "messages", "context_length_exceeded")
        return GenerationConfig(max_new_tokens=self.max_tokens or room, stop_strings=self.stop, sampling=self.sampling,
                                constraint=self.constraint)


def parse_chat(body, model: str, defaults: dict | None = None) -> Completion:
    """`defaults`: the sampling a request leaves unset takes (Pipeline.sampling_defaults; none: OpenAI's)."""
    _check_fields(body, ("messages", "logprobs", "top_logprobs", *STRUCTURED_FIELDS))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects", "messages")
    try:
        messages = [_message(m, i) for i, m in enumerate(messages)]
        tools, choice = read_tools(body.get("tools"), body.get("tool_choice"))
        constraint = response_format_constraint(body.get("response_format"))
        if choice is not None and constraint is not None:
            raise ToolsError("give 'response_format' or 'tools', not both: a tool call's arguments follow its own "
                             "schema", "response_format")
        parallel = _typed(body, "parallel_tool_calls", bool, None)
        if parallel is False and not tools:
            raise ToolsError("'parallel_tool_calls' needs 'tools'", "parallel_tool_calls")
    except ToolsError as err:
        raise APIError(str(err), err.param) from err
    except InputError as err:  # a schema that is not one
        raise APIError(f"'response_format': {err}", "response_format") from err
    if choice is not None:
        constraint = tool_constraint(tools, choice, parallel=parallel is True)  # several calls when asked
    wanted = _typed(body, "logprobs", bool, False)
    top = _typed(body, "top_logprobs", int, None)
    if top is not None and not wanted:
        raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top is not None and not 0 <= top <= MOST_LOGPROBS:
        raise APIError(f"'top_logprobs' must be in 0..{MOST_LOGPROBS}", "top_logprobs")
    return Completion(messages=tuple(messages), **_generation(body, model, defaults), constraint=constraint,
                      tools=tools, tool_choice=choice, logprobs=(top or 0) if wanted else None)


def parse_completion(body, model: str, defaults: dict | None = None) -> Completion:
    _check_fields(body, ("prompt", "logprobs", "echo"))
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    # token ids are not taken (strings only): a list of integers is refused here, not read as text
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise APIError("'prompt' must be a non-empty string or a non-empty list of them", "prompt")
    logprobs = _typed(body, "logprobs", int, None)
    if logprobs is not None and not 0 <= logprobs <= MOST_LOGPROBS:
        raise APIError(f"'logprobs' must be in 0..{MOST_LOGPROBS}", "logprobs")
    generation = _generation(body, model, defaults)
    echo = _typed(body, "echo", bool, False)
    if echo and generation["stream"]:
        raise APIError("'echo' is for requests that are not streamed", "echo", "unsupported_parameter")
    return Completion(prompt=prompts[0], prompts=tuple(prompts) if len(prompts) > 1 else (), **generation,
                      logprobs=logprobs, echo=echo)


def _check_fields(body, own: tuple[str, ...]) -> None:
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, value in body.items():
        if name in own or name in SAMPLING_FIELDS:
            continue
        if name in NOT_BUILT and value is not None:
            raise APIError(f"'{name}' is not supported by this server: {NOT_BUILT[name]}", name, "unsupported_parameter")
        if name not in INERT_FIELDS:
            raise APIError(f"'{name}' is not supported by this server", name, "unsupported_parameter")
        inert = INERT_FIELDS[name]
        if inert is None:
            if not isinstance(value, str):
                raise APIError(f"'{name}' must be a string", name)
        elif value is not None and not any(type(value) is type(v) and value == v for v in inert):  # True is not 1
            raise APIError(f"'{name}' = {value!r} is not supported by this server (only {inert[0]!r})", name,
                           "unsupported_parameter")


def _message(message, index: int) -> dict:
    param = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise APIError(f"{param} must be an object with a 'role' and a 'content'", param)
    if message["role"] not in ("system", "developer", "user", "assistant", "tool"):
        raise APIError(f"{param}.role {message['role']!r} is not supported (system, developer, user, assistant, "
                       "tool)", f"{param}.role")
    # name: a participant's label, as `user` (not shown); an assistant's earlier tool calls; a tool result's call id
    allowed = {"role", "content", "name"} | ({"tool_calls"} if message["role"] == "assistant" else set()) \
        | ({"tool_call_id"} if message["role"] == "tool" else set())
    unknown = set(message) - allowed
    if unknown:
        raise APIError(f"{param} has unsupported fields: {', '.join(sorted(unknown))}", param, "unsupported_parameter")
    if message.get("tool_calls") is not None:  # written back as the model writes a call (edgespec/tool_calls.py)
        return {"role": "assistant", "content": written_call(message["tool_calls"], param)}
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise APIError(f"{param}.content: only text parts are supported", f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(f"{param}.content must be a string", f"{param}.content")
    if message["role"] == "tool":
        return {"role": "user", "content": f"Tool result: {content}"}
    return {"role": "system" if message["role"] == "developer" else message["role"], "content": content}


def _generation(body: dict, model: str, defaults: dict | None) -> dict:
    if not isinstance(body.get("model"), str):
        raise APIError("'model' is required: a string", "model")
    if body["model"] != model:  # OpenAI's answer to a model it does not have: 404, not a malformed request
        raise APIError(f"the model {body['model']!r} does not exist here: this server serves {model!r}", "model",
                       "model_not_found", status=404)
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, {})
    if options and not stream:
        raise APIError("'stream_options' is for streamed requests ('stream': true)", "stream_options")
    if set(options) - {"include_usage"}:
        raise APIError("'stream_options' supports 'include_usage' only", "stream_options", "unsupported_parameter")
    include_usage = _typed(options, "include_usage", bool, False)
    n = _typed(body, "n", int, 1)
    if not 1 <= n <= MOST_CHOICES:
        raise APIError(f"'n' must be in 1..{MOST_CHOICES} (got {n})", "n")
    max_tokens = _max_tokens(body)
    stop = _stop(body.get("stop"))
    sampling = _sampling(body, {"temperature": 1.0} if defaults is None else defaults)
    return dict(sampling=sampling, stop=stop, max_tokens=max_tokens, stream=stream, include_usage=include_usage, n=n,
                user=body.get("user") or None, cache_salt=body.get("cache_salt") or None)


def _sampling(body: dict, defaults: dict) -> SamplingConfig:
    """The request's sampling fields over `defaults` (what a field left unset takes)."""
    temperature = _number(body, "temperature", None, 0.0, 2.0)
    top_p = _number(body, "top_p", None, 0.0, 1.0)
    if top_p == 0:
        raise APIError("'top_p' must be in (0, 1]", "top_p")
    top_k = _typed(body, "top_k", int, None)
    if top_k is not None and top_k < -1:
        raise APIError("'top_k' must be >= 0 (0 or -1: all tokens)", "top_k")
    seed = _typed(body, "seed", int, None)
    if seed is not None and seed < 0:
        raise APIError("'seed' must be >= 0", "seed")
    given = {"temperature": None if temperature is None else temperature if temperature >= 1e-3 else 0.0,
             # temperatures below the runtime's smallest are greedy, as a tiny temperature is in effect
             "top_p": top_p, "top_k": None if top_k is None else max(top_k, 0), "seed": seed,
             "min_p": _number(body, "min_p", None, 0.0, 1.0),
             "repetition_penalty": _number(body, "repetition_penalty", None, 0.0, 10.0),
             "frequency_penalty": _number(body, "frequency_penalty", None, -2.0, 2.0),
             "presence_penalty": _number(body, "presence_penalty", None, -2.0, 2.0),
             "logit_bias": _logit_bias(body.get("logit_bias"))}
    if given["temperature"] == 0:  # greedy: a penalty at its neutral value is no request for one
        given = {name: value for name, value in given.items()
                 if value not in ({"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
                                  .get(name, object()),)}
    try:
        return with_defaults(given, defaults)
    except InputError as err:
        named = [(str(err).find(n), n) for n in given if n in str(err)]  # the setting the message is about
        name = min(named)[1] if named else None
        raise APIError(str(err), name) from err


def _logit_bias(bias) -> tuple[tuple[int, float], ...] | None:
    """OpenAI's {"token id": bias} as (id, bias) pairs; None or {} for none."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise APIError("'logit_bias' must map token ids to numbers from -100 to 100", "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(f"'logit_bias': {key!r}: {value!r} must map a token id to a number", "logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _typed(body: dict, name: str, kind: type, default):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise APIError(f"'{name}' must be {'an integer' if kind is int else 'a ' + kind.__name__}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise APIError(f"'{name}' must be a number", name)
    if not low <= value <= high:
        raise APIError(f"'{name}' must be between {low} and {high} (got {value})", name)
    return float(value)


def _max_tokens(body: dict) -> int | None:
    values = {}
    for name in ("max_completion_tokens", "max_tokens"):
        value = _typed(body, name, int, None)
        if value is not None and value <= 0:
            raise APIError(f"'{name}' must be at least 1 (got {value})", name)
        if value is not None:
            values[name] = value
    if len(set(values.values())) > 1:
        raise APIError("'max_tokens' and 'max_completion_tokens' disagree: send one", "max_tokens")
    return next(iter(values.values()), None)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise APIError(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(stops)


# --- responses -------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def usage(results: list[Result], n: int = 1) -> dict:
    """Every choice's completion tokens, and each prompt's tokens once (its first choice's: `results` by choice
    index, n per prompt)."""
    firsts = results[::n]
    prompt, completion = sum(r.stats.prompt_tokens for r in firsts), sum(r.stats.new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.stats.cached_tokens for r in firsts)}}


def speculation(results: list[Result]) -> dict:
    """The documented extension field `edgespec`: how speculation went for this request (over all its choices
    when there are several, with `stop_reasons` by choice index)."""
    if len(results) == 1:
        stats = results[0].stats
        return {"tokens_per_target_pass": round(stats.mean_accepted_per_pass, 3), "target_passes": stats.target_passes,
                "tokens_per_s": round(stats.tokens_per_s, 2), "time_to_first_token_s": round(stats.first_token_s, 4),
                "stop_reason": results[0].stop_reason}
    every = [r.stats for r in results]
    passes = sum(s.target_passes for s in every)
    decoded, decode_s = sum(max(0, s.new_tokens - 1) for s in every), sum(s.decode_s for s in every)
    return {"tokens_per_target_pass": round((sum(s.accepted_drafts for s in every) + passes) / passes, 3)
            if passes else 0.0, "target_passes": passes,
            "tokens_per_s": round(decoded / decode_s, 2) if decode_s else 0.0,  # a choice's own decoding speed
            "time_to_first_token_s": round(min(s.first_token_s for s in every), 4),
            "stop_reasons": [r.stop_reason for r in results]}


def choice(index: int, chat: bool, result: Result, tool_calls: list[dict] | None = None, logprobs: dict | None = None,
           echoed: str = "") -> dict:
    """One choice of a response. `tool_calls`: the calls the answer made (edgespec/tool_calls.py: read_call), which
    they are instead of text; `logprobs`: the choice's (edgespec/openai_logprobs.py); `echoed`: the prompt, before
    a completion's text."""
    finish = "tool_calls" if tool_calls else FINISH_REASONS[result.stop_reason]
    if not chat:
        return {"index": index, "text": echoed + result.text, "finish_reason": finish, "logprobs": logprobs}
    message = {"role": "assistant", "content": None, "tool_calls": tool_calls} if tool_calls else \
        {"role": "assistant", "content": result.text}
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}


def response(request_id: str, chat: bool, model: str, results: list[Result], choices: list[dict], n: int = 1) -> dict:
    """`results` and their `choices` by choice index (`choice`), n per prompt."""
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(results, n), "edgespec": speculation(results)}


def chunk(request_id: str, chat: bool, model: str, text: str | None = None, result: Result | None = None,
          first: bool = False, tool_calls: list[dict] | None = None, called: bool = False,
          logprobs: dict | None = None, index: int = 0) -> dict:
    """A stream chunk of choice `index`: text (the first chat chunk also names the role), a tool call (whole,
    in one chunk), or its last one (finish reason, "tool_calls" when `called`, and the extension field of
    that choice)."""
    base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}
    finish = None if result is None else "tool_calls" if called else FINISH_REASONS[result.stop_reason]
    if chat and tool_calls:
        delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]}
        choice = {"index": index, "delta": delta, "finish_reason": None}
    elif chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "finish_reason": finish, **({"logprobs": logprobs} if logprobs else {})}
    else:
        choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
    extra = {"edgespec": speculation([result])} if result is not None else {}
    return {**base, "choices": [choice], **extra}


def usage_chunk(request_id: str, chat: bool, model: str, results: list[Result], n: int = 1) -> dict:
    """The usage-only last chunk of `stream_options.include_usage`, over every choice. Usage is on that chunk
    alone: clients that add up usage over chunks (LangChain) would count it twice."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [], "usage": usage(results, n)}
