"""Applies a quantization policy to a model graph with onnxruntime's own weight-only quantizer.

int8/int4 weights of MatMul nodes become MatMulNBits (asymmetric schemes: symmetric MatMulNBits plus
exact float block offsets, see offsets.py), the embedding Gather becomes GatherBlockQuantized; fp16 weights are stored in half precision behind a Cast (computed in fp32 on
the CPU). Norms, biases and rope tables stay fp32: they are small and precision-critical.
"""
from __future__ import annotations

import fnmatch
import logging

import numpy as np
import onnx
from edgespec.runtime.contract.errors import InputError
from onnx import helper, numpy_helper
from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

from . import integer
from .gguf_grid import BlockGrid, matmul_nbits_inputs
from .nbits import pack_columns, pack_table, replacement, table_replacement
from .offsets import replace_matmul, write_nbits
from .rewrite import replace_node
from .schemes import QuantPolicy


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def untie_head(model: onnx.ModelProto, head_name: str = "lm_head", arrays: dict[str, np.ndarray] | None = None,
               packed: bool = False) -> None:
    """Gemm(x, E, transB=1) -> MatMul(x, E^T): MatMulNBits quantizes MatMul weights only. `arrays`: weights
    held outside the graph (by name; the head's among them when `packed`, for pack_columns to read E^T
    where it lies instead of a transposed copy in the graph)."""
    arrays = {} if arrays is None else arrays
    inits = _initializers(model)
    for node in model.graph.node:
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        if node.op_type != "Gemm" or trans_b != 1 or len(node.input) != 2:
            continue
        if node.input[1] not in inits and node.input[1] not in arrays:
            continue
        weight = arrays.pop(node.input[1]) if node.input[1] in arrays else numpy_helper.to_array(inits[node.input[1]])
        if node.input[1] == head_name and head_name in inits:
            model.graph.initializer.remove(inits[head_name])
        if packed:
            arrays[head_name] = weight.T
        else:
            model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), head_name))
        node.op_type = "MatMul"
        node.input[1] = head_name
        del node.attribute[:]


def packs_directly(policy: QuantPolicy, name: str, grids: dict | None = None) -> bool:
    """Whether MatMul weight `name` goes to onnxruntime's n-bit kernel as it is (not a GGUF grid, an integer
    matmul, float offsets or a float type): what quant/nbits.py packs without the graph holding it."""
    scheme = policy.scheme_for(name)
    if scheme.bits is None or name in (grids or {}):
        return False
    if scheme.bits == 8 and policy.default.integer_matmul:
        return False
    return policy.default.symmetric or policy.default.integer_zero_points


def _drop_unused_initializers(model: onnx.ModelProto) -> None:
    used = {name for node in model.graph.node for name in node.input}
    for tensor in [t for t in model.graph.initializer if t.name not in used]:
        model.graph.initializer.remove(tensor)


EMBEDDING = "embed_tokens"  # the one table a Gather reads that is a weight (exporters/llama.py's name)


def _weight_nodes(model: onnx.ModelProto, arrays: dict | None = None) -> dict[str, list[onnx.NodeProto]]:
    inits = set(_initializers(model)) | set(arrays or ())
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm") and node.input[1] in inits:
            users.setdefault(node.input[1], []).append(node)
        # not the rotary tables a Gather may read; nor, in a part of a graph, a table another part holds
        elif node.op_type == "Gather" and node.input[0] == EMBEDDING and EMBEDDING in inits:
            users.setdefault(node.input[0], []).append(node)
    return users


def _store_half(model: onnx.ModelProto, names: list[str]) -> None:
    inits = _initializers(model)
    for name in names:
        tensor = inits[name]
        half = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float16), f"{name}.fp16")
        model.graph.initializer.remove(tensor)
        model.graph.initializer.append(half)
        model.graph.node.insert(0, helper.make_node("Cast", [half.name], [name], name=f"{name}.cast",
                                                    to=onnx.TensorProto.FLOAT))


