"""Feature-reading drafts (EAGLE-style): the target returns its final hidden states, the draft reads them."""
import json

import numpy as np
import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig

PROMPTS = ["def add(a, b):", "The quick brown fox", "{\"name\": \"edge"]


def write_feature_draft(folder, hidden=64, seed=5):
    """A random tiny draft that reads the target's features: a Hugging Face folder plus distill's description."""
    from edgespec.exporters.drafts import DRAFT_INFO
    from safetensors.numpy import save_file
    from tiny import make_model

    make_model(folder, "llama", seed=seed, layers=1, hidden=hidden)
    rng = np.random.default_rng(seed)
    save_file({"weight": rng.normal(0, 0.3, (hidden, 2 * hidden)).astype(np.float32),
               "bias": rng.normal(0, 0.1, hidden).astype(np.float32)}, str(folder / "features.safetensors"))
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    (folder / DRAFT_INFO).write_text(json.dumps({"head_tokens": list(range(0, vocab, 2)),
                                                 "features": {"file": "features.safetensors"}}))
    return folder


@pytest.fixture(scope="module")
def feature_bundles(models, tmp_path_factory):
    from edgespec.exporters.export import ExportConfig, export

    root = tmp_path_factory.mktemp("features")
    draft = write_feature_draft(root / "draft")
    made = {}
    for tree in ("chain:3", "topk:2x3", "dynamic:6"):
        made[tree] = export(ExportConfig(model=str(models["target"]), draft=str(draft), out=root / tree.replace(":", "-"),
                                         tree=tree, context=256, cache_dir=root / "cache"))
    return made


def test_the_manifest_wires_target_features_into_the_draft(feature_bundles):
    from edgespec.runtime.contract.manifest import open_bundle

    manifest = open_bundle(feature_bundles["chain:3"])
    assert manifest.target.graph.outputs["features_out"]["shape"][-1] == manifest.target.facts.hidden_size
    assert "features" in manifest.draft.graph.inputs and "features_out" in manifest.draft.graph.outputs
    assert manifest.target.feature_size == manifest.target.facts.hidden_size


def test_target_features_are_the_torch_models_final_hidden_states(feature_bundles, models):
    import torch
    from edgespec.runtime.pipeline import Pipeline
    from transformers import AutoModelForCausalLM

    pipeline = Pipeline(feature_bundles["chain:3"], threads=1)
    ids = pipeline.encode("The quick brown fox jumps")
    session = pipeline.new_session()
    from edgespec.runtime.execution.model import prefill

    prefill(pipeline.target, session.cache, ids, chunk=4)
    model = AutoModelForCausalLM.from_pretrained(models["target"]).float().eval()
    with torch.no_grad():
        expected = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    assert np.abs(session.cache.feature_rows() - expected).max() <= 1e-4


@pytest.mark.parametrize("tree", ["chain:3", "topk:2x3", "dynamic:6"])
def test_feature_drafts_are_lossless(feature_bundles, tree):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(feature_bundles[tree], threads=1)
    greedy = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    sampled = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=3))
    for prompt in PROMPTS:
        plain = pipeline.generate(prompt, config=greedy, speculate=False)
        spec = pipeline.generate(prompt, config=greedy, speculate=True)
        assert spec.token_ids == plain.token_ids
        assert len(pipeline.generate(prompt, config=sampled).token_ids) == 24  # runs: distribution tests elsewhere


def test_the_draft_pairs_each_token_with_the_targets_previous_feature(feature_bundles):
    """Recomputes a chain proposal by hand: the draft's row i reads the target's feature at i - 1, and a
    drafted token reads the draft's own output feature at its parent."""
    from edgespec.runtime.execution.kvcache import KVCache
    from edgespec.runtime.execution.model import commit
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(feature_bundles["chain:3"], threads=1)
    session = pipeline.new_session(False)
    pipeline.generate("def add(a, b):", config=GenerationConfig(max_new_tokens=5, stop_at_eos=False),
                      speculate=False, session=session)
    committed, target_features = session.window, session.cache.feature_rows()
    assert len(target_features) == len(committed) - 1
    tree = pipeline.make_drafter(True).propose(committed, 8, None, target_features)

    runner, facts = pipeline.draft, pipeline.manifest.draft.facts
    cache = KVCache(facts, 256, facts.hidden_size)
    n = len(committed)
    shifted = np.concatenate([np.zeros((1, facts.hidden_size), np.float32), target_features])
    out = runner.forward(cache, committed, range(n), np.tril(np.ones((n, n), bool)), [n - 1], features=shifted)
    commit(cache, out, range(n))
    expected, feature = [int(out.logits[0].argmax())], out.features[-1:]
    for depth in range(1, 3):
        out = runner.forward(cache, expected[-1:], [n - 1 + depth], np.ones((1, 1), bool), [0], features=feature)
        commit(cache, out, [0])
        expected.append(int(out.logits[0].argmax()))
        feature = out.features
    assert [int(t) for t in tree.tokens[1:]] == expected
    # and the features matter: without them the draft proposes something else somewhere
    zeros = KVCache(facts, 256, facts.hidden_size)
    blind = runner.forward(zeros, committed, range(n), np.tril(np.ones((n, n), bool)), range(n),
                           features=np.zeros((n, facts.hidden_size), np.float32))
    informed = runner.forward(KVCache(facts, 256, facts.hidden_size), committed, range(n),
                              np.tril(np.ones((n, n), bool)), range(n), features=shifted)
    assert not np.allclose(blind.logits[np.isfinite(blind.logits)], informed.logits[np.isfinite(informed.logits)])


