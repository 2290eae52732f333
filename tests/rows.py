"""A check shared by the fp32 and quantized tests: a token's logits do not depend on the pass's shape."""
import numpy as np

from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import ModelRunner, prefill
from edgespec.runtime.tree import Topology


def assert_rows_shape_invariant(runner: ModelRunner, seed: int, prefix: int, chunk: int, tail: int = 10) -> None:
    """Logits of `tail` tokens computed one at a time equal, bit for bit, the same tokens computed in
    one pass after a prefill of `prefix` tokens in chunks of `chunk`; and so do the cached keys/values."""
    facts = runner.facts
    ids = list(np.random.default_rng(seed).integers(3, facts.vocab_size, prefix + tail))
    alone = KVCache(facts, 64)
    singles = []
    for token in ids:
        out = runner.forward(alone, [token], [alone.length], np.ones((1, 1), bool), [0])
        alone.append(out.new_kv, [0])
        singles.append(out.logits[0])
    together = KVCache(facts, 64)
    prefill(runner, together, ids[:prefix], chunk)
    out = runner.forward(together, ids[prefix:], range(prefix, prefix + tail), np.tril(np.ones((tail, tail), bool)),
                         range(tail))
    assert np.array_equal(out.logits, np.array(singles[prefix:]))
    assert np.array_equal(together.data[:, :, :prefix], alone.data[:, :, :prefix])


# Siblings sit between a node and its ancestors in a tree pass: node 5's path 0-2-5 has nodes 1, 3 and 4
# in between. The tree is wider than MLAS's 6-row blocks and deep enough to cross lane boundaries.
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 2, 3, 5, 5, 8)


def assert_tree_rows_match_plain_decoding(runner: ModelRunner, seed: int, prefix: int,
                                          parents: tuple[int, ...] = TREE_PARENTS) -> None:
    """Every node of a tree verified in one pass has, bit for bit, the logits and keys/values that plain
    decoding (one token at a time) gives the same token after the same path."""
    facts = runner.facts
    rng = np.random.default_rng(seed)
    context = list(rng.integers(3, facts.vocab_size, prefix))
    tokens = list(rng.integers(3, facts.vocab_size, len(parents)))
    topology = Topology(tuple(parents))
    paths = [topology.path_to(node) for node in range(topology.size)]

    cache = KVCache(facts, 64)
    prefill(runner, cache, context, 8)
    tree = runner.forward(cache, tokens, cache.length + topology.depths, topology.ancestor_mask,
                          range(topology.size))
    for node, path in enumerate(paths):
        plain = KVCache(facts, 64)
        prefill(runner, plain, context, 8)
        for step in path:
            alone = runner.forward(plain, [tokens[step]], [plain.length], np.ones((1, 1), bool), [0])
            plain.append(alone.new_kv, [0])
        assert np.array_equal(tree.logits[node], alone.logits[0]), f"node {node} (path {path})"
        assert np.array_equal(tree.new_kv[:, :, node], alone.new_kv[:, :, 0]), f"node {node} (path {path})"
