"""`edgespec stage BUNDLE --stages N`: an exported bundle's target cut into stages (or its stages undone)
in place, without exporting it again.

The stages are cut from the target's own graph where the builder recorded each layer's entry
(onnx_builder.LAYER_BOUNDARIES_KEY): a stage is the graph's nodes between two boundaries, so it computes
what the builder's stage would, weight for weight. As an export writes them, each stage keeps its weights in
a file of its own (a runtime maps a stage's file whole) and every other graph of the bundle reads each weight
from the stage that holds it: the bundle holds each weight once. The new files are written into a folder
beside the bundle, which then replaces it whole (bundle_writer.staged_bundle): a bundle is re-staged
whole or not at all.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import onnx
from edgespec.runtime.contract.errors import BundleError, ExportError
from edgespec.runtime.contract.manifest import (GraphSpec, Manifest, bundle_files, open_bundle, sha256_file,
                                                 write_manifest)

from .bundle_writer import mark_exact_rows, stage_plan, staged_bundle, value_shape
from .onnx_builder import FLOAT, LAYER_BOUNDARIES_KEY
from .weights import ALIGN, external_table, external_tensors, point_external

Where = tuple[str, int]  # (weights file, offset): a stored tensor


def restage(folder: Path, groups: int, say) -> Manifest:
    """Re-stages the bundle at `folder` into `groups` groups of layers (0: no stages) and returns its new
    manifest."""
    folder = Path(folder)
    manifest = open_bundle(folder)  # every file checked against its checksum before anything is read
    entry = manifest.target
    graphs = _bundle_graphs(manifest)
    whole = load_graph(folder, entry.graph.file)
    boundaries = boundaries_of(whole, entry.graph.file)
    plan = stage_plan(entry.facts.num_layers, groups) if groups else []
    with staged_bundle(folder, force=True) as out:
        stored = _Stored(folder, out)
        stages = []
        for i, (layers, embed, head) in enumerate(plan):
            name = f"target.stage{i}"
            stage = cut_stage(whole, boundaries, entry.facts.hidden_size, layers, embed, head,
                              f"edgespec_target_stage{i}")
            stored.own(stage, f"{name}.weights")
            onnx.save_model(stage, out / f"{name}.onnx")
            stages.append(_stage_spec(name, stage, entry.graph, layers, embed))
            say(f"wrote {name} ({_span(layers, embed, head)})")
        specs = {}
        for name in graphs:  # the whole graph and every other graph of the bundle: read from where weights now lie
            model = whole if name == entry.graph.file else load_graph(folder, name)
            stored.read_from_stages(model, name.removesuffix(".onnx") + ".weights")
            onnx.save_model(model, out / name)
            specs[name] = _weights(model, name.removesuffix(".onnx") + ".weights")
        _link_the_rest(folder, out, stored.replaced | set(graphs) | {old.file for old in entry.stages})
        target = replace(entry, graph=replace(entry.graph, weights=specs[entry.graph.file]), stages=tuple(stages),
                         slots=replace(entry.slots, weights=specs[entry.slots.file]) if entry.slots else None)
        others = tuple(replace(p, target=replace(p.target, weights=specs[p.target.file]) if p.target else None)
                       for p in manifest.other_profiles)
        new = replace(manifest, target=target, other_profiles=others,
                      files={name: sha256_file(out / name) for name in bundle_files(out) if not name.startswith(".")
                             and name != "manifest.json"})
        write_manifest(out, new)
    return new


def cut_stage(whole: onnx.ModelProto, boundaries: dict[int, tuple[str, str | None]], hidden_size: int,
              layers: range, embed: bool, head: bool, name: str) -> onnx.ModelProto:
    """The nodes of `whole` that compute one stage, with the stage's inputs and outputs named as the
    builder names them (exporters/llama.py `build`): `hidden` and `branch` in, `hidden_out` and
    `branch_out` out, the layers' KV buffers, and the embedding's or the head's own inputs and outputs."""
    g = whole.graph
    graph_inputs = {i.name: i for i in g.input}
    graph_outputs = {o.name: o for o in g.output}
    kv_outputs = [f"present_{kind}_{l}" for l in layers for kind in ("key", "value")]
    if head:
        wanted = [o for o in g.output if not o.name.startswith("present_")]
        outputs = [graph_outputs[n] for n in kv_outputs] + wanted
        ends: list[tuple[str, str]] = []
    else:
        hidden, branch = boundaries[layers.stop]
        outputs = [graph_outputs[n] for n in kv_outputs]
        ends = [(hidden, "hidden_out")] + ([(branch, "branch_out")] if branch else [])
        outputs += [_like_hidden(whole, out, hidden_size) for _, out in ends]
    starts = {} if embed else dict(zip((n for n in boundaries[layers.start] if n), ("hidden", "branch")))
    # the residual stream where earlier layers began has the stage input's shape: the graph reads it once
    # for the pass's sizes (exporters/llama.py `decoder_layers`), which the stage reads from `hidden`
    sizes = {} if embed else {boundaries[k][0]: "hidden" for k in boundaries if k < layers.start}
    nodes = _between(g.node, [o.name for o in outputs if o.name not in dict(ends).values()] + [t for t, _ in ends],
                     set(starts) | set(sizes))
    renamed = []
    for node in nodes:
        node = _copy(node)
        for i, tensor in enumerate(node.input):
            if tensor in sizes and tensor not in starts and node.op_type != "Shape":
                raise ExportError(f"the stage of {_span(layers, embed, head)} would read an earlier layer's "
                                  f"residual stream ({tensor}) in a {node.op_type}: this graph cannot be re-staged; "
                                  "export the bundle again with --stages")
            node.input[i] = starts.get(tensor, sizes.get(tensor, tensor))
        renamed.append(node)
    renamed += [onnx.helper.make_node("Identity", [starts.get(t, t)], [out], name=f"{out}_identity") for t, out in ends]
    read = {t for node in renamed for t in node.input if t}
    inits = [_copy(t) for t in g.initializer if t.name in read]
    inputs = [_like_hidden(whole, n, hidden_size) for n in ("hidden", "branch") if n in starts.values()]
    inputs += [graph_inputs[t] for t in graph_inputs if t in read]
    produced = {t for node in renamed for t in node.output} | {t.name for t in inits} | {i.name for i in inputs}
    # a stage reads only its own layers' caches: one that reaches further (a head returning features of
    # earlier layers, as for an EAGLE-3 head) cannot be cut there
    foreign = sorted(t for t in read & set(graph_inputs) if t.startswith(("past_key_", "past_value_"))
                     and int(t.rsplit("_", 1)[1]) not in layers)
    if foreign:
        raise ExportError(f"the stage of {_span(layers, embed, head)} would read {foreign[0]}, another stage's "
                          "cache (a draft head's features from earlier layers?): this graph cannot be re-staged")
    missing = sorted(read - produced)
    if missing:
        raise ExportError(f"the stage of {_span(layers, embed, head)} would read {', '.join(missing[:3])}, which no "
                          "stage input gives: this graph cannot be re-staged; export the bundle again with --stages")
    graph = onnx.helper.make_graph(renamed, name, inputs, outputs, inits)
    model = onnx.helper.make_model(graph, opset_imports=whole.opset_import, producer_name=whole.producer_name)
    model.ir_version = whole.ir_version
    onnx.helper.set_model_props(model, {p.key: p.value for p in whole.metadata_props if p.key != LAYER_BOUNDARIES_KEY})
    mark_exact_rows(model)
    return model