def test_a_feature_draft_without_target_features_is_refused(feature_bundles):
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(feature_bundles["chain:3"], threads=1)
    with pytest.raises(ValueError, match="features"):
        pipeline.make_drafter(True).propose([3, 4, 5], 4, None, None)


def test_sliding_with_a_feature_draft_stays_lossless(feature_bundles):
    """(That the features move with their rows: tests/test_sliding.py.)"""
    from edgespec.runtime.pipeline import Pipeline

    pipeline = Pipeline(feature_bundles["chain:3"], threads=1, memory_budget=None)
    config = GenerationConfig(max_new_tokens=300, stop_at_eos=False, kv_policy="sliding")
    plain = pipeline.generate("The quick brown fox", config=config, speculate=False)
    spec = pipeline.generate("The quick brown fox", config=config, speculate=True)
    assert spec.token_ids == plain.token_ids


def test_a_feature_draft_for_another_width_is_refused(models, tmp_path):
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.runtime.contract.errors import ExportError

    draft = write_feature_draft(tmp_path / "wide", hidden=32)
    with pytest.raises(ExportError, match="hidden size"):
        export(ExportConfig(model=str(models["target"]), draft=str(draft), out=tmp_path / "b", context=256))
    assert not (tmp_path / "b").exists()


def test_quality_report_measures_a_feature_draft_with_a_trimmed_head(models, tmp_path):
    from edgespec.exporters.export import ExportConfig, export

    draft = write_feature_draft(tmp_path / "draft")
    bundle = export(ExportConfig(model=str(models["target"]), draft=str(draft), out=tmp_path / "b", context=256,
                                 quant="int8"))
    report = json.loads((bundle / "quality.json").read_text())
    agreement = report["draft_agreement"]
    # measured with the target's features fed to the draft, for the fp32 and the int8 pair
    assert 0.0 <= agreement["quantized"] <= 1.0 and 0.0 <= agreement["fp32"] <= 1.0
    assert abs(agreement["fp32"] - agreement["quantized"]) <= 0.25


def test_a_feature_draft_pass_can_be_timed(feature_bundles):
    """`benchmarks/measure/verify_cost.py` times the draft alone, with no target to give it features."""
    from edgespec.runtime.pipeline import Pipeline

    from edgespec.tune import pass_seconds

    pipeline = Pipeline(feature_bundles["chain:3"], threads=1)
    assert pipeline.draft.reads_features
    seconds = pass_seconds(pipeline.draft, pipeline.manifest.prefill_chunk, (1, 3), past=5, repeats=2)
    assert set(seconds) == {1, 3} and all(s > 0 for s in seconds.values())


def test_graph_ab_compares_graphs_in_processes_of_every_load_order(feature_bundles, tmp_path):
    """`benchmarks/measure/graph_ab.py` on two copies of one graph: a line per graph, the first the baseline."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    bundle = feature_bundles["chain:3"]
    copy = tmp_path / "copy"
    shutil.copytree(bundle, copy)
    script = Path(__file__).parent.parent / "benchmarks" / "measure" / "graph_ab.py"
    done = subprocess.run([sys.executable, str(script), str(bundle), str(bundle / "target.onnx"),
                           str(copy / "target.onnx"), "--past", "6", "--rounds", "1", "--steps", "2", "--threads", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "2 processes" in lines[0] and len(lines) == 3
    assert lines[1].startswith("0:target.onnx") and "x1.000" in lines[1] and lines[2].startswith("1:target.onnx")
    missing = subprocess.run([sys.executable, str(script), str(bundle), str(tmp_path / "none.onnx")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "no graph at" in missing.stderr
