"""Tiny GGUF files written from tiny Hugging Face models with the `gguf` package, the way llama.cpp's
converter lays them out (its tensor names, q/k rows permuted for the rotary halves, llama3 rope as a
`rope_freqs` tensor): no network, no llama.cpp."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """HF's q/k rows -> llama.cpp's (interleaved rotary pairs), as its converter does."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter stores as `rope_freqs` for a llama3 rope."""
    base = rope["rope_theta"]
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(model, folder: Path, path: Path, quant: dict | None = None, seed: int = 0) -> Path:
    """`model`: a transformers Llama or Qwen3 model (fp32) saved with its tokenizer in `folder`. `quant`:
    GGUF tensor name suffix -> GGMLQuantizationType for the 2-D weights (default F32)."""
    import gguf

    cfg = model.config
    arch = cfg.model_type
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    special = {a["id"] for a in tok.get("added_tokens", [])}

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    if arch == "qwen3":
        names.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        tensors["output.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            weight = state[f"model.layers.{i}.{hf}.weight"]
            if arch != "llama":  # llama.cpp permutes q/k rows for Llama's rotary layout only
                pass
            elif gg == "attn_q":
                weight = _permute(weight, cfg.num_attention_heads)
            elif gg == "attn_k":
                weight = _permute(weight, cfg.num_key_value_heads)
            tensors[f"blk.{i}.{gg}.weight"] = weight
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(rope, cfg.head_dim)
    for name, value in tensors.items():
        qtype = next((t for suffix, t in (quant or {}).items() if name.endswith(suffix)), None) if value.ndim == 2 else None
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        else:
            w.add_tensor(name, quantized(value, qtype, seed), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# k-quant blocks: the byte offsets of their fp16 super-block scales, and a scale that keeps weights near 0.3
K_QUANT_SCALES = {"Q2_K": ((80, 1e-3), (82, 1e-3)), "Q4_K": ((0, 3e-4), (2, 3e-4)), "Q5_K": ((0, 1.5e-4), (2, 1.5e-4)), "Q6_K": ((208, 7e-5),)}


def quantized(value: np.ndarray, qtype, seed: int) -> np.ndarray:
    """`value` [N, K] in GGUF block type `qtype`: gguf's own quantizer where it has one; random blocks for the
    k-quants it cannot make (the tests compare with what transformers reads back, not with `value`)."""
    import gguf

    if qtype.name not in K_QUANT_SCALES:
        return gguf.quants.quantize(value, qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed + value.size)
    raw = rng.integers(0, 256, (value.shape[0] * value.shape[1] // block, size), dtype=np.uint8)
    for offset, scale in K_QUANT_SCALES[qtype.name]:
        raw[:, offset:offset + 2] = rng.uniform(0.5, 1.5, len(raw)).astype(np.float16).__mul__(scale).astype(
            np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(value.shape[0], -1)