def _between(nodes, outputs: list[str], starts: set[str]) -> list[onnx.NodeProto]:
    """The nodes `outputs` depend on, walking back no further than `starts`, in the graph's order."""
    producer = {t: i for i, node in enumerate(nodes) for t in node.output}
    needed, todo = set(), [t for t in outputs if t not in starts]
    while todo:
        i = producer.get(todo.pop())
        if i is None or i in needed:
            continue
        needed.add(i)
        todo += [t for t in nodes[i].input if t and t not in starts]
    return [nodes[i] for i in sorted(needed)]


class _Stored:
    """Where each weight lies after re-staging. Stage files are written first, each holding every weight
    its stage reads; any other graph then reads a weight from the first stage that holds it, and from
    `target.weights` (or its own file) only what no stage holds."""

    def __init__(self, source: Path, out: Path):
        self.source, self.out = source, out
        self.moved: dict[Where, Where] = {}
        self.replaced: set[str] = set()  # the weights files of the old bundle that the new one rewrites

    def own(self, model: onnx.ModelProto, location: str) -> None:
        with open(self.out / location, "wb") as f:
            for tensor in _external(model):
                old = _where(tensor)
                new = (location, self._append(f, tensor))
                self.moved.setdefault(old, new)
                point_external(tensor, *new, _length(tensor))

    def read_from_stages(self, model: onnx.ModelProto, own: str) -> None:
        leftover = [t for t in _external(model) if _where(t) not in self.moved]
        if leftover:
            with open(self.out / own, "ab") as f:
                for tensor in leftover:
                    self.moved[_where(tensor)] = (own, self._append(f, tensor))
        for tensor in _external(model):
            point_external(tensor, *self.moved[_where(tensor)], _length(tensor))

    def _append(self, f, tensor: onnx.TensorProto) -> int:
        location, offset = _where(tensor)
        self.replaced.add(location)
        start = f.tell() + (-f.tell()) % ALIGN
        f.write(b"\0" * (start - f.tell()))
        try:
            with open(self.source / location, "rb") as src:
                src.seek(offset)
                data = src.read(_length(tensor))
        except OSError as err:
            raise BundleError(f"cannot read {tensor.name} from {self.source / location}: {err}") from err
        if len(data) != _length(tensor):
            raise BundleError(f"{self.source / location} ends inside {tensor.name}: the bundle is damaged")
        f.write(data)
        return start


