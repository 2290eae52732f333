"""How a pass's rows are laid out in attention sequences (runtime/execution/model.py: pass_feed)."""
import numpy as np
import pytest
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import GraphSignature
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import pass_feed

FACTS = ModelFacts(architecture="llama", num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=32, max_context=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                   tie_word_embeddings=True, sliding_window=None)


def graph(lanes: int = 1, inputs=None) -> GraphSignature:
    """A graph of FACTS attending in `lanes` lanes that takes `inputs` (default: every input a pass builds)."""
    every = GraphSignature.every_input(FACTS, lanes)
    return every if inputs is None else GraphSignature(every.heads, frozenset(inputs), lanes)


def cache_with(length: int, lanes: int = 1) -> KVCache:
    cache = KVCache(FACTS, 64, lanes=lanes)
    cache.length = length
    return cache


def test_paths_of_a_tree_in_leaf_order():
    tree = Topology((-1, 0, 0, 1, 1, 2))
    assert tree.root_to_leaf_paths == ((0, 1, 3), (0, 1, 4), (0, 2, 5))
    assert Topology.from_ancestor_mask(tree.ancestor_mask) == tree
    assert Topology.from_ancestor_mask(np.tril(np.ones((4, 4), bool))).root_to_leaf_paths == ((0, 1, 2, 3),)


@pytest.mark.parametrize("mask", [
    np.ones((3, 3), bool),                                  # a row sees a later row
    np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool),      # row 2 sees its parent but not the root
    np.array([[1, 0], [1, 0]], bool),                       # a row does not see itself
])
def test_a_mask_that_is_not_an_ancestor_mask_is_refused(mask):
    with pytest.raises(ValueError, match="ancestor mask|chain of its parent"):
        Topology.from_ancestor_mask(mask)


