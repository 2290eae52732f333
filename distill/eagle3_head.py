"""The eagle3 design: a head in the published EAGLE-3 layout (exporters/eagle3.py reads it; SGLang, vLLM and
SpecForge read it too), trained by the same distill machinery as edgespec's own designs.

What differs from the eagle design, and only where the published layout makes it differ:
    reads   three of the target's residual streams (the inputs of layers (2, L // 2, L - 3), named in the
            config as SpecForge names them), concatenated; `fc` [H, 3H] projects them, and is trained
    layer   one decoder layer whose attention reads [input_layernorm(embedding), hidden_norm(feature)]
            (q/k/v take 2H) with the feature as its residual; its output before the final norm is what
            its next drafting step reads (no fc: the target graph applies fc to committed rows)
    loss    tokens only, no regression onto the target's feature (EAGLE-3 drops it: its feature is not the
            target's, and later steps read the head's own output)
    head    its own `lm_head` over the head tokens, with `d2t` / `t2d`; frozen at the target's rows, as the
            other designs keep the target's head (the data is too small to improve it)
The midlayer starts as the target layer its last tap enters (q/k/v reading embedding and feature alike) and
fc as that tap alone, so the untrained head is the target's layer over [token, stream] rather than noise.
The embedding is the target's, never saved (the exporter gives the head the target's table).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from edgespec.exporters.architectures import family_for
from edgespec.exporters.eagle3 import ARCHITECTURE, TAPS, FeatureTaps, default_taps
from edgespec.runtime.contract.errors import InputError
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

MIN_LAYERS = 4  # the default taps (2, L // 2, L - 3) are three distinct layers from here on


def target_taps(target_config) -> FeatureTaps:
    """The residual streams the data engine returns for this design: concatenated, no fc (training learns it)."""
    layers = int(target_config.num_hidden_layers)
    if layers < MIN_LAYERS:
        raise InputError(f"the eagle3 design reads the target's layers {default_taps(layers)}: a target of "
                         f"{layers} layers has too few (at least {MIN_LAYERS}); choose --design eagle")
    return FeatureTaps(default_taps(layers), None)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, h, rope, bias, past=None):
        """h [B, T, 2H]; rope (cos, sin) [B, T, head_dim]; bias [B, 1, T, keys] additive; past: earlier
        (keys, values) [B, kv_heads, K, head_dim] the rows may see. Returns (out [B, T, H], (keys, values))."""
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope[0][:, None], rope[1][:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        repeat = self.heads // self.kv_heads
        out = nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(repeat, 1),
                                                         v.repeat_interleave(repeat, 1), attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inner: int, eps: float):
        super().__init__()
        self.input_layernorm, self.hidden_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim)
        self.mlp = MLP(hidden, inner)

    def forward(self, embedded, feature, rope, bias, past=None):
        h = torch.cat([self.input_layernorm(embedded), self.hidden_norm(feature)], dim=-1)
        attended, present = self.self_attn(h, rope, bias, past)
        x = feature + attended
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Eagle3Draft(nn.Module):
    """The head in training. state_dict() holds exactly the published tensors it trains (fc, midlayer.*,
    norm); the target's embedding and output rows ride along as buffers that are never saved."""

    def __init__(self, target):
        super().__init__()
        cfg = target.config
        hidden, heads = int(cfg.hidden_size), int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        eps = float(getattr(cfg, "rms_norm_eps", None) or 1e-6)
        self.taps = target_taps(cfg)
        self.config_dict = head_config(cfg, hidden, heads, kv_heads, head_dim, eps, self.taps)
        self.fc = nn.Linear(TAPS * hidden, hidden, bias=False)
        self.midlayer = MidLayer(hidden, heads, kv_heads, head_dim, int(cfg.intermediate_size), eps)
        self.norm = RMSNorm(hidden, eps)
        self.register_buffer("embed_tokens", target.get_input_embeddings().weight.detach().float().clone(),
                             persistent=False)
        self.register_buffer("vocab_head", target.get_output_embeddings().weight.detach().float().clone(),
                             persistent=False)
        # the rotary the exporter builds from the written config (exporters/eagle3_graph.py)
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in self.config_dict.items()
                                                          if k not in ("architectures", "eagle_config")}))
        self._initialise(target)

    @torch.no_grad()
    def _initialise(self, target) -> None:
        hidden = self.fc.out_features
        self.fc.weight.zero_()
        self.fc.weight[:, (TAPS - 1) * hidden:] = torch.eye(hidden)  # the last tap alone
        offset = float(family_for(target.config, type(target).__name__).builder.norm_offset)  # Gemma: 1 + w
        source = target.model.layers[self.taps.layers[-1]]
        mine = self.midlayer
        for name in ("input_layernorm", "post_attention_layernorm"):
            theirs = getattr(source, name, None)
            if theirs is not None and theirs.weight.shape == getattr(mine, name).weight.shape:
                getattr(mine, name).weight.copy_(theirs.weight.float() + offset)
        mine.hidden_norm.weight.copy_(mine.input_layernorm.weight)
        self.norm.weight.copy_(target.model.norm.weight.float() + offset)
        for part, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                            ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for name in names:
                theirs = getattr(getattr(source, part, None), name, None)
                ours = getattr(getattr(mine, part), name).weight
                if theirs is None:
                    continue  # a family with fused or other projections: this one starts at random
                w = theirs.weight.float()
                if ours.shape[1] == 2 * w.shape[1] and ours.shape[0] == w.shape[0]:
                    ours.copy_(torch.cat([w, w], dim=1) * 0.5)  # embedding and feature read alike
                elif ours.shape == w.shape:
                    ours.copy_(w)

    def head_rows(self, head_tokens: torch.Tensor):
        """The frozen lm_head: the target's output rows of the head tokens."""
        return self.vocab_head[head_tokens]

    def hidden_steps(self, ids, mask, features, steps: int, step_mask) -> list:
        """Normed hidden states [B, T, H] for drafting steps 1..`steps`, as draft_model.draft_hidden_steps
        lays them out (`step_mask(mask, step, dtype)`: which keys each row sees at a step): step 1 reads
        fc(the target's streams) at the row before, a later step the head's own pre-norm output there."""
        embedded = self.embed_tokens[ids]
        positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        rope = self.rotary(embedded, positions)
        rows = ids.shape[1]
        causal = torch.tril(torch.ones(rows, rows, dtype=torch.bool, device=ids.device))[None] & mask.bool()[:, None, :]
        causal = causal | torch.eye(rows, dtype=torch.bool, device=ids.device)[None]  # a padded row sees itself
        bias = torch.zeros(causal.shape, dtype=embedded.dtype, device=ids.device).masked_fill(
            ~causal, torch.finfo(embedded.dtype).min)[:, None]
        out, past = self.midlayer(embedded, self.fc(features), rope, bias)
        pre_norm = [out]
        for step in range(2, steps + 1):
            previous = nn.functional.pad(pre_norm[-1][:, :-1], (0, 0, 1, 0))  # row t reads row t - 1's output
            out, past = self.midlayer(embedded, previous, rope, step_mask(mask, step, embedded.dtype), past)
            pre_norm.append(out)
        return [self.norm(x) for x in pre_norm]


