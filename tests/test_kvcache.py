import numpy as np
import pytest
from edgespec.runtime.contract.errors import ContextOverflowError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import KV_SLACK
from edgespec.runtime.execution.kvcache import KVCache

FACTS = ModelFacts("llama", 2, 8, 2, 1, 4, 16, 10, 16, 1e-5, 1e4, True)


def write(cache: KVCache, lane: int, rows: int, base: float) -> np.ndarray:
    """What a pass does: writes `rows` new rows into `lane` after the valid ones; returns them
    [layers, 2, kv_heads, rows, head_dim]."""
    new = np.arange(2 * 2 * 1 * rows * 4, dtype=np.float32).reshape(2, 2, 1, rows, 4) + base  # one kv head
    cache.data[:, :, lane, :, cache.length : cache.length + rows] = new
    return new


def test_commit_keeps_the_accepted_lanes_rows_in_every_lane():
    cache = KVCache(FACTS, capacity=8, lanes=3)
    for lane in range(3):
        first = write(cache, lane, 3, 0)
    cache.commit(0, 3)
    write(cache, 0, 2, 500)
    accepted = write(cache, 2, 3, 1000)
    cache.commit(2, 3)
    assert cache.length == 6
    for lane in range(3):
        assert np.array_equal(cache.data[:, :, lane, :, :3], first)
        assert np.array_equal(cache.data[:, :, lane, :, 3:6], accepted)
    assert np.array_equal(cache.rows(3, 6), accepted)


def test_buffers_are_bound_lane_major_with_room_for_a_padding_row():
    cache = KVCache(FACTS, capacity=8, lanes=3)
    buffer = cache.data[1, 0].reshape(1, 3 * FACTS.num_kv_heads, -1, FACTS.head_dim)
    assert buffer.shape[2] > cache.capacity and np.shares_memory(buffer, cache.data)


def test_the_buffer_grows_by_doubling_keeping_every_lanes_rows_up_to_the_capacity():
    cache = KVCache(FACTS, capacity=12, lanes=2, initial_rows=2)
    assert cache.data.shape[4] == 2 + KV_SLACK
    kept = write(cache, 1, 2, 0)
    cache.commit(1, 2)
    cache.reserve(3)
    assert cache.data.shape[4] == 4 + KV_SLACK
    for lane in range(2):
        assert np.array_equal(cache.data[:, :, lane, :, :2], kept)
    cache.reserve(9)
    assert cache.data.shape[4] == 9 + KV_SLACK
    cache.reserve(12 + KV_SLACK)  # a pass at a full cache writes its padding row past the capacity
    assert cache.data.shape[4] == 12 + KV_SLACK
    with pytest.raises(ContextOverflowError):
        cache.reserve(13 + KV_SLACK)
    held = cache.data
    cache.reserve(12 + KV_SLACK)  # the whole context is held: no copy, the bindings stay
    assert cache.data is held


def test_held_bytes_count_the_old_and_the_grown_buffer_while_a_pass_grows_it():
    cache = KVCache(FACTS, capacity=12, feature_size=3, initial_rows=2)
    per_row = cache.data.nbytes // cache.data.shape[4]
    features = cache.features.nbytes
    assert cache.held_bytes() == cache.data.nbytes + features == (2 + KV_SLACK) * per_row + features
    assert cache.held_bytes(2) == cache.held_bytes()  # fits: nothing grows
    assert cache.held_bytes(3) == (2 + KV_SLACK) * per_row + (4 + KV_SLACK) * per_row + features  # both, mid-copy
    cache.reserve(3)
    assert cache.held_bytes() == (4 + KV_SLACK) * per_row + features  # the old buffer is gone
    cache.reserve(12)
    assert cache.held_bytes(12 + KV_SLACK) == cache.held_bytes() == (12 + KV_SLACK) * per_row + features


def test_a_static_buffer_is_whole_from_the_start_and_never_copied():
    cache = KVCache(FACTS, capacity=10, initial_rows=10, slack=4)
    held = cache.data
    assert held.shape[4] == 14
    for rows in (3, 10, 12, 14):  # a pass near the end of the context writes into the slack
        cache.reserve(rows)
        assert cache.data is held
    with pytest.raises(ContextOverflowError):
        cache.reserve(15)


def test_trim_is_a_pointer_move_and_overflow_is_refused():
    cache = KVCache(FACTS, capacity=4)
    cache.commit(0, 4)
    with pytest.raises(ContextOverflowError):
        cache.commit(0, 1)
    cache.trim(2)
    assert cache.length == 2 and cache.room() == 2
    with pytest.raises(ValueError):
        cache.trim(3)


def test_one_token_steps_write_their_inputs_into_the_arrays_bound_before(bundle_factory):
    from edgespec.runtime.execution.model import commit, prefill
    from edgespec.runtime.pipeline import Pipeline

    target = Pipeline(bundle_factory(draft="ngram", tree="chain:4")).target
    tokens = [3, 5, 7, 11, 13, 2, 4, 9]

    def steps(rebind: bool) -> tuple[list[np.ndarray], list[dict]]:
        cache = target.new_cache(32)
        prefill(target, cache, tokens[:3], 8)
        logits, held = [], []
        for token in tokens[3:]:
            if rebind:  # every input bound afresh, as before any step had run
                cache.binding(target.session).held.clear()
            out = target.forward(cache, [token], [cache.length], np.ones((1, 1), bool), [0])
            commit(cache, out, [0])
            logits.append(out.logits[0])
            held.append(dict(cache.binding(target.session).held))
        return logits, held

    reused, held = steps(rebind=False)
    fresh, _ = steps(rebind=True)
    assert set(held[0]) == set(target.new_cache(8).binding(target.session).inputs)  # every input besides the KV buffers
    for before, after in zip(held, held[1:]):  # a step of the same shapes binds nothing new
        assert set(before) == set(after) and all(after[name] is before[name] for name in before)
    for a, b in zip(reused, fresh):
        assert np.array_equal(a, b)  # what each step wrote in place is what it would have bound
    assert len({x.tobytes() for x in reused}) == len(reused)  # every step's logits differ: a stale input would show


def test_a_request_takes_the_rows_it_can_reach_before_its_first_token(bundle_factory, monkeypatch):
    """The buffer grows once, at the prompt, to the prompt and the answer's most tokens: not while the
    answer is timed (each doubling copies every valid row). A fixed-size cache (CoreML's) keeps its size."""
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:4", context=512), threads=1)
    grown, real = [], KVCache.reserve

    def recording(cache, rows):
        before = cache.data.shape[4]
        real(cache, rows)
        if cache.data.shape[4] != before:
            grown.append((cache.length, cache.data.shape[4] - cache.slack))

    monkeypatch.setattr(KVCache, "reserve", recording)
    prompt = "one two three four five six seven eight nine ten " * 3  # within the first buffer's rows
    result = pipeline.generate(prompt, speculate=False,
                               config=GenerationConfig(max_new_tokens=300, stop_at_eos=False))
    reach = result.stats.prompt_tokens + 300
    assert result.stats.new_tokens == 300 and result.stats.prompt_tokens < 256 < reach
    assert len(grown) == 1 and grown[0][0] == 0 and grown[0][1] >= reach
