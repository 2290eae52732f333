"""Suffix drafting (runtime/decoding/suffix.py) and the step controller (runtime/decoding/controller.py): the match, the
store, the tree, the choice of each step's tree, and losslessness end to end on tiny models."""
import numpy as np
import pytest
from edgespec.runtime.contract.drafting import SuffixConfig
from edgespec.runtime.contract.errors import ExportError, InputError
from edgespec.runtime.contract.manifest import read_manifest
from edgespec.runtime.decoding.controller import EXPLORE_EVERY, Controller, DraftCost, Measurements, PassCosts
from edgespec.runtime.decoding.drafters import NoDrafter
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.suffix import SuffixDrafter, SuffixStore, TokenArray
from edgespec.runtime.decoding.tree import Tree
from edgespec.runtime.pipeline import Pipeline
from test_sampling_engine import assert_same_distribution, first_tokens

CONFIG = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
PROMPTS = ["a b c d e f a b c d e f a b c", "def add(a, b):", "The quick brown fox", "{\"name\": \"edge"]


def array(tokens) -> TokenArray:
    a = TokenArray(4)
    a.extend(tokens)
    return a


def test_the_longest_earlier_match_is_found_and_never_the_suffix_itself():
    a = array([1, 2, 3, 9, 7, 2, 3, 8, 1, 2, 3])
    positions, length = a.matches(a.tokens, a.length, max_pattern=8)
    assert length == 3 and list(positions) == [3]  # "1 2 3" before 9; "2 3" before 8 is shorter
    positions, length = a.matches(a.tokens, a.length, max_pattern=2)
    assert length == 2 and list(positions) == [3, 7]  # capped: both "2 3" occurrences
    assert a.matches(np.array([5]), a.length, 8)[1] == 0  # nothing to continue


def test_the_store_keeps_the_newest_outputs_within_its_capacity_and_apart():
    store = SuffixStore(10)
    store.add([1, 2, 3])
    store.add([4, 5, 6, 7])
    store.add([8, 9])  # 3 + 1 + 4 + 1 + 2 + 1 > 10: the oldest go
    assert store.array.length <= 10 and list(store.array.tokens[-3:]) == [8, 9, -1]
    drafter = SuffixDrafter(SuffixConfig(min_match=1), store)
    assert list(drafter.propose([0, 3, 9], 8, None).tokens) == [9]  # 9 ends its output: nothing runs across
    assert list(drafter.propose([0, 5, 6], 8, None).tokens) == [6, 7]
    empty = SuffixStore(0)
    empty.add([1])
    assert empty.array.length == 0
    big = SuffixStore(1000)
    for start in range(0, 5000, 70):
        big.add(list(range(start, start + 70)))
        assert big.array.length <= 1000 and big.nbytes == 4 * 1001  # never grows past what the budget counted


def test_continuations_vote_and_the_tree_keeps_within_its_lanes():
    seq = [7, 1, 2, 3, 5, 8, 1, 2, 3, 6, 9, 1, 2, 3, 5, 10, 1, 2, 3]  # "1 2 3" went on with 5, 6, 5
    config = SuffixConfig(min_match=2, spec_factor=2.0, min_probability=0.2)
    chain = SuffixDrafter(config, None, max_leaves=1).proposal(seq, 16)
    assert chain.match_length == 3 and chain.tree.topology.leaves == 1
    assert list(chain.tree.tokens[:3]) == [3, 5, 8]  # the majority, then the first of a tie
    assert chain.parent_probability[1] == pytest.approx(2 / 3) and chain.parent_probability[2] == pytest.approx(1 / 2)
    tree = SuffixDrafter(config, None, max_leaves=2).proposal(seq, 16)
    assert tree.tree.topology.leaves == 2 and list(tree.tree.tokens[:3]) == [3, 5, 6]  # most probable first
    assert tree.tree.size - 1 <= int(config.spec_factor * tree.match_length)
    longest = SuffixDrafter(config, None).proposal(seq + [6, 9, 1, 2, 3], 16)
    assert longest.match_length == 8 and list(longest.tree.tokens[:2]) == [3, 5]  # "1 2 3 6 9 1 2 3" once, then 5


