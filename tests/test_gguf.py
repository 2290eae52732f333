"""GGUF files as llama.cpp's converter writes them: what transformers' loader drops is read back."""
import numpy as np
import pytest
import torch
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.sessions import make_session
from gguf_files import write_gguf
from tiny import FAMILY_CONFIGS, make_model

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


MATMULS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
           "ffn_up.weight", "ffn_down.weight", "token_embd.weight")


def _quantized_gguf(tmp_path, types: dict):
    import gguf

    model = make_model(tmp_path / "hf", "llama", seed=4, hidden=256, layers=1, random_norms=True)
    (tmp_path / "gguf").mkdir()
    quant = {suffix: getattr(gguf.GGMLQuantizationType, kind) for suffix, kind in types.items()}
    return write_gguf(model, tmp_path / "hf", tmp_path / "gguf" / "m.gguf", quant=quant)


def _export_and_compare(path, out, **options):
    """The export's logits against transformers' own reading of the GGUF, and the manifest's schemes."""
    from transformers import AutoModelForCausalLM

    export(ExportConfig(model=str(path), draft="ngram", out=out, context=256, cache_dir=out.parent / "cache",
                        gguf_blocks=True, **options))
    manifest = open_bundle(out)
    source = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    runner = ModelRunner(make_session(out / manifest.target.graph.file, ("CPUExecutionProvider",), 1),
                         manifest.target.facts)
    ids = [int(t) for t in np.random.default_rng(1).integers(3, manifest.target.facts.vocab_size, 40)]
    got = runner.forward(KVCache(manifest.target.facts, 256), ids, range(40), np.tril(np.ones((40, 40), bool)),
                         range(40)).logits
    with torch.no_grad():
        expected = source(torch.tensor([ids])).logits[0].numpy()
    return np.abs(got - expected).max() / np.abs(expected).max(), manifest.target.graph.quantization["tensors"]


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_each_block_type_keeps_its_grid(kind, tmp_path):
    path = _quantized_gguf(tmp_path, {suffix: kind for suffix in MATMULS})
    # fp32 activations (accuracy level 1): the sums run in another order than transformers', and an offset
    # type adds its blocks' offsets as a product of its own (x's block sums), which cancels against the rest
    error, tensors = _export_and_compare(path, tmp_path / "b", quant="int8", accuracy_level=1)
    assert error < 1e-4
    assert {tensors[f"layers.0.{w}"] for w in ("qkv", "o", "gate_up", "down")} == {f"gguf {kind}"}
    assert tensors["lm_head"] == f"gguf {kind}"  # the tied head reads the embedding's blocks


def test_a_q4_k_m_style_file_keeps_its_mix_within_half_a_percent_of_its_perplexity(tmp_path):
    import json

    types = {"attn_q.weight": "Q4_K", "attn_k.weight": "Q4_K", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_K",
             "ffn_gate.weight": "Q4_K", "ffn_up.weight": "Q4_K", "ffn_down.weight": "Q6_K", "token_embd.weight": "Q6_K"}
    path = _quantized_gguf(tmp_path, types)
    _, tensors = _export_and_compare(path, tmp_path / "b", quant="int8")
    assert tensors["layers.0.qkv"] == "gguf Q4_K+Q6_K" and tensors["layers.0.down"] == "gguf Q6_K"
    assert tensors["layers.0.gate_up"] == "gguf Q4_K" and tensors["lm_head"] == "gguf Q6_K"
    quality = json.loads((tmp_path / "b" / "quality.json").read_text())
    assert abs(quality["perplexity"]["increase_percent"]) < 0.5  # against the GGUF's own fp32 dequantization


def test_a_block_type_that_cannot_be_kept_is_named(tmp_path, capsys):
    types = {suffix: "Q4_K" for suffix in MATMULS} | {"ffn_up.weight": "Q2_K"}
    path = _quantized_gguf(tmp_path, types)
    _, tensors = _export_and_compare(path, tmp_path / "b", quant="int8")
    assert tensors["layers.0.gate_up"] == "int8" and tensors["layers.0.qkv"] == "gguf Q4_K"
    said = capsys.readouterr().err
    assert "not kept, quantized as --quant int8 instead: embed_tokens (Q4_K); layers.0.gate_up (Q2_K)" in said


def test_gguf_blocks_needs_a_gguf(models, tmp_path):
    from edgespec.runtime.contract.errors import ExportError

    with pytest.raises(ExportError, match="--gguf-blocks keeps a GGUF file's blocks"):
        export(ExportConfig(model=str(models["target"]), draft="ngram", out=tmp_path / "b", quant="int4", context=256,
                            gguf_blocks=True, cache_dir=tmp_path / "cache"))
    assert not (tmp_path / "b").exists()


def test_the_cli_keeps_a_gguf_s_blocks(tmp_path):
    from edgespec.cli import main

    path = _quantized_gguf(tmp_path, {suffix: "Q4_K" for suffix in MATMULS})
    assert main(["export", str(path), "--draft", "ngram", "--quant", "int4", "--gguf-blocks", "--context", "256",
                 "--out", str(tmp_path / "b")]) in (0, None)
    assert open_bundle(tmp_path / "b").target.graph.quantization["tensors"]["layers.0.qkv"] == "gguf Q4_K"


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_a_gguf_read_a_tensor_at_a_time_is_what_transformers_loads(model_type, tmp_path):
    """Each tensor decoded on its own (blocks and row order as transformers' loader) equals the whole load's
    float32 weights, quantized blocks and llama.cpp's permuted q/k rows included."""
    import gguf
    from edgespec.exporters.gguf_stream import GgufWeights
    from edgespec.exporters.sources import resolve_source

    model = make_model(tmp_path / "hf", model_type, seed=3, random_norms=True)
    (tmp_path / "gguf").mkdir()
    quant = {"attn_q.weight": gguf.GGMLQuantizationType.Q4_0, "ffn_down.weight": gguf.GGMLQuantizationType.Q8_0}
    path = write_gguf(model, tmp_path / "hf", tmp_path / "gguf" / "m.gguf", quant=quant)
    source = resolve_source(str(path), tmp_path)
    skeleton, _, weights = source.load_streamed()
    assert isinstance(weights, GgufWeights)
    loaded = source.load()[0].state_dict()
    for name in weights:
        np.testing.assert_array_equal(weights[name], loaded[name].float().numpy())
