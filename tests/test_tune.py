import json

import pytest
from edgespec.runtime.contract.manifest import open_bundle, read_manifest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.cli import main
from edgespec.tune import AcceptanceCounter, probe_topology, tune


def test_probe_is_a_spine_of_top_candidates_with_siblings():
    probe = probe_topology(width=3, depth=2)
    assert probe.parents == (-1, 0, 0, 0, 1, 1, 1)


def test_self_draft_is_accepted_at_rank_zero_at_every_depth(bundle_factory):
    """With the target as its own draft, the top candidate is always the target's choice, so every
    step walks the whole spine."""
    pipeline = Pipeline(bundle_factory(draft="target", tree="topk:2x2"))
    pipeline = pipeline.with_drafting(probe_topology(width=2, depth=3), pipeline.lookup)
    counter = AcceptanceCounter(pipeline.make_drafter(True), ranks=2, depths=3)
    result = pipeline.generate("def add(a, b):", config=GenerationConfig(max_new_tokens=30, stop_at_eos=False),
                               session=pipeline.new_session(drafter=counter))
    steps = result.stats.target_passes  # decoding passes (the prefill is not one)
    assert counter.opportunities.tolist() == [steps] * 3
    assert (counter.hits[:, 0] == steps).all() and counter.hits[:, 1].sum() == 0


def test_a_draft_that_never_agrees_is_measured_at_depth_one_only(bundle_factory):
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:2"))
    pipeline = pipeline.with_drafting(probe_topology(), pipeline.lookup)
    counter = AcceptanceCounter(pipeline.make_drafter(True))
    pipeline.generate("one two three four", config=GenerationConfig(max_new_tokens=12, stop_at_eos=False),
                      session=pipeline.new_session(drafter=counter))
    assert counter.opportunities[1:].sum() == counter.hits[1:].sum() == 0
    assert counter.acceptance.shape == (1, 4)


def test_tune_chooses_measures_and_writes_the_tree(bundle_factory, tmp_path, capsys):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="ngram", tree="chain:2"), bundle)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c d e f a b c d e f a b c"}\n{"prompt": "The quick brown fox"}\n')
    assert main(["tune", str(bundle), "--prompts", str(prompts), "--max-nodes", "6", "--max-new-tokens", "24",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert {"tree", "predicted_tokens_per_s", "measured_tokens_per_s", "best_chain_tokens_per_s",
            "measured_speedup", "best_chain_speedup"} <= set(result)
    rates = result["acceptance_by_depth_and_rank"]
    assert len(rates) >= 1 and all(len(row) == 4 and all(0 <= a <= 1 for a in row) for row in rates)
    assert sorted(map(int, result["pass_ms"])) == list(range(1, 7))
    assert sorted(map(int, result["leaf_ms"])) == list(range(3, 7)) and min(result["leaf_ms"].values()) >= 0
    assert 1 <= result["tree"]["size"] <= 6 and result["predicted_tokens_per_pass"] >= 1
    assert open_bundle(bundle).tree.parents == tuple(result["tree"]["parents"])
    assert result["measured_tokens_per_pass"] >= 1


def test_dry_run_leaves_the_bundle_alone(bundle_factory, tmp_path):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(), bundle)
    before = (bundle / "manifest.json").read_text()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c a b c a b"}\n')
    tune(bundle, prompts, max_nodes=4, max_new_tokens=12, threads=1, write=False)
    assert (bundle / "manifest.json").read_text() == before


def test_export_with_an_automatic_tree(models, tmp_path):
    from edgespec.exporters.export import ExportConfig

    from edgespec.tune import export_tuned

    out = tmp_path / "auto"
    export_tuned(ExportConfig(model=str(models["target"]), draft="ngram", out=out, tree="auto", context=256,
                              cache_dir=tmp_path))
    tree = open_bundle(out).tree
    assert 1 <= tree.size <= 12
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


@pytest.mark.parametrize("extra,message", [({"profile": "ai-pc-intel", "draft": "draft"}, "static-shape graphs"),
                                           ({"context": 64}, "do not fit --context 64")])
def test_an_automatic_tree_that_cannot_be_tuned_is_refused_with_what_to_do(extra, message, models, tmp_path):
    from edgespec.exporters.export import ExportConfig, ExportError

    from edgespec.tune import export_tuned

    settings = {"draft": "ngram", "context": 256, **extra}
    settings["draft"] = str(models[settings["draft"]]) if settings["draft"] in models else settings["draft"]
    with pytest.raises(ExportError, match=message):
        export_tuned(ExportConfig(model=str(models["target"]), out=tmp_path / "auto", tree="auto", cache_dir=tmp_path,
                                  **settings))
    assert not (tmp_path / "auto").exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_dynamic_tree_bundle_is_refused_before_any_work(bundle_factory, capsys):
    bundle = bundle_factory(draft="draft", tree="dynamic:6")
    assert main(["tune", str(bundle), "--dry-run"]) != 0
    assert "dynamic tree" in capsys.readouterr().err


def test_tune_measures_each_lookup_length_beside_a_draft_model_and_writes_the_best(bundle_factory, tmp_path, capsys):
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="draft", tree="chain:1", lookup=3), bundle)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c d e f a b c d e f a b c"}\n')
    assert main(["tune", str(bundle), "--prompts", str(prompts), "--max-nodes", "4", "--max-new-tokens", "16",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    speedups = result["speedup_by_lookup"]
    # none, the standard lengths (10 tokens while quoting) and the bundle's own
    assert sorted(speedups) == ["0/10", "2/10", "3", "4/10", "none"]
    best = max(speedups, key=speedups.get)
    lookup = open_bundle(bundle).lookup
    written = "none" if lookup is None else f"{lookup.tokens}" + (f"/{lookup.quote_tokens}" if lookup.quote_tokens else "")
    assert written == best == result["lookup"]
    assert (result["lookup_tokens"], result["lookup_quote_tokens"]) == ((lookup.tokens, lookup.quote_tokens)
                                                                        if lookup else (0, 0))
    assert max(map(int, result["pass_ms"])) == 4 + 4  # a tree of 4 nodes with the longest lookup (quotes not costed)
    assert main(["tune", str(bundle), "--prompts", str(prompts), "--max-nodes", "4", "--max-new-tokens", "8",
                 "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "speedup over plain by lookup" in printed and "none: " in printed and "; chosen: " in printed


def test_write_tree_sets_or_removes_the_lookup(bundle_factory, tmp_path):
    import shutil

    from edgespec.runtime.contract.drafting import LookupConfig
    from edgespec.runtime.contract.topology import Topology

    from edgespec.tune import write_tree

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="draft", tree="chain:1", lookup=4), bundle)
    write_tree(bundle, Topology((-1, 0, 0)), read_manifest(bundle).lookup)
    assert open_bundle(bundle).lookup.tokens == 4 and open_bundle(bundle).tree.size == 3
    write_tree(bundle, Topology((-1, 0)), LookupConfig(tokens=2))
    assert open_bundle(bundle).lookup == LookupConfig(tokens=2)
    write_tree(bundle, Topology((-1, 0)), None)
    assert open_bundle(bundle).lookup is None


def test_tune_with_two_nodes_on_a_training_free_bundle(bundle_factory, tmp_path):
    """No star fits in two nodes: no leaf cost to measure, and nothing to fail on."""
    import shutil

    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(draft="ngram", tree="chain:1"), bundle)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c a b c a b"}\n')
    result = tune(bundle, prompts, max_nodes=2, max_new_tokens=8, threads=1, write=False)
    assert result["leaf_ms"] == {} and result["tree"]["size"] <= 2
