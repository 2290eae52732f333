"""Prompt lookup beside a draft model (`export --lookup K`): the grafted chain, and exactness."""
import json

import numpy as np
import pytest
from edgespec.runtime.contract.drafting import LEGACY_NGRAM, LookupConfig, NgramConfig
from edgespec.runtime.contract.errors import BundleError
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.decoding.drafters import NgramDrafter, RecyclingDrafter, new_recycling_table
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.lookup import WithLookup, graft_chain
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.decoding.tree import Tree
from edgespec.runtime.pipeline import Pipeline

REPEATING = ["one two three four five six seven eight one two three four five six seven eight one two",
             "def f(x):\n    return x + 1\n\ndef g(x):\n    return x + 1\n\ndef h(x):\n    return"]
CONFIG = GenerationConfig(max_new_tokens=40, stop_at_eos=False)


def test_the_chain_follows_matching_nodes_then_grows_new_ones():
    tree = Tree.from_parents((-1, 0, 0, 1), [7, 10, 11, 12])
    grafted = graft_chain(tree, [10, 12, 13, 14], max_nodes=16)
    assert grafted.parents == (-1, 0, 0, 1, 3, 4) and list(grafted.tokens) == [7, 10, 11, 12, 13, 14]
    other = graft_chain(tree, [20, 21], max_nodes=16)
    assert other.parents == (-1, 0, 0, 1, 0, 4) and list(other.tokens[4:]) == [20, 21]


def test_the_chain_stops_at_the_node_limit():
    tree = Tree.from_parents((-1, 0), [7, 10])
    assert graft_chain(tree, [20, 21, 22], max_nodes=3).parents == (-1, 0, 0)
    assert graft_chain(tree, [10, 21, 22], max_nodes=3).parents == (-1, 0, 1)


class FixedDrafter:
    def __init__(self, tree):
        self.tree = tree

    def propose(self, committed, max_nodes, sampler, target_features=None):
        return self.tree

    def observe(self, accepted, tokens=None, logits=None):
        pass

    def rewind(self, length):
        pass


def test_lookup_continues_an_earlier_occurrence_as_point_masses():
    committed = [5, 6, 7, 8, 9, 5, 6]
    plain = Tree.from_parents((-1, 0), [6, 30])
    drafter = WithLookup(FixedDrafter(plain), LookupConfig(tokens=3, min_n=1, max_n=4))
    tree = drafter.propose(committed, 16, None)
    assert tree.paths()[-1] == [7, 8, 9]  # what followed "5 6" before
    assert tree.q_draft is None and tree.drawn is None
    q_root = np.full(40, 1 / 40)
    sampled = Tree(plain.topology, plain.tokens, q_draft=np.stack([q_root, np.zeros(40)]))
    tree = WithLookup(FixedDrafter(sampled), LookupConfig(tokens=3)).propose(committed, 16, None)
    assert tree.parents == (-1, 0, 0, 2, 3) and list(tree.drawn) == [True, True, False, False, False]
    assert np.array_equal(tree.q_draft[0], q_root) and tree.q_draft.shape == (5, 40)


def test_a_partial_match_is_cut_at_its_depth_and_a_full_match_runs_long():
    drafter = NgramDrafter(Topology(tuple(range(-1, 6))), max_n=3, min_n=1, partial_match_depth=2)
    quoting = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]  # "1 2 3" occurred before: the whole suffix matches
    assert list(drafter.propose(quoting, 16, None).tokens) == [3, 4, 5, 6, 7, 8, 9]
    assert drafter.full_match()
    drafter = NgramDrafter(Topology(tuple(range(-1, 6))), max_n=3, min_n=1, partial_match_depth=2)
    partial = [1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 3]  # only "3" occurred before
    assert list(drafter.propose(partial, 16, None).tokens) == [3, 4, 5]
    assert not drafter.full_match()


