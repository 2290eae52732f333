"""The step controller beside other conversations in a shared pass (runtime/decoding/controller.py,
`sharing`): a greedy step's tree is priced against the whole pass, so a tree that pays alone is left out
where its rows slow the others' steps more than its tokens give; a sampled step keeps its choice alone;
a shared pass's seconds (waits for the others included) do not enter the pass costs; and once the slots
passes themselves are timed, a shared step is priced by their seconds, not the single graph's line."""
import numpy as np
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.controller import Controller, Measurements, PassCosts
from edgespec.runtime.decoding.sampling import Sampler, SamplingConfig
from edgespec.runtime.decoding.tree import Tree

from edgespec.parser import build_parser
from edgespec.serve import ServeConfig

CHAIN = 4  # the main drafter's tree: a chain of this many nodes, the root included


class ChainDrafter:
    def __init__(self):
        self.asked = 0

    def propose(self, committed, max_nodes, sampler, target_features=None):
        self.asked += 1
        return Tree.from_parents(tuple(range(-1, CHAIN - 1)), [committed[-1], 5, 6, 7])

    def observe(self, accepted, tokens=None, logits=None):
        pass

    def rewind(self, length):
        pass


def controller() -> Controller:
    """Passes of 1 row: 8 ms; of r >= 2 rows: 6 + 2 r ms (timed); the main tree: 2.5 tokens of 4 nodes,
    drafted in no time. Alone: a drafted step, 2.5 / 14 ms, beats a plain one, 1 / 8 ms; beside 3 plain
    steps: (2.5 + 3) / 20 ms against 4 / 14 ms, plain wins."""
    measured = Measurements.fresh(CHAIN)
    measured.costs = PassCosts()
    measured.costs.seconds_by_rows = {1: 0.008, 2: 0.010, 3: 0.012, 5: 0.016}
    return Controller(None, ChainDrafter(), lanes=1, measured=measured)


def test_a_tree_that_pays_alone_is_left_out_beside_three_others():
    c = controller()
    assert c.propose([1, 2, 3], 16, None).size == CHAIN  # alone: the tree
    c.rewind(3)
    c.sharing = lambda: 3
    assert c.propose([1, 2, 3], 16, None).size == 1  # three others aboard: a plain step
    c.rewind(3)
    c.sharing = lambda: 1
    assert c.propose([1, 2, 3], 16, None).size == CHAIN  # one other: (2.5 + 1) / 16 ms beats 2 / 10 ms


def test_timed_slots_passes_price_a_shared_step_once_there_are_some():
    c = controller()
    c.sharing = lambda: 3
    c.measured.record_shared(3, 3, 0.015)  # three conversations' passes: not the four of this step
    c.measured.record_shared(3, 3, 0.015)  # (the first pass of a shape is not timed)
    assert c.propose([1, 2, 3], 16, None).size == 1  # so still the single graph's line: a plain step
    c.rewind(3)
    for rows, seconds in ((4, 0.020), (4, 0.020), (7, 0.022), (7, 0.022)):  # 4 conversations, rows nearly free
        c.measured.record_shared(4, rows, seconds)
    # beside three others: (2.5 + 3) / 22 ms against 4 / 20 ms, the tree wins where the single line said plain
    assert c.propose([1, 2, 3], 16, None).size == CHAIN
    c.rewind(3)
    c.sharing = lambda: 0
    assert c.propose([1, 2, 3], 16, None).size == CHAIN  # alone: the single graph's line, as before


def test_a_sampled_step_keeps_its_choice_alone():
    c = controller()
    c.sharing = lambda: 3
    sampler = Sampler(SamplingConfig(temperature=0.9, seed=1))
    assert c.propose([1, 2, 3], 16, sampler).size == CHAIN


def test_a_shared_pass_is_not_timed_into_the_pass_costs():
    c = controller()
    before = dict(c.measured.costs.seconds_by_rows)
    c.sharing = lambda: 3
    tree = c.propose([1, 2, 3], 16, None)
    c.observe([9], tree.tokens, np.zeros((tree.size, 16), dtype=np.float32))
    assert c.measured.costs.seconds_by_rows == before and 1 not in c.measured.costs.seen
    c.sharing = lambda: 0
    tree = c.propose([1, 2, 3, 9], 16, None)
    c.observe(list(tree.tokens[1:]) + [9], tree.tokens, np.zeros((tree.size, 16), dtype=np.float32))
    assert CHAIN in c.measured.costs.seen  # alone, the pass is timed (its first of a shape only seen)


def test_serve_prices_as_alone_unless_told_and_refuses_other_words():
    assert build_parser().parse_args(["serve"]).shared_speculation == "alone"  # batch lost on 2 cores (§68)
    assert build_parser().parse_args(["serve", "--shared-speculation", "batch"]).shared_speculation == "batch"
    assert ServeConfig(model="m").shared_speculation == "alone"
    with pytest.raises(InputError, match="--shared-speculation"):
        ServeConfig(model="m", shared_speculation="fast")
