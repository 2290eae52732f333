"""A graph's weights quantized and written as the graph is built, a layer at a time.

The graph builder (exporters/onnx_builder.py) hands each layer's nodes and float32 weights to a
`StreamedWeights`: it quantizes them by the policy exactly as quant/apply.py quantizes a whole graph
(the same rewrites, applied to the nodes that read each weight) on a worker thread while the builder
reads the next layer, appends what they became to the graph's weights file in the graph's order, and
returns the nodes and initializers that stand for them. The float32 arrays are let go as soon as a
layer is written, so an export holds a few layers' weights at a time (IN_FLIGHT), whatever the size.
"""
from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from edgespec.quant.apply import check_policy_names, packs_directly, quantize_model
from edgespec.quant.nbits import c_order, packable
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.contract.errors import ExportError
from onnx import helper
from tqdm import tqdm

from .onnx_builder import IN_FLIGHT, OPSET
from .weights import append_external, point_external


@dataclass(frozen=True)
class Stored:
    """Where a weight's bytes lie in a bundle's weights file (`folder`/`location`)."""
    folder: Path
    location: str
    offset: int
    length: int

    @classmethod
    def of(cls, tensor: onnx.TensorProto, folder: Path) -> Stored:
        info = {e.key: e.value for e in tensor.external_data}
        return cls(folder, info["location"], int(info["offset"]), int(info["length"]))

    def holds(self, data: bytes) -> bool:
        """Whether these are `data`'s bytes: read back only for a weight of the same name, so a graph that
        reuses nothing pays nothing."""
        if len(data) != self.length:
            return False
        with open(self.folder / self.location, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length) == data

    def point(self, tensor: onnx.TensorProto) -> None:
        """Makes `tensor` (the same bytes) read them from here instead of carrying its own."""
        point_external(tensor, self.location, self.offset, self.length)


class StreamedWeights:
    """The sink of one graph's weights: `path` is its weights file, opened on entering and closed on leaving.
    `applied` collects {weight name: scheme} as quant/apply.py's quantize_model returns it. `parts`: how
    many flushes the graph's build makes (its layers and the rest), for the progress bar."""

    def __init__(self, path: Path, policy: QuantPolicy, maxima: dict | None = None, grids: dict | None = None,
                 parts: int = 0, label: str = "", reuse: dict | None = None):
        self.path, self.policy, self.maxima, self.grids = Path(path), policy, maxima, grids
        self.applied: dict[str, str] = {}
        # {name: Stored}: where this graph stored each weight; `reuse` is another graph's, whose copy is read
        # instead of storing the same bytes again
        self.index: dict[str, Stored] = {}
        self.reuse = reuse or {}
        self._stored: set[str] = set()
        self._file = None
        self._bar = tqdm(total=parts, desc=label or self.path.stem, unit="part", file=sys.stderr, leave=False,
                         disable=parts < 2)

    def __enter__(self) -> StreamedWeights:
        self._file = open(self.path, "wb")
        self._workers = ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="quantize")
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._workers.shutdown(wait=True, cancel_futures=True)
            self._file.close()  # its last writes: a full disk or a file size limit shows here
        finally:
            self._bar.close()  # before the error is printed, not on the line after it

    def submit(self, nodes: list[onnx.NodeProto], weights: dict[str, np.ndarray]) -> Future:
        """Starts quantizing `nodes` with `weights` (float32, by name) on a worker thread: onnxruntime's
        quantizer and numpy let go of the interpreter, so a part is quantized while the next is read."""
        part = helper.make_model(helper.make_graph(nodes, "part", [], []),
                                 opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
        part.ir_version = 10
        packed = self._packed_in_place(nodes, weights)
        for name in list(weights):  # into the part's own message: one copy of each array, not numpy_helper's two
            array = c_order(weights.pop(name))
            tensor = part.graph.initializer.add()
            tensor.name, tensor.data_type = name, onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
            tensor.dims.extend(array.shape)
            # protobuf takes only bytes and copies them into its arena: the array goes before that copy, so a
            # vocabulary table (an 8B body's) is held twice at most, not three times
            data = array.tobytes()
            del array
            tensor.raw_data = data
            del data
        return self._workers.submit(self._quantize, part, packed)

    def _packed_in_place(self, nodes: list[onnx.NodeProto], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The weights quant/nbits.py packs from where they lie (taken out of `weights`), never copied into the
        part: each read by one MatMul, or the head's Gemm over a checkpoint's [out, in] matrix (quantize_model
        unties it into a MatMul over its transpose), under a scheme onnxruntime's n-bit kernel writes."""
        readers: dict[str, list[onnx.NodeProto]] = {}
        for node in nodes:
            for name in node.input:
                readers.setdefault(name, []).append(node)
        block = self.policy.default.block_size
        taken = {}
        for name, array in list(weights.items()):
            node = readers.get(name, [None])[0]
            if len(readers.get(name, ())) != 1 or node.input[1:2] != [name]:
                continue
            if node.op_type == "MatMul":
                direct = packs_directly(self.policy, name, self.grids) and packable(array, block)
            else:
                trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
                direct = (node.op_type == "Gemm" and trans_b == 1 and len(node.input) == 2
                          and packs_directly(self.policy, "lm_head", self.grids) and packable(array.T, block))
            if direct:
                taken[name] = weights.pop(name)
        return taken

    def _quantize(self, part: onnx.ModelProto, packed: dict[str, np.ndarray]) -> tuple[onnx.ModelProto, dict[str, str]]:
        try:
            return part, quantize_model(part, self.policy, strict=False, activation_maxima=self.maxima, grids=self.grids,
                                        arrays=packed)
        except ValueError as err:
            raise ExportError(str(err)) from err

    def finish(self, job: Future) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
        """A submitted part, quantized, its weights stored: (its nodes, their initializers). Called in the
        order of the submissions, so the weights file is written in the graph's order."""
        part, applied = job.result()
        self.applied.update(applied)
        carried = {t.name for t in part.graph.initializer if t.HasField("raw_data")}
        for tensor in part.graph.initializer:
            stored = self.reuse.get(tensor.name)
            if stored is not None and tensor.HasField("raw_data") and stored.holds(tensor.raw_data):
                stored.point(tensor)
        append_external(part, self._file, self.path.name)
        for tensor in part.graph.initializer:
            if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name in carried:
                self.index.setdefault(tensor.name, Stored.of(tensor, self.path.parent))
        # constants a rewrite adds to every part it touches (the offsets' block shapes) are stored once
        stored = [_detached(t) for t in part.graph.initializer if t.name not in self._stored]
        self._stored.update(t.name for t in stored)
        self._bar.update(1)
        return [_detached(n) for n in part.graph.node], stored

    def check_policy(self) -> None:
        """After the whole graph: a policy pattern that named none of its weights is an error."""
        check_policy_names(self.policy, {name for name, scheme in self.applied.items()
                                         if not scheme.startswith("gguf")})


def _detached(message):
    """A copy of a part's node or initializer that does not keep the part alive: protobuf allocates a message
    and everything in it from one arena, freed only with the last reference into it, so holding the part's
    own nodes would hold its float32 weights (cleared fields do not give their bytes back)."""
    copy = type(message)()
    copy.ParseFromString(message.SerializeToString())
    return copy
