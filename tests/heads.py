"""Published-layout draft heads built from a known config with random tensors under the published names and
shapes (exporters/eagle3.py, exporters/medusa.py), and a torch reference of what each computes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def write_eagle3_head(folder: Path, target_folder: Path, seed: int = 11, draft_vocab: int | None = 96,
                      aux_ids: list[int] | None = None, norm_before_residual: bool = False, drop: tuple = (),
                      reshape: dict | None = None, config_extra: dict | None = None, hidden: int | None = None) -> Path:
    """A `LlamaForCausalLMEagle3` head for the tiny target in `target_folder`, as SpecForge saves one: config.json
    and model.safetensors (fc, midlayer.*, norm, lm_head, d2t, t2d). `draft_vocab` None: the whole vocabulary,
    no maps. `drop`: tensors left out; `reshape`: {name: shape} written wrong (malformed heads)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_folder) / "config.json").read_text())
    hidden, vocab = hidden or target["hidden_size"], target["vocab_size"]
    heads, kv_heads, head_dim, inner = 4, 2, 16, 2 * hidden
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": inner, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": vocab, "hidden_act": "silu",
              "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if draft_vocab is not None:
        config["draft_vocab_size"] = draft_vocab
    if aux_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True}
    if norm_before_residual:
        config["norm_before_residual"] = True
    config.update(config_extra or {})
    rows = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    a, m = "midlayer.self_attn.", "midlayer.mlp."
    tensors = {
        "fc.weight": rand(hidden, 3 * hidden, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + rand(hidden, scale=0.2),
        "midlayer.hidden_norm.weight": 1 + rand(hidden, scale=0.2),
        "midlayer.post_attention_layernorm.weight": 1 + rand(hidden, scale=0.2),
        a + "q_proj.weight": rand(heads * head_dim, 2 * hidden), a + "k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        a + "v_proj.weight": rand(kv_heads * head_dim, 2 * hidden), a + "o_proj.weight": rand(hidden, heads * head_dim),
        m + "gate_proj.weight": rand(inner, hidden), m + "up_proj.weight": rand(inner, hidden),
        m + "down_proj.weight": rand(hidden, inner),
        "norm.weight": 1 + rand(hidden, scale=0.2), "lm_head.weight": rand(rows, hidden),
    }
    if draft_vocab is not None:  # a sorted random subset of the target's ids, as SpecForge's frequency pick
        hot = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
        tensors["d2t"] = hot - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot] = True
        tensors["t2d"] = t2d
    for name in drop:
        tensors.pop(name)
    for name, shape in (reshape or {}).items():
        tensors[name] = rand(*shape)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def eagle3_reference(head_folder: Path, target, ids: list[int], taps: tuple[int, ...],
                     steps: int = 1) -> tuple[np.ndarray, list[int]]:
    """The head as the references compute it, in torch: (its logits over the target's ids at every row of `ids`
    [len(ids), V] (-inf off its vocabulary), and the greedy chain it drafts `steps` tokens deep after `ids`).
    Row i reads fc(target residual streams at i - 1) (zeros at 0); a drafted row reads the previous row's
    output before the final norm. `taps`: the residual streams (HF hidden_states indices)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    folder = Path(head_folder)
    config = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors"))
    eps, hidden = config["rms_norm_eps"], config["hidden_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
        streams = [out.hidden_states[t][0] for t in taps]
        if len(target.model.layers) in taps:  # HF's last hidden state is normed: take the norm's input instead
            raise ValueError("tap the final residual stream through a hook, not hidden_states")
        target_features = torch.cat(streams, dim=-1) @ w["fc.weight"].T
        embed = target.model.embed_tokens.weight

        def norm(x, weight):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        rotary = LlamaRotaryEmbedding(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))

        def layer(tokens, features, positions, past):
            """Rows `tokens` at `positions` after `past` (keys, values) rows; returns (pre-norm out, logits, past)."""
            p = "midlayer."
            e = embed[torch.tensor(tokens)]
            normed = norm(features, w[p + "hidden_norm.weight"])
            residual = normed if config.get("norm_before_residual") else features
            h = torch.cat([norm(e, w[p + "input_layernorm.weight"]), normed], dim=-1)
            n = len(tokens)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, head_dim).transpose(0, 1)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, kv_heads, head_dim).transpose(0, 1)
            cos, sin = rotary(v, torch.tensor([positions]))

            def turn(x):
                half = x.shape[-1] // 2
                return x * cos[0] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[0]

            q, k = turn(q), turn(k)
            if past is not None:
                k, v = torch.cat([past[0], k], dim=1), torch.cat([past[1], v], dim=1)
            k_rep, v_rep = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
            scores = q @ k_rep.transpose(1, 2) / head_dim ** 0.5
            total = k.shape[1]
            scores = scores + torch.triu(torch.full((n, total), float("-inf")), total - n + 1)
            attn = (scores.softmax(-1) @ v_rep).transpose(0, 1).reshape(n, heads * head_dim)
            x = residual + attn @ w[p + "self_attn.o_proj.weight"].T
            hm = norm(x, w[p + "post_attention_layernorm.weight"])
            mlp = (torch.nn.functional.silu(hm @ w[p + "mlp.gate_proj.weight"].T) * (hm @ w[p + "mlp.up_proj.weight"].T)
                   @ w[p + "mlp.down_proj.weight"].T)
            pre_norm = x + mlp
            rows = norm(pre_norm, w["norm.weight"]) @ w["lm_head.weight"].T
            full = torch.full((n, len(embed)), float("-inf"))
            hot = torch.arange(rows.shape[1]) + (w["d2t"] if "d2t" in w else 0)
            full[:, hot] = rows
            return pre_norm, full, (k, v)

        shifted = torch.cat([torch.zeros(1, hidden), target_features[:-1]])
        pre_norm, logits, past = layer(ids, shifted, list(range(len(ids))), None)
        chain, feature, row = [], pre_norm[-1:], logits[-1]
        for depth in range(steps):
            chain.append(int(row.argmax()))
            if depth + 1 == steps:
                break
            feature, row, past = layer(chain[-1:], feature, [len(ids) - 1 + depth + 1], past)
            row = row[0]
    return logits.numpy(), chain


def write_medusa_head(folder: Path, target_folder: Path, heads: int = 3, blocks: int = 1, seed: int = 13,
                      file: str = "medusa_lm_head.safetensors", drop: tuple = (), reshape: dict | None = None) -> Path:
    """Medusa heads for the tiny target in `target_folder`, as FasterDecoding/Medusa saves them: config.json with
    medusa_num_heads / medusa_num_layers, and the ModuleList's state ({k}.{j}.linear.*, {k}.{blocks}.weight).
    Each head's last linear starts from the target's own head (Medusa's init) plus noise, so its guesses are
    the target's kind of tokens; the blocks are random."""
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = json.loads((Path(target_folder) / "config.json").read_text())
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    state = load_file(str(Path(target_folder) / "model.safetensors"))
    lm_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for k in range(heads):
        for j in range(blocks):
            tensors[f"{k}.{j}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.1
            tensors[f"{k}.{j}.linear.bias"] = torch.randn(hidden, generator=g) * 0.1
        tensors[f"{k}.{blocks}.weight"] = lm_head.float() + torch.randn(vocab, hidden, generator=g) * 0.1
    for name in drop:
        tensors.pop(name)
    for name, shape in (reshape or {}).items():
        tensors[name] = torch.randn(*shape, generator=g)
    if file.endswith(".pt"):
        torch.save(tensors, folder / file)
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / file))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": blocks,
                                                    "base_model_name_or_path": str(target_folder)}))
    return folder


