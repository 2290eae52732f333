"""Streaming every weight form the bundles use: sessions made once, packed pages fetched and given back,
the single graph's bits at every budget, speculation exact under a budget."""
import json

import numpy as np
import pytest
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution import prepacked
from edgespec.runtime.execution.budget import embedding_rows, plan_memory
from edgespec.runtime.execution.embedding import MappedEmbedding
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.stage_build import build_staged_target, resident_stage_bytes, window_specs

pytestmark = pytest.mark.skipif(not prepacked.available(), reason="releases mapped pages through /proc/self/maps")
FORMS = {"int4-offsets": dict(quant="int4", symmetric=False), "int4-symmetric": dict(quant="int4"),
         "int8": dict(quant="int8"), "fp32": dict(quant="fp32")}


@pytest.fixture(scope="module")
def staged(models, tmp_path_factory):
    """A four-layer target in four stages of one layer (plus embedding and head), per weight form."""
    from edgespec.exporters.export import ExportConfig, export
    from tiny import make_model

    root = tmp_path_factory.mktemp("streaming")
    make_model(root / "deep", "llama", seed=7, layers=4)
    made = {}

    def make(form):
        if form not in made:
            made[form] = export(ExportConfig(model=str(root / "deep"), draft=str(models["draft"]), tree="chain:3",
                                             out=root / form, context=128, stages=4, **FORMS[form]))
        return made[form]

    return make


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return tmp_path_factory.mktemp("prepacked")


def _runner(folder, prepared, pinned=()):
    manifest = open_bundle(folder)
    return build_staged_target(manifest, folder, pinned, ("CPUExecutionProvider",), 1, prepared,
                               evict_page_cache=False)


def _streaming_budget(folder, prepared, context=128):
    """A budget where the target streams through the smallest window, at `context` tokens, and is resident
    with more: sized from the packed copies (prepared here) as the pipeline's plan counts them."""
    manifest = open_bundle(folder)
    _runner(folder, prepared).window.close()
    measured = resident_stage_bytes(manifest, prepared)
    full = plan_memory(manifest, folder, None, stage_bytes=measured)
    table = manifest.target.stages[0].embedding_table
    mapped = 0 if table is None else MappedEmbedding.resident_bound(table, embedding_rows(manifest))
    return full.total - full.target_weights - full.target_kv - full.draft_kv + context * (
        full.target_kv_per_token + full.draft_kv_per_token) + sum(sorted(measured)[-2:]) + mapped, full


def _single_graph(folder):
    from edgespec.runtime.execution.model import ModelRunner
    from edgespec.runtime.execution.sessions import make_session

    manifest = open_bundle(folder)
    return ModelRunner(make_session(folder / manifest.target.graph.file, ("CPUExecutionProvider",), 1),
                       manifest.target.facts)


def _two_passes(runner):
    """A prefill of 12 tokens and a 3-node chain after it: the logits and the keys/values both wrote."""
    cache = KVCache(runner.facts, 64, lanes=runner.lanes)
    first = runner.forward(cache, np.arange(5, 17), range(12), np.tril(np.ones((12, 12), bool)), range(12))
    cache.length = 12
    second = runner.forward(cache, [7, 8, 9], [12, 13, 14], np.tril(np.ones((3, 3), bool)), [0, 1, 2])
    return first.logits, second.logits, cache.data[:, :, 0, :, :15].copy()


@pytest.mark.parametrize("form", FORMS)
def test_every_stage_streams_from_its_packed_copy_with_the_single_graphs_bits(staged, prepared, form):
    folder = staged(form)
    runner = _runner(folder, prepared)
    assert all(isinstance(s, prepacked.PrepackedStage) for s in runner.window.stages)
    # the embedding table is indexed in its mapped file, never a stage: fetching it whole for a pass's
    # few rows cost as much as a layer group's fetch (history.md §76)
    assert runner.embedding is not None and runner.window.count == len(open_bundle(folder).target.stages) - 1
    sessions = [s.session for s in runner.window.stages]
    expected = _two_passes(_single_graph(folder))
    for _ in range(2):  # streamed twice over: the same sessions, and the same bits
        for want, got in zip(expected, _two_passes(runner)):
            np.testing.assert_array_equal(want, got)
    assert [s.session for s in runner.window.stages] == sessions
    runner.window.close()


@pytest.mark.parametrize("form", ["int4-offsets", "int8"])
def test_a_streamed_quantized_stage_holds_its_pages_only_while_fetched(staged, prepared, form):
    from test_staged import _mapped_rss_kib

    folder = staged(form)
    runner = _runner(folder, prepared)
    stage = runner.window.stages[2]
    weights = (stage.weights).resolve()
    assert _mapped_rss_kib(weights) == 0  # made, then given back until its turn
    stage.fetch()
    measured = resident_stage_bytes(open_bundle(folder), prepared)[2]
    assert _mapped_rss_kib(weights) * 1024 >= 0.9 * measured > 0
    assert measured == sum(r.high - r.low for r in stage.ranges)
    stage.release()
    assert _mapped_rss_kib(weights) == 0
    runner.window.close()