def test_every_path_gets_a_lane_whose_slots_sit_at_the_columns_plain_decoding_gives_them():
    tree = Topology((-1, 0, 0, 1, 1, 2))
    past = 5
    layout = pass_feed(cache_with(past, lanes=4), graph(4), list(range(6)), past + tree.depths, tree.ancestor_mask, range(6))
    feed, paths = layout.feed, layout.path_nodes
    slots = [int(feed["out_rows"][node, 0]) // FACTS.num_heads for node in range(6)]  # s * lanes + b
    assert layout.rows == 6 and paths.shape == (4, 3) and layout.lanes == 4
    for node in range(6):
        k, b = divmod(slots[node], layout.lanes)
        assert paths[b, k] == node and k == tree.depths[node]
        assert list(paths[b, : k + 1]) == tree.path_to(node)  # root first, then ancestors, then the node
    assert list(paths[3]) == list(paths[0])  # the unused lane repeats the first
    assert list(feed["position_ids"][0]) == [past, past + 1, past + 2]  # a slot's position is its column
    assert not feed["attention_bias"].any()  # the op's causal mask is the whole mask
    assert list(feed["seqlens_k"]) == [past + 2] and int(feed["total_sequence_length"]) == past + 3


def test_a_tree_with_more_paths_than_lanes_is_refused():
    tree = Topology((-1, 0, 0))
    with pytest.raises(ValueError, match="within_paths"):
        pass_feed(cache_with(2), graph(), [1, 2, 3], 2 + tree.depths, tree.ancestor_mask, range(3))


def test_a_single_token_is_one_lane_with_its_padding_row_after_it():
    layout = pass_feed(cache_with(3), graph(), [7], [3], np.ones((1, 1), bool), [0])
    feed = layout.feed
    assert layout.rows == 1 and list(layout.path_nodes[0]) == [0, 1]
    assert list(feed["out_rows"][:, 0]) == [0, 2]  # each token's first head is its slot's: 2 heads per slot
    assert list(feed["input_ids"][0]) == [7, 0] and list(feed["position_ids"][0]) == [3, 4]
    assert list(feed["logit_rows"]) == [0, 0]


def test_head_rows_fold_lanes_into_the_ops_packed_heads():
    from edgespec.runtime.execution.model import head_rows_of

    path_nodes = np.array([[0, 1, 3], [0, 2, 2]])  # lane 1's last slot repeats its leaf
    node_slots = np.array([0, 1, 4, 2])  # node 2 sits in lane 1, slot 1 (1 * 3 + 1)
    qkv_rows, out_rows = head_rows_of(path_nodes, node_slots, (2, 1))  # 2 query heads, 1 kv head: 4 rows a token
    assert qkv_rows.shape == (3, 2 * 4)
    # slot 1: lane 0 holds node 1, lane 1 node 2; q heads of both lanes, then k of both, then v of both
    assert list(qkv_rows[1]) == [4, 5, 8, 9, 6, 10, 7, 11]
    assert list(out_rows[2]) == [(1 * 2 + 1) * 2, (1 * 2 + 1) * 2 + 1]  # slot 1, lane 1, its 2 heads
    assert list(out_rows[3]) == [(2 * 2 + 0) * 2, (2 * 2 + 0) * 2 + 1]


def test_a_draft_pass_keeps_one_lane_and_masks_through_the_bias():
    past_mask = np.array([[True, False, True], [False, True, True]])
    layout = pass_feed(cache_with(3), graph(), [1, 2], [3, 3], np.eye(2, dtype=bool), [0, 1], past_mask=past_mask,
                       exact_rows=False)
    feed = layout.feed
    assert layout.path_nodes.shape == (1, 2) and list(feed["position_ids"][0]) == [3, 3]
    assert ((feed["attention_bias"][0, 0, :, :3] == 0) == past_mask).all()
    assert ((feed["attention_bias"][0, 0, :, 3:] == 0) == np.eye(2, dtype=bool)).all()


def test_a_graph_without_an_attention_bias_gets_no_bias_and_only_exact_passes():
    """A target's graph attends under the op's causal mask alone: its passes are exact."""
    tree = Topology((-1, 0, 0))
    target_inputs = frozenset({"input_ids", "qkv_rows", "out_rows", "position_ids", "seqlens_k",
                               "total_sequence_length", "logit_rows"})
    feed = pass_feed(cache_with(5, lanes=2), graph(2, target_inputs), [1, 2, 3], 5 + tree.depths, tree.ancestor_mask,
                     range(3)).feed
    assert set(feed) == target_inputs and int(feed["total_sequence_length"]) == 5 + 2
    with pytest.raises(ValueError, match="causal mask alone"):
        pass_feed(cache_with(3), graph(1, target_inputs), [1, 2], [3, 3], np.eye(2, dtype=bool), [0, 1],
                  exact_rows=False)
    with pytest.raises(ValueError, match="causal mask alone"):
        pass_feed(cache_with(3), graph(1, target_inputs), [1], [3], np.ones((1, 1), bool), [0],
                  past_mask=np.ones((1, 3), bool))
    one_lane = pass_feed(cache_with(3), graph(1, target_inputs - {"qkv_rows", "out_rows"}), [1], [3],
                         np.ones((1, 1), bool), [0]).feed
    assert "qkv_rows" not in one_lane and list(one_lane["position_ids"][0]) == [3, 4]  # still two slots


def test_a_chain_is_known_without_walking_its_paths(monkeypatch):
    from edgespec.runtime.execution import model

    assert model._is_chain(np.tril(np.ones((4, 4), bool))) and model._is_chain(np.ones((1, 1), bool))
    assert not model._is_chain(Topology((-1, 0, 0)).ancestor_mask)
    assert not model._is_chain(np.eye(3, dtype=bool))  # rows that do not see their predecessors
    assert not model._is_chain(np.ones((3, 3), bool))  # a row that sees a later one

    def walked(mask):
        raise AssertionError("a chain's one path was looked for among a tree's")
    monkeypatch.setattr(model.Topology, "from_ancestor_mask", staticmethod(walked))
    layout = pass_feed(cache_with(5), graph(), [1, 2, 3], [5, 6, 7], np.tril(np.ones((3, 3), bool)), [0, 1, 2])
    assert layout.path_nodes.tolist() == [[0, 1, 2]]
