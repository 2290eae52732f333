"""EAGLE-3 heads as published (exporters/eagle3.py): a head in SpecForge's layout, built here from a known config
with random tensors, exports beside its tiny target, computes what the references compute, and decodes losslessly."""
import json

import numpy as np
import pytest
import torch
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline
from heads import eagle3_reference, write_eagle3_head
from tiny import CORPUS, FAMILY_CONFIGS, make_model

PROMPTS = ["def add(a, b):", "The quick brown fox", "{\"name\": \"edge"]


def _export(target, head, out, **options):
    return export(ExportConfig(model=str(target), draft=str(head), out=out, context=256,
                               cache_dir=out.parent / "cache", **options))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A four-layer target, so that the default taps (2, L // 2, L - 3) = (2, 2, 1) and given ones differ."""
    folder = tmp_path_factory.mktemp("eagle3") / "target"
    return folder, make_model(folder, "llama", seed=3, layers=4)


@pytest.fixture(scope="module")
def bundles(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_bundles")
    head = write_eagle3_head(root / "head", target[0], aux_ids=[0, 1, 2])
    return {tree: _export(target[0], head, root / tree.replace(":", "-"), tree=tree)
            for tree in ("chain:3", "topk:2x3", "dynamic:6")}, head


def test_the_head_computes_what_the_references_compute(bundles, target):
    """The draft's logits at every prefill row, and the chain it drafts (its 2nd+ steps reading its own
    pre-norm output), equal a torch reference of the published head over the target's layers 0, 1, 2 outputs."""
    made, head = bundles
    pipeline = Pipeline(made["chain:3"], threads=1)
    session = pipeline.new_session(False)
    pipeline.generate(PROMPTS[0], config=GenerationConfig(max_new_tokens=6, stop_at_eos=False), speculate=False,
                      session=session)
    committed, target_features = session.window, session.cache.feature_rows()
    logits, chain = eagle3_reference(head, target[1], committed, taps=(1, 2, 3), steps=3)
    tree = pipeline.make_drafter(True).propose(committed, 8, None, target_features)
    assert [int(t) for t in tree.tokens[1:]] == chain

    from edgespec.runtime.execution.features import draft_inputs
    from edgespec.runtime.execution.kvcache import KVCache

    facts, n = pipeline.manifest.draft.facts, len(committed)
    out = pipeline.draft.forward(KVCache(facts, 256, facts.hidden_size), committed, range(n),
                                 np.tril(np.ones((n, n), bool)), range(n), features=draft_inputs(target_features, 0, n))
    hot = np.isfinite(logits)
    assert (np.isfinite(out.logits) == hot).all()  # the head's vocabulary, placed by d2t
    assert np.abs(out.logits[hot] - logits[hot]).max() <= 1e-4


@pytest.mark.parametrize("tree", ["chain:3", "topk:2x3", "dynamic:6"])
def test_an_eagle3_head_is_lossless(bundles, tree):
    pipeline = Pipeline(bundles[0][tree], threads=1)
    greedy = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    sampled = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=3))
    for prompt in PROMPTS:
        plain = pipeline.generate(prompt, config=greedy, speculate=False)
        spec = pipeline.generate(prompt, config=greedy, speculate=True)
        assert spec.token_ids == plain.token_ids
        # sampling: the same seed gives the same draws plain or speculative only by chance; the rejection
        # sampler's distribution is tested in test_sampling_engine.py: here it must run over the trimmed head
        assert len(pipeline.generate(prompt, config=sampled).token_ids) == 24


def test_the_manifest_wires_the_taps_into_the_draft(bundles):
    from edgespec.runtime.contract.manifest import open_bundle

    manifest = open_bundle(bundles[0]["chain:3"])
    assert manifest.target.feature_size == manifest.target.facts.hidden_size
    assert "features" in manifest.draft.graph.inputs and "features_out" in manifest.draft.graph.outputs
    assert manifest.draft.facts.num_layers == 1 and manifest.draft.head_tokens is not None
    head = json.loads((bundles[0]["chain:3"] / manifest.draft.head_tokens).read_text())
    assert len(head) == 96


def test_the_default_taps_and_a_whole_vocabulary_head(target, tmp_path):
    """Without eagle_aux_hidden_state_layer_ids the head reads the inputs of layers (2, L // 2, L - 3); a head
    over the whole vocabulary has no d2t; `norm_before_residual` (vLLM) makes the normed feature the residual."""
    head = write_eagle3_head(tmp_path / "head", target[0], draft_vocab=None, norm_before_residual=True)
    bundle = _export(target[0], head, tmp_path / "b", tree="chain:3")
    pipeline = Pipeline(bundle, threads=1)
    assert pipeline.manifest.draft.head_tokens is None
    session = pipeline.new_session(False)
    pipeline.generate(PROMPTS[1], config=GenerationConfig(max_new_tokens=5, stop_at_eos=False), speculate=False,
                      session=session)
    _, chain = eagle3_reference(head, target[1], session.window, taps=(2, 2, 1), steps=3)
    tree = pipeline.make_drafter(True).propose(session.window, 8, None, session.cache.feature_rows())
    assert [int(t) for t in tree.tokens[1:]] == chain


