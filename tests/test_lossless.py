"""Greedy speculative output equals plain greedy output of the same bundle, token for token."""
import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.exactness import check_exact_rows
from edgespec.runtime.pipeline import Pipeline
from rows import assert_rows_shape_invariant, assert_tree_rows_match_plain_decoding

PROMPTS = ["def add(a, b):", "The quick brown fox", "Speculative decoding drafts tokens", "{\"name\": \"edge"]
CONFIG = GenerationConfig(max_new_tokens=48, stop_at_eos=False)


def both(pipeline, **ask):
    plain = pipeline.generate(**ask, config=CONFIG, speculate=False)
    spec = pipeline.generate(**ask, config=CONFIG, speculate=True)
    return plain, spec


@pytest.mark.parametrize("tree", ["chain:4", "topk:2x2", "parents:-1,0,0,1,1,3"])
def test_self_draft_accepts_every_draft_token(tree, models, bundle_factory):
    """The draft is the target itself: every drafted top-1 token must be accepted."""
    pipeline = Pipeline(bundle_factory(draft="target", tree=tree))
    depth = pipeline.manifest.tree.max_depth
    for prompt in PROMPTS:
        plain, spec = both(pipeline, prompt=prompt)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.accepted_drafts == depth * spec.stats.target_passes


@pytest.mark.parametrize("tree", ["chain:4", "topk:2x2", "topk:3x1"])
def test_unrelated_draft(tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree=tree))
    accepted = []
    for prompt in PROMPTS:
        plain, spec = both(pipeline, prompt=prompt)
        assert spec.token_ids == plain.token_ids
        accepted.append(spec.stats.mean_accepted_per_pass)
    assert np.mean(accepted) < 1.5  # a random draft is almost never right


@pytest.mark.parametrize("tree", ["chain:6", "topk:2x3", None])
def test_ngram_drafter(tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree=tree))
    for prompt in PROMPTS:
        plain, spec = both(pipeline, prompt=prompt)
        assert spec.token_ids == plain.token_ids
    # a prompt that repeats itself gives the n-gram drafter something to find
    plain, spec = both(pipeline, prompt="a b c d e f a b c d e f a b c d e f a b c")
    assert spec.token_ids == plain.token_ids


@pytest.mark.parametrize("drafter,tree", [("recycling", "topk:2x2"), ("recycling", "chain:4"),
                                          ("ngram+recycling", "topk:2x3")])
def test_token_recycling_drafters(drafter, tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=drafter, tree=tree))
    accepted = 0
    for prompt in PROMPTS + ["a b c d e f a b c d e f a b c"]:
        plain, spec = both(pipeline, prompt=prompt)
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats.accepted_drafts
    assert accepted > 0  # the recycled candidates do get accepted


def test_recycling_table_keeps_the_targets_top_candidates():
    from edgespec.runtime.contract.topology import parse_tree_spec
    from edgespec.runtime.decoding.drafters import RecyclingDrafter, new_recycling_table

    drafter = RecyclingDrafter(parse_tree_spec("topk:2x2"), new_recycling_table(10, width=3))
    logits = np.array([[0, 5, 1, 9, 0, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 8, 0, 6, 0, 0]], dtype=np.float32)
    drafter.observe([3], tokens=np.array([4, 2]), logits=logits)
    assert list(drafter.table[4]) == [3, 1, 2] and list(drafter.table[2]) == [5, 0, 7]
    tree = drafter.propose([9, 4], max_nodes=16, sampler=None)
    assert list(tree.tokens[:3]) == [4, 3, 1] and tree.parents[:3] == (-1, 0, 0)


@pytest.mark.parametrize("draft", ["target", "draft"])
def test_dynamic_trees_are_lossless_and_stay_within_the_budget(draft, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree="dynamic:8"))
    assert pipeline.manifest.dynamic is not None and pipeline.manifest.dynamic.budget == 8
    sizes = []
    drafter = pipeline.make_drafter(True)
    original = drafter.propose

    def recording(committed, max_nodes, sampler, target_features=None):
        tree = original(committed, max_nodes, sampler, target_features)
        sizes.append(tree.size)
        return tree

    drafter.propose = recording
    for prompt in PROMPTS:
        plain = pipeline.generate(prompt, config=CONFIG, speculate=False)
        spec = pipeline.generate(prompt, config=CONFIG, session=pipeline.new_session(drafter=drafter))
        assert spec.token_ids == plain.token_ids
        if draft == "target":  # a perfect draft: its most confident path is always accepted
            assert spec.stats.mean_accepted_per_pass > 2
    assert sizes and max(sizes) <= 8  # a tree of the budget at most, every step drafted