def test_a_short_match_drafts_nothing_and_an_edit_is_noticed():
    drafter = SuffixDrafter(SuffixConfig(min_match=3), None)
    assert drafter.propose([1, 2, 7, 1, 2], 8, None).size == 1  # a match of 2
    assert list(drafter.propose([4, 5, 6, 1, 4, 5, 6], 8, None).tokens[:2]) == [6, 1]
    assert list(drafter.propose([4, 5, 6, 2, 4, 5, 6], 8, None).tokens[:2]) == [6, 2]  # earlier tokens changed


def test_bad_settings_are_refused():
    for bad in (dict(min_match=0), dict(max_depth=0), dict(spec_factor=0), dict(min_probability=2),
                dict(store_tokens=-1), dict(max_pattern=True)):
        with pytest.raises(InputError):
            SuffixConfig(**bad)


def test_pass_costs_are_read_through_a_robust_line_over_what_was_timed():
    costs = PassCosts()
    assert costs.seconds(5) == pytest.approx(2.0)  # the prior, in one-row passes
    costs.record(1, 0.050)  # a shape's first pass allocates: left out
    assert costs.seconds(5) == pytest.approx(2.0)
    costs.record(1, 0.010)
    assert costs.seconds(3) == pytest.approx(0.010 + 2 * 0.25 * 0.010)  # one count timed: the prior's slope
    for rows, ms in ((2, 12), (3, 14), (4, 16), (5, 18), (21, 140)):  # the last one noisy
        costs.record(rows, 1.0)
        costs.record(rows, ms / 1000)
    assert costs.seconds(1) == pytest.approx(0.010)
    assert costs.seconds(8) == pytest.approx(0.008 + 0.002 * 8)  # the median slope: the outlier does not bend it
    assert costs.seconds(21) < 0.140


def test_a_drafts_cost_is_read_at_one_steps_catch_up():
    cost = DraftCost()
    assert cost.seconds(1.5) == 0.0  # never timed: hopeful
    cost.record(300, 0.040)  # the prompt, caught up on at its first call
    assert cost.seconds(1.5) == pytest.approx(0.040 * 1.5 / 300)  # no slope yet: not a prompt's seconds a step
    for behind, seconds in ((2, 0.0012), (1, 0.0010), (12, 0.0030), (3, 0.0014), (1, 0.0011)):
        cost.record(behind, seconds)
    assert 0.0009 < cost.seconds(1.5) < 0.0013  # not the catch-ups' seconds


class FixedDrafter:
    """A main drafter proposing a fixed chain, counting its calls."""

    def __init__(self, tokens):
        self.tokens, self.calls = tokens, 0

    def propose(self, committed, max_nodes, sampler, target_features=None):
        self.calls += 1
        return Tree.from_parents(tuple(range(-1, len(self.tokens))), [committed[-1], *self.tokens])

    def observe(self, accepted, tokens=None, logits=None):
        pass

    def rewind(self, length):
        pass


class FixedCosts(PassCosts):
    """Pass costs that the test sets: a tiny model's passes, timed in the loop, would take microseconds."""

    def __init__(self, one_row: float, per_row: float):
        super().__init__()
        self.seconds_by_rows = {rows: one_row + per_row * (rows - 1) for rows in range(1, 65)}

    def record(self, rows, seconds):
        pass


def step(controller, committed, truth):
    """One step against a target that would go on with `truth`: the tree's first path is accepted as far
    as it agrees, and the next true token is the bonus."""
    tree = controller.propose(committed, 64, None)
    node, accepted = 0, []
    while tree.topology.children[node] and int(tree.tokens[tree.topology.children[node][0]]) == truth[len(accepted)]:
        node = tree.topology.children[node][0]
        accepted.append(truth[len(accepted)])
    controller.observe(accepted + [truth[len(accepted)]], tree.tokens, np.zeros((tree.size, 4)))
    return tree


def test_the_controller_takes_a_quote_and_drops_a_draft_that_does_not_pay():
    quote = list(range(10, 22))
    committed = [1, *quote, 2, *quote[:9]]
    main = FixedDrafter([99])  # never right
    controller = Controller(SuffixDrafter(SuffixConfig(), None), main, lanes=1, measured=Measurements.fresh(2))
    controller.measured.costs = FixedCosts(0.010, 0.002)
    tree = step(controller, committed, quote[9:] + [0])  # the quote goes on where the suffix says
    assert list(tree.tokens[1:4]) == quote[9:12]
    for _ in range(12):  # the draft's proposals are never accepted: its steps stop paying
        if step(controller, [5, 6, 7], [3, 4]).size == 1:
            break
    else:
        raise AssertionError("a draft that is never right is still asked")
    calls = main.calls
    for _ in range(EXPLORE_EVERY - 1):
        assert step(controller, [5, 6, 7], [3, 4]).size == 1  # nothing to quote, a useless draft: plain steps
    assert main.calls == calls
    step(controller, [5, 6, 7], [3, 4])
    assert main.calls == calls + 1  # asked again now and then