def quantize_model(model: onnx.ModelProto, policy: QuantPolicy, strict: bool = True,
                   activation_maxima: dict[str, np.ndarray] | None = None,
                   grids: dict[str, BlockGrid] | None = None, arrays: dict[str, np.ndarray] | None = None) -> dict[str, str]:
    """Quantizes `model` in place; returns {weight name: scheme} for every matmul/embedding weight.
    `strict`: a policy pattern that names no weight of this graph is an error (a stage holds only
    some of the model's weights, so its patterns are checked on the whole model instead).
    `activation_maxima`: calibrate.py's, for integer matmuls (measured on the whole model: a stage
    cannot measure its own). `grids`: weights that keep a GGUF file's own blocks (gguf_grid.py), by name.
    `arrays`: MatMul weights ([K, N] float32, any strides) the graph reads but does not hold, each one
    that `packs_directly`; they are packed from where they lie and the dict is emptied."""
    grids = grids or {}
    arrays = {} if arrays is None else arrays
    head, embedding = policy.scheme_for("lm_head"), policy.scheme_for("embed_tokens")
    if head.bits or head.name != embedding.name or "lm_head" in grids:
        # MatMulNBits needs a MatMul; a tied head needs its own copy
        untie_head(model, arrays=arrays, packed=packs_directly(policy, "lm_head", grids))
        _drop_unused_initializers(model)  # a head-only stage no longer needs the embedding table
    users = _weight_nodes(model, arrays)  # before the grids' rewrite: their offsets' small matmuls stay fp32
    kept = _apply_grids(model, grids, policy.default.accuracy_level)
    users = {name: nodes for name, nodes in users.items() if name not in kept}
    if strict:
        check_policy_names(policy, set(users))
    applied = {name: policy.scheme_for(name).name for name in users}
    for name, nodes in users.items():
        if applied[name] == "int8" and nodes[0].op_type == "Gather":
            if dict(policy.overrides).get(name) == "int8":  # asked for by name, not by a default or a glob
                raise InputError(f"the quantization policy asks for {name}: int8, but onnxruntime's "
                                 "GatherBlockQuantized stores 4-bit tables only: use int4, fp16 or fp32")
            applied[name] = "fp32"  # GatherBlockQuantized stores 4-bit tables only
    _store_half(model, [n for n, s in applied.items() if s == "fp16"])
    if policy.default.integer_matmul:
        _apply_integer(model, users, applied, activation_maxima or {})
    if not policy.default.symmetric and not policy.default.integer_zero_points:
        _apply_offsets(model, users, applied, policy)
    _apply_nbits(model, applied, policy, arrays)
    if "lm_head" not in applied and "lm_head" not in kept and "embed_tokens" in applied:
        applied["lm_head"] = applied["embed_tokens"]  # a tied head reads the embedding table as stored
    return {**kept, **applied}


def check_policy_names(policy: QuantPolicy, names: set[str]) -> None:
    """A policy pattern that names none of a model's weights (`names`, the ones it quantizes) is a mistake."""
    unmatched = [pattern for pattern, _ in policy.overrides
                 if not any(fnmatch.fnmatchcase(name, pattern) for name in names | {"lm_head"})]
    if unmatched:
        raise InputError(f"the quantization policy names no weight of this model: {', '.join(unmatched)} "
                         f"(weights are named like {', '.join(sorted(names)[:4])}, ...)")


def _apply_grids(model: onnx.ModelProto, grids: dict[str, BlockGrid], accuracy_level: int) -> dict[str, str]:
    """MatMul weights named in `grids` become MatMulNBits over the GGUF's own blocks; returns {name: "gguf TYPE"}."""
    inits = _initializers(model)
    kept = {}
    for name, nodes in _weight_nodes(model).items():
        if name not in grids or nodes[0].op_type != "MatMul":
            continue
        packed, scales, zeros, offsets = matmul_nbits_inputs(grids[name])
        for node in nodes:
            write_nbits(model, node, numpy_helper.to_array(inits[name]).shape, packed, scales, offsets,
                        grids[name].bits, grids[name].block, accuracy_level, zeros)
        model.graph.initializer.remove(inits[name])
        kept[name] = f"gguf {grids[name].kind}"
    return kept


def _apply_integer(model: onnx.ModelProto, users, applied: dict[str, str], maxima: dict[str, np.ndarray]) -> None:
    """int8 matmul weights become MatMulInteger over per-row int8 activations (integer.py)."""
    inits = _initializers(model)
    for name, nodes in users.items():
        if applied[name] == "int8" and nodes[0].op_type == "MatMul":
            weight = numpy_helper.to_array(inits[name])
            for node in nodes:
                integer.replace_matmul(model, node, weight, maxima.get(name))
            model.graph.initializer.remove(inits[name])


def _apply_offsets(model: onnx.ModelProto, users, applied: dict[str, str], policy: QuantPolicy) -> None:
    """Asymmetric schemes: matmul weights become MatMulNBits + exact float offsets (offsets.py)."""
    scheme = policy.default
    inits = _initializers(model)
    for name, nodes in users.items():
        bits = {"int4": 4, "int8": 8}.get(applied[name])
        if bits and nodes[0].op_type == "MatMul":
            weight = numpy_helper.to_array(inits[name])
            for node in nodes:
                replace_matmul(model, node, weight, bits, scheme.block_size, scheme.accuracy_level)
            model.graph.initializer.remove(inits[name])


def _apply_nbits(model: onnx.ModelProto, applied: dict[str, str], policy: QuantPolicy,
                 arrays: dict[str, np.ndarray]) -> None:
    """What is still int8/int4 goes through onnxruntime's own arithmetic, one bit width at a time: MatMul
    weights and the embedding table packed a slice at a time (quant/nbits.py), anything else (a weight it
    would pad) by its quantizer. The graph ends as the quantizer leaves it, initializers in its order."""
    scheme = policy.default
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    for bits in (8, 4):
        group = {name for name, s in applied.items() if s == f"int{bits}"}
        remaining = _weight_nodes(model, arrays)  # after the offset rewrite: its own small matmuls stay fp32
        if not group & set(remaining):
            continue
        direct = _packed_here(model, remaining, group, arrays, scheme.block_size, bits)
        quantized = group - direct
        if quantized & set(remaining):
            _quantizer(model, bits, scheme, remaining, quantized)
        inits = _initializers(model)
        for node in [n for n in model.graph.node if _weight_of(n) in direct]:
            name = _weight_of(node)
            if name in arrays:
                weight = arrays.pop(name)
            else:
                weight = numpy_helper.to_array(inits[name])
                model.graph.initializer.remove(inits[name])
            if node.op_type == "Gather":
                new, tensors = table_replacement(node, name, weight.shape,
                                                 *pack_table(weight, scheme.block_size, scheme.symmetric),
                                                 scheme.block_size)
            else:
                new, tensors = replacement(node, name, weight.shape,
                                           *pack_columns(weight, bits, scheme.block_size, scheme.symmetric),
                                           bits, scheme.block_size, scheme.accuracy_level)
            del weight
            replace_node(model.graph, node, [new])
            model.graph.initializer.extend(tensors)
    if arrays:
        raise ValueError(f"weights handed in but not packed: {', '.join(sorted(arrays))}")


def _weight_of(node: onnx.NodeProto) -> str | None:
    if node.op_type == "MatMul" and len(node.input) > 1:
        return node.input[1]
    if node.op_type == "Gather" and node.input[0] == EMBEDDING:
        return node.input[0]
    return None


def _packed_here(model: onnx.ModelProto, remaining, group: set[str], arrays: dict, block: int, bits: int) -> set[str]:
    """The weights of `group` that quant/nbits.py packs (each read by one MatMul or the embedding's Gather,
    whole blocks), when every weight left to onnxruntime's quantizer is read before them in the graph (it
    appends what it writes in node order, so its own go first either way); a weight handed in as an array
    is written into the graph when it is left to the quantizer."""
    inits = _initializers(model)

    def packs(name):
        nodes = remaining[name]
        weight = arrays.get(name)
        shape = weight.shape if weight is not None else tuple(inits[name].dims)
        float32 = weight.dtype == np.float32 if weight is not None else inits[name].data_type == onnx.TensorProto.FLOAT
        along = {"MatMul": 0, "Gather": 1 if bits == 4 else None}.get(nodes[0].op_type)  # blocks run along it
        return (len(nodes) == 1 and along is not None and float32 and len(shape) == 2 and shape[along] % block == 0
                and _weight_of(nodes[0]) == name)

    order = [_weight_of(n) for n in model.graph.node if _weight_of(n) in group and _weight_of(n) in remaining]
    direct = {name for name in order if packs(name)}
    left = [i for i, name in enumerate(order) if name not in direct]
    if left and direct and max(left) > min(i for i, name in enumerate(order) if name in direct):
        direct = set()
    for name in [n for n in list(arrays) if n not in direct]:  # the quantizer reads the graph's own copy
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(arrays.pop(name)), name))
    return direct


def _quantizer(model: onnx.ModelProto, bits: int, scheme, remaining, group: set[str]) -> None:
    """onnxruntime's MatMulNBitsQuantizer over the weights of `group` alone."""
    # the quantizer treats nodes_to_include as an addition, not a filter: exclude the rest instead
    excluded = sorted([node.name for name, nodes in remaining.items() if name not in group for node in nodes]
                      + [node.name for node in model.graph.node  # tables that are not weights (rotary)
                         if node.op_type == "Gather" and node.input[0] != EMBEDDING])
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=scheme.block_size, is_symmetric=scheme.symmetric,
        accuracy_level=scheme.accuracy_level, nodes_to_exclude=excluded,
        op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)))
    quantizer.process()
    if quantizer.model.model is not model:
        model.CopyFrom(quantizer.model.model)