def test_dynamic_trees_need_a_draft_model(models, tmp_path):
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.runtime.contract.errors import ExportError

    for tree, message in [("dynamic:8", "needs a draft model|give --draft a model"), ("dynamic:x", "needs a node count"),
                          ("dynamic:1", "bad dynamic tree settings")]:
        with pytest.raises(ExportError, match=message):
            export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", tree=tree,
                                context=256, cache_dir=tmp_path))


def test_chat_prompts_and_multi_turn_session(open_pipeline, backend):
    pipeline = open_pipeline(draft="draft", tree="topk:2x2" if backend == "onnx" else "chain:4")  # CoreML: chains
    session = pipeline.new_session()
    messages = [{"role": "user", "content": "hello fox"}]
    first = pipeline.generate(messages=messages, config=CONFIG, session=session)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and the dog?"}]
    second = pipeline.generate(messages=messages, config=CONFIG, session=session)
    fresh = pipeline.generate(messages=messages, config=CONFIG, speculate=False)
    assert first.token_ids == pipeline.generate(messages=messages[:1], config=CONFIG, speculate=False).token_ids
    assert second.token_ids == fresh.token_ids


def test_caches_that_grow_while_speculating_give_plain_decodings_output(bundle_factory):
    """A cache whose buffer starts at 4 rows grows (and is bound anew) several times in one generation."""
    from edgespec.runtime.decoding.engine import Session
    from edgespec.runtime.execution.kvcache import KVCache

    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    target = pipeline.manifest.target
    small = Session(cache=KVCache(target.facts, pipeline.context, lanes=target.lanes, initial_rows=4))
    grown = pipeline.generate("the quick brown fox", config=CONFIG, session=small)
    assert small.cache.data.shape[4] > 4 + 2  # it grew
    assert grown.token_ids == pipeline.generate("the quick brown fox", config=CONFIG, speculate=False).token_ids


def test_a_token_computed_alone_or_inside_a_tree_has_the_same_bits(bundle_factory):
    """The reason greedy equality holds: per-row results do not depend on the pass's shape
    (see MIN_ROWS in runtime/execution/model.py)."""
    assert_rows_shape_invariant(Pipeline(bundle_factory(draft="ngram", tree="chain:4")).target, seed=5, prefix=30, chunk=16)


def test_the_targets_graph_attends_under_the_causal_mask_alone_and_the_drafts_takes_a_bias(bundle_factory):
    """A target's exact passes need no attention bias (history.md §54); a draft masks its trees with one."""
    pipeline = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    target_inputs = {i.name for i in pipeline.target.session.get_inputs()}
    assert "attention_bias" not in target_inputs and {"position_ids", "seqlens_k"} <= target_inputs
    assert "attention_bias" in {i.name for i in pipeline.draft.session.get_inputs()}
    # (test_unrelated_draft decodes this bundle speculatively, against plain decoding)


def test_a_target_of_one_lane_pads_its_tokens_into_the_slots_and_other_graphs_gather_them(bundle_factory):
    """A target's one lane: token k in slot k, so a Pad and a Slice replace the head gathers (history.md §54).
    A draft's graph keeps them: OpenVINO, which runs drafts, cannot type the Pad and Slice."""
    one = Pipeline(bundle_factory(draft="ngram", tree="chain:4"))
    several = Pipeline(bundle_factory(draft="draft", tree="topk:2x2"))
    assert one.target.lanes == 1 and several.draft.lanes == 1 and several.target.lanes > 1
    for runner, gathers in ((one.target, False), (several.draft, True), (several.target, True)):
        inputs = {i.name for i in runner.session.get_inputs()}
        assert ({"qkv_rows", "out_rows"} <= inputs) == gathers, inputs


def test_every_node_of_a_verified_tree_has_the_bits_plain_decoding_gives_it(bundle_factory):
    """A node's siblings sit between it and its ancestors in the pass; its row must not notice."""
    target = Pipeline(bundle_factory(draft="ngram", tree="chain:4")).target
    for seed, prefix in [(6, 29), (7, 13)]:
        assert_tree_rows_match_plain_decoding(target, seed=seed, prefix=prefix)


