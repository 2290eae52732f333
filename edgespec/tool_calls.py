"""OpenAI's structured output and tools as constraints: `response_format` and `tools` / `tool_choice` read into a
ConstraintSpec, the tools told to the model, and its answer read back as `tool_calls`. Pure functions.

The model is told its tools by its chat template where the template renders a `tools` list, otherwise by a
system instruction (TOOL_INSTRUCTION: the tools' JSON, then how to call one) added to the conversation's
first system message or as one of its own; it calls a tool by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the form Hermes, Qwen and SmolLM2 were tuned on.
The call is constrained by a grammar whose JSON part is the tools' schemas (objects closed, as OpenAI's strict
mode), so its arguments validate against their tool's parameters: `tool_choice` "required" or a named
function admits only a call; "auto" a call or text that does not begin with `<`; "none" no call, and the
tools are not shown. One call per answer unless the request says `parallel_tool_calls: true`; then calls follow
one another, a newline between, as Hermes-style models write several. Several are asked for, not assumed from
OpenAI's default: a run of calls cut at the budget returns no call at all, where one call is always whole
(on the agent set the default model made one call either way, history.md §63).
Earlier calls and their results in `messages` are written back in the same form, results as user turns
beginning "Tool result:" (as benchmarks/workloads/agent.jsonl writes them), so any chat template reads them.
"""
from __future__ import annotations

import json
import uuid

from edgespec.runtime.decoding.constraints import JSON_OPTIONS, ConstraintSpec, closed_objects

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_INSTRUCTION = ("Tools (JSON Schema of each one's arguments):\n{tools}\nTo call one, answer only "
                    "<tool_call>{{\"name\": ..., \"arguments\": {{...}}}}</tool_call>; otherwise answer in text.")



class ToolsError(ValueError):
    """A `tools`, `tool_choice` or `response_format` value the API refuses: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def response_format_constraint(value) -> ConstraintSpec | None:
    """OpenAI's `response_format`: text (None), json_object, or json_schema {name, schema, strict}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise ToolsError("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}",
                         "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return ConstraintSpec.json_object()
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ToolsError("'response_format.json_schema' must be an object with a 'name' and a 'schema'",
                         "response_format.json_schema")
    schema, strict = spec.get("schema", {}), spec.get("strict")
    if not isinstance(schema, dict) or not isinstance(strict, (bool, type(None))):
        raise ToolsError("'response_format.json_schema.schema' must be a JSON schema object and 'strict' a boolean",
                         "response_format.json_schema")
    return ConstraintSpec.json_schema(schema, strict=bool(strict))


def read_tools(tools, tool_choice) -> tuple[tuple[dict, ...], str | None]:
    """(the functions offered, the choice: "auto", "required", a function's name, or None for no call)."""
    if tools in (None, []):
        if tool_choice not in (None, "none"):
            raise ToolsError("'tool_choice' needs 'tools'", "tool_choice")
        return (), None
    if not isinstance(tools, list):
        raise ToolsError("'tools' must be a list of {'type': 'function', 'function': {...}}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolsError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             "...}}}", f"tools[{i}]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]")
        functions.append({"name": function["name"], "description": function.get("description", ""),
                          "parameters": parameters})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ToolsError("'tools' names a function twice", "tools")
    if tool_choice in (None, "auto"):
        return tuple(functions), "auto"
    if tool_choice == "none":
        return tuple(functions), None
    if tool_choice == "required":
        return tuple(functions), "required"
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and named in names):
        raise ToolsError("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                         f"{{'name': one of {names}}}}}", "tool_choice")
    return tuple(functions), named


