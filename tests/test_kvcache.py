import numpy as np
import pytest

from edgespec.runtime.errors import ContextOverflowError
from edgespec.runtime.facts import ModelFacts
from edgespec.runtime.kvcache import KVCache

FACTS = ModelFacts("llama", 2, 8, 2, 1, 4, 16, 10, 16, 1e-5, 1e4, True)


def kv(n, base):
    return np.arange(2 * 2 * n * 1 * 4, dtype=np.float32).reshape(2, 2, n, 1, 4) + base


def test_append_compacts_to_the_path():
    cache = KVCache(FACTS, capacity=8)
    cache.append(kv(3, 0), [0, 1, 2])
    new = kv(4, 1000)
    cache.append(new, [0, 2, 3])
    assert cache.length == 6
    assert np.array_equal(cache.data[:, :, 3:6], new[:, :, [0, 2, 3]])
    assert cache.past()["past_key_1"].shape == (6, 1, 4)
    assert cache.past()["past_key_1"].flags["C_CONTIGUOUS"]


def test_trim_is_a_pointer_move_and_overflow_is_refused():
    cache = KVCache(FACTS, capacity=4)
    cache.append(kv(4, 0), range(4))
    with pytest.raises(ContextOverflowError):
        cache.append(kv(1, 0), [0])
    cache.trim(2)
    assert cache.length == 2 and cache.room() == 2
    with pytest.raises(ValueError):
        cache.trim(3)
