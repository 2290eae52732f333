"""Small in-place edits of an ONNX graph shared by the matmul rewrites (offsets.py, integer.py)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper


def replace_node(graph: onnx.GraphProto, node: onnx.NodeProto, new_nodes: list[onnx.NodeProto]) -> None:
    """Puts `new_nodes` where `node` was, in order (the graph stays topologically sorted)."""
    position = list(graph.node).index(node)
    graph.node.remove(node)
    for i, new in enumerate(new_nodes):
        graph.node.insert(position + i, new)


def add_constants(graph: onnx.GraphProto, constants: dict[str, np.ndarray]) -> None:
    """Adds the initializers the graph does not hold yet (constants several rewrites share)."""
    known = {t.name for t in graph.initializer}
    graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in constants.items() if name not in known)
