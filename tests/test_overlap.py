"""Drafting while the target verifies (runtime/decoding/overlap.py): the same output as plain decoding, greedy bit
for bit and sampled in distribution, with trees drafted ahead actually used."""
import json
from collections import Counter

import numpy as np
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.overlap import likely_path
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.decoding.tree import Tree
from edgespec.runtime.execution.placement import Placement, candidates
from edgespec.runtime.pipeline import Pipeline
from edgespec.targets.profiles import Provider, get_profile
from test_features import feature_bundles  # noqa: F401 (a fixture)
from test_sampling_engine import TRIALS, assert_same_distribution

PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts tokens", "{\"name\": \"edge"]
CONFIG = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
OVERLAPPED = Placement(Provider("CPUExecutionProvider"), draft_threads=1, target_threads=1, overlap=True)


def assert_overlap_is_lossless(folder, expect_kept: bool):
    plain_pipeline = Pipeline(folder, threads=1)
    overlapped = Pipeline(folder, placement=OVERLAPPED)
    kept = 0
    for prompt in PROMPTS:
        plain = plain_pipeline.generate(prompt, config=CONFIG, speculate=False)
        sequential = plain_pipeline.generate(prompt, config=CONFIG)
        ahead = overlapped.generate(prompt, config=CONFIG)
        assert ahead.token_ids == plain.token_ids == sequential.token_ids
        assert ahead.stats.drafted_ahead > 0
        kept += ahead.stats.kept_ahead
    assert (kept > 0) == expect_kept


@pytest.mark.parametrize("draft,tree,expect_kept", [
    ("target", "chain:3", True),  # the draft is the target: its guesses come true
    ("target", "topk:2x2", True),
    ("draft", "topk:2x2", False),  # a random draft: guesses fail, the draft rewinds every step
    ("target", "dynamic:6", True),
])
def test_overlapped_steps_give_plain_decodings_tokens(draft, tree, expect_kept, bundle_factory):
    assert_overlap_is_lossless(bundle_factory(draft=draft, tree=tree), expect_kept)


class WrongGuesses:
    """The target as its own draft, except that a two-node proposal (how the worker guesses the bonus
    token) names another token: every guess has the right length and the wrong content."""

    def __init__(self, inner, vocab_size: int):
        self.inner, self.vocab_size = inner, vocab_size

    def propose(self, committed, max_nodes, sampler, target_features=None):
        tree = self.inner.propose(committed, max_nodes, sampler, target_features)
        if max_nodes == 2 and tree.size == 2:
            return Tree(tree.topology, np.array([tree.tokens[0], (tree.tokens[1] + 1) % self.vocab_size]))
        return tree

    def observe(self, accepted, tokens=None, logits=None):
        self.inner.observe(accepted, tokens, logits)

    def rewind(self, length):
        self.inner.rewind(length)


def test_a_tree_drafted_for_another_outcome_is_never_verified(bundle_factory):
    folder = bundle_factory(draft="target", tree="chain:3")
    plain, overlapped = Pipeline(folder, threads=1), Pipeline(folder, placement=OVERLAPPED)
    for prompt in PROMPTS:
        drafter = WrongGuesses(overlapped.make_drafter(True), overlapped.manifest.target.facts.vocab_size)
        ours = overlapped.generate(prompt, config=CONFIG, session=overlapped.new_session(drafter=drafter))
        assert ours.token_ids == plain.generate(prompt, config=CONFIG, speculate=False).token_ids
        assert ours.stats.drafted_ahead > 0 and ours.stats.kept_ahead == 0


def test_a_feature_draft_drafts_ahead_on_its_own_features(feature_bundles):  # noqa: F811
    assert_overlap_is_lossless(feature_bundles["chain:3"], expect_kept=False)


def test_the_next_conversation_turn_after_overlapped_steps(bundle_factory):
    """The draft forgets what it drafted ahead when a generation ends: a follow-up turn on the same
    session and drafter stays lossless."""
    folder = bundle_factory(draft="target", tree="chain:3")
    plain, overlapped = Pipeline(folder, threads=1), Pipeline(folder, placement=OVERLAPPED)
    plain_session, session = plain.new_session(False), overlapped.new_session()
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    text = "Hello there"
    for follow_up in (" and then", " so"):
        ours = overlapped.generate(text, config=config, session=session)
        reference = plain.generate(text, config=config, speculate=False, session=plain_session)
        assert ours.token_ids == reference.token_ids
        assert ours.stats.cached_tokens > 0 or text == "Hello there"  # a follow-up reuses the cache
        text += ours.text + follow_up


def late_tokens(pipeline, speculate: bool) -> tuple[Counter, int]:
    """How often each pair of 4th and 5th new tokens comes out (top-3 sampling: 9 outcomes), and how many
    trees drafted ahead were kept (the 4th and 5th tokens come from steps after the first)."""
    counts, kept = Counter(), 0
    for seed in range(TRIALS):
        config = GenerationConfig(max_new_tokens=5, stop_at_eos=False,
                                  sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed))
        result = pipeline.generate("The quick", config=config, speculate=speculate)
        counts[tuple(result.token_ids[3:5])] += 1
        kept += result.stats.kept_ahead
    return counts, kept


def test_overlapped_sampling_has_the_plain_distribution(bundle_factory):
    """The target as its own draft, one drafted token: a good share of the trees drafted ahead are kept."""
    folder = bundle_factory(draft="target", tree="chain:1")
    plain, _ = late_tokens(Pipeline(folder, threads=1), speculate=False)
    ahead, kept = late_tokens(Pipeline(folder, placement=OVERLAPPED), speculate=True)
    assert kept > TRIALS // 10
    assert_same_distribution(plain, ahead)


def test_overlapped_sampling_repeats_with_its_seed(bundle_factory):
    overlapped = Pipeline(bundle_factory(draft="target", tree="chain:2"), placement=OVERLAPPED)
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=1.0, seed=7))
    assert overlapped.generate("The quick", config=config).token_ids == \
        overlapped.generate("The quick", config=config).token_ids


def test_likely_path_follows_first_children():
    tree = Tree.from_parents((-1, 0, 0, 1, 1, 3), [9, 5, 6, 7, 8, 4])
    assert likely_path(tree) == [5, 7, 4]
    assert likely_path(Tree.from_parents((-1,), [9])) == []


def test_placement_candidates_and_their_records():
    found = candidates(get_profile("cpu"), cores=2)
    assert [(p.draft.name, p.draft_threads, p.target_threads, p.overlap) for p in found] == [
        ("CPUExecutionProvider", 2, 2, False), ("CPUExecutionProvider", 1, 2, True), ("CPUExecutionProvider", 1, 1, True)]
    assert candidates(get_profile("cpu"), cores=1) == [Placement(found[0].draft, 1, 1, overlap=False)]
    assert all(Placement.from_dict(p.to_dict()) == p for p in found)
    assert "overlapped" in found[1].describe() and "sequential" in found[0].describe()
    with pytest.raises(InputError):
        Placement.from_dict({"draft": {"name": "CPUExecutionProvider"}, "draft_threads": 0, "target_threads": 1,
                             "overlap": False})
    with pytest.raises(InputError):
        Placement.from_dict({"draft": "CPUExecutionProvider"})


def test_calibrate_measures_every_placement_caches_the_fastest_and_auto_reads_it(bundle_factory, monkeypatch,
                                                                                 tmp_path, capsys):
    from edgespec import calibrate as calibration
    from edgespec.cli import main

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    folder = bundle_factory(draft="target", tree="chain:3")
    assert main(["calibrate", str(folder), "--threads", "2", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    speeds = [m["tokens_per_s"] for m in out["measured"]]
    assert len(speeds) == 3 and all(s > 0 for s in speeds)
    assert out["chosen"] == out["measured"][speeds.index(max(speeds))]["placement"]
    assert calibration.cache_file(folder, 2).is_file()
    assert main(["doctor", str(folder)]) == 0
    assert "measured placement: " in capsys.readouterr().out

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached calibration should have been read")

    monkeypatch.setattr(calibration, "calibrate", no_measuring)
    chosen = calibration.auto_placement(folder, [], 2)
    assert chosen.to_dict() == out["chosen"]
    assert main(["generate", str(folder), "--prompt", "Hi", "--max-new-tokens", "6", "--threads", "2",
                 "--placement", "auto", "--json"]) == 0
    assert "placement: " in capsys.readouterr().err


def test_a_calibration_where_no_placement_starts_is_refused_not_cached(bundle_factory, monkeypatch, tmp_path):
    from edgespec import calibrate as calibration

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    folder = bundle_factory(draft="target", tree="chain:3")
    monkeypatch.setattr(calibration, "candidates", lambda profile, cores: [])  # as if no provider started
    with pytest.raises(InputError, match="no placement .* could start"):
        calibration.calibrate(folder, [], 2)
    assert not calibration.cache_file(folder, 2).exists()


def test_placement_options_refuse_what_cannot_be_placed(bundle_factory, capsys):
    from edgespec.cli import main

    ngram = str(bundle_factory(draft="ngram", tree="chain:4"))
    assert main(["calibrate", ngram, "--max-new-tokens", "8"]) == 2
    assert "no draft model" in capsys.readouterr().err
    assert main(["generate", ngram, "--prompt", "Hi", "--placement", "overlapped"]) == 2
    assert "no draft model" in capsys.readouterr().err
    drafted = str(bundle_factory(draft="target", tree="chain:3"))
    assert main(["generate", drafted, "--prompt", "Hi", "--placement", "overlapped", "--threads", "1"]) == 2
    assert "two cores" in capsys.readouterr().err
    assert main(["generate", drafted, "--prompt", "Hi", "--max-new-tokens", "6", "--placement", "overlapped",
                 "--threads", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["drafted_ahead"] > 0


def test_overlapped_steps_under_the_sliding_kv_policy(bundle_factory):
    """Past the context: the cache slides between steps, so a tree drafted ahead of a slide is dropped, and
    the output stays plain sliding decoding's."""
    folder = bundle_factory(draft="target", tree="chain:3", context=64)
    sliding = GenerationConfig(max_new_tokens=150, stop_at_eos=False, kv_policy="sliding")
    plain = Pipeline(folder, threads=1).generate("The quick brown fox", config=sliding, speculate=False)
    ahead = Pipeline(folder, placement=OVERLAPPED).generate("The quick brown fox", config=sliding)
    assert len(plain.token_ids) == 150 and ahead.token_ids == plain.token_ids
    assert ahead.stats.kept_ahead > 0
