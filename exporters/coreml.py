"""CoreML packages for Apple devices, built from the same model definition as the ONNX graphs (a
LlamaBuilder: its weights, facts and per-architecture overrides), written as MIL programs op by op.

Every function has static shapes, as the Neural Engine needs: N new tokens at rotary positions
`position_ids`, written into a KV cache of fixed capacity at the explicit row `write_pos`. A token sees
every cached row before `write_pos` and, among the N new ones, what a static mask baked into the
function lets it see: its ancestors in the bundle's tree (verify), the rows before it (prefill, step).

    inputs:  input_ids [1, N] int32, position_ids [N] int32, write_pos [1] int32
             features [1, N, H] fp16                (a draft that reads the target's features)
             key_cache, value_cache [layers, kv_heads, capacity, head_dim] fp16
                 kv "state": CoreML states (iOS 18 / macOS 15), read and updated in place
                 kv "io": plain inputs (older systems); the function returns the N new rows instead
    outputs: logits [1, N, V] fp16, features_out [1, N, H] fp16 (a target whose draft reads features),
             new_keys, new_values [layers, kv_heads, N, head_dim] fp16 (kv "io" only)

A stateful model is one package with two functions that share their weights (prefill, and verify or
step); the "io" fallback is one package per function, since multifunction packages need iOS 18 too.

coremltools is the optional extra `[coreml]`: it converts and compresses on any system, but runs a
package only on macOS (exporters/mil_reference.py runs the saved programs here, for the checks).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edgespec.runtime.contract.coreml_package import COMPUTE_UNITS, CoreMLPackage
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.topology import Topology

from .llama import LlamaBuilder

KV_FORMS = ("state", "io")
COMPRESSIONS = ("fp16", "int8", "int4", "palette4")
NEEDS_IOS18 = {"int4", "palette4"}  # 4-bit linear quantization and grouped lookup tables are iOS 18 / macOS 15 ops
MASKED = -1e4  # added to a masked score: exp() of it is 0, and score + MASKED stays inside fp16 (−65504 would overflow)


@dataclass(frozen=True)
class CoreMLOptions:
    kv_forms: tuple[str, ...] = KV_FORMS
    compression: str = "int8"

    def __post_init__(self):
        unknown = [form for form in self.kv_forms if form not in KV_FORMS]
        if unknown or not self.kv_forms:
            raise ExportError(f"--coreml-kv takes {', '.join(KV_FORMS)} (comma-separated), got {','.join(self.kv_forms)!r}")
        if self.compression not in COMPRESSIONS:
            raise ExportError(f"--coreml-compress takes {', '.join(COMPRESSIONS)}, got {self.compression!r}")
        if self.compression == "palette4" and importlib.util.find_spec("sklearn") is None:
            raise ExportError("--coreml-compress palette4 clusters weights with coremltools' k-means, which needs "
                              "scikit-learn: pip install scikit-learn (or use int8 or int4)")
        if self.compression in NEEDS_IOS18 and "io" in self.kv_forms:
            raise ExportError(f"--coreml-compress {self.compression} runs on iOS 18 / macOS 15, where KV caches are "
                              "states: the 'io' fallback for older systems takes int8 or fp16 (or pass --coreml-kv state)")


@dataclass(frozen=True)
class FunctionPlan:
    name: str  # prefill, verify (target) or step (draft)
    nodes: int
    parents: tuple[int, ...]  # the static mask: each new token sees its ancestors and itself


def function_plans(role: str, tree: Topology, prefill_chunk: int) -> tuple[FunctionPlan, ...]:
    prefill = FunctionPlan("prefill", prefill_chunk, tuple(range(-1, prefill_chunk - 1)))
    if role == "target":
        return prefill, FunctionPlan("verify", tree.size, tree.parents)
    return prefill, FunctionPlan("step", 1, (-1,))


def tree_bias(parents: tuple[int, ...]) -> np.ndarray:
    """[N, N] fp16: 0 where a token may see another (its ancestors and itself), MASKED elsewhere."""
    visible = Topology(tuple(parents)).ancestor_mask
    return np.where(visible, 0.0, MASKED).astype(np.float16)


class MILProgramBuilder:
    """One model's MIL functions. `capacity`: the KV rows a cache holds (context plus the largest N)."""

    def __init__(self, model: LlamaBuilder, capacity: int):
        self.model = model
        self.facts = model.facts
        self.capacity = capacity
        self.weight_names: set[str] = set()  # coremltools spells a const's name with _ for .
        cos, sin = model.rope_tables()  # the context's positions (padding rows take position 0)
        self.rope = (cos.astype(np.float16), sin.astype(np.float16))

    def weight(self, mb, name: str, value: np.ndarray):
        """A weight the compression may touch, by name (the rotary tables and masks are left as they are:
        a row of zeros, as sin's at position 0, has no scale)."""
        self.weight_names.add(name)
        return mb.const(val=np.asarray(value, dtype=np.float16), name=name)

    def function(self, plan: FunctionPlan, kv_form: str):
        import coremltools as ct
        from coremltools.converters.mil.mil import Builder as mb
        from coremltools.converters.mil.mil import Function, types

        f, n = self.facts, plan.nodes
        cache_shape = (f.num_layers, f.num_kv_heads, self.capacity, f.head_dim)
        spec = mb.StateTensorSpec if kv_form == "state" else mb.TensorSpec
        inputs = {"input_ids": mb.TensorSpec(shape=(1, n), dtype=types.int32),
                  "position_ids": mb.TensorSpec(shape=(n,), dtype=types.int32),
                  "write_pos": mb.TensorSpec(shape=(1,), dtype=types.int32)}
        if self.model.feature_fc is not None:
            inputs["features"] = mb.TensorSpec(shape=(1, n, f.hidden_size), dtype=types.fp16)
        inputs["key_cache"] = spec(shape=cache_shape, dtype=types.fp16)
        inputs["value_cache"] = spec(shape=cache_shape, dtype=types.fp16)
        with Function(inputs, opset_version=ct.target.iOS18 if kv_form == "state" else ct.target.iOS17) as fn:
            fn.set_outputs(self._body(mb, fn.inputs, plan, kv_form))
        return fn

    def _body(self, mb, x_in: dict, plan: FunctionPlan, kv_form: str) -> list:
        f, model = self.facts, self.model
        w16 = lambda a: np.asarray(a, dtype=np.float16)  # noqa: E731
        table = self.weight(mb, "embed_tokens", model.state["model.embed_tokens.weight"])
        x = mb.gather(x=table, indices=x_in["input_ids"], axis=0)  # [1, N, H]
        if model.feature_fc is not None:
            weight, bias = model.feature_fc
            x = mb.linear(x=mb.concat(values=[x, x_in["features"]], axis=-1), weight=self.weight(mb, "feature_fc", weight),
                          bias=w16(bias))
        cos = mb.reshape(x=mb.gather(x=self.rope[0], indices=x_in["position_ids"], axis=0), shape=[1, 1, plan.nodes, -1])
        sin = mb.reshape(x=mb.gather(x=self.rope[1], indices=x_in["position_ids"], axis=0), shape=[1, 1, plan.nodes, -1])
        mask = self._mask(mb, x_in["write_pos"], plan, kv_form)
        caches = {name: mb.read_state(input=x_in[name]) if kv_form == "state" else x_in[name]
                  for name in ("key_cache", "value_cache")}
        new_rows = {"key_cache": [], "value_cache": []}
        for layer in range(f.num_layers):
            w = model.layer_weights(layer)
            h = self._rms_norm(mb, x, w["input_norm"])
            attn = self._attention(mb, h, w, layer, (cos, sin), mask, caches, new_rows, x_in, plan.nodes, kv_form)
            x = mb.add(x=x, y=attn)
            x = mb.add(x=x, y=self._mlp(mb, self._rms_norm(mb, x, w["post_norm"]), w, layer))
        x = self._rms_norm(mb, x, model.state["model.norm.weight"])
        if f.tie_word_embeddings and model.head_tokens is None:
            head = table
        else:
            full = model.state["model.embed_tokens.weight" if f.tie_word_embeddings else "lm_head.weight"]
            head = self.weight(mb, "lm_head", full if model.head_tokens is None else full[model.head_tokens])
        outputs = [mb.linear(x=x, weight=head, name="logits")]
        if model.features_out:
            outputs.append(mb.identity(x=x, name="features_out"))
        if kv_form == "io":
            outputs += [mb.concat(values=new_rows["key_cache"], axis=0, name="new_keys"),
                        mb.concat(values=new_rows["value_cache"], axis=0, name="new_values")]
        return outputs

    def _mask(self, mb, write_pos, plan: FunctionPlan, kv_form: str):
        """The additive mask over the columns a token attends: cached rows before write_pos are seen by
        all, the N new rows by the static mask, the rest by none. State: [N, capacity], the new rows at
        write_pos + i in the cache; io: [N, capacity + N], the new rows after the cache (iOS 17 has no
        slice_update to write them in)."""
        rel = mb.sub(x=np.arange(self.capacity, dtype=np.int32), y=write_pos)  # column - write_pos
        if kv_form == "io":
            past = mb.select(cond=mb.less(x=rel, y=np.int32(0)), a=np.zeros((plan.nodes, self.capacity), np.float16),
                             b=np.float16(MASKED))  # [N, capacity]
            return mb.concat(values=[past, tree_bias(plan.parents)], axis=-1)
        inside = mb.minimum(x=mb.maximum(x=rel, y=np.int32(0)), y=np.int32(plan.nodes - 1))
        new_part = mb.gather(x=tree_bias(plan.parents), indices=inside, axis=1)  # [N, capacity]
        seen_new = mb.select(cond=mb.less(x=rel, y=np.int32(plan.nodes)), a=new_part, b=np.float16(MASKED))
        return mb.select(cond=mb.less(x=rel, y=np.int32(0)), a=np.zeros((plan.nodes, self.capacity), np.float16),
                         b=seen_new)

    def _rms_norm(self, mb, x, gamma):
        # as a layer norm over [x, -x] (mean 0, variance mean(x^2)): one op the Neural Engine runs in
        # its own precision, where x^2 summed in fp16 could overflow
        size = self.facts.hidden_size
        both = mb.concat(values=[x, mb.mul(x=x, y=np.float16(-1.0))], axis=-1)
        normed = mb.layer_norm(x=both, axes=[-1], epsilon=np.float16(max(self.facts.rms_norm_eps, 1e-7)))
        normed = mb.slice_by_index(x=normed, begin=[0, 0, 0], end=[0, 0, size], end_mask=[True, True, False])
        return mb.mul(x=normed, y=np.asarray(gamma, dtype=np.float16))

    def _rotate(self, mb, t, cos, sin):
        half = self.facts.head_dim // 2
        first = mb.slice_by_index(x=t, begin=[0, 0, 0, 0], end=[0, 0, 0, half], end_mask=[True, True, True, False])
        second = mb.slice_by_index(x=t, begin=[0, 0, 0, half], end=[0, 0, 0, 0], end_mask=[True, True, True, True])
        rotated = mb.concat(values=[mb.mul(x=second, y=np.float16(-1.0)), first], axis=-1)
        return mb.add(x=mb.mul(x=t, y=cos), y=mb.mul(x=rotated, y=sin))

    def _attention(self, mb, h, w, layer, rope, mask, caches, new_rows, x_in, nodes, kv_form):
        f = self.facts
        heads, kv_heads, d = f.num_heads, f.num_kv_heads, f.head_dim
        qkv = mb.linear(x=h, weight=self.weight(mb, f"layers_{layer}_qkv", w["qkv"].T),
                        bias=np.asarray(w["qkv_bias"], dtype=np.float16) if "qkv_bias" in w else None)
        q, k, v = mb.split(x=qkv, split_sizes=[heads * d, kv_heads * d, kv_heads * d], axis=-1)
        q = self._rotate(mb, mb.transpose(x=mb.reshape(x=q, shape=[1, nodes, heads, d]), perm=[0, 2, 1, 3]), *rope)
        k = self._rotate(mb, mb.transpose(x=mb.reshape(x=k, shape=[1, nodes, kv_heads, d]), perm=[0, 2, 1, 3]), *rope)
        v = mb.transpose(x=mb.reshape(x=v, shape=[1, nodes, kv_heads, d]), perm=[0, 2, 1, 3])
        seen = {}
        for name, rows in (("key_cache", k), ("value_cache", v)):
            rows = mb.cast(x=rows, dtype="fp16") if rows.dtype != caches[name].dtype else rows
            if kv_form == "state":
                begin = mb.concat(values=[np.array([layer, 0], np.int32), x_in["write_pos"], np.array([0], np.int32)],
                                  axis=0)
                end = mb.add(x=begin, y=np.array([1, kv_heads, nodes, d], np.int32))
                caches[name] = mb.coreml_update_state(
                    state=x_in[name], value=mb.slice_update(x=caches[name], update=rows, begin=begin, end=end))
            layer_rows = mb.slice_by_index(x=caches[name], begin=[layer, 0, 0, 0], end=[layer + 1, 0, 0, 0],
                                           end_mask=[False, True, True, True])  # [1, kvH, capacity, D]
            if kv_form == "io":
                new_rows[name].append(rows)
                layer_rows = mb.concat(values=[layer_rows, rows], axis=2)  # [1, kvH, capacity + N, D]
            seen[name] = layer_rows
        # grouped heads: the query heads of one kv head are consecutive, so [1, kvH, group * N, D]
        group = heads // kv_heads
        q = mb.reshape(x=mb.mul(x=q, y=np.float16(1.0 / np.sqrt(d))), shape=[1, kv_heads, group * nodes, d])
        scores = mb.matmul(x=q, y=seen["key_cache"], transpose_y=True)  # [1, kvH, group * N, columns]
        columns = self.capacity + (nodes if kv_form == "io" else 0)
        scores = mb.add(x=mb.reshape(x=scores, shape=[1, kv_heads, group, nodes, columns]), y=mask)
        probs = mb.reshape(x=mb.softmax(x=scores, axis=-1), shape=[1, kv_heads, group * nodes, columns])
        out = mb.reshape(x=mb.matmul(x=probs, y=seen["value_cache"]), shape=[1, heads, nodes, d])
        out = mb.reshape(x=mb.transpose(x=out, perm=[0, 2, 1, 3]), shape=[1, nodes, heads * d])
        return mb.linear(x=out, weight=self.weight(mb, f"layers_{layer}_o", w["o"].T))

    def _mlp(self, mb, h, w, layer: int):
        size = self.facts.intermediate_size
        gate_up = mb.linear(x=h, weight=self.weight(mb, f"layers_{layer}_gate_up", w["gate_up"].T))
        gate, up = mb.split(x=gate_up, split_sizes=[size, size], axis=-1)
        return mb.linear(x=mb.mul(x=mb.silu(x=gate), y=up), weight=self.weight(mb, f"layers_{layer}_down", w["down"].T))


