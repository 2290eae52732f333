"""What a GGUF file says about its model that transformers' GGUF loader drops, put back.

transformers maps each architecture's GGUF keys onto a config through a fixed table. Rope scaling (for
every architecture but gpt-oss), llama.cpp's `rope_freqs` tensor (how its converter stores a llama3 rope)
and `attention.key_length` where a family's head size is not hidden / heads (Qwen3) fall outside it, so a
Llama 3.x GGUF would load with a plain rope and edgespec would reproduce the wrong model exactly.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from edgespec.runtime.contract.errors import ExportError

ROPE_TYPES = ("none", "linear", "yarn")  # llama.cpp's rope.scaling.type values this module maps


@dataclass(frozen=True)
class GGUFFacts:
    architecture: str
    key_length: int | None
    rope_scaling: dict | None  # transformers' rope_parameters entries beyond rope_theta
    rope_freq_factors: np.ndarray | None  # llama.cpp's rope_freqs: each frequency divided by its factor


def read_gguf_facts(path: Path) -> GGUFFacts:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, struct.error) as err:  # not a GGUF, unreadable, or cut short
        raise ExportError(f"cannot read GGUF file {path}: {err}") from err

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    arch = value("general.architecture")
    key_length = value(f"{arch}.attention.key_length")
    rope_type = value(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if rope_type is not None and rope_type not in ROPE_TYPES:
        raise ExportError(f"GGUF file {path} uses rope scaling {rope_type!r}, which edgespec cannot read from a "
                          f"GGUF yet ({', '.join(ROPE_TYPES)}); export from the Hugging Face folder instead")
    if rope_type in ("linear", "yarn"):
        rope_scaling = {"rope_type": rope_type, "factor": float(value(f"{arch}.rope.scaling.factor"))}
        original = value(f"{arch}.rope.scaling.original_context_length")
        if rope_type == "yarn":
            if original is None:
                raise ExportError(f"GGUF file {path}: yarn rope scaling without original_context_length")
            rope_scaling["original_max_position_embeddings"] = int(original)
    factors = next((np.array(t.data, dtype=np.float32) for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return GGUFFacts(arch, None if key_length is None else int(key_length), rope_scaling, factors)


def fix_config(config, facts: GGUFFacts) -> None:
    """Puts the file's head size and rope scaling into the config transformers made from it (before the
    model is built from it)."""
    if facts.key_length is not None and getattr(config, "head_dim", None) != facts.key_length:
        config.head_dim = facts.key_length
    if facts.rope_scaling is not None:
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") not in ("default", facts.rope_scaling["rope_type"]):
            return  # transformers read a rope of its own from the file (gpt-oss): keep it
        config.rope_parameters = {**rope, **facts.rope_scaling}


def apply_rope_factors(model, facts: GGUFFacts) -> None:
    """llama.cpp divides each rotary frequency by its `rope_freqs` factor; the model's rotary module is
    given the same frequencies, so its tables (and so the export) follow the file."""
    if facts.rope_freq_factors is None:
        return
    rotary = model.model.rotary_emb
    if getattr(rotary, "rope_type", "default") != "default":
        raise ExportError(f"the GGUF file has both rope_freqs and {rotary.rope_type} rope scaling; edgespec "
                          "cannot combine them")
    if rotary.inv_freq.shape != facts.rope_freq_factors.shape:
        raise ExportError(f"the GGUF file's rope_freqs has {facts.rope_freq_factors.size} factors for "
                          f"{rotary.inv_freq.numel()} rotary frequencies")
    scaled = rotary.inv_freq / torch.from_numpy(facts.rope_freq_factors).to(rotary.inv_freq.dtype)
    rotary.inv_freq = scaled
    rotary.original_inv_freq = scaled.clone()