def test_an_int4_head_on_a_static_profile_stays_lossless(target, tmp_path):
    """Quantized by the same policies (the target's taps and the draft alike), drafted on an NPU profile's
    static-shape graph."""
    import warnings

    head = write_eagle3_head(tmp_path / "head", target[0], aux_ids=[0, 1, 3])
    bundle = _export(target[0], head, tmp_path / "b", tree="chain:3", quant="int4", profile="ai-pc-intel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no NPU here
        pipeline = Pipeline(bundle, threads=1)
    assert pipeline.draft.static is not None
    assert pipeline.manifest.draft.graph.quantization["scheme"] == "int4"
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    for prompt in PROMPTS[:2]:
        assert (pipeline.generate(prompt, config=config, speculate=True).token_ids
                == pipeline.generate(prompt, config=config, speculate=False).token_ids)


FAMILY_TYPES = sorted(FAMILY_CONFIGS)


@pytest.mark.parametrize("model_type", FAMILY_TYPES)
def test_every_family_exports_and_decodes_with_an_eagle3_head(model_type, tmp_path):
    make_model(tmp_path / "t", model_type, seed=7, random_norms=True, **FAMILY_CONFIGS[model_type])
    head = write_eagle3_head(tmp_path / "head", tmp_path / "t", aux_ids=[0, 1, 1])
    pipeline = Pipeline(_export(tmp_path / "t", head, tmp_path / "b", tree="topk:2x2"), threads=1)
    config = GenerationConfig(max_new_tokens=20, stop_at_eos=False)
    for text in (CORPUS[1], CORPUS[2]):
        assert (pipeline.generate(text, config=config, speculate=True).token_ids
                == pipeline.generate(text, config=config, speculate=False).token_ids)


@pytest.mark.parametrize("malformed, message", [
    (dict(drop=("midlayer.hidden_norm.weight",)), "is missing midlayer.hidden_norm.weight"),
    (dict(drop=("d2t",)), "is missing d2t"),
    (dict(reshape={"fc.weight": (64, 128)}), r"fc.weight is \[64, 128\], expected \[64, 192\]"),
    (dict(reshape={"midlayer.self_attn.q_proj.weight": (64, 64)}), "q_proj.weight is"),
    (dict(hidden=32), "hidden_size 32 and the target 64"),
    (dict(config_extra={"num_hidden_layers": 2}), "has 2 decoder layers"),
    (dict(aux_ids=[0, 1, 9]), "reads target layers"),
    (dict(aux_ids=[0, 1]), "must list 3 layers"),
    (dict(config_extra={"architectures": ["Eagle3Speculator"]}), "Eagle3Speculator"),
    (dict(reshape={"midlayer.self_attn.q_proj.bias": (64,)}), "does not read"),
])
def test_a_malformed_head_is_refused_in_one_line_before_any_graph(target, tmp_path, monkeypatch, malformed, message):
    import edgespec.exporters.export as export_module

    def no_graph(*args, **kwargs):
        raise AssertionError("a graph was written before the head was refused")

    monkeypatch.setattr(export_module, "write_model", no_graph)
    head = write_eagle3_head(tmp_path / "head", target[0], **malformed)
    with pytest.raises(ExportError, match=message) as refused:
        _export(target[0], head, tmp_path / "b")
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "b").exists()


def test_reference_taps_match_the_hidden_states_transformers_returns(target):
    """exporters/reference.py's taps hook the residual stream entering each layer: HF's hidden_states[l]."""
    from edgespec.exporters.eagle3 import FeatureTaps
    from edgespec.exporters.reference import reference_rows

    model = target[1]
    fc = np.random.default_rng(0).normal(0, 0.1, (3 * 64, 64)).astype(np.float32)
    ids = [5, 9, 17, 33, 2, 8]
    rows = reference_rows(model, None, [ids], True, FeatureTaps((0, 2, 4), fc))[0]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        final = model.model.layers[-1](out.hidden_states[3], position_embeddings=model.model.rotary_emb(
            out.hidden_states[3], torch.arange(len(ids))[None]))
    final = final[0] if isinstance(final, tuple) else final
    expected = torch.cat([out.hidden_states[0][0], out.hidden_states[2][0], final[0]], dim=-1).numpy() @ fc
    assert np.abs(rows.features - expected).max() <= 1e-4