def compress(mlmodel, compression: str, weights: set[str], blockwise: bool):
    """Compresses the named weights with coremltools' optimization tools; fp16 leaves the model as it is.

    Linear quantization is affine (a zero point beside each scale), in blocks of 32 where the target
    allows them (iOS 18), per output channel before: on the reference model int8 keeps 0.986 of greedy
    tokens so, 0.944 symmetric per channel (benchmarks/history.md §46). Its int4 keeps 0.54: the weights
    are a Q4_1 GGUF's, whose float offsets an integer zero point cannot hold. Palettization keeps 16
    values per group of 16 output channels (one table for a whole tensor kept no token)."""
    if compression == "fp16":
        return mlmodel
    import coremltools.optimize.coreml as cto

    if compression == "palette4":
        op_config = cto.OpPalettizerConfig(mode="kmeans", nbits=4, granularity="per_grouped_channel", group_size=16,
                                           weight_threshold=0)
        return cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_name_configs={n: op_config for n in weights}))
    granularity = dict(granularity="per_block", block_size=32) if blockwise else dict(granularity="per_channel")
    op_config = cto.OpLinearQuantizerConfig(mode="linear", dtype=compression, weight_threshold=0, **granularity)
    return cto.linear_quantize_weights(mlmodel, cto.OptimizationConfig(op_name_configs={n: op_config for n in weights}))


