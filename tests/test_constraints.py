"""Constrained decoding: every node of a tree masked by its own path's parser state; speculative output equals
plain output under every kind of constraint, with every drafter; sampling keeps the masked distribution."""
import json
import re
from collections import Counter

import jsonschema
import numpy as np
import pytest
from edgespec.runtime.contract.errors import ConstraintError, InputError
from edgespec.runtime.decoding.constraints import ConstraintSpec, Grammars
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.decoding.tree import Tree
from edgespec.runtime.execution.model import prefill
from edgespec.runtime.pipeline import Pipeline
from test_sampling_engine import TRIALS, assert_same_distribution

from edgespec.cli import main

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "count": {"type": "integer"},
                                           "kind": {"enum": ["fox", "dog", "lazy dog"]}},
          "required": ["name", "count", "kind"], "additionalProperties": False}
GRAMMAR = 'start: "add(" NUM ", " NUM ")"\nNUM: /[0-9]{1,3}/\n'
SPECS = {"json_schema": ConstraintSpec.json_schema(SCHEMA), "json_object": ConstraintSpec.json_object(),
         "regex": ConstraintSpec.regex(r"(quick|lazy) [a-z]{2,8}\."),
         "choice": ConstraintSpec.choice(["The quick brown fox", "the lazy dog", "def add(a, b)"]),
         "grammar": ConstraintSpec.grammar(GRAMMAR)}
PROMPTS = ["The quick brown fox", "{\"name\": \"edge", "a b c d e f a b c"]


def config(spec, max_new_tokens=40, **sampling):
    return GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False, constraint=spec,
                            sampling=SamplingConfig(**sampling))


def first_tokens(pipeline, speculate: bool, trials: int, prompt: str, constraint) -> Counter:
    """The first three tokens' outcomes over `trials` seeds, sampled under `constraint`."""
    counts = Counter()
    for seed in range(trials):
        sampled = GenerationConfig(max_new_tokens=3, stop_at_eos=False, constraint=constraint,
                                   sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed),
                                   close_within_budget=False)  # the first tokens of the masked distribution
        counts[tuple(pipeline.generate(prompt, config=sampled, speculate=speculate).token_ids)] += 1
    return counts


def assert_matches(kind: str, result) -> None:
    """A finished output (or one the budget closed) matches its constraint; a cut one is a prefix of a match."""
    if result.stop_reason not in ("eos", "closed"):
        assert result.stop_reason == "max_new_tokens"
        return
    text = result.text
    if kind in ("json_schema", "json_object"):
        value = json.loads(text)
        assert isinstance(value, dict)
        if kind == "json_schema":
            assert set(value) == {"name", "count", "kind"} and value["kind"] in ("fox", "dog", "lazy dog")
            assert isinstance(value["count"], int) and len(value["name"]) <= 12
    elif kind == "regex":
        assert re.fullmatch(r"(quick|lazy) [a-z]{2,8}\.", text), text
    elif kind == "choice":
        assert text in ("The quick brown fox", "the lazy dog", "def add(a, b)"), text
    else:
        assert re.fullmatch(r"add\([0-9]{1,3}, [0-9]{1,3}\)", text), text


@pytest.mark.parametrize("draft,tree,suffix", [("draft", "topk:2x2", False), ("ngram", "chain:6", False),
                                               ("suffix", None, True), ("target", "chain:4", False)])
def test_speculative_equals_plain_under_every_constraint(draft, tree, suffix, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=suffix))
    supplied = 0
    for kind, spec in SPECS.items():
        for prompt in PROMPTS:
            plain = pipeline.generate(prompt, config=config(spec), speculate=False)
            spec_result = pipeline.generate(prompt, config=config(spec), speculate=True)
            assert spec_result.token_ids == plain.token_ids, (kind, prompt)
            assert spec_result.text == plain.text and spec_result.stop_reason == plain.stop_reason
            assert_matches(kind, plain)
            assert plain.stats.grammar_tokens == 0  # plain decoding: one token a pass, whatever the grammar forces
            supplied += spec_result.stats.grammar_tokens
    assert supplied > 0  # the grammar's forced tokens rode in verify passes