@pytest.mark.parametrize("draft,tree", [("ngram", "chain:6"), ("target", "topk:2x2"), ("draft", "chain:4")])
def test_speculation_runs_to_the_end_of_the_context_like_plain_decoding(draft, tree, bundle_factory):
    """Near the end of the context the tree shrinks to what fits, so speculative decoding goes as far
    as plain decoding does, and then both stop with the same error."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, context=64))
    prompt = "a b c d e f a b c d e f a b c"
    room = 64 - len(pipeline.encode(prompt)) + 1  # the last token needs no cache row
    config = GenerationConfig(max_new_tokens=room, stop_at_eos=False)
    plain, spec = both_with(pipeline, config, prompt=prompt)
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == room
    from edgespec.runtime.contract.errors import ContextOverflowError

    for speculate in (False, True):
        with pytest.raises(ContextOverflowError, match="context is full"):
            pipeline.generate(prompt, config=GenerationConfig(max_new_tokens=room + 1, stop_at_eos=False),
                              speculate=speculate)


def both_with(pipeline, config, **ask):
    return (pipeline.generate(**ask, config=config, speculate=False),
            pipeline.generate(**ask, config=config, speculate=True))


def test_a_dynamic_tree_feeds_no_more_rows_than_the_draft_cache_has_room_for(bundle_factory):
    """The pruning cut bounds the tree, not the rows fed while growing it: a confident draft goes one node
    deeper per level, past the room left near the end of the context. It must stop at that room and leave
    the draft cache holding the committed rows only."""
    import dataclasses

    from edgespec.runtime.contract.drafting import DynamicTreeConfig
    from edgespec.runtime.decoding.dynamic_tree import DynamicDrafter

    pipeline = Pipeline(bundle_factory(draft="draft", tree="dynamic:8", context=64))
    vocab = pipeline.manifest.target.facts.vocab_size
    confident = np.full((vocab, vocab), -4.0, np.float32)  # every token's successor at p > 0.99
    confident[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 8.0
    forward, fed = pipeline.draft.forward, []

    def confident_forward(cache, tokens, positions, tree_mask, logit_rows, **kwargs):
        out = forward(cache, tokens, positions, tree_mask, logit_rows, **kwargs)
        fed.append(len(tokens))
        return dataclasses.replace(out, logits=confident[np.asarray(tokens)[list(logit_rows)]])

    pipeline.draft.forward = confident_forward
    committed = (pipeline.encode("a b c d e f g h " * 20) * 2)[:57]
    cache = pipeline.new_draft_cache()
    drafter = DynamicDrafter(pipeline.draft, cache, DynamicTreeConfig(budget=8, width=4, max_depth=6,
                                                                      min_confidence=0.0), 16)
    tree = drafter.propose(committed, 64 - len(committed) + 1, None)  # the target's room, as the engine passes
    assert cache.length == len(committed) and tree.size == 8
    assert sum(fed) == 64  # the catch-up's 57 rows, then tree rows 4 + 1 + 1 + 1: the room, and no more
    pipeline.draft.forward = forward


@pytest.mark.parametrize("tree", ["chain:4", "dynamic:8"])
def test_a_draft_that_fails_while_drafting_leaves_only_committed_rows(tree, bundle_factory):
    """A later call starts from the draft cache's length: tree rows left behind would pass for committed ones."""
    pipeline = Pipeline(bundle_factory(draft="draft", tree=tree))
    drafter = pipeline.make_drafter(True)
    if tree.startswith("dynamic"):
        drafter.config = type(drafter.config)(budget=8, width=2, max_depth=4, min_confidence=0.0)
    committed = pipeline.encode("def add(a, b): return a + b")
    forward, calls = pipeline.draft.forward, []

    def failing_forward(cache, tokens, *args, **kwargs):
        calls.append(len(tokens))
        if cache.length >= len(committed) + 1:  # a tree level after one was fed
            raise RuntimeError("the draft's session failed")
        return forward(cache, tokens, *args, **kwargs)

    pipeline.draft.forward = failing_forward
    with pytest.raises(RuntimeError, match="session failed"):
        drafter.propose(committed, 8, None)
    pipeline.draft.forward = forward
    assert drafter.cache.length == len(committed)


