"""GGUF files as llama.cpp's converter writes them: what transformers' loader drops is read back."""
import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from tiny import FAMILY_CONFIGS, make_model

from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.bundle import open_bundle
from edgespec.runtime.kvcache import KVCache
from edgespec.runtime.model import ModelRunner
from edgespec.runtime.sessions import make_session

TOLERANCE = 1e-4


def _logits_of_export(gguf_path, out, ids):
    export(ExportConfig(model=str(gguf_path), draft="ngram", out=out, context=256, cache_dir=out.parent / "cache"))
    manifest = open_bundle(out)
    runner = ModelRunner(make_session(out / manifest.target.graph.file, ("CPUExecutionProvider",), 1),
                         manifest.target.facts)
    n = len(ids)
    return runner.forward(KVCache(manifest.target.facts, 256), ids, range(n), np.tril(np.ones((n, n), bool)),
                          range(n)).logits


@pytest.mark.parametrize("model_type,extra", [
    ("llama", FAMILY_CONFIGS["llama"]),  # llama3 rope: llama.cpp stores it as the rope_freqs tensor
    ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}),  # heads wider than hidden / heads
])
def test_a_gguf_exports_the_model_it_was_converted_from(model_type, extra, tmp_path):
    model = make_model(tmp_path / "hf", model_type, seed=3, random_norms=True, **extra)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(model, tmp_path / "hf", tmp_path / "gguf" / "m.gguf")
    ids = [int(t) for t in np.random.default_rng(0).integers(3, model.config.vocab_size, 120)]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(_logits_of_export(path, tmp_path / "b", ids) - expected).max() <= TOLERANCE


def test_transformers_alone_would_load_the_llama3_gguf_wrongly(tmp_path):
    """The case the fix is for: without rope_freqs the model is another one (so the test above can fail)."""
    from transformers import AutoModelForCausalLM

    model = make_model(tmp_path / "hf", "llama", seed=3, **FAMILY_CONFIGS["llama"])
    (tmp_path / "gguf").mkdir()
    write_gguf(model, tmp_path / "hf", tmp_path / "gguf" / "m.gguf")
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "gguf"), gguf_file="m.gguf", dtype=torch.float32)
    ids = torch.tensor([list(range(3, 100))])
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max() > 1.0
