"""EAGLE-3 heads as published: a `LlamaForCausalLMEagle3` checkpoint (the layout SGLang, vLLM and SpecForge
read) exported as a feature-reading draft.

The head (SGLang `models/llama_eagle3.py`, vLLM `models/llama_eagle3.py`, SpecForge's trainer):
    fc         [H, 3H]   projects the concatenated residual streams of three target layers to H
    midlayer.* one Llama decoder layer whose attention reads [input_layernorm(embedding of token i),
               hidden_norm(feature)] (q/k/v take 2H); the feature, not the embedding, is its residual
               (or the normed feature where the config says `norm_before_residual`, as vLLM reads it)
    norm, lm_head [draft vocab, H]; `d2t` [draft vocab]: target id = draft id + d2t (`t2d`: the reverse mask)
    no embedding of its own: the target's table (a checkpoint that carries `embed_tokens.weight` is read, as
    vLLM reads it)

How it maps onto edgespec's feature-reading drafts (runtime/execution/features.py): the target graph returns,
as `features_out`, fc(concat(three residual streams)) — where vLLM applies `fc` too (`combine_hidden_states`),
outside the draft's forward — so every feature a draft row reads is H wide: the target's projected one for
committed tokens, and for its 2nd+ drafting steps the draft's own output before its final norm (SGLang's
`hidden_states_to_aux`), which the draft graph returns as its `features_out`. The draft's logits cover the
target ids `arange(draft vocab) + d2t` (a trimmed head: the manifest's `head_tokens`).

Which target layers: `eagle_config.eagle_aux_hidden_state_layer_ids` names layers whose *outputs* are read
(SpecForge hooks the layers' outputs; SGLang captures the input of layer id + 1); without it, the inputs of
layers (2, L // 2, L - 3), the default of SGLang, vLLM and EAGLE's own repository. (vLLM reads ids it is given
as layer inputs, one below SpecForge's; checkpoints name SpecForge's.)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edgespec.runtime.contract.errors import ExportError

from .onnx_builder import GraphBuilder

ARCHITECTURE = "LlamaForCausalLMEagle3"
TAPS = 3  # residual streams the published fc reads


@dataclass(frozen=True)
class FeatureTaps:
    """What a target graph returns as features for an EAGLE-3 head: the residual stream entering each of
    `layers` (num_layers: after the last layer, before the final norm), concatenated and projected; without
    `fc`, concatenated alone (distill's data engine: the head's fc is what it trains)."""
    layers: tuple[int, ...]
    fc: np.ndarray | None  # [len(layers) * H, H], as the graph multiplies
    bias: np.ndarray | None = None  # [H]

    def width(self, hidden: int) -> int:
        """How wide the features the graph returns are."""
        return hidden if self.fc is not None else len(self.layers) * hidden

    def check(self, facts) -> None:
        if not all(0 <= l <= facts.num_layers for l in self.layers):
            raise ExportError(f"the EAGLE-3 head reads target layers {list(self.layers)}, but the target has "
                              f"{facts.num_layers} layers: it was trained for another target")

    def project(self, g: GraphBuilder, streams: list[str]) -> str:
        if self.fc is None:
            return g.op("Concat", streams, axis=-1)
        out = g.op("MatMul", [g.op("Concat", streams, axis=-1), g.weight("eagle3_fc", self.fc)], "eagle3_fc")
        return out if self.bias is None else g.op("Add", [out, g.weight("eagle3_fc_bias", self.bias)])


@dataclass(frozen=True)
class Eagle3Head:
    folder: Path
    config: dict  # config.json as published
    tensors: dict  # {published name: float32 array (d2t int64, t2d bool)}

    @property
    def draft_vocab(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.config["vocab_size"])

    @property
    def head_tokens(self) -> np.ndarray | None:
        """The target ids of the head's rows; None where it predicts the whole vocabulary in order."""
        if "d2t" not in self.tensors:
            return None
        return np.arange(self.draft_vocab, dtype=np.int64) + self.tensors["d2t"].astype(np.int64)

    def taps_for(self, target_config) -> FeatureTaps:
        """The target's features this head reads, checked against the target (before any graph is written)."""
        layers, hidden = target_config.num_hidden_layers, target_config.hidden_size
        for key, want in (("hidden_size", hidden), ("target_hidden_size", hidden), ("vocab_size", target_config.vocab_size)):
            if key in self.config and self.config[key] != want:
                raise ExportError(f"the EAGLE-3 head in {self.folder} has {key} {self.config[key]} and the target "
                                  f"{want}: it was trained for another target")
        eagle = self.config.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        taps = tuple(int(i) + 1 for i in ids) if ids else default_taps(layers)
        tokens = self.head_tokens
        if tokens is not None and (len(np.unique(tokens)) != len(tokens) or tokens.min() < 0
                                   or tokens.max() >= target_config.vocab_size):
            raise ExportError(f"the EAGLE-3 head in {self.folder} maps its draft ids (d2t) outside the target's "
                              f"{target_config.vocab_size} ids or onto one id twice")
        fc = self.tensors["fc.weight"].T
        return FeatureTaps(taps, np.ascontiguousarray(fc), self.tensors.get("fc.bias"))


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """The residual streams a head without `eagle_aux_hidden_state_layer_ids` reads: the inputs of layers
    (2, L // 2, L - 3), the default of SGLang, vLLM and EAGLE's own repository."""
    return 2, num_layers // 2, num_layers - 3


