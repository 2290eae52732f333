"""Which graph builder serves which Hugging Face architecture. Each overrides only what differs."""
from __future__ import annotations

from edgespec.runtime.errors import ExportError, UnsupportedArchitectureError

from .llama import LlamaBuilder


class Qwen2Builder(LlamaBuilder):
    architecture = "qwen2"
    qkv_bias = True  # Qwen2 adds a bias to its q, k and v projections


class MistralBuilder(LlamaBuilder):
    architecture = "mistral"

    def sliding_window(self, cfg, max_context: int) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        # Attention beyond the window would need a banded mask; until then the context stays inside it.
        if window is not None and max_context > window:
            raise ExportError(f"this Mistral model attends within a sliding window of {window} tokens; "
                              f"export it with --context {window} or less")
        return window


BUILDERS = {
    "LlamaForCausalLM": LlamaBuilder,
    "Qwen2ForCausalLM": Qwen2Builder,
    "MistralForCausalLM": MistralBuilder,
}


def builder_for(model, max_context: int, head_tokens=None, feature_fc=None, features_out: bool = False,
                lanes: int = 1, exact_passes: bool = False) -> LlamaBuilder:
    names = list(getattr(model.config, "architectures", None) or [type(model).__name__])
    for name in names:
        if name in BUILDERS:
            return BUILDERS[name](model, max_context, head_tokens, feature_fc, features_out, lanes, exact_passes)
    raise UnsupportedArchitectureError(
        f"architecture {', '.join(names)} is not supported; edgespec exports {', '.join(sorted(BUILDERS))}")