def _bundle_graphs(manifest: Manifest) -> list[str]:
    """The target's graphs that read its weights: the whole graph, a slots graph, other profiles' graphs."""
    entry = manifest.target
    names = [entry.graph.file] + ([entry.slots.file] if entry.slots else [])
    return names + [p.target.file for p in manifest.other_profiles if p.target is not None]


def boundaries_of(model: onnx.ModelProto, file: str) -> dict[int, tuple[str, str | None]]:
    props = {p.key: p.value for p in model.metadata_props}
    if LAYER_BOUNDARIES_KEY not in props:
        raise ExportError(f"{file} does not record where its layers begin (it was exported by an older edgespec): "
                          "export it again, with --stages N")
    return {int(layer): (hidden, branch) for layer, (hidden, branch) in json.loads(props[LAYER_BOUNDARIES_KEY]).items()}


def _stage_spec(name: str, stage: onnx.ModelProto, whole: GraphSpec, layers: range, embed: bool) -> GraphSpec:
    names = {t.name for t in stage.graph.initializer}
    applied = {k: v for k, v in whole.quantization.get("tensors", {}).items()
               if any(n == k or n.startswith((f"{k}_", f"{k}.")) for n in names)}
    return GraphSpec(file=f"{name}.onnx", weights=_weights(stage, f"{name}.weights"),
                     inputs={i.name: value_shape(i) for i in stage.graph.input},
                     outputs={o.name: value_shape(o) for o in stage.graph.output},
                     quantization={**whole.quantization, "tensors": applied}, layers=(layers.start, layers.stop),
                     tensors=external_tensors(stage),
                     embedding_table=external_table(stage, "embed_tokens") if embed else None)


def _weights(model: onnx.ModelProto, own: str) -> tuple[str, ...]:
    found = {_where(t)[0] for t in _external(model)}
    return tuple(sorted(found, key=lambda f: (f != own, f)))


def _link_the_rest(source: Path, out: Path, rewritten: set[str]) -> None:
    """Every file of the bundle that re-staging leaves as it was, linked (or copied) into the new folder."""
    for name in bundle_files(source):
        if name in rewritten or name == "manifest.json":
            continue
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source / name, target)
        except OSError:  # another file system, or links refused: a copy
            shutil.copy2(source / name, target)


def _like_hidden(whole: onnx.ModelProto, name: str, hidden_size: int) -> onnx.ValueInfoProto:
    """A [1, nodes, hidden] float tensor, its `nodes` dimension as the graph's input_ids has it."""
    ids = next(i for i in whole.graph.input if i.name == "input_ids")
    rows = ids.type.tensor_type.shape.dim[1]
    return onnx.helper.make_tensor_value_info(name, FLOAT, [1, rows.dim_param or rows.dim_value, hidden_size])


def load_graph(folder: Path, name: str) -> onnx.ModelProto:
    try:
        return onnx.load(str(folder / name), load_external_data=False)
    except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError, ValueError) as err:
        raise BundleError(f"cannot read {folder / name}: {err}") from err


def external_bytes(model: onnx.ModelProto) -> int:
    """The bytes of weights `model` reads from files."""
    return sum(_length(t) for t in _external(model))


def _external(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]


def _where(tensor: onnx.TensorProto) -> Where:
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0))


def _length(tensor: onnx.TensorProto) -> int:
    return int({e.key: e.value for e in tensor.external_data}["length"])


def _copy(proto):
    copied = type(proto)()
    copied.CopyFrom(proto)
    return copied


def _span(layers: range, embed: bool, head: bool) -> str:
    return "the embedding" if embed else "the head" if head else f"layers {layers.start}-{layers.stop - 1}"
