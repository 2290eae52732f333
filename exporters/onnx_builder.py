"""A small helper to write ONNX graphs node by node, with weights kept apart for external storage."""
from __future__ import annotations

import heapq
import json
import itertools
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import numpy as np
import onnx
from edgespec.quant.nbits import c_order
from onnx import TensorProto, helper, numpy_helper

OPSET = 21  # int4 tensors (MatMulNBits weights) need opset 21 and IR version 10
# the graph's metadata key for where each layer begins: the residual stream and the branch not yet added to
# it, by layer index (the last entry: after the last layer), so a graph can be cut into stages later
# (exporters/restage.py) exactly where the builder would have cut it
LAYER_BOUNDARIES_KEY = "edgespec.layer_boundaries"


class WeightSink(Protocol):
    """Where a graph's weights go as it is built (exporters/weight_stream.py): `submit` takes a run of nodes
    and the float32 weights they read and starts quantizing them (in the background); `finish`, called
    in the order of the submissions, returns the nodes that replace them with the initializers they read,
    already stored outside the graph."""

    def submit(self, nodes: list[onnx.NodeProto], weights: dict[str, np.ndarray]) -> Future: ...

    def finish(self, job: Future) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]: ...


IN_FLIGHT = 2  # parts a sink quantizes while the builder reads the next: each holds a layer's weights


class _Pending:
    """A flushed run of nodes in the graph's node list, while the sink quantizes it."""

    def __init__(self, job: Future):
        self.job = job


class GraphBuilder:
    """Collects nodes, graph inputs/outputs and initializers.

    Weights (`weight`) are recorded by name under the builder's canonical names (`embed_tokens`,
    `layers.3.qkv`, `lm_head`, ...), which quantization policies refer to; small constants (`const`)
    are deduplicated. With a `sink`, `flush` hands the nodes added since the last flush and the weights
    they read to it, and the builder keeps only what it returns: a model is written a layer at a time
    and never held whole in float32. A weight read again later (a tied head's table) is marked `last`:
    it is written with the nodes of the final flush.
    """

    def __init__(self, name: str, sink: WeightSink | None = None):
        self.name = name
        self.sink = sink
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.constants: list[onnx.TensorProto] = []
        self.weights: dict[str, np.ndarray | Callable[[], np.ndarray]] = {}
        self.written: list[onnx.TensorProto] = []  # initializers the sink stored
        self._last: set[str] = set()
        self._flushed = 0  # nodes (and _Pending runs) before this index went through the sink
        self._pending: list[_Pending] = []
        self._ids = itertools.count()
        self._const_cache: dict[tuple, str] = {}
        self.boundaries: dict[int, tuple[str, str | None]] = {}

    def mark_boundary(self, layer: int, hidden: str, branch: str | None) -> None:
        """Records the tensors that enter `layer` (LAYER_BOUNDARIES_KEY)."""
        self.boundaries[layer] = (hidden, branch)

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

    def weight(self, name: str, array: np.ndarray | Callable[[], np.ndarray], last: bool = False) -> str:
        """`array`, or a function that reads it when it is written; `last`: read by nodes still to come
        after the next flush."""
        self.weights[name] = array  # as it lies: a sink packs some from a checkpoint's own layout
        if last:
            self._last.add(name)
        return name

    def flush(self, final: bool = False, wait: bool = False) -> None:
        """Through the sink: the nodes since the last flush, with the weights they read (`final`: every
        weight left, with the earlier nodes that read one). A part is quantized while the next is built;
        its nodes take their place in order. `wait`: this part is quantized before anything more is read."""
        if self.sink is None:
            return
        if final:
            self._resolve(0)
        segment = self.nodes[self._flushed:]
        if final and self._last:  # the earlier readers of a weight marked `last` go with the final segment
            earlier = [n for n in self.nodes[: self._flushed] if set(n.input) & self._last]
            self.nodes[: self._flushed] = [n for n in self.nodes[: self._flushed] if not set(n.input) & self._last]
            self._flushed -= len(earlier)
            segment = earlier + segment
        read = {name for node in segment for name in node.input}
        ready = [name for name in self.weights if name in read and (final or name not in self._last)]
        if ready:
            pending = _Pending(self.sink.submit(segment, {name: _read(self.weights.pop(name)) for name in ready}))
            self._pending.append(pending)
            segment = [pending]
        self.nodes[self._flushed:] = segment
        self._flushed = len(self.nodes)
        self._resolve(0 if final or wait else IN_FLIGHT)
        if final and self._last:
            self.nodes = topological(self.nodes, {i.name for i in self.inputs}
                                     | {t.name for t in self.constants + self.written})

    def _resolve(self, keep: int) -> None:
        """Puts the quantized nodes of all but the last `keep` pending parts in their places, oldest first
        (the sink stores their weights in this order)."""
        while len(self._pending) > keep:
            pending = self._pending.pop(0)
            nodes, stored = self.sink.finish(pending.job)
            self.written.extend(stored)
            at = next(i for i, node in enumerate(self.nodes) if node is pending)
            self.nodes[at : at + 1] = nodes
            self._flushed += len(nodes) - 1

    def input(self, name: str, elem_type: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, source: str, name: str, elem_type: int, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [source], [name], name=self.fresh("out")))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def to_model(self) -> onnx.ModelProto:
        """The graph: with a sink, its weights where the sink stored them; else inline (the bundle writer
        moves them to an external file)."""
        self.flush(final=True)
        initializers = self.constants + self.written + [numpy_helper.from_array(_array(array), name)
                                                        for name, array in self.weights.items()]
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)], producer_name="edgespec")
        model.ir_version = 10
        if self.boundaries:
            helper.set_model_props(model, {LAYER_BOUNDARIES_KEY: json.dumps(
                {str(layer): list(names) for layer, names in sorted(self.boundaries.items())})})
        return model


def _read(value) -> np.ndarray:
    return value() if callable(value) else value


def _array(value) -> np.ndarray:
    return c_order(_read(value))


def topological(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where every input is produced before it is read, as close to the given order as
    that allows (of the nodes whose inputs are ready, the earliest goes first)."""
    producer = {name: i for i, node in enumerate(nodes) for name in node.output}
    readers: dict[int, list[int]] = {}
    waits = []
    for i, node in enumerate(nodes):
        before = {producer[name] for name in node.input if name and name not in available and name in producer}
        for j in before:
            readers.setdefault(j, []).append(i)
        waits.append(len(before))
    ready = [i for i, count in enumerate(waits) if count == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for j in readers.get(i, ()):
            waits[j] -= 1
            if waits[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        raise ValueError(f"graph nodes read each other's outputs in a cycle ({len(nodes) - len(order)} nodes)")
    return order


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
BOOL = TensorProto.BOOL
