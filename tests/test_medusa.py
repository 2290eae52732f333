"""Medusa heads as published (exporters/medusa.py, runtime/decoding/medusa.py): heads in FasterDecoding/Medusa's
layout, built here from a known config, export beside their tiny target, propose what a torch reference of
the heads proposes, and decode losslessly."""
import numpy as np
import pytest
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.drafting import DrafterKind
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
from heads import PROMPTS, lossless_accepted, medusa_reference, write_medusa_head
from tiny import CORPUS, FAMILY_CONFIGS, make_model



def _export(target, heads, out, **options):
    return export(ExportConfig(model=str(target), draft=str(heads), out=out, context=256,
                               cache_dir=out.parent / "cache", **options))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("medusa") / "target"
    return folder, make_model(folder, "llama", seed=3)


@pytest.fixture(scope="module")
def bundles(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa_bundles")
    heads = write_medusa_head(root / "heads", target[0], heads=3, blocks=1)
    return {tree: _export(target[0], heads, root / tree.replace(":", "-"), tree=tree)
            for tree in ("chain:3", "topk:2x3")}, heads


def test_the_heads_propose_what_the_reference_ranks(bundles, target):
    """Depth d of the tree holds head d - 1's top tokens at the target's last computed row, in rank order."""
    made, heads = bundles
    pipeline = Pipeline(made["topk:2x3"], threads=1)
    assert pipeline.manifest.drafter is DrafterKind.MEDUSA
    session = pipeline.new_session(False)
    pipeline.generate(PROMPTS[0], config=GenerationConfig(max_new_tokens=5, stop_at_eos=False), speculate=False,
                      session=session)
    committed, features = session.window, session.cache.feature_rows()
    ranked = medusa_reference(heads, target[1], committed[:-1])
    tree = pipeline.make_drafter(True).propose(committed, 16, None, features)
    topo = tree.topology
    for node in range(1, topo.size):
        depth = int(topo.depths[node])
        siblings = list(topo.children[topo.parents[node]])
        assert int(tree.tokens[node]) == ranked[depth - 1][siblings.index(node)]


@pytest.mark.parametrize("tree", ["chain:3", "topk:2x3"])
def test_medusa_heads_are_lossless(bundles, tree):
    pipeline = Pipeline(bundles[0][tree], threads=1)
    assert lossless_accepted(pipeline) > 0  # heads started from the target's own head guess some tokens right


def test_a_pt_file_and_an_int4_export(target, tmp_path):
    """medusa_lm_head.pt (the original releases) reads as the safetensors file does; int4 heads stay lossless."""
    heads = write_medusa_head(tmp_path / "heads", target[0], heads=2, blocks=2, file="medusa_lm_head.pt")
    pipeline = Pipeline(_export(target[0], heads, tmp_path / "b", tree="topk:2x2", quant="int4"), threads=1)
    assert pipeline.manifest.draft.graph.quantization["scheme"] == "int4"
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    for prompt in PROMPTS[:2]:
        assert (pipeline.generate(prompt, config=config, speculate=True).token_ids
                == pipeline.generate(prompt, config=config, speculate=False).token_ids)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_every_family_decodes_with_medusa_heads(model_type, tmp_path):
    make_model(tmp_path / "t", model_type, seed=7, random_norms=True, **FAMILY_CONFIGS[model_type])
    heads = write_medusa_head(tmp_path / "heads", tmp_path / "t", heads=2)
    pipeline = Pipeline(_export(tmp_path / "t", heads, tmp_path / "b", tree="topk:2x2"), threads=1)
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    for text in (CORPUS[1], CORPUS[2]):
        assert (pipeline.generate(text, config=config, speculate=True).token_ids
                == pipeline.generate(text, config=config, speculate=False).token_ids)


@pytest.mark.parametrize("malformed, options, message", [
    (dict(drop=("1.0.linear.bias",)), {}, "is missing 1.0.linear.bias"),
    (dict(reshape={"0.1.weight": (100, 64)}), {}, r"0.1.weight is \[100, 64\]"),
    (dict(reshape={"0.0.linear.weight": (32, 32)}), {}, "another target"),
    (dict(reshape={"7.1.weight": (10, 64)}), {}, "does not describe"),
    ({}, dict(tree="dynamic:6"), "drop dynamic"),
    ({}, dict(profile="ai-pc-intel"), "static-shape"),
])
def test_malformed_heads_are_refused_in_one_line_before_any_graph(target, tmp_path, monkeypatch, malformed, options,
                                                                   message):
    import edgespec.exporters.export as export_module

    def no_graph(*args, **kwargs):
        raise AssertionError("a graph was written before the heads were refused")

    monkeypatch.setattr(export_module, "write_model", no_graph)
    heads = write_medusa_head(tmp_path / "heads", target[0], **malformed)
    with pytest.raises(ExportError, match=message) as refused:
        _export(target[0], heads, tmp_path / "b", **options)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "b").exists()


def test_the_budget_counts_no_draft_cache_for_medusa(bundles):
    pipeline = Pipeline(bundles[0]["chain:3"], threads=1, memory_budget="2GB")
    assert pipeline.memory.draft_kv == 0
    assert np.isfinite(pipeline.memory.total)


def test_inspect_and_calibrate_know_medusa_heads(bundles, capsys):
    from edgespec.calibrate import placeable
    from edgespec.inspection import print_bundle
    from edgespec.runtime.contract.errors import InputError

    print_bundle(bundles[0]["chain:3"])
    shown = capsys.readouterr().out
    assert "medusa" in shown and "draft.onnx" in shown
    with pytest.raises(InputError, match="Medusa heads"):
        placeable(bundles[0]["chain:3"], None)
