"""`edgespec serve`'s structured output and tools, through OpenAI's own client, streamed and not: response_format
(json_object, json_schema strict), tools with every tool_choice, calls whose arguments validate, clear 400s."""
import json

import jsonschema
import pytest
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.pipeline import Pipeline
from test_serve import KEY, MESSAGES, MODEL, Server

from edgespec.openai_api import APIError, parse_chat
from edgespec.tool_calls import CallWatch, read_call, told, tool_constraint, with_tools

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"},
                                           "pet": {"enum": ["fox", "dog"]}},
          "required": ["name", "age", "pet"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
TIMER = {"type": "function", "function": {"name": "timer", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 90}},
    "required": ["minutes"]}}}
TOOLS = [WEATHER, TIMER]


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3", context=512), threads=1)


@pytest.fixture(scope="module")
def server(pipeline):
    running = Server(pipeline, api_keys=(KEY,), queue=1)
    yield running
    running.stop()


def streamed(client, **settings):
    """(the text, the tool calls, the finish reason) of a streamed answer, as a client puts them together."""
    text, calls, finish = "", [], None
    for part in client.chat.completions.create(stream=True, **settings):
        if not part.choices:
            continue
        delta = part.choices[0].delta
        text += delta.content or ""
        for call in delta.tool_calls or []:
            calls.append({"name": call.function.name, "arguments": call.function.arguments})
        finish = part.choices[0].finish_reason or finish
    return text, calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_strict_and_json_object(server, stream):
    client = server.client()
    for response_format, check in [
        ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
         lambda value: jsonschema.validate(value, {**PERSON, "additionalProperties": False})),
        ({"type": "json_object"}, lambda value: isinstance(value, dict) or pytest.fail("not an object")),
    ]:
        settings = dict(model=MODEL, messages=MESSAGES, max_tokens=120, temperature=0, response_format=response_format)
        if stream:
            text, calls, finish = streamed(client, **settings)
        else:
            answer = client.chat.completions.create(**settings)
            text, finish = answer.choices[0].message.content, answer.choices[0].finish_reason
        if finish == "stop":  # else cut at max_tokens: a random tiny model may write a long string
            check(json.loads(text))
        assert text.startswith("{")


def test_streamed_structured_output_equals_unstreamed(server):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0,
                    response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON,
                                                                             "strict": True}})
    whole = client.chat.completions.create(**settings).choices[0].message.content
    assert streamed(client, **settings)[0] == whole


def test_a_schema_the_engine_cannot_compile_is_a_400(server):
    status, _, reply = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}})
    assert status == 400 and reply["error"]["param"] == "response_format"
    assert "cannot be compiled" in reply["error"]["message"]
    for body, param in [({"response_format": {"type": "yaml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
                        ({"tools": [{"type": "function"}]}, "tools[0]"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format")]:
        status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, **body})
        assert status == 400 and reply["error"]["param"] == param, (body, reply)


def test_a_max_tokens_no_output_can_complete_in_is_a_400(server, pipeline):
    """Refused before the request's turn, with the fewest tokens a complete answer needs, not run to the budget."""
    schema = {"name": "p", "schema": PERSON, "strict": True}
    needed = pipeline.grammars.shortest(ConstraintSpec.json_schema(PERSON, strict=True))
    for stream in (False, True):
        status, _, reply = server.post("/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_tokens": needed - 1, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": schema}})
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply
        assert reply["error"]["code"] == "max_tokens_too_small"
        assert f"raise max_tokens to {needed}" in reply["error"]["message"]
    status, _, reply = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 2, "tools": TOOLS, "tool_choice": "required"})
    assert status == 400 and reply["error"]["param"] == "max_tokens", reply
    closes = pipeline.grammars.start(ConstraintSpec.json_schema(PERSON, strict=True), budget=99).closing_distance()
    if closes > needed:  # closing within the budget (runtime/decoding/closing.py) asks for its own completion's length
        status, _, reply = server.post("/v1/chat/completions", {
            "model": MODEL, "messages": MESSAGES, "max_tokens": closes - 1,
            "response_format": {"type": "json_schema", "json_schema": schema}})
        assert status == 400 and f"raise max_tokens to {closes}" in reply["error"]["message"], reply
    answer = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max(needed, closes),
                                                     temperature=0,
                                                     response_format={"type": "json_schema", "json_schema": schema})
    json.loads(answer.choices[0].message.content)  # complete: the model's own end or the budget's close
    assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "timer"}}])
