"""Moves a graph's weights into one external file, page-aligned, so onnxruntime can map them."""
from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import onnx

ALIGN = 4096
INLINE_LIMIT = 1024  # bytes: smaller tensors (shape constants, scalars) stay inside the graph


FLOATS = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}
NIBBLES = {onnx.TensorProto.UINT4: "uint4", onnx.TensorProto.INT4: "int4"}
GATHER_QUANTIZED = "GatherBlockQuantized"


def external_table(model: onnx.ModelProto, name: str) -> dict | None:
    """Where an externalized table lies in its weights file, for a reader that maps it and indexes it
    itself (runtime/execution/embedding.py): a plain float32/float16 array, or GatherBlockQuantized's
    4-bit levels with their scales and zero points, gathered by row and quantized along the row. None
    for any other form: the runtime then runs the graph."""
    inits = {t.name: t for t in model.graph.initializer}
    for tensor_name in (name, f"{name}.fp16"):
        tensor = inits.get(tensor_name)
        if tensor is not None and tensor.data_type in FLOATS and _where(tensor):
            return {**_where(tensor), "shape": list(tensor.dims), "dtype": FLOATS[tensor.data_type]}
    for node in model.graph.node:
        if node.op_type == GATHER_QUANTIZED and node.input[0].startswith(name):
            return _quantized_table(node, inits)
    return None


def _quantized_table(node: onnx.NodeProto, inits: dict) -> dict | None:
    """GatherBlockQuantized's table where the reader computes its rows as the operator does: 4-bit levels
    gathered by row, blocks along the row, float32 scales (fp16 ones make the operator compute in half
    precision), zero points of the levels' type, every part in one weights file."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    levels, scales = inits.get(node.input[0]), inits.get(node.input[2])
    zero = inits.get(node.input[3]) if len(node.input) > 3 and node.input[3] else None
    block = int(attrs.get("block_size", 128))
    if levels is None or scales is None or levels.data_type not in NIBBLES or len(levels.dims) != 2:
        return None
    if (attrs.get("gather_axis", 0), attrs.get("quantize_axis", 1), attrs.get("bits", 4)) != (0, 1, 4) \
            or levels.dims[1] % block or scales.data_type != onnx.TensorProto.FLOAT \
            or (zero is not None and zero.data_type != levels.data_type):
        return None
    parts = [levels, scales] + ([zero] if zero is not None else [])
    if not all(_where(t) for t in parts) or len({_where(t)["file"] for t in parts}) != 1:
        return None
    return {**_where(levels), "shape": list(levels.dims), "dtype": NIBBLES[levels.data_type], "block_size": block,
            "scales": {"offset": _where(scales)["offset"], "dtype": "float32"},
            **({"zero_points": {"offset": _where(zero)["offset"]}} if zero is not None else {})}


def _where(tensor: onnx.TensorProto) -> dict | None:
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    return {"file": info["location"], "offset": int(info["offset"])}


def external_tensors(model: onnx.ModelProto) -> list[dict] | None:
    """Every externalized weight with where it lies ({name, offset, shape, dtype}), when all of them are
    plain float32 (a runtime can then hand them to onnxruntime in place); None otherwise."""
    table = []
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if tensor.data_type != onnx.TensorProto.FLOAT:
            return None
        table.append({"name": tensor.name, "offset": _where(tensor)["offset"], "shape": list(tensor.dims),
                      "dtype": "float32"})
    return table or None


def externalize(model: onnx.ModelProto, path: Path) -> None:
    """Writes every initializer of at least INLINE_LIMIT bytes to `path` and points the graph at it; a
    quantized table's parts whatever their size, so that a runtime can map the table whole."""
    with open(path, "wb") as out:
        append_external(model, out, path.name)


def append_external(model: onnx.ModelProto, out: BinaryIO, location: str) -> None:
    """`externalize` onto the end of an open weights file (`location`, its name beside the graph): an export
    writes a graph's weights a part at a time (exporters/weight_stream.py)."""
    tables = {name for node in model.graph.node if node.op_type == GATHER_QUANTIZED
              for i, name in enumerate(node.input) if i != 1}
    for tensor in model.graph.initializer:
        if not tensor.HasField("raw_data") or (len(tensor.raw_data) < INLINE_LIMIT and tensor.name not in tables):
            continue
        offset = out.tell()
        pad = (-offset) % ALIGN
        out.write(b"\0" * pad)
        offset += pad
        out.write(tensor.raw_data)
        point_external(tensor, location, offset, len(tensor.raw_data))


def point_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """Makes `tensor` read its bytes from `location` at `offset` instead of carrying them."""
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    del tensor.external_data[:]
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
