"""What a caller may keep apart from the pipeline's shared state (a server: per client): its own store of
earlier outputs and Token Recycling table, and a conversation it already encoded."""
import numpy as np
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

CONFIG = GenerationConfig(max_new_tokens=48, stop_at_eos=False)
PROMPT = "The quick brown fox"


def test_a_callers_suffix_store_is_the_only_one_its_requests_learn_from(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="suffix", tree=None, suffix=True))
    mine, theirs = pipeline.new_suffix_store(), pipeline.new_suffix_store()
    assert mine is not pipeline.suffix_store and mine.array.length == 0
    first = pipeline.generate(PROMPT, config=CONFIG, session=pipeline.new_session(suffix_store=mine))
    assert mine.array.length == len(first.token_ids) + 1
    assert pipeline.suffix_store.array.length == 0 and theirs.array.length == 0  # nothing leaked to the shared one
    # another caller's store knows nothing of the first output: no faster than the first time
    other = pipeline.generate(PROMPT, config=CONFIG, session=pipeline.new_session(suffix_store=theirs))
    assert other.token_ids == first.token_ids and theirs.array.length == mine.array.length
    # the first caller's store does know it: its drafter quotes it (the same bits, fewer passes)
    again = pipeline.generate(PROMPT, config=CONFIG, session=pipeline.new_session(suffix_store=mine))
    assert again.token_ids == first.token_ids
    assert again.stats.mean_accepted_per_pass > max(first.stats.mean_accepted_per_pass,
                                                    other.stats.mean_accepted_per_pass)
    assert pipeline.suffix_store.array.length == 0 and mine.array.length == 2 * theirs.array.length


def test_without_suffix_drafting_there_is_no_store_to_keep(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram"))
    assert pipeline.new_suffix_store() is None and pipeline.new_recycling_table() is None


def test_a_callers_recycling_table_is_the_one_its_drafter_fills(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="recycling", tree="topk:2x2"))
    table = pipeline.new_recycling_table()
    assert table is not None and (table == -1).all()
    spec = pipeline.generate(PROMPT, config=CONFIG, session=pipeline.new_session(recycling_table=table))
    assert (table != -1).any()  # the target's candidates went into the caller's table
    assert pipeline.recycling_table is None  # the shared one was never made
    assert spec.token_ids == pipeline.generate(PROMPT, config=CONFIG, speculate=False).token_ids


def test_generate_takes_the_conversation_already_encoded(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram"))
    messages = [{"role": "user", "content": PROMPT}]
    ids = pipeline.encode(messages=messages)
    expected = pipeline.generate(messages=messages, config=CONFIG)

    def encodes_again(*args, **kwargs):
        raise AssertionError("the ids were encoded again")

    pipeline.codec.encode_chat = pipeline.codec.encode = encodes_again
    got = pipeline.generate(ids=ids, config=CONFIG)
    assert got.token_ids == expected.token_ids and got.stats.prompt_tokens == len(ids)
    assert pipeline.generate(ids=np.array(ids), config=CONFIG, speculate=False).token_ids == expected.token_ids


@pytest.mark.parametrize("kwargs,words", [(dict(ids=[1, 2], prompt="x"), "one of them"),
                                          (dict(ids=[1, -1]), "integers in"),
                                          (dict(ids=[1, 10**9]), "integers in"),
                                          (dict(ids=[1, 2.0]), "integers in"),
                                          (dict(ids=[True]), "integers in")])
def test_bad_ids_are_refused(bundle_factory, kwargs, words):
    pipeline = Pipeline(bundle_factory(draft="ngram"))
    with pytest.raises(InputError, match=words):
        pipeline.generate(config=CONFIG, **kwargs)
