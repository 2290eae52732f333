"""Writes one model's weights once, to a file every graph of that model points into."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ALIGN = 4096  # page-aligned so onnxruntime can memory-map each tensor


def write_weights(path: Path, weights: dict[str, np.ndarray]) -> dict[str, onnx.TensorProto]:
    """Writes `weights` to `path`; returns TensorProtos that reference it as external data."""
    refs: dict[str, onnx.TensorProto] = {}
    with open(path, "wb") as out:
        for name, array in weights.items():
            offset = out.tell()
            pad = (-offset) % ALIGN
            out.write(b"\0" * pad)
            offset += pad
            data = np.ascontiguousarray(array).tobytes()
            out.write(data)
            tensor = numpy_helper.from_array(np.zeros(0, dtype=array.dtype), name)
            tensor.ClearField("raw_data")
            tensor.dims[:] = array.shape
            tensor.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", path.name), ("offset", str(offset)), ("length", str(len(data)))):
                entry = tensor.external_data.add()
                entry.key, entry.value = key, value
            refs[name] = tensor
    return refs