def test_a_draft_whose_first_call_caught_up_on_the_prompt_is_asked_again():
    main = FixedDrafter([3])
    controller = Controller(None, main, lanes=1, measured=Measurements.fresh(2))
    controller.measured.costs = FixedCosts(0.010, 0.002)
    controller.measured.main_draft.record(300, 0.040)  # its first call: the whole prompt, four plain passes' time
    assert step(controller, [5, 6, 7], [3, 4]).size == 2  # a step's catch-up is priced at a step's tokens
    assert main.calls == 1


def test_a_plain_step_wins_where_extra_rows_cost_too_much():
    committed = [1, 2, 3, 4, 5, 1, 2, 3, 4]
    controller = Controller(SuffixDrafter(SuffixConfig(), None), None, lanes=1, measured=Measurements.fresh(1))
    controller.measured.costs = FixedCosts(0.010, 0.030)
    assert controller.propose(committed, 64, None).size == 1


@pytest.mark.parametrize("draft,tree", [("suffix", None), ("target", "chain:2"), ("draft", "topk:2x1")])
def test_suffix_drafting_is_lossless(draft, tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=True))
    assert read_manifest(bundle_factory(draft=draft, tree=tree, suffix=True)).suffix == SuffixConfig()
    chosen = {}
    for prompt in PROMPTS:
        plain = pipeline.generate(prompt, config=CONFIG, speculate=False)
        spec = pipeline.generate(prompt, config=CONFIG)
        assert spec.token_ids == plain.token_ids
        assert sum(c["tokens"] for c in spec.stats.steps_by_choice.values()) >= len(spec.token_ids) - 1
        for choice, counts in spec.stats.steps_by_choice.items():
            chosen[choice] = chosen.get(choice, 0) + counts["steps"]
    assert chosen.get("suffix", 0) > 0  # the tiny models repeat themselves: there is something to quote
    if draft == "draft":  # two lanes: the draft's tree with the suffix chain grafted on
        assert pipeline.target.lanes == 2


def test_earlier_outputs_are_drafted_from_in_a_later_request(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="suffix", tree=None, suffix=True))
    first = pipeline.generate("The quick brown fox", config=CONFIG)
    assert pipeline.suffix_store.array.length == len(first.token_ids) + 1
    again = pipeline.generate("The quick brown fox", config=CONFIG)  # the prompt alone has nothing to quote
    assert again.token_ids == first.token_ids
    assert again.stats.mean_accepted_per_pass > first.stats.mean_accepted_per_pass


def test_suffix_drafting_under_sampling_has_the_plain_distribution(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="suffix", tree=None, suffix=True), threads=1)
    prompt = "a b c a b c a b c a b"
    plain = first_tokens(pipeline, False, 600, prompt)
    spec = first_tokens(pipeline, True, 600, prompt)
    assert_same_distribution(plain, spec)


def test_plain_decoding_has_no_controller_and_requests_share_what_was_measured(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="suffix", tree=None, suffix=True))
    assert isinstance(pipeline.make_drafter(False), NoDrafter)
    first, second = pipeline.make_drafter(True), pipeline.make_drafter(True)
    assert isinstance(first, Controller) and first.measured is second.measured is pipeline.step_measurements
    pipeline.generate("a b c a b c a b", config=CONFIG)
    assert pipeline.step_measurements.costs.seconds_by_rows  # the passes of one request price the next's


def test_export_refuses_suffix_beside_lookup_or_a_tree_for_it(models, tmp_path):
    from edgespec.exporters.export import ExportConfig, plan_export

    with pytest.raises(ExportError, match="replaces prompt lookup"):
        plan_export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b",
                                 suffix=True, lookup_quote=8))
    with pytest.raises(ExportError, match="drop --tree"):
        plan_export(ExportConfig(model=str(models["target"]), draft="suffix", out=tmp_path / "b", tree="chain:3"))
    with pytest.raises(ExportError, match="static-shape"):
        plan_export(ExportConfig(model=str(models["target"]), draft="suffix", out=tmp_path / "b",
                                 profile="ai-pc-intel"))
