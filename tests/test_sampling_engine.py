"""Speculative sampling end to end on tiny models: same distribution as plain sampling, same seed
same output. Significance as in test_sampling.py (alpha = 0.001, fixed seeds)."""
from collections import Counter

import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline
from scipy.stats import chi2_contingency

from edgespec.cli import main

TRIALS = 1200


class GreedyProposals:
    """Point-mass proposals with high acceptance: the draft model's greedy top tokens, even when sampling."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, committed, max_nodes, sampler, target_features=None):
        return self.inner.propose(committed, max_nodes, None, target_features)

    def observe(self, accepted, tokens=None, logits=None):
        self.inner.observe(accepted, tokens, logits)

    def rewind(self, length):
        self.inner.rewind(length)


def first_tokens(pipeline, speculate, trials, prompt, point_mass=False, **sampling):
    counts = Counter()
    for seed in range(trials):
        config = GenerationConfig(max_new_tokens=3, stop_at_eos=False,
                                  sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed, **sampling))
        session = pipeline.new_session(drafter=GreedyProposals(pipeline.make_drafter(True))) \
            if speculate and point_mass else None
        counts[tuple(pipeline.generate(prompt, config=config, speculate=speculate, session=session).token_ids)] += 1
    return counts


def assert_same_distribution(plain: Counter, spec: Counter) -> None:
    """Chi-square test of two samples of outcomes (alpha = 0.001)."""
    cells = sorted(set(plain) | set(spec))
    table = np.array([[plain[c] for c in cells], [spec[c] for c in cells]])
    assert chi2_contingency(table).pvalue > 1e-3


@pytest.mark.parametrize("draft,tree,point_mass,penalty", [
    ("draft", "topk:2x2", False, 1.0),
    ("draft", "topk:2x2", False, 1.5),  # history-dependent processing: path tokens count as seen
    ("target", "chain:3", False, 1.0),
    ("target", "topk:2x2", True, 1.0),  # point masses (deterministic proposals), often accepted
    ("draft", "dynamic:6", False, 1.0),  # dynamic trees: point masses chosen by the draft's confidence
    ("ngram", "chain:3", False, 1.0),
])
def test_speculative_sampling_has_the_plain_distribution(draft, tree, point_mass, penalty, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree), threads=1)
    plain = first_tokens(pipeline, False, TRIALS, "The quick", repetition_penalty=penalty)
    spec = first_tokens(pipeline, True, TRIALS, "The quick", point_mass, repetition_penalty=penalty)
    assert_same_distribution(plain, spec)


@pytest.mark.parametrize("draft,tree", [("draft", "chain:1"), ("draft", "topk:2x1")])
def test_lookup_beside_a_sampled_draft_has_the_plain_distribution(draft, tree, bundle_factory):
    """Prompt-lookup point masses grafted beside siblings drawn from the draft (a prompt that repeats,
    so the lookup chain is there at every step)."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, lookup=3), threads=1)
    prompt = "one two three one two three one two three one"
    plain = first_tokens(pipeline, False, TRIALS, prompt)
    spec = first_tokens(pipeline, True, TRIALS, prompt)
    assert_same_distribution(plain, spec)


def test_the_same_seed_reproduces_the_same_output(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False,
                              sampling=SamplingConfig(temperature=0.8, top_p=0.9, seed=42))
    first = pipeline.generate("The quick", config=config)
    assert pipeline.generate("The quick", config=config).token_ids == first.token_ids
    other = GenerationConfig(max_new_tokens=20, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=43))
    assert pipeline.generate("The quick", config=other).token_ids != first.token_ids


def test_self_draft_sampling_accepts_nearly_everything(bundle_factory):
    """With q_draft == p_target every drafted token is accepted (min(1, p/q) = 1)."""
    pipeline = Pipeline(bundle_factory(draft="target", tree="chain:4"))
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False, sampling=SamplingConfig(temperature=0.9, seed=1))
    stats = pipeline.generate("def add(a, b):", config=config).stats
    assert stats.accepted_drafts == 4 * stats.target_passes


def test_cli_sampling_options(bundle_factory, capsys):
    import json

    bundle = str(bundle_factory(draft="draft", tree="topk:2x2"))
    args = ["generate", bundle, "--prompt", "The quick", "--max-new-tokens", "10", "--json", "--temperature", "0.7",
            "--top-k", "20", "--top-p", "0.95", "--min-p", "0.01", "--repetition-penalty", "1.1", "--seed", "3"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    assert main(["generate", bundle, "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature must be 0 (greedy) or at least 0.001" in capsys.readouterr().err
    assert main(["bench", bundle, "--max-new-tokens", "6", "--temperature", "0.7", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical_greedy"] is None and report["temperature"] == 0.7
    assert report["speculative"]["mean_accepted_per_pass"] >= 1


def test_a_quote_standing_alone_under_sampling_has_the_plain_distribution(bundle_factory):
    """Lookup only while quoting: steps alternate between a quote's point-mass chain (the model resting)
    and the model's sampled tree (after catching up on the quote)."""
    from edgespec.runtime.contract.drafting import LookupConfig

    pipeline = Pipeline(bundle_factory(draft="draft", tree="chain:2", lookup=0, lookup_quote=6), threads=1)
    # one repeated token makes a full match on a tiny random model (test_lookup.py)
    pipeline = pipeline.with_drafting(pipeline.tree, LookupConfig(tokens=0, min_n=1, max_n=1, quote_tokens=6))
    prompt = "one two three one two three one two three one"
    plain = first_tokens(pipeline, False, TRIALS, prompt)
    spec = first_tokens(pipeline, True, TRIALS, prompt)
    assert_same_distribution(plain, spec)
