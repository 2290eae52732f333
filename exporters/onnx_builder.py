"""A small helper to write ONNX graphs node by node, with weights kept apart for external storage."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 21  # int4 tensors (MatMulNBits weights) need opset 21 and IR version 10


class GraphBuilder:
    """Collects nodes, graph inputs/outputs and initializers.

    Weights (`weight`) are recorded by name under the builder's canonical names (`embed_tokens`,
    `layers.3.qkv`, `lm_head`, ...), which quantization policies refer to; small constants (`const`)
    are deduplicated.
    """

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.weights: dict[str, np.ndarray] = {}
        self._ids = itertools.count()
        self._const_cache: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    def op(self, op_type: str, inputs: list[str], hint: str | None = None, n_out: int = 1, **attrs):
        outs = [self.fresh(hint or op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.fresh(op_type), **attrs))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.fresh("const")
            self.constants.append(numpy_helper.from_array(array, name))
            self._const_cache[key] = name
        return self._const_cache[key]

    def weight(self, name: str, array: np.ndarray) -> str:
        self.weights[name] = np.ascontiguousarray(array)
        return name

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, source: str, name: str, elem_type: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [name], name=self.fresh("out")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def to_model(self) -> onnx.ModelProto:
        """The graph with its weights inline; the bundle writer moves them to an external file."""
        initializers = self.constants + [numpy_helper.from_array(array, name) for name, array in self.weights.items()]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)], producer_name="edgespec")
        model.ir_version = 10
        return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL
