"""Asymmetric block quantization with exact float offsets, on top of symmetric MatMulNBits.

Per block of `block` input channels a weight is w = d * q + m with q in 0..2^bits-1 (min-max fit).
onnxruntime's MatMulNBits stores only integer zero points on its fast path, which cannot hold an
arbitrary offset m (a float zero point exists but runs ~10x slower on the CPU). So the product is
split:

    x . w = x . (d * (q - z0))  +  blocksum(x) . (m + d * z0)        z0 = 2^(bits-1), MatMulNBits' implied zero point
            ---------------------    -----------------------------
            symmetric MatMulNBits    a small fp32 matmul: [K / block] x N offsets

blocksum(x) is itself a matmul with a fixed 0/1 matrix [K, K / block]. Weights that already lie on
such a grid — a model that came from a Q4_1/Q8_1 GGUF file — are reproduced exactly.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper


def quantize_block_minmax(weight: np.ndarray, bits: int, block: int):
    """weight [K, N] (MatMul layout) -> (packed [N, K/block, block*bits/8] uint8, scales [N*K/block] float32,
    offsets [K/block, N] float32)."""
    k, n = weight.shape
    if k % block:
        raise ValueError(f"input size {k} is not a multiple of the block size {block}")
    levels = (1 << bits) - 1
    blocks = weight.T.reshape(n, k // block, block).astype(np.float64)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = (high - low) / levels
    scale[scale == 0] = 1.0  # a constant block: q = 0, the offset carries the value
    q = np.clip(np.rint((blocks - low[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    zero = 1 << (bits - 1)
    offsets = (low + scale * zero).astype(np.float32).T  # [K/block, N]
    if bits == 4:
        packed = q[..., 0::2] | (q[..., 1::2] << 4)
    else:
        packed = q
    return np.ascontiguousarray(packed, dtype=np.uint8), scale.astype(np.float32).reshape(-1), np.ascontiguousarray(offsets)


def replace_matmul(model: onnx.ModelProto, node: onnx.NodeProto, weight: np.ndarray, bits: int, block: int,
                   accuracy_level: int) -> None:
    """Rewrites MatMul(x, W) in place as MatMulNBits(x) + MatMul(MatMul(x, S), offsets)."""
    name = node.input[1]
    k, n = weight.shape
    packed, scales, offsets = quantize_block_minmax(weight, bits, block)
    summer = np.zeros((k, k // block), dtype=np.float32)
    summer[np.arange(k), np.arange(k) // block] = 1.0
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(packed, f"{name}_Q{bits}"),
                              numpy_helper.from_array(scales, f"{name}_scales"),
                              numpy_helper.from_array(offsets, f"{name}_offsets")])
    summer_name = f"blocksum_{k}_{block}"
    if not any(t.name == summer_name for t in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(summer, summer_name))
    x, y = node.input[0], node.output[0]
    new_nodes = [
        helper.make_node("MatMulNBits", [x, f"{name}_Q{bits}", f"{name}_scales"], [f"{y}_sym"], name=f"{node.name}_nbits",
                         domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level),
        helper.make_node("MatMul", [x, summer_name], [f"{y}_blocksum"], name=f"{node.name}_blocksum"),
        helper.make_node("MatMul", [f"{y}_blocksum", f"{name}_offsets"], [f"{y}_offset"], name=f"{node.name}_offset"),
        helper.make_node("Add", [f"{y}_sym", f"{y}_offset"], [y], name=f"{node.name}_add"),
    ]
    position = list(graph.node).index(node)
    graph.node.remove(node)
    for i, new in enumerate(new_nodes):
        graph.node.insert(position + i, new)
