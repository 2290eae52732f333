"""A check shared by the fp32 and quantized tests: a token's logits do not depend on the pass's shape.
The comparisons live in the runtime (runtime/decoding/exactness.py), where `inspect --check-exact` runs them too."""
from edgespec.runtime.decoding.exactness import TREE_PARENTS, chunk_mismatches, tree_mismatches
from edgespec.runtime.execution.model import ModelRunner


def assert_rows_shape_invariant(runner: ModelRunner, seed: int, prefix: int, chunk: int, tail: int = 10) -> None:
    """Logits of `tail` tokens computed one at a time equal, bit for bit, the same tokens computed in
    one pass after a prefill of `prefix` tokens in chunks of `chunk`; and so do the cached keys/values."""
    assert chunk_mismatches(runner, seed, prefix, chunk, tail) == []


def assert_tree_rows_match_plain_decoding(runner: ModelRunner, seed: int, prefix: int,
                                          parents: tuple[int, ...] = TREE_PARENTS) -> None:
    """Every node of a tree verified in one pass has, bit for bit, the logits and keys/values that plain
    decoding (one token at a time) gives the same token after the same path."""
    assert tree_mismatches(runner, seed, prefix, parents) == []
