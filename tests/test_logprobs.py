"""Log-probabilities (runtime/decoding/logprobs.py): the target's own, read from the passes that chose the
tokens; greedy speculative's equal plain decoding's to the bit; a prompt's equal one pass's scoring of it."""
import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.logprobs import Scores, log_softmax, scored
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline


def test_scored_gives_the_token_and_the_likeliest_alternatives():
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.25, 0.5, 0.25]]))
    first, second = scored(logits, [2, 0], top=2)
    assert np.isclose(first.logprob, np.log(0.3)) and [t for t, _ in first.top] == [1, 2]
    assert [t for t, _ in second.top] == [1, 0]  # a tie: the lower id first
    assert np.allclose(np.exp(log_softmax(logits)).sum(-1), 1)
    with pytest.raises(ValueError):
        Scores(top=21)


def run(pipeline, speculate, top=3, prompt=False, stop=(), sampling=SamplingConfig(), on_text=None):
    scores = Scores(top=top, prompt=prompt)
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stop_strings=stop, sampling=sampling)
    return pipeline.generate("The quick brown fox", config=config, speculate=speculate, scores=scores,
                             on_text=on_text), scores


@pytest.mark.parametrize("draft,tree", [("draft", "topk:2x2"), ("target", "chain:3"), ("ngram", "chain:4")])
def test_greedy_logprobs_are_plain_decodings(draft, tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree))
    plain, _ = run(pipeline, False)
    spec, _ = run(pipeline, True)
    assert spec.token_ids == plain.token_ids
    if draft == "target":  # a self-draft: several tokens a pass, each scored from its own row of the tree
        assert spec.stats.target_passes < plain.stats.target_passes
    assert spec.logprobs == plain.logprobs  # every float, bit for bit
    assert [e.token for e in spec.logprobs] == spec.token_ids
    assert all(e.top[0][0] == e.token and e.top[0][1] == e.logprob for e in spec.logprobs)  # greedy: the argmax


def test_seeded_sampled_logprobs_are_plain_decodings(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    sampling = SamplingConfig(temperature=1.0, seed=3)
    plain, _ = run(pipeline, False, sampling=sampling)
    spec, _ = run(pipeline, True, sampling=sampling)
    assert spec.token_ids == plain.token_ids and spec.logprobs == plain.logprobs


def test_logprobs_end_where_the_output_ends_and_stream_with_the_text(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    whole, _ = run(pipeline, True)
    stop = whole.text[len(whole.text) // 2:][:3]
    streamed = []
    holder = {}

    def on_text(piece):
        streamed.extend(holder["scores"].take_shown())

    scores = Scores(top=3)
    holder["scores"] = scores
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False, stop_strings=(stop,))
    cut = pipeline.generate("The quick brown fox", config=config, scores=scores, on_text=on_text)
    assert cut.stop_reason == "stop_string" and len(cut.logprobs) == len(cut.token_ids) < len(whole.token_ids)
    assert cut.logprobs == whole.logprobs[: len(cut.token_ids)]
    assert streamed == cut.logprobs  # each token's with the text that completes it, none past the stop


def test_a_prompts_logprobs_equal_one_pass_scoring_it(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    prompt = " ".join(["the quick brown fox jumps over the lazy dog"] * 16)
    ids = pipeline.encode(prompt)
    scores = Scores(top=2, prompt=True)
    session = pipeline.new_session()
    pipeline.generate(ids=ids[:5], config=GenerationConfig(max_new_tokens=2), session=session)  # a kept prefix
    result = pipeline.generate(ids=ids, config=GenerationConfig(max_new_tokens=1), scores=scores, session=session)
    assert len(ids) > pipeline.manifest.prefill_chunk  # several chunks
    cache = pipeline.target.new_cache(pipeline.context)
    n = len(ids)
    out = pipeline.target.forward(cache, ids, range(n), np.tril(np.ones((n, n), dtype=bool)), range(n))
    one_pass = scored(out.logits[: n - 1], ids[1:], 2)
    assert result.prompt_logprobs == one_pass
    assert result.logprobs == scored(out.logits[n - 1 :], result.token_ids, 2)