def test_the_constrained_output_is_the_argmax_of_the_masked_logits(bundle_factory):
    """Plain constrained greedy decoding, checked token by token against the target's own logits."""
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    prompt = "The quick brown fox"
    masks_only = GenerationConfig(max_new_tokens=24, stop_at_eos=False, constraint=SPECS["json_schema"],
                                  close_within_budget=False)  # closing: tests/test_closing.py
    result = pipeline.generate(prompt, config=masks_only, speculate=False)
    free = pipeline.generate(prompt, config=config(None, max_new_tokens=24), speculate=False)
    assert result.token_ids != free.token_ids  # a random tiny model does not write this JSON by itself
    guide = pipeline.grammars.start(SPECS["json_schema"])
    ids = pipeline.encode(prompt)
    for token in result.token_ids:
        session = pipeline.new_session()
        logits = prefill(pipeline.target, session.cache, ids, pipeline.manifest.prefill_chunk)
        assert token == int(np.argmax(np.where(guide.mask(), logits, -np.inf)))
        guide.advance([token])
        ids = ids + [token]


def test_each_node_is_masked_by_its_own_paths_state_and_refused_drafts_are_pruned(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    codec, grammars = pipeline.codec, pipeline.grammars
    spec = ConstraintSpec.choice(["fox jumps", "dog sleeps"])
    fox, dog = codec.encode("fox")[0], codec.encode("dog")[0]
    jumps = codec.encode("fox jumps")[1]
    # root -> fox -> jumps, root -> dog, root -> jumps (refused at the root)
    tree = Tree.from_parents((-1, 0, 1, 0, 0), [5, fox, jumps, dog, jumps])
    guide = grammars.start(spec)
    kept, masks = guide.admit(tree, sampling=False)
    assert list(kept.tokens) == [5, fox, jumps, dog] and kept.parents == (-1, 0, 1, 0)
    for node in range(kept.size):
        reference = grammars.start(spec)
        reference.advance(kept.path(node))
        assert np.array_equal(masks[node], reference.mask()), node
    assert masks[0][fox] and masks[0][dog] and not masks[0][jumps]
    # the guide is back at its committed state
    assert np.array_equal(guide.mask(), grammars.start(spec).mask())
    # under sampling, a refused token drawn from q_draft stays, as a leaf: its rejection shapes the residual
    drawn = Tree(tree.topology, tree.tokens, q_draft=np.full((5, masks.shape[1]), 1 / masks.shape[1]))
    kept, _ = guide.admit(drawn, sampling=True)
    assert list(kept.tokens) == [5, fox, jumps, dog, jumps]


def test_forced_tokens_are_the_grammars_and_plain_guides_supply_none(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    spec = ConstraintSpec.choice(["The quick brown fox"])
    forced = pipeline.grammars.start(spec).forced(16)
    assert pipeline.codec.decode(forced) and "The quick brown fox".startswith(pipeline.codec.decode(forced))
    assert pipeline.grammars.start(spec, forced_chains=False).forced(16) == []
    result = pipeline.generate("x", config=config(spec))
    assert result.text == "The quick brown fox" and result.stats.grammar_tokens > 0
    assert result.stats.to_dict()["grammar_tokens_per_pass"] > 0


@pytest.mark.parametrize("draft,tree,kind", [("draft", "topk:2x2", "choice"), ("target", "chain:3", "regex"),
                                             ("ngram", "chain:3", "json_object")])
def test_constrained_sampling_has_the_plain_distribution(draft, tree, kind, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree), threads=1)
    constraint = {"choice": ConstraintSpec.choice(["the lazy dog", "the quick fox", "the end", "a b c"]),
                  "regex": ConstraintSpec.regex(r"[a-f ]{2,6}"), "json_object": SPECS["json_object"]}[kind]
    plain = first_tokens(pipeline, False, TRIALS, "The quick", constraint=constraint)
    spec = first_tokens(pipeline, True, TRIALS, "The quick", constraint=constraint)
    assert len(plain) > 1
    assert_same_distribution(plain, spec)


def test_constraint_specs_are_checked():
    with pytest.raises(InputError, match="unknown constraint kind"):
        ConstraintSpec("yaml", "x")
    with pytest.raises(InputError, match="not valid JSON"):
        ConstraintSpec.json_schema("{nope")
    with pytest.raises(InputError, match="tuple of non-empty strings"):
        ConstraintSpec.choice([])
    with pytest.raises(InputError, match="needs its text"):
        ConstraintSpec.regex("")
    with pytest.raises(InputError, match="ConstraintSpec"):
        GenerationConfig(constraint={"type": "object"})


def test_a_constraint_the_engine_cannot_compile_is_a_clear_error(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    for spec, message in [(ConstraintSpec.json_schema({"type": "strin"}), "JSON schema cannot be compiled"),
                          (ConstraintSpec.regex("a(b"), "unclosed group"),
                          (ConstraintSpec.grammar("start: nothing_defined"), "grammar cannot be compiled")]:
        with pytest.raises(ConstraintError, match=message):
            pipeline.generate("x", config=config(spec))


def test_grammars_read_the_bundles_vocabulary(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:6"))
    grammars = pipeline.grammars
    assert isinstance(grammars, Grammars) and grammars.vocab_size == pipeline.manifest.target.facts.vocab_size
    assert pipeline.grammars is grammars  # read once per pipeline
    mask = grammars.start(ConstraintSpec.json_object()).mask()
    assert mask.shape == (grammars.vocab_size,) and 0 < mask.sum() < len(mask)


def test_cli_constraint_flags(bundle_factory, tmp_path, capsys):
    bundle = str(bundle_factory(draft="ngram", tree="chain:6"))
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    assert main(["generate", bundle, "--prompt", "The quick", "--json-schema", str(schema), "--json",
                 "--max-new-tokens", "60"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["text"].startswith("{\"name\": \"") and "grammar_tokens_per_pass" in report["stats"]
    assert main(["generate", bundle, "--prompt", "x", "--choice", "yes", "--choice", "no", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    grammar = tmp_path / "g.lark"
    grammar.write_text(GRAMMAR)
    assert main(["generate", bundle, "--prompt", "x", "--grammar", str(grammar), "--json"]) == 0
    assert re.fullmatch(r"add\([0-9]{1,3}, [0-9]{1,3}\)", json.loads(capsys.readouterr().out)["text"])
    assert main(["generate", bundle, "--prompt", "x", "--json-schema", str(tmp_path / "none.json")]) == 2
    assert "--json-schema" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"type": "strin"}')
    assert main(["generate", bundle, "--prompt", "x", "--json-schema", str(tmp_path / "bad.json")]) == 2
    assert "cannot be compiled" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # one constraint at a time
        main(["generate", bundle, "--prompt", "x", "--regex", "a", "--choice", "b"])


def extraction_schema(messages: list[dict]) -> dict:
    """The JSON schema an extraction prompt of benchmarks/workloads/extraction.jsonl embeds after "Schema:"."""
    text = messages[-1]["content"]
    return json.JSONDecoder().raw_decode(text[text.index("Schema:") + len("Schema:"):].lstrip())[0]


@pytest.mark.reference
def test_reference_model_constrained_speculation_is_lossless_and_valid():
    from pathlib import Path

    from edgespec.defaults import ensure_default_bundle

    pipeline = Pipeline(ensure_default_bundle())
    workload = Path(__file__).resolve().parent.parent / "benchmarks" / "workloads" / "extraction.jsonl"
    for line in workload.read_text().splitlines()[:2]:
        messages = json.loads(line)["messages"]
        schema = extraction_schema(messages)
        spec = ConstraintSpec.json_schema(schema, strict=True)
        # a budget the closing rule fits (a shorter one is refused up front: test_closing.py); the output is
        # then complete and valid, whether the model or the budget ends it
        constrained = GenerationConfig(max_new_tokens=128, constraint=spec)
        plain = pipeline.generate(messages=messages, config=constrained, speculate=False)
        fast = pipeline.generate(messages=messages, config=constrained, speculate=True)
        assert fast.token_ids == plain.token_ids
        assert fast.stats.grammar_tokens > 0
        jsonschema.validate(json.loads(plain.text), schema)
    person = ConstraintSpec.json_schema({"type": "object", "properties": {"name": {"type": "string"}, "age": {
        "type": "integer"}}, "required": ["name", "age"]}, strict=True)
    ask = [{"role": "user", "content": "Alice is 30 years old. Give her name and age as JSON."}]
    plain = pipeline.generate(messages=ask, config=GenerationConfig(max_new_tokens=48, constraint=person), speculate=False)
    fast = pipeline.generate(messages=ask, config=GenerationConfig(max_new_tokens=48, constraint=person))
    assert fast.token_ids == plain.token_ids and json.loads(plain.text) == {"name": "Alice", "age": 30}
    choice = GenerationConfig(max_new_tokens=16, constraint=ConstraintSpec.choice(["Paris", "London", "Rome"]))
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    answer = pipeline.generate(messages=ask, config=choice)
    assert answer.text in ("Paris", "London", "Rome")
    assert answer.token_ids == pipeline.generate(messages=ask, config=choice, speculate=False).token_ids


def test_bench_reports_the_tokens_the_grammar_supplied(bundle_factory, tmp_path, capsys):
    bundle = str(bundle_factory(draft="ngram", tree="chain:6"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Fill this in. Schema: {json.dumps(SCHEMA)} {tail}"})
                                 for tail in ("fox", "dog")))
    assert main(["bench", bundle, "--prompts", str(prompts), "--schema-in-prompt", "--max-new-tokens", "40",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_greedy"] and report["constraint"] == "schema in each prompt"
    assert report["speculative"]["grammar_tokens_per_pass"] > 0 and report["plain"]["grammar_tokens_per_pass"] == 0
    assert main(["bench", bundle, "--prompts", str(prompts), "--choice", "a b", "--max-new-tokens", "8"]) == 0
    assert "the grammar supplied" in capsys.readouterr().out


@pytest.mark.parametrize("draft,tree,suffix", [("draft", "chain:3", False), ("ngram", "chain:6", False),
                                               ("suffix", None, True)])
def test_a_forced_chain_the_target_spells_otherwise_rewinds_the_drafter(draft, tree, suffix, bundle_factory):
    """The engine's forced tokens are certain with llguidance (its mask admits only them); a guide whose
    forced token is merely admitted is rejected by the target now and then: the drafter, which took the
    token as committed, forgets it, and the output is still plain decoding's."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=suffix))
    start = pipeline.grammars.start

    def loose(spec, forced_chains=True, budget=None):
        guide = start(spec, forced_chains, budget)
        guide.forced = lambda limit: [int(np.flatnonzero(guide.mask())[0])] if forced_chains and limit > 0 else []
        return guide

    pipeline.grammars.start = loose
    rejected = 0
    for prompt in PROMPTS:
        session = pipeline.new_session()
        plain = pipeline.generate(prompt, config=config(SPECS["json_object"]), speculate=False)
        fast = pipeline.generate(prompt, config=config(SPECS["json_object"]), session=session)
        assert fast.token_ids == plain.token_ids
        rejected += fast.stats.target_passes - fast.stats.grammar_tokens
        if draft == "ngram":  # what the drafter indexed is what was committed
            assert session.drafter.context == session.committed[: len(session.drafter.context)]
    assert rejected > 0


def test_a_drafted_tree_hangs_below_the_forced_chain():
    drafted = Tree(Tree.from_parents((-1, 0, 0, 1), [7, 8, 9, 10]).topology, np.array([7, 8, 9, 10]),
                   q_draft=np.full((4, 12), 1 / 12), drawn=np.array([False, True, True, False]))
    tree = drafted.after(5, [6, 7])
    assert tree.parents == (-1, 0, 1, 2, 2, 3) and list(tree.tokens) == [5, 6, 7, 8, 9, 10]
    assert list(tree.drawn) == [False, False, False, True, True, False]  # the chain is point masses
    assert not tree.q_draft[:2].any() and np.array_equal(tree.q_draft[2:], drafted.q_draft)
    greedy = Tree.from_parents((-1, 0), [7, 8]).after(5, [6, 7])
    assert greedy.q_draft is None and list(greedy.tokens) == [5, 6, 7, 8]
