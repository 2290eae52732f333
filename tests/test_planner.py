"""The planner's trade between context and speed: pure arithmetic over a bundle's sizes and fake stage costs."""
import pytest
from edgespec.runtime.contract.errors import BudgetError
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution.budget import (DEFAULT_CONTEXT, MIN_CONTEXT, choose_pinned, embedding_rows,
                                              plan_memory, trade_offs, window_bytes)
from edgespec.runtime.execution.embedding import MappedEmbedding
from edgespec.runtime.execution.stream_costs import StreamCosts

MB = 10**6


@pytest.fixture(scope="module")
def staged(models, tmp_path_factory):
    from edgespec.exporters.export import ExportConfig, export
    from tiny import make_model

    root = tmp_path_factory.mktemp("planner")
    make_model(root / "deep", "llama", seed=5, layers=4)
    return export(ExportConfig(model=str(root / "deep"), draft="ngram", out=root / "b", context=512, stages=4,
                               quant="int4"))


# fake stages as a device would measure them: a small one, four layer groups, a large head
STAGES = [2 * MB, 4 * MB, 4 * MB, 4 * MB, 4 * MB, 10 * MB]


def _costs(fetch=(0.5, 1.0, 1.0, 1.0, 1.0, 4.0)):
    return StreamCosts(run_seconds=(0.1, 1.0, 1.0, 1.0, 1.0, 1.0), fetch_seconds=tuple(fetch), measured=True)


def _parts(folder):
    """(bytes beside the target and its caches, KV bytes per token, full context) of a budget's plan."""
    full = plan_memory(open_bundle(folder), folder, None, stage_bytes=STAGES)
    return full.total - full.target_weights - full.target_kv - full.draft_kv, \
        full.target_kv_per_token + full.draft_kv_per_token, full.context


def _mapped(folder):
    """What a streaming plan keeps of the mapped embedding table (runtime/execution/embedding.py)."""
    manifest = open_bundle(folder)
    table = manifest.target.stages[0].embedding_table
    return MappedEmbedding.resident_bound(table, embedding_rows(manifest)) if table else 0


def test_a_pass_costs_every_run_and_each_streamed_fetch():
    costs = _costs()
    assert costs.pass_seconds(range(6)) == pytest.approx(5.1)
    assert costs.pass_seconds(()) == pytest.approx(5.1 + 8.5)
    assert costs.pass_seconds((5,)) == pytest.approx(5.1 + 4.5)


def test_the_stages_whose_fetch_costs_most_per_byte_are_pinned_first():
    # the head streams slowest per byte here (0.4 s per MB against 0.25): pinned before any layer group
    assert choose_pinned(STAGES, window_bytes(STAGES, (5,)), _costs()) == (5,)
    # with the head's fetch cheap per byte, a layer group goes first, though smaller
    cheap_head = _costs((0.5, 1.0, 1.0, 1.0, 1.0, 1.0))
    assert 5 not in choose_pinned(STAGES, window_bytes(STAGES, (1,)), cheap_head)
    # without measured costs: the bytes, largest first
    assert choose_pinned(STAGES, window_bytes(STAGES, (5,))) == (5,)


def test_the_context_asked_for_is_a_floor_and_speed_comes_first(staged):
    manifest = open_bundle(staged)
    others, per_token, full = _parts(staged)
    resident = plan_memory(manifest, staged, None, stage_bytes=STAGES).target_weights
    # room for every weight beside the least context asked: resident, the caches take what is left
    budget = others + resident + 200 * per_token
    assert not plan_memory(manifest, staged, budget, context=MIN_CONTEXT, stage_bytes=STAGES).streams
    assert plan_memory(manifest, staged, budget, context=MIN_CONTEXT, stage_bytes=STAGES).context == 200
    # asking for the full context makes the same budget stream, and keeps that context
    plan = plan_memory(manifest, staged, budget, context=full, stage_bytes=STAGES, costs=_costs())
    assert plan.streams and plan.context == full and plan.total <= budget
    assert plan.min_context == full and plan.pass_seconds == pytest.approx(_costs().pass_seconds(plan.pinned_stages))
    with pytest.raises(BudgetError, match="--context"):
        plan_memory(manifest, staged, budget, context=full + 1, stage_bytes=STAGES)