def medusa_reference(head_folder: Path, target, ids: list[int]) -> list[list[int]]:
    """Per head, its tokens ranked by logit at the last row of `ids` (the target's final hidden state there)."""
    from safetensors.torch import load_file

    config = json.loads((Path(head_folder) / "config.json").read_text())
    w = load_file(str(Path(head_folder) / "medusa_lm_head.safetensors"))
    with torch.no_grad():
        h = target.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        ranked = []
        for k in range(config["medusa_num_heads"]):
            x = h
            for j in range(config["medusa_num_layers"]):
                x = x + torch.nn.functional.silu(x @ w[f"{k}.{j}.linear.weight"].T + w[f"{k}.{j}.linear.bias"])
            ranked.append(torch.argsort(x @ w[f"{k}.{config['medusa_num_layers']}.weight"].T, descending=True).tolist())
    return ranked


PROMPTS = ["def add(a, b):", "The quick brown fox", "{\"name\": \"edge"]


def lossless_accepted(pipeline, prompts=PROMPTS) -> int:
    """Greedy speculative output equals plain on each prompt, and a seeded sampled run completes; returns the
    draft tokens the speculative runs accepted (a head whose proposals are never used would pass the rest)."""
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.decoding.sampling import SamplingConfig

    greedy = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    sampled = GenerationConfig(max_new_tokens=24, stop_at_eos=False, sampling=SamplingConfig(temperature=0.8, seed=3))
    accepted = 0
    for prompt in prompts:
        plain = pipeline.generate(prompt, config=greedy, speculate=False)
        spec = pipeline.generate(prompt, config=greedy, speculate=True)
        assert spec.token_ids == plain.token_ids
        accepted += spec.stats.accepted_drafts
        assert len(pipeline.generate(prompt, config=sampled).token_ids) == 24
    return accepted
