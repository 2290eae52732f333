import numpy as np
import pytest
from edgespec.runtime.contract.topology import Topology, parse_tree_spec


def test_chain_spec():
    topo = parse_tree_spec("chain:3")
    assert topo.parents == (-1, 0, 1, 2)
    assert list(topo.depths) == [0, 1, 2, 3]
    assert np.array_equal(topo.ancestor_mask, np.tril(np.ones((4, 4), bool)))


def test_topk_spec_is_full_tree():
    topo = parse_tree_spec("topk:2x2")
    assert topo.parents == (-1, 0, 0, 1, 1, 2, 2)
    assert topo.children[0] == (1, 2)
    assert topo.levels == ((0,), (1, 2), (3, 4, 5, 6))
    assert topo.path_to(5) == [0, 2, 5]
    # node 5 sees itself, its parent 2 and the root, and nothing else
    assert list(np.flatnonzero(topo.ancestor_mask[5])) == [0, 2, 5]


def test_explicit_parents_round_trip():
    topo = parse_tree_spec("parents:-1,0,0,1")
    assert parse_tree_spec(topo.spec()).parents == topo.parents
    assert parse_tree_spec("chain:3").spec() == "chain:3" and parse_tree_spec("parents:-1").spec() == "parents:-1"


@pytest.mark.parametrize("bad", ["chain:0", "topk:0x2", "ring:3", "parents:0,1", "parents:-1,2", "topk:9x9",
                                 "topk:1x100000000", "topk:100000x100000000"])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        parse_tree_spec(bad)


def test_topology_rejects_forward_parent():
    with pytest.raises(ValueError):
        Topology((-1, 0, 3, 1))


def test_within_depth_keeps_the_shallow_nodes_renumbered():
    topo = Topology((-1, 0, 1, 0, 2, 3))  # depths 0 1 2 1 3 2
    assert topo.within_depth(2).parents == (-1, 0, 1, 0, 3)  # node 5 (child of 3) becomes node 4
    assert topo.within_depth(0).parents == (-1,)
    assert topo.within_depth(3) is topo