def convert_function(function, name: str, kv_form: str, compression: str, weights: set[str], path: Path) -> None:
    import coremltools as ct
    from coremltools.converters.mil.mil import Program

    program = Program()
    program.add_function("main", function)
    target = ct.target.iOS18 if kv_form == "state" or compression in NEEDS_IOS18 else ct.target.iOS17
    mlmodel = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=target,
                         compute_precision=ct.precision.FLOAT16)
    mlmodel = compress(mlmodel, compression, weights, blockwise=target >= ct.target.iOS18)
    mlmodel.short_description = f"edgespec {name}"
    mlmodel.save(str(path))


def write_coreml(folder: Path, role: str, model: LlamaBuilder, tree: Topology, prefill_chunk: int,
                 options: CoreMLOptions, compute_units: str, say=lambda message: None) -> list[CoreMLPackage]:
    """Writes `role`'s packages under folder/coreml/ and returns their manifest entries."""
    with quiet_coremltools():
        try:
            import coremltools  # noqa: F401
        except ImportError as err:
            raise ExportError("--format coreml needs coremltools: pip install 'edgespec[coreml]'") from err
    if compute_units not in COMPUTE_UNITS:
        raise ExportError(f"unknown CoreML compute units {compute_units!r}; expected one of {', '.join(COMPUTE_UNITS)}")
    if not model.coreml_packages or any(model.windows):
        what = "sliding-window attention" if model.coreml_packages else f"the {model.architecture} family"
        raise ExportError(f"CoreML packages do not compute {what} yet; export this model without --format coreml")
    plans = function_plans(role, tree, prefill_chunk)
    capacity = model.facts.max_context + max(plan.nodes for plan in plans)
    builder = MILProgramBuilder(model, capacity)
    out = folder / "coreml"
    out.mkdir(exist_ok=True)
    scratch = out / f".{role}-parts"
    entries = []
    try:
        for kv_form in options.kv_forms:
            say(f"CoreML {role} ({kv_form} KV, {options.compression}): "
                + ", ".join(f"{plan.name} {plan.nodes} tokens" for plan in plans))
            scratch.mkdir(exist_ok=True)
            parts = {plan.name: scratch / f"{plan.name}-{kv_form}.mlpackage" for plan in plans}
            for plan in plans:
                with quiet_coremltools():
                    convert_function(builder.function(plan, kv_form), f"{role} {plan.name}", kv_form,
                                     options.compression, builder.weight_names, parts[plan.name])
            with quiet_coremltools():
                entries += _place(out, role, kv_form, plans, parts, options.compression, compute_units, capacity)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return entries