def _against_the_caches(folder, contexts: int):
    """Fake stages sized against the caches: a layer group's bytes hold the KV of `contexts`-th of the
    whole context (the parts, as `_parts` gives them)."""
    others, per_token, full = _parts(folder)
    unit = full * per_token // contexts
    return [unit // 2, unit, unit, unit, unit, 5 * unit // 2], others, per_token, full


def test_without_a_context_asked_the_default_floor_is_kept_before_any_stage_is_pinned(staged):
    manifest = open_bundle(staged)
    stages, others, per_token, full = _against_the_caches(staged, 2)
    # room for three stages pinned beside the least context, while streaming them all holds the whole context
    budget = others + (MIN_CONTEXT + 8) * per_token + _mapped(staged) + window_bytes(stages, (1, 2, 5))
    fastest = plan_memory(manifest, staged, budget, MIN_CONTEXT, stage_bytes=stages, costs=_costs())
    assert len(fastest.pinned_stages) == 3 and fastest.context < full // 2
    plan = plan_memory(manifest, staged, budget, stage_bytes=stages, costs=_costs())
    assert plan.min_context == min(DEFAULT_CONTEXT, full) == plan.context
    assert plan.total <= budget and 0 < len(plan.pinned_stages) < 3  # what is left above the floor still pins
    # what the default costs in speed is listed beside it: the split that pins three, below the floor
    splits = trade_offs(manifest, staged, budget, stage_bytes=stages, costs=_costs())
    assert splits[0] == plan and fastest.pinned_stages in [s.pinned_stages for s in splits[1:]]


def test_the_default_floor_is_what_the_budget_holds_where_that_is_less_never_a_refusal(staged):
    manifest = open_bundle(staged)
    stages, others, per_token, full = _against_the_caches(staged, 8)
    least = others + MIN_CONTEXT * per_token + _mapped(staged) + window_bytes(stages, (), slots=2)
    for budget in (least - 1, least, least + 50 * per_token):  # one slot, then two, then room to pin one
        plan = plan_memory(manifest, staged, budget, stage_bytes=stages, costs=_costs())
        most = max(s.context for s in trade_offs(manifest, staged, budget, MIN_CONTEXT, stages, _costs()))
        assert MIN_CONTEXT <= plan.min_context == plan.context == most < full and plan.total <= budget
        assert plan.pinned_stages == ()


def test_trade_offs_give_context_back_stage_by_stage(staged):
    manifest = open_bundle(staged)
    others, per_token, full = _parts(staged)
    budget = others + MIN_CONTEXT * per_token + _mapped(staged) + window_bytes(STAGES, (1, 2, 5))
    splits = trade_offs(manifest, staged, budget, MIN_CONTEXT, stage_bytes=STAGES, costs=_costs())
    assert splits[0] == plan_memory(manifest, staged, budget, MIN_CONTEXT, stage_bytes=STAGES, costs=_costs())
    assert len(splits[0].pinned_stages) == 3 and splits[-1].pinned_stages == ()
    pinned = [len(s.pinned_stages) for s in splits]
    assert pinned == sorted(pinned, reverse=True)
    contexts, seconds = [s.context for s in splits], [s.pass_seconds for s in splits]
    assert contexts == sorted(contexts) and contexts[0] < contexts[-1]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1]
    assert all(s.total <= budget and s.context >= MIN_CONTEXT for s in splits)


def test_a_streamed_pass_buys_a_longer_tree_than_a_resident_one():
    from edgespec.runtime.decoding.streamed_tree import streamed_pass_seconds, tree_for_budget

    costs = _costs()
    seconds = streamed_pass_seconds(costs, (), 4)
    assert seconds[1] == pytest.approx(costs.pass_seconds(()))
    assert seconds[3] - seconds[2] == pytest.approx(seconds[2] - seconds[1]) and seconds[2] > seconds[1]
    streamed = tree_for_budget(costs, (), agreement=0.5, max_nodes=8, lanes=1, draft_seconds_per_level=0.3)
    resident = tree_for_budget(costs, range(6), agreement=0.5, max_nodes=8, lanes=1, draft_seconds_per_level=0.3)
    assert streamed.max_depth > resident.max_depth >= 1
    assert streamed.leaves == 1  # one lane: a chain


