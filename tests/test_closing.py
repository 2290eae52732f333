"""Budget-aware closing (runtime/decoding/closing.py): a constrained output ends complete within its budget,
speculative equal to plain with closing triggered, under every constraint kind and drafter; sampling keeps
the closed distribution; a budget no output fits is refused up front."""
import json
import re
from collections import Counter

import numpy as np
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.closing import INFINITE, Completions
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline
from test_constraints import GRAMMAR, PROMPTS
from test_sampling_engine import TRIALS, assert_same_distribution

from edgespec.tool_calls import read_call, tool_constraint

# an array without bounds: a random tiny model fills it until the budget, so only closing ends it
LIST = {"type": "object", "properties": {"title": {"type": "string"},
                                         "items": {"type": "array", "items": {"type": "object", "properties": {
                                             "name": {"type": "string"}, "qty": {"type": "integer"}},
                                             "required": ["name", "qty"], "additionalProperties": False}},
                                         "done": {"type": "boolean"}},
        "required": ["title", "items", "done"], "additionalProperties": False}
SPECS = {"json_schema": ConstraintSpec.json_schema(LIST), "json_object": ConstraintSpec.json_object(),
         "regex": ConstraintSpec.regex(r"(quick|lazy) [a-z]{2,40}\."),
         "choice": ConstraintSpec.choice(["The quick brown fox", "the lazy dog", "def add(a, b)"]),
         "grammar": ConstraintSpec.grammar(GRAMMAR)}


def valid(kind: str, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        if kind == "json_object":
            return isinstance(value, dict)
        return (set(value) == {"title", "items", "done"} and isinstance(value["done"], bool)
                and all(set(item) == {"name", "qty"} and isinstance(item["qty"], int) for item in value["items"]))
    if kind == "regex":
        return re.fullmatch(r"(quick|lazy) [a-z]{2,40}\.", text) is not None
    if kind == "choice":
        return text in ("The quick brown fox", "the lazy dog", "def add(a, b)")
    return re.fullmatch(r"add\([0-9]{1,3}, [0-9]{1,3}\)", text) is not None


@pytest.mark.parametrize("draft,tree,suffix", [("draft", "topk:2x2", False), ("ngram", "chain:6", False),
                                               ("suffix", None, True)])
def test_closed_outputs_are_complete_and_speculative_equals_plain(draft, tree, suffix, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=suffix))
    closed = 0
    for kind, spec in SPECS.items():
        closes = pipeline.grammars.start(spec, budget=1000).closing_distance()
        assert closes >= pipeline.grammars.shortest(spec)  # a completion's length, above the lower bound
        for prompt in PROMPTS:
            for budget in (closes, closes + 3, closes + 17):  # closing from the first token, then later
                config = GenerationConfig(max_new_tokens=budget, stop_at_eos=False, constraint=spec)
                plain = pipeline.generate(prompt, config=config, speculate=False)
                fast = pipeline.generate(prompt, config=config, speculate=True)
                assert fast.token_ids == plain.token_ids, (kind, prompt, budget)
                assert fast.stop_reason == plain.stop_reason
                assert plain.stop_reason in ("eos", "closed"), (kind, prompt, budget, plain.text)
                assert len(plain.token_ids) <= budget and valid(kind, plain.text), (kind, budget, plain.text)
                closed += plain.stop_reason == "closed"
    assert closed >= 10  # the random model runs to the budget: closing, not the model, ended these


def test_a_looping_array_closes_where_masks_alone_cut_it(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    spec, prompt = SPECS["json_schema"], "Shopping list as JSON:"
    cut = pipeline.generate(prompt, config=GenerationConfig(max_new_tokens=80, constraint=spec,
                                                            close_within_budget=False))
    assert cut.stop_reason == "max_new_tokens"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.text)
    closed = pipeline.generate(prompt, config=GenerationConfig(max_new_tokens=80, constraint=spec))
    assert closed.stop_reason == "closed" and valid("json_schema", closed.text)
    common = next((i for i, (a, b) in enumerate(zip(cut.token_ids, closed.token_ids)) if a != b), None)
    assert common is not None and common > 20  # the same output until the end came near


