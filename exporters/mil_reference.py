"""Runs a saved CoreML package's MIL program in numpy, op by op, where CoreML itself cannot run (Linux).

The program is read back from the package (coremltools' milproto loader), so what runs is what was
written, compression included: constexpr ops are expanded by coremltools' own decompression. Each op
computes in float32 and stores its result in the dtype the program declares (fp16), as a device stores
activations; a device's accumulation order and fp16 arithmetic differ, so this bounds what the program
computes rather than reproducing a Mac's bits. An op this reference does not know is an error.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.execution.coreml import CoreMLModel, io_cache, merged_package

from .coreml import quiet_coremltools


def load_program(package: Path):
    """The MIL program a saved package holds, and its spec (inputs, outputs, states per function)."""
    with quiet_coremltools():
        import coremltools as ct
        from coremltools.converters.mil.frontend.milproto.load import load

        mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
        spec = mlmodel.get_spec()
        program = load(spec, specification_version=spec.specificationVersion, file_weights_dir=mlmodel.weights_dir)
    return program, spec


def _slices(shape, begin, end, stride=None, begin_mask=None, end_mask=None):
    out = []
    for axis, size in enumerate(shape):
        b = 0 if begin_mask is not None and begin_mask[axis] else int(begin[axis])
        e = size if end_mask is not None and end_mask[axis] else int(end[axis])
        out.append(slice(b, e, 1 if stride is None else int(stride[axis])))
    return tuple(out)


def _layer_norm(x, axes, gamma=None, beta=None, epsilon=1e-5):
    axes = tuple(int(a) for a in axes)
    mean = x.mean(axis=axes, keepdims=True)
    out = (x - mean) / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + epsilon)
    return out * (1 if gamma is None else gamma) + (0 if beta is None else beta)


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=int(axis), keepdims=True))
    return e / e.sum(axis=int(axis), keepdims=True)


def _split(x, axis, split_sizes=None, num_splits=None):
    if split_sizes is None:
        return np.split(x, int(num_splits), axis=int(axis))
    return np.split(x, np.cumsum(split_sizes)[:-1], axis=int(axis))


def _slice_update(x, update, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None):
    out = x.copy()
    out[_slices(x.shape, begin, end, stride, begin_mask, end_mask)] = update
    return out


OPS = {
    "add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
    "real_div": lambda x, y: x / y, "maximum": lambda x, y: np.maximum(x, y), "minimum": lambda x, y: np.minimum(x, y),
    "less": lambda x, y: x < y, "greater_equal": lambda x, y: x >= y,
    "select": lambda cond, a, b: np.where(cond, a, b),
    "gather": lambda x, indices, axis=0, batch_dims=0, validate_indices=False: np.take(x, indices.astype(np.int64), axis=int(axis)),
    "linear": lambda x, weight, bias=None: x @ weight.T + (0 if bias is None else bias),
    "matmul": lambda x, y, transpose_x=False, transpose_y=False: np.matmul(
        np.swapaxes(x, -1, -2) if transpose_x else x, np.swapaxes(y, -1, -2) if transpose_y else y),
    "reshape": lambda x, shape: x.reshape([int(s) for s in shape]),
    "transpose": lambda x, perm: np.transpose(x, [int(p) for p in perm]),
    "concat": lambda values, axis, interleave=False: np.concatenate(values, axis=int(axis)),
    "split": _split,
    "slice_by_index": lambda x, begin, end, stride=None, begin_mask=None, end_mask=None, squeeze_mask=None:
        x[_slices(x.shape, begin, end, stride, begin_mask, end_mask)],
    "slice_update": _slice_update,
    "layer_norm": _layer_norm,
    "softmax": _softmax,
    "silu": lambda x: x / (1 + np.exp(-x)), "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "cast": lambda x, dtype: x, "identity": lambda x: x,
}


class ProgramRunner:
    """Calls one function of a loaded program: inputs and states in, outputs (and states) out."""

    def __init__(self, program, function: str, activations=np.float16):
        from coremltools.converters.mil.mil import types

        self.function = program.functions[function]
        self.types = types
        self.activations = activations
        self.weights: dict[str, np.ndarray] = {}  # const and constexpr values, expanded once

    def _value(self, var, env):
        if var.name in env:
            return env[var.name]
        if var.val is not None:
            return np.asarray(var.val)
        raise ExportError(f"the program reads {var.name}, which nothing computed")

    def _dtype(self, var):
        dtype = self.types.nptype_from_builtin(var.dtype)
        return self.activations if dtype == np.float16 else dtype

    def __call__(self, feed: dict, states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`states` (a stateful function's) are updated in place: after the call they hold what the
        function wrote."""
        env = {name: np.asarray(value) for name, value in feed.items()}
        for op in self.function.operations:
            result = self._run(op, env, states)
            results = result if isinstance(result, (list, tuple)) else [result]
            for var, value in zip(op.outputs, results):
                env[var.name] = np.asarray(value).astype(self._dtype(var), copy=False)
        return {var.name: env[var.name] for var in self.function.outputs}

    def _run(self, op, env, states):
        kind = op.op_type
        if kind == "const" or kind.startswith("constexpr_"):
            if op.name not in self.weights:
                value = op.materialized_val_inference() if kind.startswith("constexpr_") else op.outputs[0].val
                self.weights[op.name] = np.asarray(value)
            return self.weights[op.name]
        if kind == "read_state":
            return states[op.inputs["input"].name].copy()
        if kind == "coreml_update_state":
            value = self._value(op.inputs["value"], env)
            states[op.inputs["state"].name][...] = value
            return value
        if kind not in OPS:
            raise ExportError(f"the reference does not know the MIL op {kind!r} ({op.name})")
        args = {}
        for name, var in op.inputs.items():
            if isinstance(var, (list, tuple)):
                args[name] = [self._float(self._value(v, env)) for v in var]
            else:
                args[name] = self._float(self._value(var, env))
        return OPS[kind](**args)

    @staticmethod
    def _float(value):
        value = np.asarray(value)
        return value.astype(np.float32) if value.dtype == np.float16 else value


