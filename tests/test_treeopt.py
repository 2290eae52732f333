import numpy as np

from edgespec.runtime.treeopt import best_trees, choose_tree


def test_certain_top_candidate_gives_a_chain():
    trees = best_trees(np.array([1.0, 0.5]), 5)
    value, topology = trees[-1]
    assert topology.parents == (-1, 0, 1, 2, 3) and value == 5.0


def test_expected_tokens_of_small_trees():
    accept = np.array([0.6, 0.3])
    trees = best_trees(accept, 4)
    assert trees[0][0] == 1.0  # the root alone: only the bonus token
    assert np.isclose(trees[1][0], 1.6)
    # three nodes: a chain gives 1 + .6 + .36 = 1.96; two siblings 1 + .6 + .3 = 1.9
    assert np.isclose(trees[2][0], 1.96) and trees[2][1].parents == (-1, 0, 1)
    # the optimum is never worse than any smaller tree
    assert all(b[0] >= a[0] for a, b in zip(trees, trees[1:]))


def test_wide_trees_win_when_second_candidates_are_good():
    value, topology = best_trees(np.array([0.3, 0.3, 0.3]), 4)[-1]
    assert topology.parents == (-1, 0, 0, 0) and np.isclose(value, 1.9)


def test_choose_tree_trades_acceptance_against_pass_cost():
    accept = np.array([0.8, 0.2])
    cheap = {n: 0.01 for n in range(1, 9)}
    tree, chain = choose_tree(accept, cheap)
    assert tree.topology.size == 8 and tree.tokens_per_s >= chain.tokens_per_s
    costly = {1: 0.01, 2: 0.01, 3: 0.05, 4: 0.05}
    tree, _ = choose_tree(accept, costly)
    assert tree.topology.size == 2
