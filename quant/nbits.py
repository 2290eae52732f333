"""A MatMul weight packed for MatMulNBits, a slice of output columns at a time; an embedding table for
GatherBlockQuantized, a slice of rows at a time; each byte for byte as onnxruntime's quantizer writes it.

onnxruntime's MatMulNBitsQuantizer takes a weight as an initializer in MatMul's [K, N] layout: a graph
builder transposes a checkpoint's [out, in] matrix into it, protobuf copies it, the quantizer copies it
back out, and its kernel holds the interpreter for the whole matrix. MatMulNBits' blocks run along K
within one output column, so columns pack independently and their bytes concatenate: here each slice of
columns is read from the checkpoint's own rows, packed into its rows of the output, and let go. The
peak is the output plus one slice (history.md §86). Symmetric levels follow the kernel's arithmetic in
numpy, which lets go of the interpreter, so the writer's threads pack side by side; asymmetric ones go
through the kernel itself. A table's blocks run along each row: the quantizer's own numpy arithmetic,
element for element, over rows viewed as [rows, blocks, block] instead of its strided walk of one block
column at a time. tests/test_nbits.py holds each against the quantizer.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

SLICE_VALUES = 1 << 23  # float32 values per slice of columns: 32 MiB


def pack_columns(weight: np.ndarray, bits: int, block: int, symmetric: bool):
    """`weight` [K, N] float32, any strides (a checkpoint's [N, K] matrix seen transposed is read row by
    row) -> (packed [N, K/block, block*bits/8] uint8, scales [N, K/block] float32, zero points: None when
    `symmetric`, else [N, ceil(K/block / (8/bits))] uint8), as onnxruntime's quantizer writes them."""
    k, n = weight.shape
    blocks = k // block
    per_byte = 8 // bits
    packed = np.empty((n, blocks, block // per_byte), np.uint8)
    scales = np.empty((n, blocks), np.float32)
    zeros = np.empty((n, -(-blocks // per_byte)), np.uint8)
    kernel = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    step = max(1, SLICE_VALUES // k)
    for start in range(0, n, step):
        stop = min(n, start + step)
        # rows of C-ordered outputs are contiguous: each slice is written in place
        if symmetric:
            _symmetric_rows(_rows(weight, start, stop).reshape(stop - start, blocks, block), bits,
                            packed[start:stop], scales[start:stop])
        else:
            kernel(packed[start:stop], _columns(weight, start, stop), scales[start:stop], zeros[start:stop], block,
                   stop - start, k, symmetric)
    return packed, scales, None if symmetric else zeros


def _symmetric_rows(blocks: np.ndarray, bits: int, packed: np.ndarray, scales: np.ndarray) -> None:
    """Output columns as [columns, K/block, block] -> their levels and scales, by onnxruntime's kernel's own
    arithmetic (MLAS's blockwise quantizer: the block's value of largest magnitude over minus the middle
    level, levels rounded half away from zero from v times the scale's reciprocal, plus the middle level)
    in numpy, which lets go of the interpreter: the writer's two threads pack at once. The bytes equal the
    kernel's (tests/test_nbits.py, ties included)."""
    middle = np.float32(1 << (bits - 1))
    low, high = (t.numpy() for t in torch.aminmax(_read_only(blocks), dim=-1))  # numpy's: twice the time
    scale = np.where(np.abs(high) > np.abs(low), high, low) / -middle
    with np.errstate(divide="ignore"):
        reciprocal = np.where(scale != 0, np.float32(1) / scale, np.float32(0))
    level = blocks * reciprocal[..., None]
    level += middle  # in [0, 2 * middle] but for a rounding error: floor(x + 1/2) is C's roundf there
    level += np.float32(0.5)
    np.floor(level, out=level)
    np.clip(level, 0, 2 * middle - 1, out=level)
    q = level.astype(np.uint8)
    packed[...] = q[..., 0::2] | (q[..., 1::2] << 4) if bits == 4 else q
    scales[...] = scale


def _rows(weight: np.ndarray, start: int, stop: int) -> np.ndarray:
    """Output columns start..stop of `weight` [K, N] as C-ordered rows [stop - start, K]: a checkpoint's own
    rows where `weight` is its matrix seen transposed."""
    return c_order(weight.T[start:stop])


def _columns(weight: np.ndarray, start: int, stop: int) -> np.ndarray:
    """weight[:, start:stop] in C order."""
    return c_order(weight[:, start:stop])


def c_order(array: np.ndarray) -> np.ndarray:
    """`array` in C order; a C-ordered matrix seen transposed (a checkpoint's [out, in] as MatMul's [in, out])
    is copied by torch, blocked and on every core, several times faster than numpy's strided copy."""
    if array.ndim == 2 and array.flags.f_contiguous and not array.flags.c_contiguous and array.size > 1 << 16:
        return _read_only(array.T).t().contiguous().numpy()
    return np.ascontiguousarray(array)


def _read_only(array: np.ndarray) -> torch.Tensor:
    """`array` as a tensor that is only read (a checkpoint's arrays are read-only maps)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def pack_table(table: np.ndarray, block: int, symmetric: bool):
    """`table` [V, H] float32 -> (levels packed two a byte [V * H / 2] uint8, scales [V, H/block] float32, zero
    points packed the same way or None when `symmetric`), as onnxruntime's quantizer writes a 4-bit table
    for GatherBlockQuantized (quantize axis 1)."""
    rows, width = table.shape
    levels = np.empty((rows, width), np.uint8)
    scales = np.empty((rows, width // block), np.float32)
    zeros = None if symmetric else np.empty((rows, width // block), np.uint8)
    step = max(1, SLICE_VALUES // width)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero scale's block: np.where picks its level
        for start in range(0, rows, step):
            _table_slice(table, start, step, block, symmetric, levels, scales, zeros)
    return _two_a_byte(levels), scales, None if zeros is None else _two_a_byte(zeros)


def _table_slice(table, start, step, block, symmetric, levels, scales, zeros) -> None:
    """Rows start..start+step of the table into `levels`, `scales` and `zeros`."""
    width = table.shape[1]
    part = table[start : start + step].reshape(-1, width // block, block)
    high, low = part.max(axis=-1, keepdims=True), part.min(axis=-1, keepdims=True)
    if symmetric:
        scale = np.where(np.abs(high) > np.abs(low), high, low) / -8.0
        q = np.where(scale == 0, 0, part / scale).round().clip(-8, 7).astype(np.int8).view(np.uint8)
    else:
        low, high = np.minimum(low, 0), np.maximum(high, 0)
        scale = (high - low) / 15.0
        zero = np.where(scale == 0, 8, -low / scale).round().clip(0, 15).astype(np.uint8)
        q = np.where(scale == 0, 8, part / scale + zero).round().clip(0, 15).astype(np.uint8)
        zeros[start : start + step] = zero[..., 0]
    levels[start : start + step] = q.reshape(-1, width)
    scales[start : start + step] = scale[..., 0]


def _two_a_byte(levels: np.ndarray) -> np.ndarray:
    flat = levels.reshape(-1)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] & 0xF) | ((flat[1::2] & 0xF) << 4)


def table_replacement(node: onnx.NodeProto, name: str, shape: tuple[int, int], packed: np.ndarray,
                      scales: np.ndarray, zeros: np.ndarray | None, block: int):
    """(the GatherBlockQuantized node for Gather `node` over table `name`, its initializers), as onnxruntime's
    quantizer writes them."""
    kind = onnx.TensorProto.INT4 if zeros is None else onnx.TensorProto.UINT4
    tensors = [helper.make_tensor(f"{name}_Q4", kind, shape, packed.tobytes(), True),
               numpy_helper.from_array(scales, f"{name}_scales")]
    if zeros is not None:
        tensors.append(helper.make_tensor(f"{name}_zero_points", kind, scales.shape, zeros.tobytes(), True))
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    inputs = [tensors[0].name, node.input[1]] + [t.name for t in tensors[1:]]
    gather = helper.make_node("GatherBlockQuantized", inputs, [node.output[0]], name=f"{node.name}_Q4" if node.name else "",
                              domain="com.microsoft", gather_axis=axis, quantize_axis=1, block_size=block)
    return gather, tensors


def packable(weight: np.ndarray, block: int) -> bool:
    """Whether `weight` packs without padding: a float32 matrix whose K is whole blocks (onnxruntime's
    quantizer pads the rest, which this leaves to it)."""
    return weight.ndim == 2 and weight.dtype == np.float32 and weight.shape[0] % block == 0


def replacement(node: onnx.NodeProto, name: str, shape: tuple[int, int], packed: np.ndarray, scales: np.ndarray,
                zeros: np.ndarray | None, bits: int, block: int, accuracy_level: int):
    """(the MatMulNBits node for MatMul `node` reading weight `name` [K, N], its initializers): named and
    ordered as onnxruntime's quantizer names and orders them."""
    k, n = shape
    tensors = [numpy_helper.from_array(packed, f"{name}_Q{bits}"), numpy_helper.from_array(scales, f"{name}_scales")]
    if zeros is not None:
        tensors.append(numpy_helper.from_array(zeros, f"{name}_zero_points"))
    attributes = {"K": k, "N": n, "bits": bits, "block_size": block}
    if accuracy_level:  # as the quantizer: an unset level is left out, not written as 0
        attributes["accuracy_level"] = accuracy_level
    matmul = helper.make_node("MatMulNBits", [node.input[0]] + [t.name for t in tensors], [node.output[0]],
                              name=f"{node.name}_Q{bits}" if node.name else "", domain="com.microsoft", **attributes)
    return matmul, tensors
