"""Which of a target graph's matmul weights keep their GGUF blocks (quant/gguf_grid.py), found by name and
checked by value.

A builder's matmul weight is one or more checkpoint tensors side by side (q, k and v as `qkv`); each is
found in the file through gguf's own name map and its blocks decoded. The decoded weights must equal, bit
for bit, what transformers read from the same file for that tensor — directly, or with llama.cpp's
rotary row order undone (its converter permutes Llama's q/k rows). A weight any of whose parts uses a
block type that cannot be kept goes to the export's --quant scheme instead, and is named.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edgespec.quant.gguf_grid import KEPT, BlockGrid, concatenate, decode
from edgespec.runtime.contract.errors import ExportError

from .llama import LlamaBuilder

FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class KeptBlocks:
    grids: dict[str, BlockGrid]  # graph weight name -> its blocks
    not_kept: dict[str, str]  # graph weight name -> the block types that could not be kept
    floats: tuple[str, ...]  # graph weights stored as floats in the file (--quant applies, nothing is lost)


def _rotary_rows(count: int, heads: int) -> np.ndarray:
    """The row order transformers' GGUF loader gives llama.cpp's permuted q/k rows."""
    dim = count // heads // 2
    return np.arange(count).reshape(heads, dim, 2).swapaxes(2, 1).reshape(count)


def kept_blocks(path: Path, builder: LlamaBuilder) -> KeptBlocks:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    arch = reader.fields["general.architecture"].contents()
    arch_id = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}.get(arch)
    if arch_id is None:
        raise ExportError(f"GGUF file {path}: gguf does not know architecture {arch!r}")
    names = gguf.get_tensor_name_map(arch_id, builder.facts.num_layers)
    f = builder.facts

    def grid_of(key: str) -> BlockGrid | str:
        """The blocks of checkpoint tensor `key` (model.layers.0.self_attn.q_proj.weight), or its type's name
        when it cannot be kept."""
        gguf_name = names.get_name(key.removesuffix(".weight"))
        tensor = tensors.get(f"{gguf_name}.weight") if gguf_name else None
        if tensor is None:
            raise ExportError(f"GGUF file {path} has no tensor for {key}")
        kind = tensor.tensor_type.name
        if kind not in KEPT:
            return kind
        expected = builder.state[key]
        grid = decode(kind, np.asarray(tensor.data).reshape(expected.shape[0], -1), expected.shape)
        weights = grid.dequantize()
        if np.array_equal(weights, expected):
            return grid
        heads = f.num_heads if ".q_proj." in key else f.num_kv_heads
        order = _rotary_rows(expected.shape[0], heads)
        if np.array_equal(weights[order], expected):
            return grid.rows(order)
        raise ExportError(f"GGUF file {path}: the blocks of {gguf_name} do not give the weights transformers "
                          f"read for {key}; export without --gguf-blocks")

    grids, not_kept = {}, {}
    embedding = tensors.get("token_embd.weight")
    if embedding is not None and embedding.tensor_type.name not in FLOAT_TYPES:
        # a Gather reads the table: transformers' dequantization of it, then --quant's scheme
        not_kept["embed_tokens"] = embedding.tensor_type.name
    floats = []
    for name, keys in builder.matmul_sources().items():
        parts = [grid_of(key) for key in keys]
        lost = sorted({p for p in parts if isinstance(p, str) and p not in FLOAT_TYPES})
        if lost:
            not_kept[name] = ", ".join(lost)
        elif any(isinstance(p, str) for p in parts):
            floats.append(name)
        else:
            grids[name] = concatenate(parts)
    return KeptBlocks(grids, not_kept, tuple(floats))
