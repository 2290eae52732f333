"""Property-based fuzzing: whatever a manifest, a bundle folder, a prompt, generation settings or a server request hold,
the outcome is a result or an EdgespecError (a 4xx answer from the server), never anything else.

CI runs a fixed-seed slice; `python benchmarks/long/fuzz.py` runs the same properties at benchmark scale
(EDGESPEC_FUZZ_EXAMPLES cases each)."""
import contextlib
import copy
import json
import os

import pytest
from edgespec.runtime.contract.errors import EdgespecError
from edgespec.runtime.contract.manifest import MANIFEST, Manifest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgespec.openai_api import APIError, parse_chat, parse_completion

EXAMPLES = int(os.environ.get("EDGESPEC_FUZZ_EXAMPLES", "60"))
FIXED_SEED = os.environ.get("EDGESPEC_FUZZ_RANDOM") != "1"  # CI replays the same cases; the benchmark explores
FUZZ = settings(max_examples=EXAMPLES, derandomize=FIXED_SEED, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8)
any_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=40) | \
    st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))


@pytest.fixture(scope="module")
def bundle(bundle_factory):
    return bundle_factory(context=96)


@pytest.fixture(scope="module")
def pipeline(bundle):
    return Pipeline(bundle, threads=1)


def paths_of(value, prefix=()):
    """Every key path into a JSON document."""
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from paths_of(inner, prefix + (key,))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from paths_of(inner, prefix + (i,))


@FUZZ
@given(data=st.data())
def test_any_manifest_loads_or_is_a_bundle_error(bundle, tmp_path_factory, data):
    original = json.loads((bundle / MANIFEST).read_text())
    paths = [p for p in paths_of(original) if p]
    document = copy.deepcopy(original)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(paths))
        where = document
        try:
            for key in path[:-1]:
                where = where[key]
            if data.draw(st.booleans()) and isinstance(where, dict):
                where.pop(path[-1], None)
            else:
                where[path[-1]] = data.draw(json_values)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier change removed this path
    try:
        Manifest.from_dict(document)
    except EdgespecError:
        return
    # it reads: then the runtime must load it or refuse it too
    import shutil

    folder = tmp_path_factory.mktemp("mutated") / "b"
    shutil.copytree(bundle, folder)
    (folder / MANIFEST).write_text(json.dumps(document))
    with contextlib.suppress(EdgespecError):
        Pipeline(folder, threads=1).generate("a b", config=GenerationConfig(max_new_tokens=2))


@FUZZ
@given(prompt=any_text, chat=st.booleans())
def test_any_prompt_answers_or_is_an_edgespec_error(pipeline, prompt, chat):
    config = GenerationConfig(max_new_tokens=2)
    try:
        if chat:
            pipeline.generate(messages=[{"role": "user", "content": prompt}], config=config)
        else:
            pipeline.generate(prompt, config=config)
    except EdgespecError:
        pass


@FUZZ
@given(damages=st.lists(st.tuples(st.sampled_from(["delete", "truncate", "flip", "extra", "folder"]),
                                  st.integers(0, 50), st.integers(0, 2**20)), min_size=1, max_size=3))
def test_any_damaged_bundle_folder_loads_or_is_an_edgespec_error(bundle, tmp_path_factory, damages):
    import shutil

    folder = tmp_path_factory.mktemp("damaged") / "b"
    shutil.copytree(bundle, folder)
    for kind, pick, offset in damages:
        files = sorted(p for p in folder.iterdir() if p.is_file())
        if not files:
            break
        path = files[pick % len(files)]
        if kind == "delete":
            path.unlink()
        elif kind == "truncate":
            path.write_bytes(path.read_bytes()[: offset % (path.stat().st_size + 1)])
        elif kind == "flip" and path.stat().st_size:
            data = bytearray(path.read_bytes())
            data[offset % len(data)] ^= 0xFF
            path.write_bytes(bytes(data))
        elif kind == "extra":
            (folder / f"extra{offset}.bin").write_bytes(b"x" * (offset % 100))
        elif kind == "folder":
            path.unlink()
            path.mkdir()
    try:
        Pipeline(folder, threads=1).generate("a b", config=GenerationConfig(max_new_tokens=2))
    except EdgespecError:
        pass


numbers = st.integers(-10**12, 10**12) | st.floats(allow_nan=True, allow_infinity=True) | st.none() | st.text(max_size=3)


@FUZZ
@given(max_new_tokens=numbers, temperature=numbers, top_k=numbers, top_p=numbers, min_p=numbers,
       repetition_penalty=numbers, seed=numbers, stop=st.lists(any_text, max_size=3), kv_policy=st.text(max_size=8))
def test_any_generation_settings_answer_or_are_an_edgespec_error(pipeline, max_new_tokens, temperature, top_k, top_p,
                                                                 min_p, repetition_penalty, seed, stop, kv_policy):
    try:
        sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                  repetition_penalty=repetition_penalty, seed=seed)
        config = GenerationConfig(max_new_tokens=max_new_tokens, stop_strings=tuple(stop), sampling=sampling,
                                  kv_policy=kv_policy)
    except EdgespecError:
        return
    if config.max_new_tokens > 4:  # a valid setting: keep the generation short
        config = GenerationConfig(max_new_tokens=4, stop_strings=config.stop_strings, sampling=sampling,
                                  kv_policy=config.kv_policy)
    try:
        pipeline.generate("a b c", config=config)
    except EdgespecError:
        pass


request_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from(["tiny", "other"]) | json_values},
    optional={"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool"])
                                                          | json_values}, optional={"content": any_text | json_values}),
                                   max_size=3) | json_values,
              "prompt": any_text | json_values, "max_tokens": numbers, "temperature": numbers, "top_p": numbers,
              "seed": numbers, "stop": json_values, "stream": json_values, "stream_options": json_values,
              "n": json_values, "tools": json_values, "logprobs": json_values, "user": json_values,
              "unknown": json_values}) | json_values


@FUZZ
@given(body=request_bodies, chat=st.booleans())
def test_any_request_body_parses_or_is_an_api_error(body, chat):
    try:
        (parse_chat if chat else parse_completion)(body, "tiny")
    except APIError as err:
        assert 400 <= err.status < 500 and err.body()["error"]["message"]


@pytest.fixture(scope="module")
def client(pipeline):
    """One app for every example, as a server runs one (its lifespan ends with the module)."""
    from starlette.testclient import TestClient

    from edgespec.serve import ServeConfig, make_app

    with TestClient(make_app(pipeline, ServeConfig(model="tiny")), raise_server_exceptions=False) as client:
        yield client


@FUZZ
@given(body=request_bodies | st.binary(max_size=60), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_the_server_never_answers_500(client, body, path):
    if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"]:
        body["max_tokens"] = min(body["max_tokens"], 4)  # valid lengths stay short: the examples are many
    content = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
    reply = client.post(path, content=content, headers={"Content-Type": "application/json"})
    assert reply.status_code < 500, reply.text