def is_eagle3_head(source) -> bool:
    """Whether a draft source is a folder whose config names the EAGLE-3 head's architecture; a head of another
    layout (vLLM speculators' `Eagle3Speculator`, EAGLE-1/2 heads) is refused here, before the target is read."""
    config = Path(source.location) / "config.json"
    if source.kind != "hf_folder" or not config.is_file():
        return False
    names = _read_config(config).get("architectures") or []
    other = [n for n in names if n != ARCHITECTURE and ("eagle" in str(n).lower() or "speculator" in str(n).lower())]
    if other:
        raise ExportError(f"the draft in {source.location} is a {', '.join(map(str, other))} head, a layout edgespec "
                          f"does not read: it reads EAGLE-3 heads saved as {ARCHITECTURE} (SGLang, SpecForge)")
    return ARCHITECTURE in names


def read_eagle3_head(source) -> Eagle3Head:
    """The head's config and tensors, every published tensor checked by name and shape; a checkpoint that does
    not match is refused in one line naming what is missing or wrong."""
    folder = Path(source.location)
    config = _read_config(folder / "config.json")
    where = f"the EAGLE-3 head in {folder}"
    try:
        hidden, heads, kv_heads = int(config["hidden_size"]), int(config["num_attention_heads"]), \
            int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim, inner = int(config.get("head_dim") or hidden // heads), int(config["intermediate_size"])
        vocab, layers = int(config["vocab_size"]), int(config.get("num_hidden_layers", 1))
        draft_vocab = int(config.get("draft_vocab_size") or vocab)
    except KeyError as err:
        raise ExportError(f"{where}: config.json has no {err.args[0]}") from err
    except (TypeError, ValueError) as err:
        raise ExportError(f"{where}: config.json has a field that is not a number ({err})") from err
    if layers != 1:
        raise ExportError(f"{where} has {layers} decoder layers; edgespec reads heads of one (`midlayer`)")
    eagle = config.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise ExportError(f"{where} sets eagle_config.use_aux_hidden_state false (no fc over the target's layers), "
                          "which edgespec does not read")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) != TAPS):
        raise ExportError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids must list {TAPS} layers (got {ids!r})")
    if config.get("hidden_act", "silu") != "silu":
        raise ExportError(f"{where} uses {config['hidden_act']!r} in its MLP; EAGLE-3 heads use silu")
    target_hidden = int(config.get("target_hidden_size") or hidden)
    p, m = "midlayer.self_attn.", "midlayer.mlp."
    shapes = {
        "fc.weight": (hidden, TAPS * target_hidden),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        p + "q_proj.weight": (heads * head_dim, 2 * hidden), p + "k_proj.weight": (kv_heads * head_dim, 2 * hidden),
        p + "v_proj.weight": (kv_heads * head_dim, 2 * hidden), p + "o_proj.weight": (hidden, heads * head_dim),
        m + "gate_proj.weight": (inner, hidden), m + "up_proj.weight": (inner, hidden), m + "down_proj.weight": (hidden, inner),
        "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
    }
    optional = {"fc.bias": (hidden,), "embed_tokens.weight": (vocab, hidden), "t2d": (vocab,), "d2t": (draft_vocab,)}
    if draft_vocab != vocab:
        shapes["d2t"] = optional.pop("d2t")
    tensors = _read_tensors(folder, where)
    missing = [name for name in shapes if name not in tensors]
    if missing:
        raise ExportError(f"{where} is missing {', '.join(missing)}")
    unknown = sorted(set(tensors) - set(shapes) - set(optional))
    if unknown:
        raise ExportError(f"{where} has tensors edgespec does not read ({', '.join(unknown[:6])}): "
                          "not the published one-layer EAGLE-3 layout")
    for name, shape in {**shapes, **optional}.items():
        if name in tensors and tuple(tensors[name].shape) != shape:
            raise ExportError(f"{where}: {name} is {list(tensors[name].shape)}, expected {list(shape)} from its config")
    return Eagle3Head(folder, config, tensors)


def _read_config(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read {path}: {err}") from err


def _read_tensors(folder: Path, where: str) -> dict:
    """model.safetensors (SpecForge) or pytorch_model.bin (EAGLE's own releases), read as plain tensors."""
    import torch

    try:
        if (folder / "model.safetensors").is_file():
            from safetensors.torch import load_file

            raw = load_file(str(folder / "model.safetensors"))
        elif (folder / "pytorch_model.bin").is_file():
            raw = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        else:
            raise ExportError(f"{where} has no model.safetensors or pytorch_model.bin")
    except (OSError, RuntimeError, ValueError) as err:
        raise ExportError(f"{where}: cannot read its weights: {type(err).__name__}: {err}") from err
    out = {}
    for name, tensor in raw.items():
        name = name.removeprefix("model.")  # some trainers save the head under `model.`
        if name in ("d2t", "t2d"):
            out[name] = tensor.numpy()
        else:
            out[name] = tensor.float().numpy()
    return out

