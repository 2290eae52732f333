"""The fewest tokens a constrained output can have: the smallest instance of a schema, a lower bound that every
complete output meets, and the up-front refusal of a budget in which no output can complete."""
import json

import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.decoding.shortest import Unmodelled, min_spelling, smallest
from edgespec.runtime.pipeline import Pipeline

RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "note": {"type": ["string", "null"]}, "age": {"type": "integer", "minimum": 18},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 2},
    "when": {"type": "string", "format": "date"}, "kind": {"anyOf": [{"const": "long one"}, {"type": "boolean"}]},
    "optional": {"type": "string"}},
    "required": ["name", "note", "age", "tags", "when", "kind"]}
SPECS = [ConstraintSpec.json_schema(RECORD, strict=True), ConstraintSpec.json_object(),
         ConstraintSpec.choice(["The quick brown fox", "the lazy dog"]), ConstraintSpec.regex(r"add\([0-9]{1,3}\)"),
         ConstraintSpec.grammar('start: "add(" NUM ", " NUM ")"\nNUM: /[0-9]{1,3}/\n'),
         ConstraintSpec.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 6})]


def test_the_smallest_instance_of_a_schema():
    assert smallest(RECORD, RECORD, 0) == {"name": "", "note": "", "age": 18, "tags": ["red", "red"],
                                           "when": "2000-01-01", "kind": True}
    referred = {"$defs": {"n": {"type": "number", "exclusiveMinimum": 2}}, "type": "array",
                "prefixItems": [{"$ref": "#/$defs/n"}], "minItems": 2, "items": {"type": "null"}}
    assert smallest(referred, referred, 0) == [3, None]
    for unmodelled in ({"type": "string", "pattern": "^a+$"}, {"allOf": [{"type": "string"}]},
                       {"type": "object", "required": ["x"]}):
        with pytest.raises(Unmodelled):
            smallest(unmodelled, unmodelled, 0)


def test_the_fewest_spelling_uses_the_longest_tokens():
    vocab = {b"a", b"b", b"ab", b"abab", b"ba"}
    assert min_spelling(b"ababa", vocab, 4) == 2  # abab + a
    assert min_spelling(b"bab", vocab, 4) == 2
    with pytest.raises(Unmodelled):
        min_spelling(b"abc", vocab, 4)


@pytest.mark.parametrize("draft,tree", [("draft", "topk:2x2"), ("ngram", "chain:6")])
def test_every_complete_output_is_at_least_the_bound(draft, tree, bundle_factory):
    """Sampled outputs of every constraint kind that complete have no fewer tokens than the bound says."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree))
    completed = 0
    for spec in SPECS:
        bound = pipeline.grammars.shortest(spec)
        assert bound >= 1
        for seed in range(6):
            config = GenerationConfig(max_new_tokens=120, constraint=spec,
                                      sampling=SamplingConfig(temperature=1.5, seed=seed))
            result = pipeline.generate("{\"a", config=config)
            if result.stop_reason == "eos":
                completed += 1
                assert len(result.token_ids) >= bound, (spec.kind, result.text, bound)
    assert completed >= len(SPECS)


def test_a_budget_no_output_can_complete_in_is_refused_up_front(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    spec = ConstraintSpec.json_schema(RECORD, strict=True)
    bound = pipeline.grammars.shortest(spec)
    # the smallest instance, written as the grammar writes JSON, is one the grammar accepts
    text = json.dumps(smallest(RECORD, RECORD, 0))
    assert bound == min_spelling(text.encode(), pipeline.grammars._vocab_bytes, pipeline.grammars._longest)
    with pytest.raises(InputError, match=f"shorter than {bound} tokens, and max_new_tokens is {bound - 1}"):
        pipeline.grammars.within(spec, bound - 1)
    pipeline.grammars.within(spec, bound)
    # Pipeline.generate refuses it too while the budget closes outputs; with masks only, a short budget is a prefix
    with pytest.raises(InputError, match=f"shorter than {bound} tokens"):
        pipeline.generate("x", config=GenerationConfig(max_new_tokens=bound - 1, constraint=spec))
    cut = pipeline.generate("x", config=GenerationConfig(max_new_tokens=bound - 1, constraint=spec,
                                                         close_within_budget=False))
    assert cut.stop_reason == "max_new_tokens" and len(cut.token_ids) == bound - 1
    # a choice: its shortest option, spelled in the fewest tokens
    choice = ConstraintSpec.choice(["a much longer option than the other", "yes"])
    assert pipeline.grammars.shortest(choice) <= 3
    with pytest.raises(InputError, match="raise max_tokens"):
        pipeline.grammars.within(ConstraintSpec.json_schema({"type": "array", "items": {"type": "integer"},
                                                             "minItems": 6}), 3, "max_tokens")
