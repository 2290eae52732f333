"""The sampling fields clients send: frequency and presence penalties, logit bias, and a seed whose
sample depends only on the seed and the target's distributions (runtime/decoding/seeded.py), whatever
drafted it. Significance as in test_sampling.py (alpha = 0.001, fixed seeds)."""
import numpy as np
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.drafters import NgramDrafter
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import Sampler, SamplingConfig
from edgespec.runtime.decoding.seeded import seeded_choice, seeded_distinct
from edgespec.runtime.pipeline import Pipeline
from scipy.stats import chisquare

from tests.test_sampling_engine import GreedyProposals

ALPHA = 1e-3


def test_frequency_and_presence_penalties_count_the_output_only():
    sampler = Sampler(SamplingConfig(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.25), origin=2)
    logits = np.zeros((2, 4))
    # committed: a prompt of two tokens [3, 3], then the output [1, 1]; row 1's path adds a 2
    probs = sampler.distributions(logits, [3, 3, 1, 1], [[], [2]])
    x = np.log(probs)
    assert np.isclose(x[0, 0] - x[0, 1], 2 * 0.5 + 0.25)  # token 1 twice in the output
    assert np.isclose(x[0, 0], x[0, 3]) and np.isclose(x[0, 0], x[0, 2])  # the prompt's 3s are not the output
    assert np.isclose(x[1, 0] - x[1, 2], 0.5 + 0.25)  # the path's token counts as output too
    negative = Sampler(SamplingConfig(temperature=1.0, presence_penalty=-1.0), origin=0).distributions(
        np.zeros((1, 4)), [0], [[]])[0]
    assert negative[0] > negative[1]  # a negative penalty favours what was said


def test_logit_bias_is_added_to_the_logits():
    sampler = Sampler(SamplingConfig(temperature=1.0, logit_bias=((1, 100.0), (2, -100.0))))
    probs = sampler.distributions(np.zeros((1, 4)), [0], [[]])[0]
    assert probs[1] > 0.999 and probs[2] < 1e-40
    with pytest.raises(InputError, match="outside this model's vocabulary"):
        SamplingConfig(temperature=1.0, logit_bias=((9, 1.0),)).check_vocabulary(4)


@pytest.mark.parametrize("bad", [dict(temperature=1.0, frequency_penalty=2.5), dict(temperature=1.0, presence_penalty=-3),
                                 dict(temperature=1.0, frequency_penalty=float("nan")),
                                 dict(temperature=1.0, logit_bias=((1, 101.0),)),
                                 dict(temperature=1.0, logit_bias=((-1, 1.0),)),
                                 dict(temperature=1.0, logit_bias=((1, 1.0), (1, 2.0))),
                                 dict(temperature=1.0, logit_bias={1: 1.0}),
                                 dict(frequency_penalty=0.5), dict(logit_bias=((1, 1.0),))])  # greedy would ignore them
def test_bad_penalties_and_biases(bad):
    with pytest.raises(InputError):
        SamplingConfig(**bad)


def test_seeded_draws_follow_the_distribution_and_are_keyed_by_position():
    p = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    firsts = [seeded_choice(p, seed, 7) for seed in range(20000)]
    assert 4 not in firsts
    assert chisquare(np.bincount(firsts, minlength=5)[:4], 20000 * p[:4]).pvalue > ALPHA
    assert seeded_choice(p, 3, 7) == seeded_choice(p.copy(), 3, 7)  # a function of (probs, seed, position)
    across = [seeded_choice(p, 3, position) for position in range(20000)]  # positions draw independently
    assert chisquare(np.bincount(across, minlength=5)[:4], 20000 * p[:4]).pvalue > ALPHA


def test_seeded_distinct_draws_without_replacement_and_leads_with_the_seeded_choice():
    q = np.array([0.6, 0.3, 0.1, 0.0])
    pairs = [seeded_distinct(q, 2, seed, 0) for seed in range(20000)]
    assert all(len(set(pair)) == 2 and 3 not in pair for pair in pairs)
    assert all(pair[0] == seeded_choice(q, seed, 0) for seed, pair in enumerate(pairs[:200]))
    # the second, given the first was 0: drawn from q without 0 -> 0.75, 0.25
    seconds = [pair[1] for pair in pairs if pair[0] == 0]
    assert chisquare(np.bincount(seconds, minlength=3)[1:3], len(seconds) * np.array([0.75, 0.25])).pvalue > ALPHA
    assert len(seeded_distinct(q, 5, 1, 0)) == 3 and seeded_distinct(np.zeros(3), 2, 1, 0) == []