def head_config(cfg, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, taps: FeatureTaps) -> dict:
    """config.json as SpecForge writes it: a one-layer Llama over the target's sizes and rotary, the target
    layers it reads as `eagle_aux_hidden_state_layer_ids` (outputs of layers: one below the inputs tapped)."""
    config = {"architectures": [ARCHITECTURE], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": int(cfg.intermediate_size), "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1,
              "vocab_size": int(cfg.vocab_size), "hidden_act": "silu", "rms_norm_eps": eps,
              "max_position_embeddings": int(getattr(cfg, "max_position_embeddings", None) or 8192),
              "tie_word_embeddings": False, "torch_dtype": "float32", "target_hidden_size": hidden,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [l - 1 for l in taps.layers],
                               "use_aux_hidden_state": True}}
    rope = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope = dict(rope.get("full_attention", rope))  # a rope per layer type (Gemma 3): the full layers'
    config["rope_theta"] = float(rope.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def write_head(draft: Eagle3Draft, head_tokens: np.ndarray, out: Path) -> None:
    """config.json and model.safetensors in the published layout: the trained tensors, the frozen lm_head over
    the head tokens (draft id d is target id d + d2t[d]), t2d marking the target ids the head holds."""
    tokens = torch.from_numpy(np.asarray(head_tokens, np.int64))
    t2d = torch.zeros(draft.embed_tokens.shape[0], dtype=torch.bool)
    t2d[tokens] = True
    tensors = {name: value.detach().float().contiguous() for name, value in draft.state_dict().items()}
    tensors.update({"lm_head.weight": draft.head_rows(tokens).contiguous(),
                    "d2t": tokens - torch.arange(len(tokens)), "t2d": t2d})
    config = dict(draft.config_dict, draft_vocab_size=len(tokens))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
