"""Moves a graph's weights into one external file, page-aligned, so onnxruntime can map them."""
from __future__ import annotations

from pathlib import Path

import onnx

ALIGN = 4096
INLINE_LIMIT = 1024  # bytes: smaller tensors (shape constants, scalars) stay inside the graph


def external_table(model: onnx.ModelProto, name: str) -> dict | None:
    """Where an externalized float table lies in its weights file (for a reader that maps it itself),
    or None when it is not stored as a plain float32/float16 array."""
    for tensor in model.graph.initializer:
        if tensor.name in (name, f"{name}.fp16") and tensor.data_location == onnx.TensorProto.EXTERNAL:
            dtype = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}.get(tensor.data_type)
            info = {e.key: e.value for e in tensor.external_data}
            if dtype:
                return {"file": info["location"], "offset": int(info["offset"]), "shape": list(tensor.dims),
                        "dtype": dtype}
    return None


def external_tensors(model: onnx.ModelProto) -> list[dict] | None:
    """Every externalized weight with where it lies ({name, offset, shape, dtype}), when all of them are
    plain float32 (a runtime can then hand them to onnxruntime in place); None otherwise."""
    table = []
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if tensor.data_type != onnx.TensorProto.FLOAT:
            return None
        info = {e.key: e.value for e in tensor.external_data}
        table.append({"name": tensor.name, "offset": int(info["offset"]), "shape": list(tensor.dims),
                      "dtype": "float32"})
    return table or None


def externalize(model: onnx.ModelProto, path: Path) -> None:
    """Writes every initializer of at least INLINE_LIMIT bytes to `path` and points the graph at it."""
    with open(path, "wb") as out:
        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_LIMIT:
                continue
            offset = out.tell()
            pad = (-offset) % ALIGN
            out.write(b"\0" * pad)
            offset += pad
            out.write(tensor.raw_data)
            length = len(tensor.raw_data)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
            del tensor.external_data[:]
            for key, value in (("location", path.name), ("offset", str(offset)), ("length", str(length))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
