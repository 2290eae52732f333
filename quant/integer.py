"""int8 matmuls whose every row is computed in integers: the same bits at any row count.

MatMulNBits (and MLAS sgemm) round a one-row product differently from a multi-row one, so an exact
pass must pad a one-token step to two rows (runtime/execution/model.py, MIN_ROWS): a third of a plain step
(benchmarks/history.md §40). Here the product is

    x . W  ~=  s_x[row] * s_w[col] * sum_k qx[row, k] * qw[k, col]

with qw uint8 per output channel (asymmetric, a zero point per channel), qx the row's activations
quantized to 8 bits at run time (symmetric, one scale per row: amax / 127, stored as uint8 around 128),
and the sum accumulated by MatMulInteger in int32, which is exact in any order. Everything else is
elementwise or a row's own reduction, so a row's result never depends on its neighbours: a one-token
step needs no padding row and runs the one-row kernel.

u8 x u8: MLAS's u8 x s8 kernel on AVX2 without VNNI adds pairs of products in int16 with saturation
(255 * 127 * 2 overflows), which costs perplexity; 7-bit weights avoid it at a smaller cost;
u8 x u8 widens to int16 first and is as fast here (history.md §41).

One scale per row lets a few channels that are always large take the row's precision (history.md
§41), so each input channel k is first divided by s_k = amax_k^a / wmax_k^(1-a) and the
weight's row k multiplied by it (SmoothQuant, a = SMOOTHING): amax_k from a calibration pass
(calibrate.py), wmax_k the weight row's largest magnitude.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .rewrite import add_constants, replace_node

SMOOTHING = 0.3  # the strength that kept perplexity at fp32's among those tried (history.md §41)

_SHARED = {  # constants every rewritten matmul reads
    "int_rows_axis": np.array([-1], np.int64),
    "int_qmax": np.array(127, np.float32),
    "int_zero": np.array(128, np.float32),
    "int_zero_u8": np.array(128, np.uint8),
    "int_tiny": np.array(np.finfo(np.float32).tiny, np.float32),  # an all-zero row (padding) divides by this
}


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """weight [K, N] -> (uint8 [K, N], scales [N], zero points uint8 [N]): asymmetric, one scale and zero
    point per output channel (min-max)."""
    w = weight.astype(np.float64)
    low, high = np.minimum(w.min(axis=0), 0.0), np.maximum(w.max(axis=0), 0.0)  # zero stays exact
    scale = np.where(high > low, (high - low) / 255.0, 1.0)
    zero = np.clip(np.rint(-low / scale), 0, 255)
    q = np.clip(np.rint(w / scale) + zero, 0, 255).astype(np.uint8)
    return q, scale.astype(np.float32), zero.astype(np.uint8)


def _quantize_rows(graph: onnx.GraphProto, x: str) -> list[onnx.NodeProto]:
    """Nodes that give x's rows as uint8 (`{x}_q8`) with their scales (`{x}_q8scale`, [rows, 1]); one set per
    input, however many matmuls read it."""
    names = {n for node in graph.node for n in node.output}
    if f"{x}_q8" in names:
        return []
    return [
        helper.make_node("Abs", [x], [f"{x}_abs"], name=f"{x}_abs"),
        helper.make_node("ReduceMax", [f"{x}_abs", "int_rows_axis"], [f"{x}_amax"], name=f"{x}_amax", keepdims=1),
        helper.make_node("Max", [f"{x}_amax", "int_tiny"], [f"{x}_amax_safe"], name=f"{x}_amax_safe"),
        helper.make_node("Div", [f"{x}_amax_safe", "int_qmax"], [f"{x}_q8scale"], name=f"{x}_q8scale"),
        helper.make_node("Div", [x, f"{x}_q8scale"], [f"{x}_scaled"], name=f"{x}_scaled"),
        helper.make_node("Round", [f"{x}_scaled"], [f"{x}_rounded"], name=f"{x}_rounded"),
        helper.make_node("Add", [f"{x}_rounded", "int_zero"], [f"{x}_shifted"], name=f"{x}_shifted"),
        helper.make_node("Cast", [f"{x}_shifted"], [f"{x}_q8"], name=f"{x}_q8", to=onnx.TensorProto.UINT8),
    ]


def smoothing_scales(activation_max: np.ndarray, weight: np.ndarray, strength: float = SMOOTHING) -> np.ndarray:
    """s [K] per input channel: x / s and s * W keep x . W and even out the channels' ranges."""
    weight_max = np.abs(weight).max(axis=1).astype(np.float64)
    activation_max = np.asarray(activation_max, np.float64)
    usable = (activation_max > 0) & (weight_max > 0)
    s = np.ones_like(weight_max)
    s[usable] = activation_max[usable] ** strength / weight_max[usable] ** (1 - strength)
    return s.astype(np.float32)


def replace_matmul(model: onnx.ModelProto, node: onnx.NodeProto, weight: np.ndarray,
                   activation_max: np.ndarray | None) -> None:
    """Rewrites MatMul(x, W) in place as row-quantized x times uint8 W, accumulated in int32;
    `activation_max` [K] (calibrate.py) smooths x's channels first, None leaves them."""
    graph = model.graph
    name = node.input[1]
    if activation_max is not None:
        smooth = smoothing_scales(activation_max, weight)
        weight = weight * smooth[:, None]
        graph.initializer.append(numpy_helper.from_array(1.0 / smooth, f"{name}_smooth"))
        smoothed = f"{node.input[0]}_for_{name}"
        graph.node.insert(list(graph.node).index(node),
                          helper.make_node("Mul", [node.input[0], f"{name}_smooth"], [smoothed], name=f"{name}_smooth"))
        node.input[0] = smoothed
    q, scales, zero = quantize_columns(weight)
    add_constants(graph, _SHARED)
    graph.initializer.extend([numpy_helper.from_array(q, f"{name}_I8"), numpy_helper.from_array(scales, f"{name}_I8scale"),
                              numpy_helper.from_array(zero, f"{name}_I8zero")])
    x, y = node.input[0], node.output[0]
    new_nodes = _quantize_rows(graph, x) + [
        helper.make_node("MatMulInteger", [f"{x}_q8", f"{name}_I8", "int_zero_u8", f"{name}_I8zero"], [f"{y}_i32"], name=f"{node.name}_int"),
        helper.make_node("Cast", [f"{y}_i32"], [f"{y}_f32"], name=f"{node.name}_float", to=onnx.TensorProto.FLOAT),
        helper.make_node("Mul", [f"{y}_f32", f"{x}_q8scale"], [f"{y}_rows"], name=f"{node.name}_rowscale"),
        helper.make_node("Mul", [f"{y}_rows", f"{name}_I8scale"], [y], name=f"{node.name}_colscale"),
    ]
    replace_node(graph, node, new_nodes)