def test_recycled_branches_fill_the_tree_as_the_ngram_drafter_cuts_it():
    topology = Topology(tuple(range(-1, 6)))
    table = new_recycling_table(16, width=2)
    table[:, 0] = (np.arange(16) + 1) % 16  # every token's recycled successor: the next id
    partial = [1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 3]
    cut = RecyclingDrafter(topology, table, NgramDrafter(topology, max_n=3, min_n=1, partial_match_depth=2))
    assert list(cut.propose(partial, 16, None).tokens) == [3, 4, 5]
    quoting = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    whole = RecyclingDrafter(topology, table, NgramDrafter(topology, max_n=3, min_n=1, partial_match_depth=2))
    assert list(whole.propose(quoting, 16, None).tokens) == [3, 4, 5, 6, 7, 8, 9]
    alone = RecyclingDrafter(topology, table)  # no n-grams: no cut, the recycled chain runs to the full depth
    assert list(alone.propose(partial, 16, None).tokens) == [3, 4, 5, 6, 7, 8, 9]


def test_ngram_settings_are_checked():
    assert NgramConfig().to_dict() == {"min_n": 1, "max_n": 4, "partial_match_depth": 5}
    for bad in (dict(min_n=0), dict(min_n=3, max_n=2), dict(partial_match_depth=-1)):
        with pytest.raises(ValueError, match="bad n-gram"):
            NgramConfig(**bad)


@pytest.mark.parametrize("draft", ["ngram", "ngram+recycling"])
def test_an_ngram_bundle_carries_its_settings_and_quotes_to_its_default_tree(draft, bundle_factory, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft=draft, tree=None), bundle)
    pipeline = Pipeline(bundle)
    assert pipeline.manifest.ngram == NgramConfig() and pipeline.tree.parents == tuple(range(-1, 11))
    ngram = pipeline.make_drafter(True)
    ngram = ngram if draft == "ngram" else ngram.ngram
    assert (ngram.min_n, ngram.max_n) == (1, 4)
    assert ngram.topology.size == 12 and ngram.partial_topology.size == 6
    # a bundle written before the settings existed keeps the drafter it had
    manifest = json.loads((bundle / "manifest.json").read_text())
    del manifest["tree"]["ngram"]
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    legacy = Pipeline(bundle)
    assert legacy.manifest.ngram == LEGACY_NGRAM
    ngram = legacy.make_drafter(True)
    ngram = ngram if draft == "ngram" else ngram.ngram
    assert (ngram.min_n, ngram.max_n) == (2, 3) and ngram.partial_topology is ngram.topology


@pytest.mark.parametrize("draft", ["draft", "recycling"])
def test_ngram_settings_for_a_drafter_without_ngrams_are_refused(draft, bundle_factory, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft=draft), bundle)
    assert Pipeline(bundle).manifest.ngram is None
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert "ngram" not in manifest["tree"]
    manifest["tree"]["ngram"] = NgramConfig().to_dict()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="no n-grams"):
        Pipeline(bundle)


def test_lookup_quote_tokens_lengthen_the_chain_only_on_a_full_match():
    config = LookupConfig(tokens=2, min_n=1, max_n=2, quote_tokens=5)
    assert config.longest == 5 and LookupConfig(tokens=4).longest == 4
    plain = Tree.from_parents((-1,), [0])
    quoting = WithLookup(FixedDrafter(plain), config).propose([5, 6, 7, 8, 9, 10, 11, 5, 6], 16, None)
    assert quoting.parents == (-1, 0, 1, 2, 3, 4) and list(quoting.tokens[1:]) == [7, 8, 9, 10, 11]
    partial = WithLookup(FixedDrafter(plain), config).propose([5, 6, 7, 8, 9, 10, 11, 4, 6], 16, None)
    assert partial.parents == (-1, 0, 1) and list(partial.tokens[1:]) == [7, 8]
    only_quoting = LookupConfig(tokens=0, min_n=1, max_n=2, quote_tokens=5)
    assert WithLookup(FixedDrafter(plain), only_quoting).propose([5, 6, 7, 8, 9, 10, 11, 4, 6], 16, None).size == 1
    assert WithLookup(FixedDrafter(plain), only_quoting).propose([5, 6, 7, 8, 9, 10, 11, 5, 6], 16, None).size == 6
    for bad in (dict(quote_tokens=-1), dict(tokens=0), dict(tokens=-1, quote_tokens=4), dict(min_n=3, max_n=2)):
        with pytest.raises(ValueError, match="bad lookup"):
            LookupConfig(**bad)