def test_tool_calls_validate_against_their_schema(server, tool_choice, stream):
    client = server.client()
    settings = dict(model=MODEL, messages=MESSAGES, max_tokens=75, temperature=0, tools=TOOLS, tool_choice=tool_choice)
    if stream:
        _, calls, finish = streamed(client, **settings)
    else:
        answer = client.chat.completions.create(**settings)
        message, finish = answer.choices[0].message, answer.choices[0].finish_reason
        assert message.content is None or finish == "length"
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    assert finish == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls[0]["name"] in schemas if tool_choice == "required" else calls[0]["name"] == "timer"
    jsonschema.validate(json.loads(calls[0]["arguments"]), schemas[calls[0]["name"]])


def test_tool_choice_auto_and_none(server):
    client = server.client()
    for choice in ("auto", "none"):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                                tools=TOOLS, tool_choice=choice)
        message = answer.choices[0].message
        if message.tool_calls:
            assert choice == "auto" and answer.choices[0].finish_reason == "tool_calls"
        else:
            assert not (message.content or "").startswith("<")


def test_a_call_and_its_result_go_back_to_the_model(server):
    client = server.client()
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "timer", "arguments": "{\"minutes\": 5}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"ok\": true}"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, tools=[TIMER])
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_the_tools_are_told_and_a_call_is_read_back():
    chat = parse_chat({"model": "m", "messages": [{"role": "system", "content": "Be brief."}, *MESSAGES],
                       "tools": TOOLS, "tool_choice": "auto"}, "m")
    assert chat.constraint.kind == "grammar" and chat.tool_choice == "auto"
    messages, tools = told(list(chat.messages), chat.tools, template_takes_tools=False)
    assert messages[0]["content"].startswith("Be brief.") and "weather" in messages[0]["content"] and tools is None
    messages, tools = told(list(chat.messages), chat.tools, template_takes_tools=True)
    assert messages == list(chat.messages) and tools[0] == {"type": "function", "function": chat.tools[0]}
    none = parse_chat({"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "none"}, "m")
    assert none.constraint is None and none.messages == tuple(MESSAGES)
    assert with_tools(MESSAGES, chat.tools)[0]["role"] == "system"
    calls = read_call('<tool_call>{"name": "timer", "arguments": {"minutes": 5}}</tool_call>')
    assert calls[0]["function"] == {"name": "timer", "arguments": "{\"minutes\": 5}"}
    assert read_call("plain words") is None
    assert "timer" in tool_constraint(chat.tools, "timer").value
    assert "weather" not in tool_constraint(chat.tools, "timer").value
    with pytest.raises(APIError, match="arguments are not JSON"):
        parse_chat({"model": "m", "messages": [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{"}}]}]}, "m")


def test_several_calls_in_one_answer_when_parallel_tool_calls_is_asked(server, pipeline):
    """The grammar admits calls one after another only under `parallel_tool_calls: true`; each is read back."""
    two = ('<tool_call>{"name": "timer", "arguments": {"minutes": 5}}</tool_call>\n'
           '<tool_call>{"name": "weather", "arguments": {"city": "Porto"}}</tool_call>')
    for parallel, admitted in ((True, True), (False, False), (None, False)):
        body = {"model": "m", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
        chat = parse_chat({**body, **({} if parallel is None else {"parallel_tool_calls": parallel})}, "m")
        guide = pipeline.grammars.start(chat.constraint)
        matcher, tokens = guide.matcher, pipeline.grammars.tokenizer.tokenize_str(two)
        first = len(pipeline.grammars.tokenizer.tokenize_str(two.split("\n")[0]))
        assert matcher.consume_tokens(tokens[:first])
        assert (matcher.try_consume_tokens(tokens[first:]) == len(tokens) - first) is admitted, parallel
    calls = read_call(two)
    assert [c["function"]["name"] for c in calls] == ["timer", "weather"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Porto"}
    tagged = read_call(two.replace('"Porto"', '"</tool_call>"'))  # read as JSON: a string may hold the tag
    assert json.loads(tagged[1]["function"]["arguments"]) == {"city": "</tool_call>"}
    assert read_call(two + "\nmore words") is None and read_call(two.split("\n")[0] + " words") is None
    # through OpenAI's client: every call the answer makes validates against its tool
    client = server.client()
    for parallel in (True, False):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=75, temperature=0,
                                                tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
        choice = answer.choices[0]
        if choice.finish_reason == "length":  # several calls may run past the budget: then no call is read
            assert parallel and choice.message.tool_calls is None
            continue
        assert choice.finish_reason == "tool_calls" and (parallel or len(choice.message.tool_calls) == 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_langchain_with_structured_output_and_bind_tools(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Timer(BaseModel):
        """Start a countdown timer."""
        minutes: int = Field(ge=1, le=90)

    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key=KEY, model=MODEL, temperature=0, max_tokens=75,
                     max_retries=0)
    for method in ("json_schema", "json_mode"):
        if method == "json_schema":
            answer = llm.with_structured_output(Timer, method=method).invoke(MESSAGES)
            assert isinstance(answer, Timer) and 1 <= answer.minutes <= 90
        else:  # JSON mode: any object; the tiny model's keys are its own
            reply = llm.with_structured_output(None, method=method, include_raw=True).invoke(MESSAGES)
            assert reply["raw"].content.startswith("{")
    called = llm.bind_tools([Timer], tool_choice="Timer").invoke(MESSAGES)
    assert called.tool_calls and called.tool_calls[0]["name"] == "Timer"
    assert 1 <= called.tool_calls[0]["args"]["minutes"] <= 90


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTOOLS {% for t in tools %}{{ t['function']['name'] }} {% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_is_given_them(bundle_factory, tmp_path):
    import shutil

    folder = tmp_path / "bundle"
    shutil.copytree(bundle_factory(draft="ngram", tree="chain:3", context=512), folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    template = folder / manifest["tokenizer"]["chat_template"]
    template.write_text(TOOLS_TEMPLATE)
    manifest["files"][template.name] = __import__("hashlib").sha256(template.read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    pipeline = Pipeline(folder, threads=1)
    assert pipeline.codec.takes_tools
    running = Server(pipeline, api_keys=(KEY,), queue=1)
    try:
        answer = running.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=75,
                                                          temperature=0, tools=TOOLS, tool_choice="required")
    finally:
        running.stop()
    rendered = pipeline.codec.decode(pipeline.encode(messages=MESSAGES, tools=[TIMER]))
    assert "TOOLS timer" in rendered and "Tools (JSON Schema" not in rendered
    assert answer.usage.prompt_tokens == len(pipeline.encode(messages=MESSAGES, tools=TOOLS))
    assert answer.choices[0].finish_reason == "tool_calls"


def test_text_under_tools_streams_and_only_a_calls_start_is_held():
    """CallWatch (edgespec/tool_calls.py): text passes on piece by piece; what could still open a call waits."""
    watch = CallWatch()
    assert [watch.feed(p) for p in ("Hel", "lo", ", there.")] == ["Hel", "lo", ", there."]
    watch = CallWatch()
    assert [watch.feed(p) for p in (" ", "<", "b", "> bold")] == ["", "", " <b", "> bold"]  # "<b" opens no call
    watch = CallWatch()
    assert [watch.feed(p) for p in ("<tool", "_call>", '{"name"')] == ["", "", ""] and watch.held.startswith("<tool_call>")
    assert not watch.text


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_an_answer_under_tools_streams_as_the_unstreamed_one(server, tool_choice):
    """Text under tool_choice "auto" arrives in pieces as it is decoded (not in one chunk at the end) and adds up
    to the unstreamed answer; a call arrives whole, as the unstreamed call."""
    client, texts = server.client(), 0
    for messages in (MESSAGES, [{"role": "user", "content": "The quick brown fox"}],
                     [{"role": "user", "content": "def add(a, b):"}]):
        settings = dict(model=MODEL, messages=messages, max_tokens=75, temperature=0, tools=TOOLS,
                        tool_choice=tool_choice)
        whole = client.chat.completions.create(**settings)
        pieces, calls = [], []
        for part in client.chat.completions.create(stream=True, **settings):
            delta = part.choices[0].delta if part.choices else None
            if delta is not None and delta.content:
                pieces.append(delta.content)
            calls += [c.function.name for c in (delta.tool_calls or [])] if delta is not None else []
        message = whole.choices[0].message
        if message.tool_calls:
            assert calls == [c.function.name for c in message.tool_calls] and not pieces
        else:
            assert tool_choice == "auto" and "".join(pieces) == message.content
            tokens = whole.usage.completion_tokens
            assert len(pieces) >= min(3, tokens // 4), (tokens, pieces)  # several chunks, not one at the end
            texts += 1
    assert texts or tool_choice != "auto", "no answer under auto was text: nothing streamed was tested"
