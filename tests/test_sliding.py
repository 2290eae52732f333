"""The sliding KV policy: attention sinks + recent tokens, lossless between plain and speculative."""
import numpy as np
import pytest
from edgespec.runtime.contract.errors import ContextOverflowError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.kvcache import KVCache

LONG = GenerationConfig(max_new_tokens=150, stop_at_eos=False)
SLIDING = GenerationConfig(max_new_tokens=150, stop_at_eos=False, kv_policy="sliding")


def _rope(x, position, freqs):
    half = len(freqs)
    cos, sin = np.cos(position * freqs), np.sin(position * freqs)
    return np.concatenate([x[:half] * cos - x[half:] * sin, x[half:] * cos + x[:half] * sin])


def test_evicted_cache_holds_keys_as_if_computed_at_their_new_positions():
    dim = 8
    freqs = 1 / 10000 ** (np.arange(0, dim, 2) / dim)
    facts = ModelFacts("llama", 1, dim, 1, 1, dim, dim, 10, 64, 1e-5, 1e4, True)
    cache = KVCache(facts, 16, feature_size=3)  # an EAGLE draft's target features move with their rows
    raw = np.random.default_rng(0).normal(size=(10, dim)).astype(np.float32)
    for p in range(10):
        cache.data[0, 0, 0, 0, p], cache.data[0, 1, 0, 0, p] = _rope(raw[p], p, freqs), raw[p]
    cache.features[:10] = np.arange(30, dtype=np.float32).reshape(10, 3)
    cache.length = 10
    cache.evict(2, 3, freqs)
    kept = [0, 1, 5, 6, 7, 8, 9]
    expected = [_rope(raw[p], row, freqs) for row, p in enumerate(kept)]
    np.testing.assert_allclose(cache.data[0, 0, 0, 0, :7], expected, atol=1e-6)
    np.testing.assert_array_equal(cache.data[0, 1, 0, 0, :7], raw[kept])
    np.testing.assert_array_equal(cache.feature_rows(), np.arange(30, dtype=np.float32).reshape(10, 3)[kept])
    assert cache.length == 7
    with pytest.raises(ValueError):
        cache.evict(5, 3, freqs)


def test_sliding_generates_past_the_context_and_speculation_stays_exact(bundle_factory):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2", context=64), threads=1)
    with pytest.raises(ContextOverflowError, match="context is full"):
        pipeline.generate(prompt="The quick brown fox", config=LONG)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        plain = pipeline.generate(prompt=prompt, config=SLIDING, speculate=False)
        spec = pipeline.generate(prompt=prompt, config=SLIDING, speculate=True)
        assert len(plain.token_ids) == 150
        assert spec.token_ids == plain.token_ids


def test_the_sinks_stay_and_the_cache_never_grows(bundle_factory):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(draft="ngram", context=64), threads=1)
    session = pipeline.new_session()
    prompt_ids = pipeline.encode("The quick brown fox", None)
    result = pipeline.generate(prompt="The quick brown fox", config=SLIDING, session=session)
    assert session.cache.capacity == 64 and session.cache.length == len(session.window) - 1 <= 64
    assert session.window[:4] == prompt_ids[:4]
    assert session.committed == prompt_ids + result.token_ids
    assert len(session.window) < len(session.committed)
    # the same prompt again continues nothing of the slid conversation: it starts again, and still decodes
    again = pipeline.generate(prompt="The quick brown fox", config=SLIDING, session=session)
    assert again.token_ids == result.token_ids


def test_a_bundle_without_rope_frequencies_cannot_slide(bundle_factory):
    """An older manifest: a bundle error that says to re-export, not a context overflow."""
    import dataclasses

    from edgespec.runtime.contract.errors import BundleError
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(), threads=1)
    pipeline.target.facts = dataclasses.replace(pipeline.target.facts, rope_frequencies=None)
    with pytest.raises(BundleError, match="export it again"):
        pipeline.generate(prompt="The quick brown fox", config=SLIDING)
    assert pipeline.generate(prompt="The quick brown fox", config=GenerationConfig(max_new_tokens=4)).token_ids


def test_a_prompt_longer_than_the_cache_slides_as_it_is_read(bundle_factory):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(draft="draft", tree="chain:3", context=64), threads=1)
    prompt = "the quick brown fox jumps over the lazy dog " * 12
    ids = pipeline.encode(prompt)
    assert len(ids) > 64
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False, kv_policy="sliding")
    session = pipeline.new_session(False)
    plain = pipeline.generate(prompt, config=config, speculate=False, session=session)
    spec = pipeline.generate(prompt, config=config)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 20
    assert session.window[:4] == ids[:4] and session.cache.length == len(session.window) - 1 <= 64
    assert session.committed == ids + plain.token_ids


def test_a_conversation_goes_on_past_the_cache_turn_after_turn(bundle_factory):
    """Each follow-up continues the slid cache (its rows are reused, not recomputed), and speculative
    decoding keeps plain decoding's tokens turn after turn."""
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(bundle_factory(draft="draft", tree="chain:3", context=64), threads=1)
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False, kv_policy="sliding")
    sessions = {speculate: pipeline.new_session(speculate) for speculate in (False, True)}
    text, slid_and_reused = "Once upon a time", 0
    for turn in range(5):
        plain = pipeline.generate(text, config=config, speculate=False, session=sessions[False])
        spec = pipeline.generate(text, config=config, speculate=True, session=sessions[True])
        assert spec.token_ids == plain.token_ids, turn
        slid = len(sessions[False].window) < len(sessions[False].committed)
        slid_and_reused += slid and plain.stats.cached_tokens > 0
        text += plain.text + " and then"
    assert len(sessions[False].committed) > 2 * 64 and slid_and_reused >= 2
