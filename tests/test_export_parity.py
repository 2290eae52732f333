"""The exported graphs compute what the torch model computes (fp32, max abs logit difference <= 1e-4)."""
import numpy as np
import pytest
import torch
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import ModelRunner, prefill
from edgespec.runtime.execution.sessions import make_session
from transformers import AutoModelForCausalLM

TOLERANCE = 1e-4


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def runner_for(bundle):
    manifest = open_bundle(bundle)
    session = make_session(bundle / manifest.target.graph.file, ("CPUExecutionProvider",), threads=1)
    return ModelRunner(session, manifest.target.facts), manifest


@pytest.mark.parametrize("arch", ["target", "untied", "qwen2", "mistral"])
def test_prefill_logits_match_torch(arch, models, bundle_factory):
    runner, manifest = runner_for(bundle_factory(target=arch))
    model = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    ids = list(np.random.default_rng(0).integers(3, manifest.target.facts.vocab_size, 13))
    cache = KVCache(manifest.target.facts, 64)
    n = len(ids)
    out = runner.forward(cache, ids, range(n), np.tril(np.ones((n, n), bool)), range(n))
    assert np.abs(out.logits - torch_logits(model, ids)).max() <= TOLERANCE


@pytest.mark.parametrize("arch", ["target", "untied", "qwen2", "mistral"])
def test_branching_tree_logits_match_torch_on_every_path(arch, models, bundle_factory):
    runner, manifest = runner_for(bundle_factory(target=arch, tree="topk:2x2"))  # a lane per path: 4
    model = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    rng = np.random.default_rng(1)
    vocab = manifest.target.facts.vocab_size
    past = list(rng.integers(3, vocab, 9))
    topo = parse_tree_spec("topk:2x2")
    tokens = rng.integers(3, vocab, topo.size)
    cache = KVCache(manifest.target.facts, 64, lanes=runner.lanes)
    prefill(runner, cache, past, chunk=4)  # several chunks, so chunked prefill is covered too
    out = runner.forward(cache, tokens, len(past) + topo.depths, topo.ancestor_mask, range(topo.size))
    for node in range(topo.size):
        sequence = past + [int(tokens[i]) for i in topo.path_to(node)]
        expected = torch_logits(model, sequence)[-1]
        assert np.abs(out.logits[node] - expected).max() <= TOLERANCE, f"node {node}"


def test_static_node_count_graph_matches_the_dynamic_one(models, tmp_path):
    """Static-shape profiles get graphs with a fixed N; they compute the same bits as the dynamic graph."""
    import onnx
    from edgespec.exporters.architectures import builder_for
    from edgespec.exporters.weights import externalize
    from edgespec.runtime.contract.facts import ModelFacts

    model = AutoModelForCausalLM.from_pretrained(models["target"]).eval()
    builder = builder_for(model, 64)
    outputs = []
    for nodes in ("nodes", 5):
        graph = builder.build("g", nodes)
        model = graph.to_model()
        externalize(model, tmp_path / f"w{nodes}.bin")
        onnx.save_model(model, tmp_path / f"g{nodes}.onnx")
        runner = ModelRunner(make_session(tmp_path / f"g{nodes}.onnx", ("CPUExecutionProvider",), 1),
                             ModelFacts.from_dict(builder.facts.to_dict()))
        ids = [5, 9, 11, 13, 17]
        out = runner.forward(KVCache(runner.facts, 16), ids, range(5), np.tril(np.ones((5, 5), bool)), range(5))
        outputs.append(out.logits)
    assert np.array_equal(outputs[0], outputs[1])