def test_agreement_by_rank_buys_siblings_where_a_pass_is_mostly_fetching_and_lanes_verify_them():
    from edgespec.runtime.decoding.streamed_tree import draft_agreement, tree_for_budget

    quality = {"draft_agreement": {"fp32": 0.5, "quantized": 0.4},
               "draft_agreement_by_rank": {"quantized": [0.4, 0.15, 0.08, 0.05]}}
    assert draft_agreement(quality) == [0.4, 0.15, 0.08, 0.05]
    assert draft_agreement({"draft_agreement": {"fp32": 0.5, "quantized": 0.4}}) == [0.4]  # older bundles: chains
    assert draft_agreement({}) is None
    fetching = _costs(fetch=(5.0,) * 6)
    ranked = tree_for_budget(fetching, (), draft_agreement(quality), max_nodes=8, lanes=4, draft_seconds_per_level=0.3)
    assert ranked.leaves > 1 and ranked.leaves <= 4 and len(ranked.children[0]) > 1  # siblings of the first choice
    first_only = tree_for_budget(fetching, (), [0.4], max_nodes=8, lanes=4, draft_seconds_per_level=0.3)
    one_lane = tree_for_budget(fetching, (), draft_agreement(quality), max_nodes=8, lanes=1,
                               draft_seconds_per_level=0.3)
    assert first_only.leaves == 1 and one_lane.leaves == 1
    resident = tree_for_budget(_costs(), range(6), draft_agreement(quality), max_nodes=8, lanes=4,
                               draft_seconds_per_level=0.3)
    assert resident.size < ranked.size  # where rows cost compute, fewer of them


def test_a_resident_plan_lists_only_the_splits_that_stream_beside_it(staged):
    manifest = open_bundle(staged)
    full = plan_memory(manifest, staged, None, stage_bytes=STAGES)
    splits = trade_offs(manifest, staged, full.total, stage_bytes=STAGES, costs=_costs())
    assert not splits[0].streams and splits[0].pass_seconds is None
    assert len(splits) > 1 and all(s.streams for s in splits[1:])
    assert len({s.pinned_stages for s in splits[1:]}) == len(splits) - 1 and splits[-1].pinned_stages == ()


def test_plan_prints_the_trade_and_context_is_a_floor_for_plan_and_pipeline(staged, tmp_path, monkeypatch, capsys):
    import json

    from edgespec.runtime.pipeline import Pipeline

    from edgespec.cli import main

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    files = plan_memory(open_bundle(staged), staged, None)
    # a byte short of the resident target beside the least context: streams, whatever the packed copies add
    budget = str(files.total - files.target_kv - files.draft_kv + MIN_CONTEXT * (
        files.target_kv_per_token + files.draft_kv_per_token) - 1)
    assert main(["plan", str(staged), "--memory-budget", budget, "--json"]) == 0
    default = json.loads(capsys.readouterr().out)
    # no context asked: the default floor, lowered to the most a split holds here (every stage streaming)
    assert MIN_CONTEXT < default["min_context"] == default["context"] < files.context
    assert default["pinned_stages"] == [] and len(default["trade_offs"]) > 1
    assert default["trade_offs"][0]["pinned_stages"] == default["pinned_stages"]
    # the splits that pin more are listed below the floor: what the default costs in speed
    assert all(t["context"] < default["context"] and t["pass_seconds"] < default["pass_seconds"]
               for t in default["trade_offs"][1:])
    assert main(["plan", str(staged), "--memory-budget", budget, "--context", str(MIN_CONTEXT), "--json"]) == 0
    asked = json.loads(capsys.readouterr().out)
    assert asked["min_context"] == MIN_CONTEXT and MIN_CONTEXT <= asked["context"] < default["context"]
    assert len(asked["pinned_stages"]) > len(default["pinned_stages"])
    assert main(["plan", str(staged), "--memory-budget", budget]) == 0
    printed = capsys.readouterr().out
    assert "splits of this budget" in printed and "tokens/s" in printed
    pipeline = Pipeline(staged, threads=1, memory_budget=budget, context=MIN_CONTEXT + 1)
    assert pipeline.memory.min_context == MIN_CONTEXT + 1 and pipeline.context >= MIN_CONTEXT + 1
    pipeline.target.window.close()
    with pytest.raises(BudgetError, match="--context"):
        Pipeline(staged, threads=1, memory_budget=budget, context=files.context + 1)