def reference_predictor(folder: Path, packages, facts, activations=np.float16) -> tuple:
    """runtime/coreml.coreml_predictor's counterpart: (predict, make_cache) over one role's saved packages of
    one KV form, run by this reference, so the runtime's CoreML decode loop runs here as on a Mac.
    `activations` float32 keeps every intermediate in fp32 (the program's semantics apart from fp16 storage)."""
    runners = {}
    for package in packages:
        program, _ = load_program(Path(folder) / package.file)
        for name in package.functions:
            runners[name] = ProgramRunner(program, name if name in program.functions else "main", activations)
    capacity, kv = packages[0].capacity, packages[0].kv

    def make_cache():
        cache = io_cache(facts, capacity)
        return cache if kv == "io" else {"key_cache": cache.keys, "value_cache": cache.values}

    def predict(name, feed, cache):
        return runners[name](feed, cache if kv == "state" else {})

    return predict, make_cache


def reference_logits(folder: Path, packages, facts, ids: list[int], activations=np.float16) -> np.ndarray:
    """The logits of every token of `ids` from a target's saved packages of one KV form, run here: one
    prefill chunk, then verify calls on the rest."""
    predict, make_cache = reference_predictor(folder, packages, facts, activations)
    package = merged_package(packages)
    model = CoreMLModel(predict, package, facts.hidden_size)
    cache = make_cache()
    chunk, verify = package.functions["prefill"], package.functions["verify"]
    rows = [model.run("prefill", cache, ids[:chunk], range(chunk), 0)["logits"][0]]
    for start in range(chunk, len(ids), verify):
        part = ids[start: start + verify]
        rows.append(model.run("verify", cache, part, range(start, start + len(part)), start)["logits"][0, : len(part)])
    return np.concatenate(rows).astype(np.float32)