WEATHER = ({"name": "weather", "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},)
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
          "additionalProperties": False}
TEXT_SPECS = {"auto": tool_constraint(WEATHER, "auto"), "answer": ConstraintSpec.json_schema(ANSWER)}


@pytest.mark.parametrize("draft,tree,suffix", [("draft", "topk:2x2", False), ("ngram", "chain:6", False),
                                               ("suffix", None, True)])
def test_text_and_free_strings_near_the_budget_speculative_equals_plain(draft, tree, suffix, bundle_factory):
    """Issue 57: the text branch of tool_choice "auto" and a free string field, at budgets where closing acts
    (a call's or the document's end near), speculative equal to plain, every output complete."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=suffix))
    for kind, spec in TEXT_SPECS.items():
        closes = pipeline.grammars.start(spec, budget=1000).closing_distance()
        for prompt in [*PROMPTS, "<tool_call>"]:
            for budget in (max(closes, 2), closes + 3, 40):
                config = GenerationConfig(max_new_tokens=budget, stop_at_eos=False, constraint=spec)
                plain = pipeline.generate(prompt, config=config, speculate=False)
                fast = pipeline.generate(prompt, config=config, speculate=True)
                assert fast.token_ids == plain.token_ids and fast.stop_reason == plain.stop_reason, (kind, budget)
                assert plain.stop_reason in ("eos", "closed"), (kind, prompt, budget, plain.text)
                if kind == "answer":
                    assert set(json.loads(plain.text)) == {"answer"}
                else:  # text, or a whole call
                    assert not plain.text.startswith("<") or read_call(plain.text) is not None, plain.text


@pytest.mark.parametrize("draft,tree,kind", [("draft", "topk:2x2", "regex"), ("ngram", "chain:3", "json_object"),
                                            ("draft", "topk:2x2", "auto")])
def test_closed_sampling_has_the_plain_distribution(draft, tree, kind, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree), threads=1)
    spec = {"regex": ConstraintSpec.regex(r"[a-f]{1,3}( [a-f]{1,3}){0,3}"), "json_object": SPECS["json_object"],
            "auto": TEXT_SPECS["auto"]}[kind]
    budget = pipeline.grammars.start(spec, budget=99).closing_distance() + 2  # closing from the first tokens

    def outcomes(speculate: bool) -> Counter:
        counts = Counter()
        for seed in range(TRIALS):
            config = GenerationConfig(max_new_tokens=budget, constraint=spec,
                                      sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed))
            result = pipeline.generate("The quick", config=config, speculate=speculate)
            assert result.stop_reason in ("eos", "closed") and len(result.token_ids) <= budget
            counts[tuple(result.token_ids)] += 1
        return counts

    plain, fast = outcomes(False), outcomes(True)
    assert len(plain) > 1
    assert_same_distribution(plain, fast)


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_a_paths_completion_is_the_same_in_any_order_and_completes(kind, bundle_factory):
    """Closing's completions (runtime/decoding/closing.py Completions) reuse their parents'; each must be a function
    of its path alone (asked deepest first, every ancestor computed on the way, as asked root first) and must
    reach an accepting state from its path."""
    pipeline, rng = Pipeline(bundle_factory()), np.random.default_rng(len(kind))
    for _ in range(4):
        guide = pipeline.grammars.start(SPECS[kind], budget=60)
        matcher, closer, path = guide.matcher, guide.closer, []
        while len(path) < 40 and not matcher.is_accepting():  # a random walk of admitted tokens
            allowed = closer.allowed(matcher)
            allowed[list(closer.eos)] = False
            path.append(int(rng.choice(np.flatnonzero(allowed))))
            assert matcher.consume_token(path[-1])
        deepest_first = Completions(closer, matcher, 60)
        at_end = deepest_first.at(path)
        root_first = Completions(closer, matcher, 60)
        matcher.rollback(len(path))
        seen = []
        for depth in range(len(path) + 1):
            seen.append(root_first.at(path[:depth]))
            assert seen[-1] == deepest_first.completion(path[:depth])[:2], (kind, depth)
            d, _, tokens = root_first.completion(path[:depth])
            if d <= 60 - depth:  # a completion within the tokens left: it completes from here
                assert matcher.try_consume_tokens(list(tokens)) == len(tokens) and matcher.is_accepting()
                matcher.rollback(len(tokens))
            if depth < len(path):
                assert matcher.consume_token(path[depth])
        assert seen[-1] == at_end
        assert any(d < INFINITE for d, _ in seen)


def test_a_budget_no_output_fits_is_refused_up_front(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    spec = SPECS["json_schema"]
    shortest, closes = pipeline.grammars.shortest(spec), pipeline.grammars.start(spec, budget=99).closing_distance()
    with pytest.raises(InputError, match=f"shorter than {shortest} tokens, and max_new_tokens is {shortest - 1}"):
        pipeline.generate("x", config=GenerationConfig(max_new_tokens=shortest - 1, constraint=spec))
    if closes > shortest:  # the closing completion is longer than the shortest document: that many are asked
        with pytest.raises(InputError, match=f"no fewer than {closes} tokens .the shortest has {shortest}., and "
                                             f"max_new_tokens is {closes - 1}"):
            pipeline.generate("x", config=GenerationConfig(max_new_tokens=closes - 1, constraint=spec))
    prefix = pipeline.generate("x", config=GenerationConfig(max_new_tokens=shortest - 1, constraint=spec,
                                                            close_within_budget=False))
    assert prefix.stop_reason == "max_new_tokens"  # without closing, a prefix is what a caller asked for


def test_generate_and_chat_refuse_a_budget_no_output_fits(bundle_factory, tmp_path, capsys):
    from edgespec.cli import main

    bundle = str(bundle_factory(draft="ngram", tree="chain:6"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(LIST))
    shortest = Pipeline(bundle).grammars.shortest(SPECS["json_schema"])
    for command in (["generate", bundle, "--prompt", "x"], ["chat", bundle]):
        capsys.readouterr()
        assert main([*command, "--json-schema", str(schema), "--max-new-tokens", str(shortest - 1)]) == 2
        error = capsys.readouterr().err
        assert f"shorter than {shortest} tokens" in error and f"max_new_tokens is {shortest - 1}" in error
    assert main(["generate", bundle, "--prompt", "x", "--regex", "[a-z]{9}", "--max-new-tokens", "2"]) == 2
    error = capsys.readouterr().err  # a pattern has no document bound: the closing completion's length is asked
    assert "closes within no fewer than 9 tokens" in error and "max_new_tokens is 2" in error
