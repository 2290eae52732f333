import itertools

import numpy as np
import pytest
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.decoding.treeopt import best_trees, chain_value, choose_tree


def expected_tokens(topology: Topology, accept: np.ndarray) -> float:
    """E[T] straight from the definition: every node's rank among its siblings, its depth, the product
    of the rates along its path."""
    rank = {}
    for kids in topology.children:
        rank.update({kid: r for r, kid in enumerate(kids)})
    value = 1.0
    for node in range(1, topology.size):
        reach = 1.0
        for u in topology.path_to(node)[1:]:
            depth = int(topology.depths[u])
            reach *= accept[min(depth, len(accept)) - 1, rank[u]]
        value += reach
    return value


def all_trees(size: int):
    """Every parents array of `size` nodes (each node's parent an earlier node)."""
    for parents in itertools.product(*[range(i) for i in range(1, size)]):
        yield Topology((-1,) + parents)


def test_certain_top_candidate_gives_a_chain():
    trees = best_trees(np.array([1.0, 0.5]), 5)
    value, topology = trees[5, 4]
    assert topology.parents == (-1, 0, 1, 2, 3) and value == 5.0


def test_expected_tokens_of_small_trees():
    accept = np.array([0.6, 0.3])
    trees = best_trees(accept, 4)
    assert trees[1, 0][0] == 1.0  # the root alone: only the bonus token
    assert np.isclose(trees[2, 1][0], 1.6)
    # three nodes: a chain gives 1 + .6 + .36 = 1.96; two siblings 1 + .6 + .3 = 1.9
    assert np.isclose(trees[3, 2][0], 1.96) and trees[3, 2][1].parents == (-1, 0, 1)
    # one level only: the siblings are the best there is
    assert np.isclose(trees[3, 1][0], 1.9) and trees[3, 1][1].parents == (-1, 0, 0)


def test_wide_trees_win_when_second_candidates_are_good():
    value, topology = best_trees(np.array([0.3, 0.3, 0.3]), 4)[4, 3]
    assert topology.parents == (-1, 0, 0, 0) and np.isclose(value, 1.9)


@pytest.mark.parametrize("seed", range(4))
def test_the_program_finds_the_best_tree_of_every_size_and_depth(seed):
    """Against every tree of up to 6 nodes, with rates that differ by depth and rank."""
    rng = np.random.default_rng(seed)
    accept = rng.uniform(0, 0.5, (3, 3))
    accept[:, 0] += 0.4  # rank 0 usually the likeliest, not always
    trees = best_trees(accept, 6)
    for n in range(1, 7):
        candidates = [t for size in range(1, n + 1) for t in all_trees(size)
                      if max(len(kids) for kids in t.children) <= 3]
        for limit in range(n):
            best = max(expected_tokens(t, accept) for t in candidates if t.max_depth <= limit)
            value, topology = trees[n, limit]
            assert np.isclose(value, best), (n, limit)
            assert np.isclose(expected_tokens(topology, accept), value)
            assert topology.size <= n and topology.max_depth <= limit


def test_rates_that_rise_with_depth_favour_deep_chains():
    """A context match that held tends to go on holding: a long chain beats a bushy tree."""
    rising = np.array([[0.3, 0.1], [0.6, 0.1], [0.9, 0.0]])
    value, topology = best_trees(rising, 5)[5, 4]
    assert topology.parents == (-1, 0, 1, 2, 3)
    assert np.isclose(value, chain_value(rising, 4))
    assert np.isclose(chain_value(rising, 4), 1 + 0.3 + 0.18 + 0.162 + 0.1458)


def test_choose_tree_trades_acceptance_against_pass_cost():
    accept = np.array([0.8, 0.2])
    cheap = {n: 0.01 for n in range(1, 9)}
    tree, chain = choose_tree(accept, cheap)
    assert tree.topology.size == 8 and tree.tokens_per_s >= chain.tokens_per_s
    costly = {1: 0.01, 2: 0.01, 3: 0.05, 4: 0.05}
    tree, _ = choose_tree(accept, costly)
    assert tree.topology.size == 2


def test_drafting_cost_per_level_favours_shallow_trees():
    accept = np.array([0.7, 0.2, 0.1])
    flat = {n: 0.010 for n in range(1, 5)}
    deep, _ = choose_tree(accept, flat, draft_seconds_per_level=0.0)
    shallow, chain = choose_tree(accept, flat, draft_seconds_per_level=0.005)
    assert deep.topology.max_depth > 1
    assert shallow.topology.parents == (-1, 0, 0, 0)  # one draft step, three candidates
    assert np.isclose(shallow.step_seconds, 0.015) and np.isclose(shallow.expected_tokens, 2.0)
    assert shallow.tokens_per_s > chain.tokens_per_s


def test_rates_must_be_probabilities():
    with pytest.raises(ValueError, match="probabilities"):
        best_trees(np.array([1.2, 0.1]), 3)


def test_each_leaf_beyond_the_first_is_charged_so_costly_paths_make_the_choice_a_chain():
    """Each root-to-leaf path attends in its own sequence: a bushy tree pays for its leaves."""
    accept = np.array([0.6, 0.3, 0.1])
    flat = {n: 0.010 for n in range(1, 5)}
    bushy, _ = choose_tree(accept, flat, draft_seconds_per_level=0.005)
    assert bushy.topology.leaves > 1
    chained, chain = choose_tree(accept, flat, draft_seconds_per_level=0.005, leaf_seconds={n: 0.01 for n in flat})
    assert chained.topology.leaves == 1 and chained.tokens_per_s == chain.tokens_per_s
    star = Topology((-1, 0, 0, 0))
    assert star.leaves == 3 and Topology((-1, 0, 1)).leaves == 1
    lookup, _ = choose_tree(accept, flat, leaf_seconds={n: 0.002 for n in flat}, extra_leaves=1)
    assert np.isclose(lookup.step_seconds, 0.010 + 0.002 * lookup.topology.leaves)


def test_only_trees_the_graphs_lanes_can_verify_are_chosen():
    """A tree with more root-to-leaf paths than the target graph's lanes is cut to its first paths at run
    time: leaves it predicts for never come. With one lane (what --tree auto exports) only chains fit."""
    accept = np.array([0.6, 0.3, 0.1])
    flat = {n: 0.010 for n in range(1, 9)}
    unlimited, _ = choose_tree(accept, flat)
    assert unlimited.topology.leaves > 2
    for lanes in (1, 2):
        tree, _ = choose_tree(accept, flat, max_paths=lanes)
        assert tree.topology.leaves <= lanes
    with_lookup, chain = choose_tree(accept, flat, extra_leaves=1, max_paths=1)
    assert with_lookup.topology == chain.topology  # nothing fits beside the lookup's path but the chain fallback


def test_a_chain_the_program_passed_over_is_chosen_when_leaves_make_the_tree_slower():
    """The program ranks trees by E[T] per size, leaves unpaid; the chains are candidates too."""
    accept = np.array([[0.5, 0.4, 0.05]])
    cost = {n: 0.010 + 0.0005 * n for n in range(1, 7)}
    tree, chain = choose_tree(accept, cost, draft_seconds_per_level=0.001, leaf_seconds={n: 0.005 for n in cost})
    assert tree.tokens_per_s >= chain.tokens_per_s  # failed before: (-1, 0) at 125 tokens/s against the chain's 130
