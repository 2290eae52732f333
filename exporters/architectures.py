"""Which graph builder serves which Hugging Face architecture. Each overrides only what differs from Llama.

FAMILIES is the one table: the exporter dispatches on it, tests/test_families.py tests every row of it
against transformers, and the README's list of supported models is generated from it
(`python -m edgespec.exporters.architectures`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from edgespec.runtime.contract.errors import UnsupportedArchitectureError

from .llama import LlamaBuilder


class Qwen2Builder(LlamaBuilder):
    architecture = "qwen2"  # a bias on q, k and v, which the checkpoint holds


class MistralBuilder(LlamaBuilder):
    architecture = "mistral"


class MinistralBuilder(LlamaBuilder):
    architecture = "ministral"


class Qwen3Builder(LlamaBuilder):
    """Llama with an RMSNorm over each query and key head before the rotary embedding."""
    architecture = "qwen3"
    coreml_packages = False
    qk_norm = "head"


class SmolLM3Builder(LlamaBuilder):
    """Llama whose layers listed 0 in `no_rope_layers` attend without rotary embedding (NoPE)."""
    architecture = "smollm3"
    coreml_packages = False

    def layer_rope(self, cfg, layer: int) -> str | None:
        return "" if cfg.no_rope_layers[layer] else None


class GraniteBuilder(LlamaBuilder):
    """Llama with four multipliers: the embedding's, the attention scores' (instead of 1/sqrt(d)), each
    block's output before it joins the residual stream (folded into o_proj and down_proj), and a divisor of
    the logits."""
    architecture = "granite"
    coreml_packages = False

    @property
    def attention_attributes(self) -> dict:
        return {"scale": float(self.model.config.attention_multiplier)}

    def embedding_scale(self) -> float | None:
        return float(self.model.config.embedding_multiplier)

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        out = super().layer_weights(i)
        residual = np.float32(self.model.config.residual_multiplier)
        return dict(out, o=out["o"] * residual, down=out["down"] * residual)

    def final_logits(self, g, logits: str) -> str:
        return g.op("Div", [logits, g.const(float(self.model.config.logits_scaling), np.float32)])

    def matmul_sources(self) -> dict[str, list[str]]:
        return {k: v for k, v in super().matmul_sources().items() if not k.endswith((".o", ".down"))}  # scaled


class Olmo2Builder(LlamaBuilder):
    """Norms after the attention and the MLP instead of before (no input norm), and an RMSNorm over the
    whole query and key projections."""
    architecture = "olmo2"
    coreml_packages = False
    qk_norm = "projection"

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        s, p = self.state, f"model.layers.{i}."
        return {
            "qkv": np.concatenate([s[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=0).T,
            "q_norm": s[p + "self_attn.q_norm.weight"], "k_norm": s[p + "self_attn.k_norm.weight"],
            "o": s[p + "self_attn.o_proj.weight"].T,
            "post_norm": s[p + "post_attention_layernorm.weight"],
            "gate_up": np.concatenate([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]], axis=0).T,
            "down": s[p + "mlp.down_proj.weight"].T,
            "post_mlp_norm": s[p + "post_feedforward_layernorm.weight"],
        }

    def decoder_layer(self, g, x, branch, w, attention):
        if branch is not None:
            x = g.op("Add", [x, branch])
        x = g.op("Add", [x, self.rms_norm(g, attention(x), w["post_norm"])])
        return x, self.rms_norm(g, self.mlp(g, x, w), w["post_mlp_norm"])


class Olmo3Builder(Olmo2Builder):
    architecture = "olmo3"


class Phi3Builder(LlamaBuilder):
    """Fused q/k/v and gate/up projections; rotary embedding over a fraction of each head (Phi-4-mini)."""
    architecture = "phi3"
    coreml_packages = False

    @property
    def rotary_dims(self) -> int:
        rope = getattr(self.model.config, "rope_parameters", None) or {}
        return int(self.facts.head_dim * rope.get("partial_rotary_factor", 1.0))

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        s, p = self.state, f"model.layers.{i}."
        return {
            "input_norm": s[p + "input_layernorm.weight"],
            "qkv": s[p + "self_attn.qkv_proj.weight"].T,
            "o": s[p + "self_attn.o_proj.weight"].T,
            "post_norm": s[p + "post_attention_layernorm.weight"],
            "gate_up": s[p + "mlp.gate_up_proj.weight"].T,  # gate first, as Phi3MLP chunks it
            "down": s[p + "mlp.down_proj.weight"].T,
        }

    def matmul_sources(self) -> dict[str, list[str]]:
        out = super().matmul_sources()
        for name, keys in out.items():
            if name.endswith(".qkv"):
                out[name] = [keys[0].replace("q_proj", "qkv_proj")]
            elif name.endswith(".gate_up"):
                out[name] = [keys[0].replace("gate_proj", "gate_up_proj")]
        return out


class GemmaBuilder(LlamaBuilder):
    """Norms that scale by (1 + weight), embeddings scaled by sqrt(hidden size), a GeLU-tanh MLP."""
    architecture = "gemma"
    coreml_packages = False
    activations = ("gelu_pytorch_tanh", "gelu")
    norm_offset = 1.0

    def embedding_scale(self) -> float | None:
        return math.sqrt(self.facts.hidden_size)

    def activation_name(self, cfg) -> str:
        return getattr(cfg, "hidden_activation", None) or cfg.hidden_act


class Gemma2Builder(GemmaBuilder):
    """Gemma with norms after the attention and the MLP as well as before, soft-capped attention scores
    and logits, a query scale of its own, and local (sliding) layers between global ones."""
    architecture = "gemma2"

    @property
    def attention_attributes(self) -> dict:
        cfg = self.model.config
        softcap = getattr(cfg, "attn_logit_softcapping", None)
        return {"scale": float(cfg.query_pre_attn_scalar) ** -0.5, **({"softcap": float(softcap)} if softcap else {})}

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        out = super().layer_weights(i)
        p, one = f"model.layers.{i}.", np.float32(self.norm_offset)
        return dict(out, post_attention_norm=self.state[p + "post_attention_layernorm.weight"] + one,
                    post_norm=self.state[p + "pre_feedforward_layernorm.weight"] + one,
                    post_mlp_norm=self.state[p + "post_feedforward_layernorm.weight"] + one)

    def decoder_layer(self, g, x, branch, w, attention):
        h, x = self.add_and_norm(g, x, branch, w["input_norm"])
        h, x = self.add_and_norm(g, x, self.rms_norm(g, attention(h), w["post_attention_norm"]), w["post_norm"])
        return x, self.rms_norm(g, self.mlp(g, h, w), w["post_mlp_norm"])

    def final_logits(self, g, logits: str) -> str:
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if not cap:
            return logits
        cap = g.const(float(cap), np.float32)
        return g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])


class Gemma3Builder(Gemma2Builder):
    """Gemma 2 with an RMSNorm over each query and key head, and a rotary table per layer type."""
    architecture = "gemma3_text"
    qk_norm = "head"


@dataclass(frozen=True)
class Family:
    name: str  # as users know it
    builder: type[LlamaBuilder]
    architectures: tuple[str, ...]  # transformers' class names in a config's `architectures`
    model_types: tuple[str, ...]  # transformers' `model_type`
    examples: str  # models people run on devices


FAMILIES = (
    Family("Llama", LlamaBuilder, ("LlamaForCausalLM",), ("llama",),
           "Llama 3.x, SmolLM2, TinyLlama, DeepSeek-R1-Distill-Llama"),
    Family("Qwen2", Qwen2Builder, ("Qwen2ForCausalLM",), ("qwen2",), "Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen"),
    Family("Qwen3", Qwen3Builder, ("Qwen3ForCausalLM",), ("qwen3",), "Qwen3 0.6B-32B"),
    Family("Mistral", MistralBuilder, ("MistralForCausalLM",), ("mistral",), "Mistral 7B"),
    Family("Ministral", MinistralBuilder, ("MinistralForCausalLM",), ("ministral",), "Ministral 8B"),
    Family("Phi-3", Phi3Builder, ("Phi3ForCausalLM",), ("phi3",), "Phi-3 / Phi-3.5-mini, Phi-4-mini"),
    Family("Gemma", GemmaBuilder, ("GemmaForCausalLM",), ("gemma",), "Gemma 2B / 7B, CodeGemma"),
    Family("Gemma 2", Gemma2Builder, ("Gemma2ForCausalLM",), ("gemma2",), "Gemma 2 2B / 9B"),
    Family("Gemma 3", Gemma3Builder, ("Gemma3ForCausalLM",), ("gemma3_text",), "Gemma 3 1B (text)"),
    Family("SmolLM3", SmolLM3Builder, ("SmolLM3ForCausalLM",), ("smollm3",), "SmolLM3-3B"),
    Family("Granite", GraniteBuilder, ("GraniteForCausalLM",), ("granite",), "Granite 3.x"),
    Family("OLMo 2", Olmo2Builder, ("Olmo2ForCausalLM",), ("olmo2",), "OLMo 2 1B / 7B"),
    Family("OLMo 3", Olmo3Builder, ("Olmo3ForCausalLM",), ("olmo3",), "OLMo 3 7B"),
)
BUILDERS = {name: family.builder for family in FAMILIES for name in family.architectures}


def family_for(config, class_name: str | None = None) -> Family:
    """The family of a transformers config (or of a loaded model's `class_name`), read before any weight is:
    an architecture edgespec does not export is refused by name."""
    names = list(getattr(config, "architectures", None) or ([class_name] if class_name else []))
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if set(names) & set(family.architectures) or (not names and model_type in family.model_types):
            return family
    known = ", ".join(sorted(BUILDERS))
    raise UnsupportedArchitectureError(
        f"architecture {', '.join(names) or model_type} is not supported; edgespec exports {known} "
        "(docs/models.md)")


def builder_for(model, max_context: int, head_tokens=None, feature_fc=None, features_out: bool = False,
                lanes: int = 1, exact_passes: bool = False, weights=None, feature_taps=None) -> LlamaBuilder:
    """`weights`: the model's state read a tensor at a time where `model` is a skeleton (exporters/checkpoint.py);
    `feature_taps`: the features an EAGLE-3 head reads (exporters/eagle3.py)."""
    return family_for(model.config, type(model).__name__).builder(model, max_context, head_tokens, feature_fc,
                                                                  features_out, lanes, exact_passes, weights,
                                                                  feature_taps)


def families_line() -> str:
    """The README's list of supported families."""
    return "Families exported: " + ", ".join(f.name for f in FAMILIES) + "."


def families_markdown() -> str:
    """docs/models.md's table of supported models."""
    rows = [f"| {f.name} | {f.examples} | `{'`, `'.join(f.architectures)}` |" for f in FAMILIES]
    return "\n".join(["| family | models | transformers architecture |", "| --- | --- | --- |", *rows])


if __name__ == "__main__":
    print(families_line(), families_markdown(), sep="\n\n")