class CountingDrafter(FixedDrafter):
    def __init__(self, tree):
        super().__init__(tree)
        self.calls = 0

    def propose(self, committed, max_nodes, sampler, target_features=None):
        self.calls += 1
        return self.tree


def test_a_lookup_only_while_quoting_stands_alone_and_the_model_rests_meanwhile():
    """A quote's chain is the whole tree (one path: no lane beside the model's tree) and the draft model is
    not run; off the quote the model's tree is proposed as it is."""
    model_tree = Tree.from_parents((-1, 0), [6, 30])
    model = CountingDrafter(model_tree)
    drafter = WithLookup(model, LookupConfig(tokens=0, min_n=1, max_n=2, quote_tokens=5))
    quoting = drafter.propose([5, 6, 7, 8, 9, 10, 11, 5, 6], 16, None)
    assert quoting.parents == (-1, 0, 1, 2, 3, 4) and list(quoting.tokens[1:]) == [7, 8, 9, 10, 11]
    assert model.calls == 0 and quoting.q_draft is None
    assert drafter.propose([5, 6, 7, 8, 9, 10, 11, 5, 6], 3, None).size == 3  # within what fits
    assert model.calls == 0
    drafter = WithLookup(model, LookupConfig(tokens=0, min_n=1, max_n=2, quote_tokens=5))  # a new context
    elsewhere = drafter.propose([5, 6, 7, 8, 9, 10, 11, 4, 6], 16, None)
    assert elsewhere is model_tree and model.calls == 1


def test_the_target_graph_gets_a_lane_for_the_lookup_only_where_it_is_grafted():
    from edgespec.exporters.export_plan import graph_lanes
    chain = Topology((-1, 0))
    assert graph_lanes(chain, None, grafted_lookup=True) == 2
    assert graph_lanes(chain, None, grafted_lookup=False) == 1
    assert graph_lanes(Topology((-1, 0, 0)), None, grafted_lookup=False) == 2


@pytest.mark.parametrize("tree,quote", [("chain:1", 0), ("dynamic:4", 0), ("chain:1", 9)])
def test_lookup_is_lossless(tree, quote, bundle_factory):
    """The verified trees do carry grafted chains (the prompts repeat), and the output stays exact.
    How many of their tokens the target accepts is a benchmark's question (RESULTS.md), not a random
    model's."""
    pipeline = Pipeline(bundle_factory(draft="draft", tree=tree, lookup=4, lookup_quote=quote))
    assert pipeline.manifest.lookup == LookupConfig(tokens=4, quote_tokens=quote)
    short = 4
    if quote:  # a random model seldom repeats 4 tokens of its context; one repeated token makes a full match here
        short, pipeline = 2, pipeline.with_drafting(pipeline.tree, LookupConfig(tokens=2, min_n=1, max_n=1,
                                                                              quote_tokens=quote))
    largest = pipeline.manifest.dynamic.budget if pipeline.manifest.dynamic else pipeline.manifest.tree.size
    for prompt in REPEATING:
        drafter = pipeline.make_drafter(True)
        assert isinstance(drafter, WithLookup)
        sizes, propose = [], drafter.propose

        def recording(*args, **kwargs):
            tree = propose(*args, **kwargs)
            sizes.append(tree.size)
            return tree

        drafter.propose = recording
        plain = pipeline.generate(prompt, config=CONFIG, speculate=False)
        spec = pipeline.generate(prompt, config=CONFIG, session=pipeline.new_session(drafter=drafter))
        assert spec.token_ids == plain.token_ids
        assert max(sizes) > largest + (short if quote else 0) and max(sizes) <= largest + max(short, quote)


