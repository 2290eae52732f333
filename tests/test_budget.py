"""Memory budgets: sizes, the plan's arithmetic, refusals, and caches sized from the plan."""
import json
import re

import pytest
from edgespec.runtime.contract.errors import BudgetError, ContextOverflowError
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution.budget import MIN_CONTEXT, parse_size, plan_memory


@pytest.mark.parametrize("text,expected", [("300MB", 300_000_000), ("1.5GiB", 3 * 2**29), ("2048", 2048),
                                           ("64 kib", 65536), (5, 5)])
def test_sizes_read_as_bytes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "300XB", "-5MB", "MB", "1e9"])
def test_unreadable_sizes_are_refused(text):
    with pytest.raises(BudgetError, match="memory budget"):
        parse_size(text)


def test_unconstrained_plan_holds_the_full_context(bundle_factory):
    folder = bundle_factory(draft="draft")
    manifest = open_bundle(folder)
    plan = plan_memory(manifest, folder, None)
    assert plan.context == manifest.target.facts.max_context
    assert plan.draft_weights > 0 and plan.draft_kv_per_token == manifest.draft.facts.kv_bytes_per_token()


def test_a_budget_gives_the_context_that_fits_and_every_part_fits_in_it(bundle_factory):
    folder = bundle_factory(draft="draft", context=512)
    manifest = open_bundle(folder)
    full = plan_memory(manifest, folder, None)
    fixed = full.total - full.target_kv - full.draft_kv
    per_token = full.target_kv_per_token + full.draft_kv_per_token
    budget = fixed + 300 * per_token + per_token // 2
    plan = plan_memory(manifest, folder, budget)
    assert plan.context == 300
    assert plan.total <= budget < plan.total + per_token


def test_a_budget_below_the_minimum_is_refused_with_the_minimum(bundle_factory):
    folder = bundle_factory(draft="draft", context=512)
    manifest = open_bundle(folder)
    full = plan_memory(manifest, folder, None)
    minimum = full.total - full.target_kv - full.draft_kv + MIN_CONTEXT * (full.target_kv_per_token +
                                                                          full.draft_kv_per_token)
    plan_memory(manifest, folder, minimum)  # exactly the minimum is enough
    with pytest.raises(BudgetError, match=r"below this bundle's minimum of [0-9.]+ MiB") as err:
        plan_memory(manifest, folder, minimum - 1)
    assert f"{minimum / 2**20:.1f} MiB" in str(err.value)


def test_pipeline_caches_hold_the_planned_context_and_say_so_when_full(bundle_factory):
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    folder = bundle_factory(draft="draft", context=512)
    full = plan_memory(open_bundle(folder), folder, None)
    budget = full.total - full.target_kv - full.draft_kv + MIN_CONTEXT * (full.target_kv_per_token +
                                                                         full.draft_kv_per_token)
    pipeline = Pipeline(folder, threads=1, memory_budget=budget)
    assert pipeline.context == MIN_CONTEXT
    assert pipeline.new_session().cache.capacity == MIN_CONTEXT
    with pytest.raises(ContextOverflowError, match=f"{MIN_CONTEXT} tokens"):
        pipeline.generate(prompt="The quick brown fox", config=GenerationConfig(max_new_tokens=400,
                                                                                stop_at_eos=False))


def test_plan_command_prints_the_split(bundle_factory, capsys):
    from edgespec.cli import main

    folder = bundle_factory(draft="draft")
    assert main(["plan", str(folder), "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    for part in ("target weights", "draft weights", "target KV", "draft KV", "scratch", "context that fits"):
        assert part in out
    assert main(["plan", str(folder), "--memory-budget", "1GiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["budget"] == 2**30
    assert main(["plan", str(folder), "--memory-budget", "1kB"]) == 2
    assert re.search(r"minimum of [0-9.]+ MiB", capsys.readouterr().err)


def test_the_largest_tree_counts_the_longest_lookup_chain(bundle_factory):
    from edgespec.runtime.execution.budget import largest_tree

    manifest = open_bundle(bundle_factory(draft="draft", tree="chain:1", lookup=4, lookup_quote=9))
    assert largest_tree(manifest) == (2 + 9, 2, 9 + 1)  # the chain's path and the lookup's, 9 deep below the root