@contextlib.contextmanager
def quiet_coremltools():
    """coremltools logs every graph pass, draws progress bars, and warns on import that this system cannot
    run what it converts; the export says what it does itself. Errors still raise."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _place(out: Path, role: str, kv_form: str, plans, parts: dict[str, Path], compression: str,
           compute_units: str, capacity: int) -> list[CoreMLPackage]:
    """Stateful functions are merged into one package (weights stored once); io ones stay apart."""
    import coremltools as ct

    common = dict(role=role, kv=kv_form, compression=compression, compute_units=compute_units, capacity=capacity)
    if kv_form == "state":
        descriptor = ct.utils.MultiFunctionDescriptor()
        for plan in plans:
            descriptor.add_function(str(parts[plan.name]), src_function_name="main", target_function_name=plan.name)
        descriptor.default_function_name = plans[-1].name
        name = f"coreml/{role}.mlpackage"
        ct.utils.save_multifunction(descriptor, str(out.parent / name))
        return [CoreMLPackage(file=name, functions={plan.name: plan.nodes for plan in plans},
                              parents={plan.name: plan.parents for plan in plans if plan.name == "verify"}, **common)]
    entries = []
    for plan in plans:
        name = f"coreml/{role}-{plan.name}-io.mlpackage"
        shutil.move(str(parts[plan.name]), out.parent / name)
        entries.append(CoreMLPackage(file=name, functions={plan.name: plan.nodes},
                                     parents={plan.name: plan.parents} if plan.name == "verify" else {}, **common))
    return entries