def test_sampling_with_lookup_reproduces_its_seed(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="draft", tree="dynamic:4", lookup=4))
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=3))
    first = pipeline.generate(REPEATING[0], config=config)
    assert pipeline.generate(REPEATING[0], config=config).token_ids == first.token_ids


def test_lookup_needs_a_draft_model(models, tmp_path):
    from edgespec.exporters.export import ExportConfig, ExportError, export

    with pytest.raises(ExportError, match="--lookup adds prompt lookup to a draft model"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", lookup=4, cache_dir=tmp_path))
    with pytest.raises(ExportError, match="--lookup must be 0"):
        export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b", lookup=-1,
                            cache_dir=tmp_path))
    with pytest.raises(ExportError, match="more drafted tokens than --lookup"):
        export(ExportConfig(model=str(models["target"]), draft=str(models["draft"]), out=tmp_path / "b", lookup=4,
                            lookup_quote=3, cache_dir=tmp_path))
    with pytest.raises(ExportError, match="--lookup adds prompt lookup to a draft model"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", lookup_quote=8,
                            cache_dir=tmp_path))
    assert not (tmp_path / "b").exists()


def test_a_manifest_with_lookup_for_a_training_free_drafter_is_refused(bundle_factory, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="ngram"), bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tree"]["lookup"] = LookupConfig().to_dict()
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="prompt lookup"):
        Pipeline(bundle)


@pytest.mark.parametrize("quote", [0, 9])
def test_tune_costs_the_lookup_nodes_and_writes_the_length_it_chose(quote, bundle_factory, tmp_path):
    import shutil

    from edgespec.tune import tune

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="draft", tree="chain:1", lookup=4, lookup_quote=quote), bundle)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": REPEATING[0]}) + "\n")
    result = tune(bundle, prompts, max_nodes=4, max_new_tokens=12, threads=1, write=True)
    written = Pipeline(bundle).manifest.lookup
    assert (written.tokens if written else 0) == result["lookup_tokens"] in (0, 2, 4)
    assert (written.quote_tokens if written else 0) == result["lookup_quote_tokens"] in (0, quote, 10)
    if written:  # the bundle's own n-gram settings are kept
        assert (written.min_n, written.max_n) == (1, 4)
    assert sorted(map(int, result["pass_ms"])) == list(range(1, 4 + 4 + 1))
    assert result["tree"]["size"] <= 4 and result["measured_tokens_per_pass"] >= 1


@pytest.mark.parametrize("draft", ["draft", "target"])
def test_a_quote_standing_alone_is_lossless_with_one_lane(draft, bundle_factory):
    """Lookup only while quoting: the graph has one lane, quotes and the model's trees take turns, the draft
    model catches up on what it did not see, and the output is plain decoding's."""
    pipeline = Pipeline(bundle_factory(draft=draft, tree="chain:2", lookup=0, lookup_quote=6))
    assert pipeline.manifest.target.lanes == 1
    # a random model seldom repeats 4 tokens of its context; one repeated token makes a full match here
    pipeline = pipeline.with_drafting(pipeline.tree, LookupConfig(tokens=0, min_n=1, max_n=1, quote_tokens=6))
    kinds = set()
    for prompt in REPEATING:
        drafter = pipeline.make_drafter(True)
        propose = drafter.propose

        def recording(*args, **kwargs):
            tree = propose(*args, **kwargs)
            kinds.add("quote" if tree.q_draft is None and tree.size > 3 else "model")
            return tree

        drafter.propose = recording
        plain = pipeline.generate(prompt, config=CONFIG, speculate=False)
        spec = pipeline.generate(prompt, config=CONFIG, session=pipeline.new_session(drafter=drafter))
        assert spec.token_ids == plain.token_ids
    assert kinds == {"quote", "model"}
