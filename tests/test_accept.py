import numpy as np
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.decoding.accept import accept_greedy


def test_chain_accepts_longest_matching_prefix_and_bonus():
    topo = parse_tree_spec("chain:3")
    tokens = np.array([9, 5, 6, 7])
    # target would say 5 after 9, 6 after 5, then 8 (not 7)
    choice = np.array([5, 6, 8, 1])
    path, bonus = accept_greedy(tokens, topo.children, choice)
    assert path == [0, 1, 2] and bonus == 8


def test_nothing_accepted_gives_the_target_token():
    topo = parse_tree_spec("chain:2")
    path, bonus = accept_greedy(np.array([1, 2, 3]), topo.children, np.array([4, 0, 0]))
    assert path == [0] and bonus == 4


def test_everything_accepted_gives_a_bonus_after_the_leaf():
    topo = parse_tree_spec("chain:2")
    path, bonus = accept_greedy(np.array([1, 2, 3]), topo.children, np.array([2, 3, 7]))
    assert path == [0, 1, 2] and bonus == 7


def test_branching_tree_follows_the_matching_sibling():
    topo = parse_tree_spec("topk:2x2")  # 0 -> (1, 2); 1 -> (3, 4); 2 -> (5, 6)
    tokens = np.array([0, 10, 20, 11, 12, 21, 22])
    choice = np.array([20, 0, 22, 0, 0, 0, 99])  # second sibling at depth 1, second at depth 2
    path, bonus = accept_greedy(tokens, topo.children, choice)
    assert path == [0, 2, 6] and bonus == 99