@pytest.mark.parametrize("budget", [3, 6, 12])
def test_dynamic_tree_skips_only_expansions_that_cannot_reach_the_budget(budget, bundle_factory):
    """Against the unpruned construction: expand the `width` most confident new nodes at every level
    down to max_depth, then keep the budget's most confident nodes. Same tree, fewer draft calls."""
    from edgespec.runtime.contract.drafting import DynamicTreeConfig
    from edgespec.runtime.decoding.drafters import catch_up
    from edgespec.runtime.decoding.dynamic_tree import DynamicDrafter, top_candidates

    pipeline = Pipeline(bundle_factory(draft="draft", tree="dynamic:8"))
    config = DynamicTreeConfig(budget=budget, width=3, max_depth=4, min_confidence=0.0)
    committed = pipeline.encode("def add(a, b): return a + b")

    def unpruned() -> tuple[list[tuple[int, ...]], int]:
        """(the chosen paths, the number of expanded nodes)"""
        cache = pipeline.new_draft_cache()
        logits = catch_up(pipeline.draft, cache, committed, pipeline.manifest.prefill_chunk, None)
        paths, frontier, rows = {(): (1.0, logits)}, [()], 0
        for depth in range(1, config.max_depth + 1):
            new = []
            for path in frontier:
                score, parent_logits = paths[path]
                for token, prob in zip(*top_candidates(parent_logits, config.width)):
                    new.append((path + (int(token),), score * float(prob)))
            new = sorted(new, key=lambda item: -item[1])
            for path, score in new:
                paths[path] = (score, None)
            if depth == config.max_depth:
                break
            frontier = [path for path, _ in new[: config.width]]
            for path in frontier:  # one row at a time: slow, but plainly what the draft predicts there
                branch = pipeline.new_draft_cache()
                out = catch_up(pipeline.draft, branch, committed + list(path), pipeline.manifest.prefill_chunk, None)
                paths[path] = (paths[path][0], out)
                rows += 1
        best = sorted((p for p in paths if p), key=lambda p: (-paths[p][0], len(p)))[: budget - 1]
        return sorted(best), rows

    drafter = DynamicDrafter(pipeline.draft, pipeline.new_draft_cache(), config, pipeline.manifest.prefill_chunk)
    fed = []  # rows fed per draft call
    forward = pipeline.draft.forward
    pipeline.draft.forward = lambda cache, tokens, *args, **kwargs: fed.append(len(tokens)) or forward(
        cache, tokens, *args, **kwargs)
    tree = drafter.propose(committed, budget, None)
    pipeline.draft.forward = forward
    chosen = sorted(tuple(path) for path in tree.paths() if path)
    expected, unpruned_rows = unpruned()
    assert chosen == expected
    expanded = sum(fed[1:])  # the first call catches up on the prompt
    assert expanded < unpruned_rows if budget <= 6 else expanded <= unpruned_rows


class ShapeDependentRunner:
    """A target whose passes of several tokens round a little differently from one-token steps: what a
    kernel with a separate multi-row path would do."""

    def __init__(self, inner):
        self.inner, self.facts, self.lanes, self.new_cache = inner, inner.facts, inner.lanes, inner.new_cache
        self.static, self.pass_limit = inner.static, inner.pass_limit

    def forward(self, cache, tokens, *args, **kwargs):
        out = self.inner.forward(cache, tokens, *args, **kwargs)
        if len(tokens) > 1:
            out.logits = out.logits + np.float32(1e-6)
        return out


def test_the_exactness_check_passes_here_and_catches_a_shape_dependent_kernel(bundle_factory):
    target = Pipeline(bundle_factory(draft="ngram", tree="topk:2x2")).target
    assert target.lanes == 4  # the check's tree of 5 paths is cut to the graph's 4 lanes: 10 of its 11 nodes
    compared, differ = check_exact_rows(target)
    assert compared == 30 + 10 + 2 * 10 and differ == []
    compared, differ = check_exact_rows(ShapeDependentRunner(target))
    assert {m.check for m in differ} == {"chunk", "tree"}
    assert all(m.max_abs_diff > 0 for m in differ)
    assert len([m for m in differ if m.check == "chunk"]) == 10  # every token of the multi-token pass
