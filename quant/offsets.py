"""Asymmetric block quantization with exact float offsets, on top of symmetric MatMulNBits.

Per block of `block` input channels a weight is w = d * q + m with q in 0..2^bits-1 (min-max fit).
onnxruntime's MatMulNBits stores only integer zero points on its fast path, which cannot hold an
arbitrary offset m (a float zero point exists but runs ~10x slower on the CPU). So the product is
split:

    x . w = x . (d * (q - z0))  +  blocksum(x) . (m + d * z0)        z0 = 2^(bits-1), MatMulNBits' implied zero point
            ---------------------    -----------------------------
            symmetric MatMulNBits    a small fp32 matmul: [K / block] x N offsets

blocksum(x) is a ReduceSum over x viewed as [rows, K / block, block] (cheaper per matmul than
the matmul with a 0/1 matrix it replaced, history.md §40). Weights that already lie
on such a grid — a model that came from a Q4_1/Q8_1 GGUF file — are reproduced exactly.

A weight whose every block is d * q with |q| <= 2^(bits-1) - 1 (a Q8_0 tensor: the reference model's
tied embedding, read as its int8 head) needs no offset: MatMulNBits' implied zero point holds it exactly,
and the offsets' fp32 matrix and three nodes cost the reference target's step time (history.md §53).
A min-max fit would not even reproduce it: 255 levels over a block that spans at most 254 steps.
"""
from __future__ import annotations

import numpy as np
import onnx
from edgespec.runtime.contract.errors import InputError
from onnx import helper, numpy_helper

from .rewrite import add_constants, replace_node


def _blocks(weight: np.ndarray, block: int) -> np.ndarray:
    """weight [K, N] (MatMul layout) -> [N, K/block, block], MatMulNBits' order."""
    k, n = weight.shape
    if k % block:
        raise InputError(f"input size {k} is not a multiple of the block size {block}")
    return weight.T.reshape(n, k // block, block)


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Levels [N, K/block, block] (uint8) -> MatMulNBits' packed [N, K/block, block*bits/8]."""
    packed = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    return np.ascontiguousarray(packed, dtype=np.uint8)


def quantize_block_minmax(weight: np.ndarray, bits: int, block: int):
    """weight [K, N] (MatMul layout) -> (packed [N, K/block, block*bits/8] uint8, scales [N*K/block] float32,
    offsets [K/block, N] float32)."""
    levels = (1 << bits) - 1
    blocks = _blocks(weight, block).astype(np.float64)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = (high - low) / levels
    scale[scale == 0] = 1.0  # a constant block: q = 0, the offset carries the value
    q = np.clip(np.rint((blocks - low[..., None]) / scale[..., None]), 0, levels).astype(np.uint8)
    zero = 1 << (bits - 1)
    offsets = (low + scale * zero).astype(np.float32).T  # [K/block, N]
    return _pack(q, bits), scale.astype(np.float32).reshape(-1), np.ascontiguousarray(offsets)


def on_symmetric_grid(weight: np.ndarray, bits: int, block: int):
    """weight [K, N] -> (packed, scales) as quantize_block_minmax packs them, with the implied zero point
    2^(bits-1), when every block is exactly d * q with |q| <= 2^(bits-1) - 1 (in fp32, as the kernel
    dequantizes it); None otherwise."""
    zero = 1 << (bits - 1)
    blocks = _blocks(weight, block)
    amax = np.abs(blocks).max(axis=-1).astype(np.float64)
    scale = np.where(amax == 0, 1.0, amax / (zero - 1)).astype(np.float32)
    q = np.rint(blocks / scale[..., None])
    if not np.array_equal(scale[..., None] * q.astype(np.float32), blocks):
        return None
    return _pack((q + zero).astype(np.uint8), bits), scale.reshape(-1)


def replace_matmul(model: onnx.ModelProto, node: onnx.NodeProto, weight: np.ndarray, bits: int, block: int,
                   accuracy_level: int) -> None:
    """Rewrites MatMul(x, W) in place as MatMulNBits(x) + MatMul(ReduceSum(x as blocks), offsets), or as
    MatMulNBits(x) alone when W lies on a symmetric grid."""
    symmetric = on_symmetric_grid(weight, bits, block)
    packed, scales, offsets = (*symmetric, None) if symmetric is not None else quantize_block_minmax(weight, bits, block)
    write_nbits(model, node, weight.shape, packed, scales, offsets, bits, block, accuracy_level)


def write_nbits(model: onnx.ModelProto, node: onnx.NodeProto, shape: tuple[int, int], packed: np.ndarray,
                scales: np.ndarray, offsets: np.ndarray | None, bits: int, block: int, accuracy_level: int,
                zero_points: np.ndarray | None = None) -> None:
    """MatMul(x, W [K, N]) -> MatMulNBits over `packed` levels with `scales` (and `zero_points`, packed as the
    op takes them; None: its implied 2^(bits-1)), plus x's block sums times `offsets` [K/block, N] if any."""
    name = node.input[1]
    k, n = shape
    graph = model.graph
    x, y = node.input[0], node.output[0]
    graph.initializer.extend([numpy_helper.from_array(packed, f"{name}_Q{bits}"),
                              numpy_helper.from_array(scales, f"{name}_scales")])
    inputs = [x, f"{name}_Q{bits}", f"{name}_scales"]
    if zero_points is not None:
        graph.initializer.append(numpy_helper.from_array(zero_points, f"{name}_zeros"))
        inputs.append(f"{name}_zeros")
    matmul = helper.make_node("MatMulNBits", inputs,
                              [y if offsets is None else f"{y}_sym"], name=f"{node.name}_nbits", domain="com.microsoft",
                              K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level)
    if offsets is None:
        replace_node(graph, node, [matmul])
        return
    graph.initializer.append(numpy_helper.from_array(offsets, f"{name}_offsets"))
    blocks_name, axis_name = f"blocks_{k}_{block}", "blocksum_axis"
    add_constants(graph, {blocks_name: np.array([-1, k // block, block], np.int64), axis_name: np.array([-1], np.int64)})
    new_nodes = [
        matmul,
        helper.make_node("Reshape", [x, blocks_name], [f"{y}_blocks"], name=f"{node.name}_blocks"),
        helper.make_node("ReduceSum", [f"{y}_blocks", axis_name], [f"{y}_blocksum"], name=f"{node.name}_blocksum",
                         keepdims=0),  # [rows, K / block]; the Add below broadcasts [rows, N] over [1, rows, N]
        helper.make_node("MatMul", [f"{y}_blocksum", f"{name}_offsets"], [f"{y}_offset"], name=f"{node.name}_offset"),
        helper.make_node("Add", [f"{y}_sym", f"{y}_offset"], [y], name=f"{node.name}_add"),
    ]
    replace_node(graph, node, new_nodes)
