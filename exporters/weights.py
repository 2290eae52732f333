"""Moves a graph's weights into one external file, page-aligned, so onnxruntime can map them."""
from __future__ import annotations

from pathlib import Path

import onnx

ALIGN = 4096
INLINE_LIMIT = 1024  # bytes: smaller tensors (shape constants, scalars) stay inside the graph


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
