"""A check shared by the fp32 and quantized tests: a token's logits do not depend on the pass's shape."""
import numpy as np

from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import ModelRunner, prefill


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