def test_the_plan_counts_what_a_packed_stage_maps_not_its_file(staged, prepared):
    folder = staged("int4-offsets")
    manifest = open_bundle(folder)
    _runner(folder, prepared).window.close()  # prepares the packed copies
    measured = resident_stage_bytes(manifest, prepared)
    assert measured is not None and len(measured) == len(window_specs(manifest))
    full = plan_memory(manifest, folder, None, stage_bytes=measured)
    assert full.target_weights >= sum(measured)
    budget = full.total - full.target_weights - full.target_kv - full.draft_kv + 128 * (
        full.target_kv_per_token + full.draft_kv_per_token) + sum(sorted(measured)[-2:])
    plan = plan_memory(manifest, folder, budget, stage_bytes=measured)
    assert plan.streams and plan.stage_bytes == tuple(measured) and plan.total <= budget


@pytest.mark.parametrize("form", FORMS)
def test_speculation_under_a_budget_is_plain_decoding_and_the_resident_bundles(staged, prepared, form):
    from edgespec.runtime.pipeline import Pipeline

    folder = staged(form)
    config = GenerationConfig(max_new_tokens=24)
    resident = Pipeline(folder, threads=1, prepared_dir=prepared)
    budget, full = _streaming_budget(folder, prepared)
    streamed = Pipeline(folder, threads=1, memory_budget=budget, prepared_dir=prepared)
    assert streamed.memory.streams and isinstance(streamed.target.window.stages[0], prepacked.PrepackedStage)
    for prompt in ("The quick brown fox", "def add(a, b):"):
        want = resident.generate(prompt=prompt, config=config, speculate=False).token_ids
        assert streamed.generate(prompt=prompt, config=config, speculate=False).token_ids == want
        assert streamed.generate(prompt=prompt, config=config, speculate=True).token_ids == want
    streamed.target.window.close()
    # no room for two streaming slots: one, each streamed stage fetched in its turn; the same bits
    one_slot = Pipeline(folder, threads=1, memory_budget=budget - sorted(streamed.memory.stage_bytes)[-2],
                        prepared_dir=prepared)
    assert one_slot.memory.stream_slots == 1 and one_slot.target.window.resident == 1
    prompt = "def add(a, b):"
    want = resident.generate(prompt=prompt, config=config, speculate=False).token_ids
    assert one_slot.generate(prompt=prompt, config=config, speculate=True).token_ids == want
    one_slot.target.window.close()
    resident_stages = Pipeline(folder, threads=1, memory_budget=2 * full.total, prepared_dir=prepared)
    assert resident_stages.stream_costs is None and resident_stages.tree == resident_stages.manifest.tree


def test_the_first_load_measures_stage_costs_and_the_tree_is_sized_to_the_streamed_pass(staged, prepared, tmp_path,
                                                                                       monkeypatch):
    from edgespec.runtime.pipeline import Pipeline

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    folder = staged("int4-offsets")
    manifest = open_bundle(folder)
    budget, _ = _streaming_budget(folder, prepared)
    first = Pipeline(folder, threads=1, memory_budget=budget, prepared_dir=prepared)
    assert first.stream_costs.measured and first.memory.costs_measured
    assert len(first.stream_costs.run_seconds) == len(window_specs(manifest))
    first.target.window.close()
    again = Pipeline(folder, threads=1, memory_budget=budget, prepared_dir=prepared)
    assert again.stream_costs == first.stream_costs  # cached per device and bundle: not measured twice
    assert again.memory.pinned_stages == first.memory.pinned_stages
    costs_file = next((tmp_path / "stream-costs").rglob("*.json"))
    costs_file.write_text(json.dumps({"run_seconds": [9.0] * len(window_specs(manifest)),
                                      "fetch_seconds": [9.0] * len(window_specs(manifest))}))
    other = Pipeline(folder, threads=2, memory_budget=budget, prepared_dir=prepared)
    assert other.stream_costs.run_seconds[0] < 9.0  # timed on other threads: measured again, not read
    other.target.window.close()
    # the export measured the draft's agreement: the tree is tune's program over the streamed pass
    assert manifest.quality["draft_agreement"]
    from edgespec.runtime.decoding.streamed_tree import tree_under_budget
    assert again.tree == tree_under_budget(manifest, again.memory, again.stream_costs, manifest.profile.max_tree_nodes)
    assert again.tree != manifest.tree
    again.target.window.close()