def test_the_kv_room_a_short_conversation_leaves_pins_more_stages_and_is_given_back(staged, monkeypatch):
    from edgespec.runtime.execution import budget as budget_module

    manifest = open_bundle(staged)
    others, per_token, full = _parts(staged)
    unit = full * per_token // 8  # stages sized against the caches: the whole context's KV holds eight
    stages = [unit // 2, unit, unit, unit, unit, 5 * unit // 2]
    budget = others + full * per_token + _mapped(staged) + window_bytes(stages, (5,))
    plan = plan_memory(manifest, staged, budget, context=full, stage_bytes=stages, costs=_costs())
    assert plan.streams and plan.context == full and plan.pinned_stages == (5,)
    beside_the_caches = plan.total - plan.target_weights - plan.target_kv + plan.mapped_embedding
    # the margin kept back: what is lent leaves it free (here it is more than the tiny caches' room)
    margin = int(budget_module.LENDING_MARGIN * budget)
    assert beside_the_caches + window_bytes(stages, plan.pinned_while(0, _costs())) <= budget - margin \
        or plan.pinned_while(0, _costs()) == plan.pinned_stages
    monkeypatch.setattr(budget_module, "LENDING_MARGIN", 0.0)
    counts = []
    for kv in range(0, plan.target_kv + per_token, max(1, plan.target_kv // 50)):
        pinned = plan.pinned_while(kv, _costs())
        assert beside_the_caches + window_bytes(stages, pinned) + min(kv, plan.target_kv) <= budget  # never over
        counts.append(len(pinned))
    assert counts[0] > len(plan.pinned_stages)  # an empty cache lends its room
    assert plan.pinned_while(plan.target_kv, _costs()) == plan.pinned_stages  # a full one has taken it back
    assert counts == sorted(counts, reverse=True)
    resident = plan_memory(manifest, staged, None, stage_bytes=stages)
    assert resident.pinned_while(0, _costs()) == resident.pinned_stages


def test_a_request_another_split_holds_is_never_refused_for_context(staged, tmp_path):
    """A request whose prompt and new tokens outgrow the plan's context, where another split of the same
    budget holds them, gets that split: fewer stages pinned, or the resident target streamed; the output is
    the unconstrained target's, and the plan stays within the budget."""
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.execution.stage_build import packed_graphs, resident_stage_bytes
    from edgespec.runtime.pipeline import Pipeline

    manifest = open_bundle(staged)
    packed_graphs(manifest, staged, tmp_path)
    measured = resident_stage_bytes(manifest, tmp_path)  # what a pipeline here plans with (None: the files)
    full = plan_memory(manifest, staged, None, stage_bytes=measured)
    per_token = full.target_kv_per_token + full.draft_kv_per_token
    resident = full.total - full.target_kv - full.draft_kv
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    reference = Pipeline(staged, threads=1, prepared_dir=tmp_path)
    # resident beside 200 tokens; then a byte short of resident beside the least context: stages pinned
    for budget, streams in ((resident + 200 * per_token, False), (resident + MIN_CONTEXT * per_token - 1, True)):
        pipeline = Pipeline(staged, threads=1, memory_budget=budget, context=MIN_CONTEXT, prepared_dir=tmp_path)
        assert pipeline.memory.streams == streams and (not streams or pipeline.memory.pinned_stages)
        most = max(s.context for s in trade_offs(manifest, staged, budget, MIN_CONTEXT, measured))
        need = (pipeline.context + most + 1) // 2
        assert pipeline.context < need <= most
        ids = [(7 * i) % 200 + 3 for i in range(need - config.max_new_tokens)]
        out = pipeline.generate(ids=ids, config=config, speculate=False)
        assert out.token_ids == reference.generate(ids=ids, config=config, speculate=False).token_ids
        assert pipeline.context >= need and pipeline.memory.streams and pipeline.memory.total <= budget
        assert pipeline.target.window.pinned == set(pipeline.memory.pinned_stages) or pipeline.target.pinning
        pipeline.target.window.close()


def test_plan_says_whether_its_figures_are_estimates_or_measured_and_where_they_are_cached(staged, tmp_path,
                                                                                          monkeypatch, capsys):
    import json
    from pathlib import Path

    from edgespec.runtime.execution import prepacked
    from edgespec.runtime.pipeline import Pipeline

    from edgespec.cli import main

    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    files = plan_memory(open_bundle(staged), staged, None)
    budget = str(files.total - files.target_kv - files.draft_kv + MIN_CONTEXT * (
        files.target_kv_per_token + files.draft_kv_per_token) - 1)  # streams
    ask = ["plan", str(staged), "--memory-budget", budget, "--threads", "1"]

    def figures():
        assert main(ask + ["--json"]) == 0
        return json.loads(capsys.readouterr().out)["figures"]

    before = figures()
    assert before["stage_costs"] == "assumed" and not Path(before["stage_costs_file"]).exists()
    assert before["stage_sizes"] == ("files" if prepacked.available() else "files, no packed copies here")
    assert main(ask) == 0
    printed = capsys.readouterr().out
    assert "figures: estimates" in printed and before["stage_costs_file"] in printed
    Pipeline(staged, threads=1, memory_budget=budget).target.window.close()  # a first run: measures, caches
    after = figures()
    assert after["stage_costs"] == "measured" and Path(after["stage_costs_file"]).is_file()
    assert after["stage_costs_file"] == before["stage_costs_file"]
    assert after["stage_sizes"] == ("measured" if prepacked.available() else before["stage_sizes"])
    assert main(ask) == 0
    assert "figures: measured here" in capsys.readouterr().out or not prepacked.available()