def generated(pipeline, seed, session=None, speculate=True, **sampling):
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False,
                              sampling=SamplingConfig(temperature=1.0, seed=seed, **sampling))
    return pipeline.generate("The quick", config=config, speculate=speculate, session=session).token_ids


@pytest.mark.parametrize("draft,tree", [("draft", "topk:2x2"), ("target", "chain:3"), ("draft", "dynamic:6"),
                                        ("ngram", "chain:3")])
def test_a_seed_gives_one_output_whatever_drafted_it(draft, tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree), threads=1)
    for seed in range(4):
        plain = generated(pipeline, seed, speculate=False, top_p=0.95, frequency_penalty=0.3)
        assert generated(pipeline, seed, top_p=0.95, frequency_penalty=0.3) == plain
        point_masses = pipeline.new_session(drafter=GreedyProposals(pipeline.make_drafter(True)))
        assert generated(pipeline, seed, point_masses, top_p=0.95, frequency_penalty=0.3) == plain
        ngram = pipeline.new_session(drafter=NgramDrafter(pipeline.tree, max_n=2, min_n=1))
        assert generated(pipeline, seed, ngram, top_p=0.95, frequency_penalty=0.3) == plain
    assert generated(pipeline, 0) != generated(pipeline, 1)


def test_a_seeded_draft_model_is_still_accepted(bundle_factory):
    """The draft draws from the same race as the target: a self-draft is accepted at every node."""
    pipeline = Pipeline(bundle_factory(draft="target", tree="chain:4"))
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig(temperature=0.9, seed=5))
    stats = pipeline.generate("def add(a, b):", config=config).stats
    assert stats.accepted_drafts == 4 * stats.target_passes


def test_unseeded_sampling_still_takes_rejection_sampling(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="target", tree="chain:4"))
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig(temperature=0.9))
    stats = pipeline.generate("def add(a, b):", config=config).stats
    assert stats.accepted_drafts == 4 * stats.target_passes  # q == p: min(1, p/q) = 1


def test_top_k_one_at_temperature_one_is_the_greedy_text(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    greedy = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=24, stop_at_eos=False)).token_ids
    for seed in (0, 1):
        assert generated(pipeline, seed, top_k=1) == greedy


def test_a_banned_token_never_comes(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    greedy = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=24, stop_at_eos=False)).token_ids
    banned = tuple((t, -100.0) for t in set(greedy))
    for seed in (0, 1):
        assert not set(generated(pipeline, seed, top_k=1, logit_bias=banned)) & set(greedy)


def test_conversation_defaults_take_the_models_generation_config_else_llama_cpps():
    from edgespec.runtime.decoding.sampling import CONVERSATION_DEFAULTS, conversation_defaults, with_defaults

    assert conversation_defaults(None) == CONVERSATION_DEFAULTS
    assert conversation_defaults({"temperature": 0.6, "top_p": 0.9})["temperature"] == 0.6
    assert conversation_defaults({"do_sample": False, "temperature": 0.6}) == CONVERSATION_DEFAULTS
    chat = with_defaults({"seed": 3, "top_k": None}, CONVERSATION_DEFAULTS)
    assert (chat.temperature, chat.top_k, chat.min_p, chat.repetition_penalty, chat.seed) == (0.8, 40, 0.05, 1.1, 3)
    assert with_defaults({"temperature": 0.0}, CONVERSATION_DEFAULTS).greedy  # no penalty comes with greedy
    assert with_defaults({}, {}).greedy  # generate and bench: greedy
    with pytest.raises(InputError, match="repetition_penalty"):
        with_defaults({"temperature": 0.0, "repetition_penalty": 1.2}, CONVERSATION_DEFAULTS)


def test_the_cli_samples_conversations_and_keeps_bench_greedy(bundle_factory, capsys):
    import json

    from edgespec.cli import main

    bundle = str(bundle_factory(draft="draft", tree="topk:2x2"))
    base = ["generate", bundle, "--prompt", "The quick", "--max-new-tokens", "12", "--json"]
    assert main(base + ["--seed", "1"]) == 0
    greedy = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(base + ["--temperature", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == greedy  # unset: greedy, as --temperature 0
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    sampled = pipeline.generate("The quick", config=GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=1, frequency_penalty=0.2)))
    assert main(base + ["--seed", "1", "--temperature", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.05",
                        "--repetition-penalty", "1.1", "--frequency-penalty", "0.2"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == sampled.token_ids
    assert main(base + ["--frequency-penalty", "0.5"]) == 2  # greedy would ignore it
    assert "--frequency-penalty applies when sampling" in capsys.readouterr().err
