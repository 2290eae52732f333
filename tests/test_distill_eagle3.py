"""`edgespec distill --design eagle3` on a tiny random target: the head it writes is the published EAGLE-3 layout
(exporters/eagle3.py reads it), it computes in training what the exported graph computes, and it drafts losslessly."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from edgespec.distill.data import DataConfig, shard_paths
from edgespec.distill.run import DistillConfig, distill
from edgespec.distill.train import TrainConfig
from edgespec.exporters.eagle3 import default_taps
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.errors import ExportError, InputError
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline
from heads import PROMPTS, eagle3_reference, lossless_accepted
from tiny import make_model

SMALL_DATA = DataConfig(batch=8, max_new_tokens=24, max_prompt_tokens=48, top_k=4, prompts_per_shard=8)
LAYERS = 6  # taps (2, 3, 3): inputs of layers 2 and 3 (SpecForge ids 1, 2, 2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("eagle3_distill") / "target"
    return folder, make_model(folder, "llama", seed=5, layers=LAYERS)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    """A run of fixed steps (no held-out pick: which step a timed run keeps hangs on the machine's load), trained
    for two drafting steps so the head's reading of its own output is trained too."""
    out = tmp_path_factory.mktemp("eagle3_run") / "head"
    corpus = out.parent / "corpus.py"
    corpus.write_text("def add(a, b):\n    return a + b\n" * 40)
    training = TrainConfig(head_size=96, window=32, batch=4, checkpoint_s=1.0, eval_s=1e9, min_steps=150,
                           max_steps=150, drafting_steps=2)
    config = DistillConfig(target=str(target[0]), out=out, minutes=0.3, corpus=(str(corpus),), seed=0, prompts=48,
                           design="eagle3", data=SMALL_DATA, training=training, data_quant="fp32")
    distill(config)
    return config


def test_the_head_is_the_published_layout(head, target):
    from safetensors.torch import load_file

    config = json.loads((head.out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [t - 1 for t in default_taps(LAYERS)]
    assert config["draft_vocab_size"] == 96
    tensors = load_file(head.out / "model.safetensors")
    hidden = target[1].config.hidden_size
    assert tensors["fc.weight"].shape == (hidden, 3 * hidden)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    assert "midlayer.hidden_norm.weight" in tensors and "embed_tokens.weight" not in tensors
    head_tokens = np.array(json.loads((head.out / "edgespec_draft.json").read_text())["head_tokens"])
    assert np.array_equal(np.arange(96) + tensors["d2t"].numpy(), head_tokens)
    assert np.array_equal(np.flatnonzero(tensors["t2d"].numpy()), head_tokens)
    # the frozen head is the target's rows of its tokens; training moved what it trains
    assert torch.equal(tensors["lm_head.weight"], target[1].lm_head.weight[torch.from_numpy(head_tokens)])
    assert not torch.equal(tensors["fc.weight"][:, 2 * hidden:], torch.eye(hidden))
    # its feature files hold the three streams, not the final hidden state
    feature = np.load(next((head.out / "data" / "features" / "chat").glob("*.npy")))
    assert feature.shape[1] == 3 * hidden


def test_the_features_are_the_targets_streams_entering_the_tapped_layers(head, target):
    """The engine's graph (fp32 here) returns transformers' hidden_states[l] for the taps, concatenated."""
    from edgespec.distill.data import load_shard

    shard = shard_paths(head.out / "data" / "chat")[0]
    tokens = load_shard(shard)["tokens"]
    stored = np.load(head.out / "data" / "features" / "chat" / f"{shard.stem}.npy").astype(np.float32)
    starts = load_shard(shard)["starts"]
    ids = torch.from_numpy(tokens[starts[0]:starts[1]].astype(np.int64))[None]
    with torch.no_grad():
        out = target[1](ids, output_hidden_states=True)
    expected = torch.cat([out.hidden_states[l][0] for l in default_taps(LAYERS)], dim=-1).numpy()
    got = stored[starts[0]:starts[1]]
    assert np.abs(got - expected).max() <= 1e-2 * np.abs(expected).max()  # stored in float16


def test_export_loads_the_head_computes_what_training_computes_and_stays_lossless(head, target, tmp_path):
    bundle = export(ExportConfig(model=str(head.target), draft=str(head.out), out=tmp_path / "b", tree="topk:2x3",
                                 context=256, cache_dir=tmp_path / "cache"))
    pipeline = Pipeline(bundle, threads=1)
    assert pipeline.manifest.draft.graph.inputs["features"] is not None and len(pipeline.draft.head_tokens) == 96
    # the chain the bundle drafts is the one the published head's torch reference drafts
    session = pipeline.new_session(False)
    pipeline.generate(PROMPTS[0], config=GenerationConfig(max_new_tokens=6, stop_at_eos=False), speculate=False,
                      session=session)
    _, chain = eagle3_reference(head.out, target[1], session.window, taps=default_taps(LAYERS), steps=3)
    chain_pipeline = Pipeline(export(ExportConfig(model=str(head.target), draft=str(head.out), out=tmp_path / "c",
                                                  tree="chain:3", context=256, cache_dir=tmp_path / "cache")),
                              threads=1)
    tree = chain_pipeline.make_drafter(True).propose(session.window, 8, None, session.cache.feature_rows())
    assert [int(t) for t in tree.tokens[1:]] == chain
    # and the draft graph's logits at every row are what the trained torch module computes
    logits = _trained_module_logits(head, target[1], session.window)
    from edgespec.runtime.execution.features import draft_inputs
    from edgespec.runtime.execution.kvcache import KVCache

    facts, n, committed = pipeline.manifest.draft.facts, len(session.window), session.window
    out = pipeline.draft.forward(KVCache(facts, 256, facts.hidden_size), committed, range(n),
                                 np.tril(np.ones((n, n), bool)), range(n),
                                 features=draft_inputs(session.cache.feature_rows(), 0, n))
    head_tokens = pipeline.draft.head_tokens
    assert np.abs(out.logits[:, head_tokens] - logits).max() <= 1e-3
    assert lossless_accepted(pipeline) > 0  # the trained head's proposals were used


def test_a_packed_head_rebuilds_the_same_head(head, target, tmp_path):
    from edgespec.distill.pack import pack_draft, unpack_draft
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    packed = pack_draft(head.out, tmp_path / "packed", {"command": "test"})
    rebuilt = unpack_draft(packed, target[1], AutoTokenizer.from_pretrained(target[0]), tmp_path / "rebuilt")
    before, after = load_file(head.out / "model.safetensors"), load_file(rebuilt / "model.safetensors")
    assert set(before) == set(after)
    assert torch.equal(before["d2t"], after["d2t"]) and torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert (before["fc.weight"] - after["fc.weight"]).abs().max() < 1e-2  # float16 in the packed form


def test_a_head_for_another_target_is_refused_in_one_line(head, tmp_path):
    other = tmp_path / "other"
    make_model(other, "llama", seed=9, layers=LAYERS, hidden=32)
    with pytest.raises(ExportError, match="hidden_size 64 and the target 32") as refused:
        export(ExportConfig(model=str(other), draft=str(head.out), out=tmp_path / "b", cache_dir=tmp_path / "cache"))
    assert "\n" not in str(refused.value) and not (tmp_path / "b").exists()


def test_a_target_too_shallow_for_three_taps_is_refused_before_any_data(tmp_path):
    shallow = tmp_path / "shallow"
    make_model(shallow, "llama", seed=1, layers=2)
    out = tmp_path / "run"
    with pytest.raises(InputError, match="too few") as refused:
        distill(DistillConfig(target=str(shallow), out=out, minutes=0.1, design="eagle3", data=SMALL_DATA))
    assert "\n" not in str(refused.value) and not (out / "data").exists()


def test_an_eagle_run_s_features_are_not_reused_by_an_eagle3_run(head, tmp_path):
    from edgespec.distill.run import features_made_alike

    assert features_made_alike(replace(head, out=tmp_path / "again", data_from=head.out / "data")) is not None
    assert features_made_alike(replace(head, out=tmp_path / "eagle", design="eagle",
                                       data_from=head.out / "data")) is None


def _trained_module_logits(head, target, ids) -> np.ndarray:
    """The head as training computes it (distill/eagle3_head.py), loaded from what distill wrote: logits over its
    head tokens [len(ids), head tokens], row i reading the target's streams at i - 1 (zeros at row 0)."""
    from edgespec.distill.draft_model import build_draft, draft_hidden, head_rows
    from edgespec.distill.train import read_draft

    draft, _ = build_draft(target, "eagle3")
    head_tokens = torch.from_numpy(read_draft(draft, head.out, "eagle3"))
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
        streams = torch.cat([out.hidden_states[l] for l in default_taps(LAYERS)], dim=-1)
        features = torch.nn.functional.pad(streams[:, :-1], (0, 0, 1, 0))
        hidden = draft_hidden(draft.eval(), ids, torch.ones_like(ids), features)
        return (hidden[0] @ head_rows(draft, head_tokens).T).numpy()


def test_the_torch_engine_gives_the_same_streams(target):
    """`--data-engine torch` (a GPU's path): TorchTarget returns the tapped streams, each row alone or padded."""
    from edgespec.distill.data import TorchTarget
    from edgespec.distill.eagle3_head import target_taps

    engine = TorchTarget(target[1], taps=target_taps(target[1].config))
    rows = [np.array([5, 9, 17, 33, 2]), np.array([8, 3])]
    got = engine.features(rows)
    for row, features in zip(rows, got):
        with torch.no_grad():
            out = target[1](torch.from_numpy(row.astype(np.int64))[None], output_hidden_states=True)
        expected = torch.cat([out.hidden_states[l][0] for l in default_taps(LAYERS)], dim=-1).numpy()
        assert features.shape == (len(row), 3 * target[1].config.hidden_size)
        assert np.abs(features - expected).max() <= 1e-4