def tool_constraint(functions: tuple[dict, ...], choice: str, parallel: bool = False) -> ConstraintSpec:
    """A grammar for `choice`: a call of the named function, a call of any ("required"), or either a call or
    text ("auto"); `parallel`: one call or more, a newline between."""
    offered = [f for f in functions if choice in ("auto", "required") or f["name"] == choice]
    call_schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                                 "arguments": closed_objects(f["parameters"])},
                              "required": ["name", "arguments"], "additionalProperties": False} for f in offered],
                   "x-guidance": JSON_OPTIONS}  # the engine's options inside a grammar: JSON as json.dumps writes it
    call = f"call: {json.dumps(CALL_OPEN)} %json {json.dumps(call_schema)} {json.dumps(CALL_CLOSE)}\n"
    calls = 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"
    if choice == "auto":  # text cannot begin with "<", so the two never share a beginning
        return ConstraintSpec.grammar("start: calls | TEXT\nTEXT: /[^<][\\s\\S]*/\n" + calls + call)
    return ConstraintSpec.grammar("start: calls\n" + calls + call)


def told(messages: list[dict], functions: tuple[dict, ...], template_takes_tools: bool) -> tuple[list[dict], list | None]:
    """(the messages, the tools for the chat template): the template renders the tools where it can (the
    call format its model was tuned on is the one Hermes-style templates ask for), else the instruction does."""
    if template_takes_tools:
        return messages, [{"type": "function", "function": f} for f in functions]
    return with_tools(messages, functions), None


def with_tools(messages: list[dict], functions: tuple[dict, ...]) -> list[dict]:
    """The conversation with the tools told in its system message (TOOL_INSTRUCTION)."""
    told = TOOL_INSTRUCTION.format(tools="\n".join(json.dumps({"name": f["name"], "description": f["description"],
                                                                "parameters": f["parameters"]}, separators=(",", ":"))
                                                    for f in functions))
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + told}, *messages[1:]]
    return [{"role": "system", "content": told}, *messages]


def written_call(tool_calls, param: str) -> str:
    """An assistant message's earlier `tool_calls`, written back as the model writes a call."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise ToolsError(f"{param}.tool_calls must be a non-empty list", f"{param}.tool_calls")
    written = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise ToolsError(f"{param}.tool_calls: each needs a function with a 'name' and 'arguments' (a JSON string)",
                             f"{param}.tool_calls")
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError as err:
            raise ToolsError(f"{param}.tool_calls: arguments are not JSON ({err.msg})", f"{param}.tool_calls") from err
        written.append(CALL_OPEN + json.dumps({"name": function["name"], "arguments": arguments}) + CALL_CLOSE)
    return "\n".join(written)


class CallWatch:
    """A streamed answer's text as it may be sent: under tools, text passes on as it comes, except what could
    still be the start of a call (`read_call`'s: after leading whitespace, a prefix of CALL_OPEN), held until
    it is known to be text or is a call (then the whole answer is held, to be read as calls at its end)."""

    def __init__(self):
        self.held = ""  # text not sent yet: what could still open a call, or the call
        self.text = False  # known to be text: everything passes on

    def feed(self, piece: str) -> str:
        """What of the answer so far can be sent now, given its next piece."""
        if self.text:
            return piece
        self.held += piece
        head = self.held.lstrip()
        if head.startswith(CALL_OPEN) or CALL_OPEN.startswith(head):
            return ""
        self.text, sent, self.held = True, self.held, ""
        return sent


def read_call(text: str) -> list[dict] | None:
    """The answer's tool calls as OpenAI's `tool_calls`, or None when it answered in text (or was cut)."""
    text, calls, at = text.strip(), [], 0
    while True:  # each call read as JSON, so that an argument holding "</tool_call>" does not end it
        if not text.startswith(CALL_OPEN, at):
            return None
        try:
            call, at = json.JSONDecoder().raw_decode(text, at + len(CALL_OPEN))
        except json.JSONDecodeError:
            return None
        if not text.startswith(CALL_CLOSE, at) or not isinstance(call, dict) or set(call) != {"name", "arguments"}:
            return None
        calls.append(call)
        at += len(CALL_CLOSE)
        if at == len(text):
            break
        if text[at] != "\n":
            return None
        at += 1
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}} for call in calls]
