"""Medusa heads as published (FasterDecoding/Medusa): K heads over the target's final hidden state, head k
predicting the token k + 2 places after the row it reads (the target's own head predicts the next one).

A head is `medusa_num_layers` residual blocks, x + SiLU(linear(x)) with a bias, then a linear to the vocabulary
without one. The checkpoint: a folder whose config.json has `medusa_num_heads` and `medusa_num_layers`, and
the heads' state in medusa_lm_head.safetensors or medusa_lm_head.pt (keys `{k}.{j}.linear.weight|bias`,
`{k}.{L}.weight`, as `nn.ModuleList` of `nn.Sequential` saves them), or under `medusa_head.` in
model.safetensors (a Medusa-2 checkpoint's heads).

The bundle's draft graph is the heads alone: `features` [1, 1, H] (the target's final hidden state at the
newest row it computed, which the target graph returns as `features_out`) -> `logits` [K, 1, V]; the runtime
(runtime/decoding/medusa.py) fills the tree's depth d with head d - 1's top tokens.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.graph import FEATURES

from .onnx_builder import FLOAT, GraphBuilder

FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "model.safetensors")


def is_medusa_head(source) -> bool:
    config = Path(source.location) / "config.json"
    if source.kind != "hf_folder" or not config.is_file():
        return False
    try:
        return "medusa_num_heads" in json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ExportError(f"cannot read {config}: {err}") from err


def read_medusa_head(source, target_config) -> dict:
    """{k: ([(linear weight [H, H], bias [H]) per block], head weight [V, H])}, checked against the target;
    refused in one line naming what is missing or wrong."""
    folder = Path(source.location)
    where = f"the Medusa heads in {folder}"
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    try:
        heads, blocks = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    except (KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{where}: config.json's medusa_num_heads/medusa_num_layers are not numbers ({err})") from err
    if not 1 <= heads <= 16 or not 0 <= blocks <= 8:
        raise ExportError(f"{where}: {heads} heads of {blocks} blocks is outside what edgespec reads (1-16, 0-8)")
    tensors = _read_tensors(folder, where)
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    found = {}
    for k in range(heads):
        names = [(f"{k}.{j}.linear.weight", (hidden, hidden)) for j in range(blocks)]
        names += [(f"{k}.{j}.linear.bias", (hidden,)) for j in range(blocks)] + [(f"{k}.{blocks}.weight", (vocab, hidden))]
        missing = [n for n, _ in names if n not in tensors]
        if missing:
            raise ExportError(f"{where} is missing {', '.join(missing[:4])} (config: {heads} heads, {blocks} blocks)")
        for name, shape in names:
            if tuple(tensors[name].shape) != shape:
                raise ExportError(f"{where}: {name} is {list(tensors[name].shape)}, expected {list(shape)} for a target "
                                  f"of hidden size {hidden} and {vocab} ids: they were trained for another target")
        found[k] = ([(tensors[f"{k}.{j}.linear.weight"], tensors[f"{k}.{j}.linear.bias"]) for j in range(blocks)],
                    tensors[f"{k}.{blocks}.weight"])
    unknown = sorted(n for n in tensors if int(n.split(".")[0]) >= heads) if all(
        n.split(".")[0].isdigit() for n in tensors) else sorted(n for n in tensors if not n.split(".")[0].isdigit())
    if unknown:
        raise ExportError(f"{where} has tensors its config does not describe ({', '.join(unknown[:4])})")
    return found


def _read_tensors(folder: Path, where: str) -> dict:
    import torch

    path = next((folder / f for f in FILES if (folder / f).is_file()), None)
    if path is None:
        raise ExportError(f"{where}: no {', '.join(FILES)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            raw = load_file(str(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as err:
        raise ExportError(f"{where}: cannot read {path.name}: {type(err).__name__}: {err}") from err
    if path.name == "model.safetensors":  # a whole Medusa-2 model: only its heads are read here
        raw = {k.removeprefix("medusa_head."): v for k, v in raw.items() if k.startswith("medusa_head.")}
    return {name.removeprefix("medusa_head."): tensor.float().numpy() for name, tensor in raw.items()}


class MedusaBuilder:
    """The heads' graph, built as a draft model's is written (bundle_writer.write_model): `facts` (the target's,
    as architecture "medusa": the heads read its hidden size and vocabulary), `build`, `matmul_sources`."""
    head_tokens = None
    feature_fc = None
    reads_features = True
    portable_attention = False  # set by the exporter for drafts; nothing here attends
    rope_slack = 0
    flushes_attention = False  # its heads go to the weight sink as one part

    def __init__(self, heads: dict, target_facts):
        self.heads = heads
        self.facts = replace(target_facts, architecture="medusa")

    def build(self, name: str, sink=None, **parts) -> GraphBuilder:
        if parts:
            raise ExportError("Medusa heads are one graph: no stages or slots")
        f = self.facts
        g = GraphBuilder(name, sink)
        x = g.input(FEATURES, FLOAT, [1, 1, f.hidden_size])
        rows = []
        for k, (blocks, head) in self.heads.items():
            h = x
            for j, (weight, bias) in enumerate(blocks):
                z = g.op("Add", [g.op("MatMul", [h, g.weight(f"medusa.{k}.block{j}", weight.T)]),
                                 g.weight(f"medusa.{k}.block{j}_bias", bias)])
                h = g.op("Add", [h, g.op("Mul", [z, g.op("Sigmoid", [z])])])
            rows.append(g.op("MatMul", [h, g.weight(f"medusa.{k}.head", head.T)]))  # [1, 1, V]
            g.flush()
        g.output(g.op("Concat", rows, axis=0), "logits", FLOAT, [len(rows), 1, f.vocab_size])
        return g

    def matmul_sources(self) -> dict:
        return {}

    def parameter_count(self) -> int:
        return sum(w.size + b.size for blocks, head in self.heads.values() for w, b in blocks) + \
            sum(head.size for _, head in self.heads.values())
