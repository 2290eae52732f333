"""The exported graphs compute what the torch model computes (fp32, max abs logit difference <= 1e-4)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from edgespec.runtime.bundle import open_bundle
from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import ModelRunner, prefill
from edgespec.runtime.sessions import make_session
from edgespec.runtime.tree import parse_tree_spec

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
    runner, manifest = runner_for(bundle_factory(target=arch))
    model = AutoModelForCausalLM.from_pretrained(models[arch]).eval()
    rng = np.random.default_rng(1)
    vocab = manifest.target.facts.vocab_size
    past = list(rng.integers(3, vocab, 9))
    topo = parse_tree_spec("topk:2x2")
    tokens = rng.integers(3, vocab, topo.size)
    cache = KVCache(manifest.target.facts, 64)
    prefill(runner, cache, past, chunk=4)  # several chunks, so chunked prefill is covered too
    out = runner.forward(cache, tokens, len(past) + topo.depths, topo.ancestor_mask, range(topo.size))
    for node in range(topo.size):
        sequence = past + [int(tokens[i]) for i in topo.path_to(node)]
        expected = torch_logits(model, sequence)[-1]
        assert np.abs(out.logits[node] - expected).max() <= TOLERANCE, f"node {node}"
