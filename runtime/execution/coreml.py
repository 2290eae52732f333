"""A bundle's CoreML packages on Apple devices: the decode loop that runs them through a predictor — on
macOS CoreML's prediction API (edgespec/coreml_backend.py, behind the [coreml] extra), for checks anywhere
the saved programs run in numpy (exporters/mil_reference.py). The runtime itself needs neither.

The packages' contract is exporters/coreml.py's: static N tokens per call, written at `write_pos`."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..contract.coreml_package import CoreMLPackage
from ..contract.errors import InputError
from ..contract.manifest import read_head_tokens
from ..contract.topology import Topology
from ..decoding.accept import accept_greedy
from .features import draft_inputs

# predict(function name, feed, cache) -> outputs; the cache is what make_cache returned
Predict = Callable[[str, dict, object], dict]


@dataclass
class IOCache:
    """The KV cache of an "io" package, kept here: the function returns each call's new rows."""
    keys: np.ndarray  # [layers, kv_heads, capacity, head_dim] fp16
    values: np.ndarray


def io_cache(facts, capacity: int) -> IOCache:
    shape = (facts.num_layers, facts.num_kv_heads, capacity, facts.head_dim)
    return IOCache(np.zeros(shape, np.float16), np.zeros(shape, np.float16))


@dataclass
class CoreMLBundle:
    """A bundle's CoreML packages opened for decoding: target (+ draft) with their caches."""
    target: "CoreMLModel"
    target_cache: object
    draft: "CoreMLModel | None"
    draft_cache: object
    tree: Topology
    prefill_chunk: int

    def generate(self, prompt: list[int], max_new_tokens: int, eos_ids=(), speculate: bool = True):
        return greedy_generate(self.target, self.target_cache, self.draft if speculate else None, self.draft_cache,
                               prompt, max_new_tokens, self.tree if speculate else Topology((-1,)),
                               self.prefill_chunk, eos_ids)


def open_coreml(folder: Path, manifest, kv: str, predictor) -> CoreMLBundle:
    """Opens the bundle's CoreML packages of KV form `kv` through `predictor(folder, packages, facts)`, which
    returns (predict, make_cache). Needs a verified manifest (runtime/bundle.open_bundle)."""
    chosen = {role: [p for p in manifest.coreml if p.role == role and p.kv == kv] for role in ("target", "draft")}
    if not chosen["target"]:
        forms = sorted({p.kv for p in manifest.coreml})
        raise InputError(f"the bundle has no CoreML target packages with KV as {kv}"
                         + (f" (it has {', '.join(forms)})" if forms else "; export it with --format onnx,coreml"))
    target_facts = manifest.target.facts
    predict, make_cache = predictor(folder, chosen["target"], target_facts)
    gives_features = manifest.draft is not None and manifest.draft.graph.inputs.get("features") is not None
    target = CoreMLModel(predict, merged_package(chosen["target"]), target_facts.hidden_size)
    tree = Topology(next(p.parents["verify"] for p in chosen["target"] if "verify" in p.parents))
    draft, draft_cache = None, None
    if chosen["draft"]:
        draft_predict, make_draft_cache = predictor(folder, chosen["draft"], manifest.draft.facts)
        draft = CoreMLModel(draft_predict, merged_package(chosen["draft"]), manifest.draft.facts.hidden_size,
                            reads_features=gives_features, head_tokens=read_head_tokens(folder, manifest.draft))
        draft_cache = make_draft_cache()
    return CoreMLBundle(target, make_cache(), draft, draft_cache, tree, manifest.prefill_chunk)


def merged_package(packages: list[CoreMLPackage]) -> CoreMLPackage:
    """One role's io packages (one function each) seen as one."""
    functions = {name: nodes for p in packages for name, nodes in p.functions.items()}
    return CoreMLPackage(**{**packages[0].__dict__, "functions": functions})


class CoreMLModel:
    """One model's functions: run N static tokens at `write_pos`, keep the rows the caller accepts."""

    def __init__(self, predict: Predict, package: CoreMLPackage, hidden_size: int, reads_features: bool = False,
                 head_tokens: np.ndarray | None = None):
        """`head_tokens`: the vocabulary ids a trimmed head's logits cover (a draft's), in order."""
        self.predict = predict
        self.head_tokens = head_tokens
        self.functions = package.functions
        self.kv = package.kv
        self.capacity = package.capacity
        self.hidden_size = hidden_size
        self.reads_features = reads_features

    def greedy_token(self, logits_row: np.ndarray) -> int:
        best = int(np.argmax(logits_row))
        return best if self.head_tokens is None else int(self.head_tokens[best])

    def run(self, name: str, cache, tokens, positions, write_pos: int, features=None) -> dict:
        """Tokens beyond the function's N are an error; fewer are padded (their rows land after the real
        ones and are overwritten later)."""
        nodes = self.functions[name]
        if len(tokens) > nodes:
            raise InputError(f"{name} takes {nodes} tokens per call, got {len(tokens)}")
        if write_pos + nodes > self.capacity:
            raise InputError(f"the context is full: {write_pos} rows and {nodes} more exceed the cache's {self.capacity}")
        feed = {"input_ids": _padded(tokens, nodes, np.int32)[None],
                "position_ids": _padded(positions, nodes, np.int32),
                "write_pos": np.array([write_pos], np.int32)}
        if self.reads_features:
            rows = np.zeros((nodes, self.hidden_size), np.float16)
            if features is not None:
                rows[: len(features)] = features
            feed["features"] = rows[None]
        if self.kv == "io":
            feed["key_cache"], feed["value_cache"] = cache.keys, cache.values
        outputs = self.predict(name, feed, cache)
        if self.kv == "io":
            cache.keys[:, :, write_pos: write_pos + nodes] = outputs["new_keys"]
            cache.values[:, :, write_pos: write_pos + nodes] = outputs["new_values"]
        return outputs


def _padded(values, size: int, dtype) -> np.ndarray:
    out = np.zeros(size, dtype)
    out[: len(values)] = values
    return out


def greedy_generate(target: CoreMLModel, target_cache, draft: CoreMLModel | None, draft_cache, prompt: list[int],
                    max_new_tokens: int, tree: Topology, prefill_chunk: int, eos_ids=()) -> tuple[list[int], int]:
    """Greedy speculative decoding on CoreML packages whose static tree is a chain; without a draft, plain
    decoding through the same verify function (one real token per call), which speculative output is
    compared with. Returns (tokens, target calls). A feature-reading draft gets the target's feature at
    i - 1 with token i, and its own prediction of it while drafting deeper (runtime/execution/features.py)."""
    if tree.max_width > 1:
        raise InputError("the CoreML loop verifies chains; this bundle's tree branches")
    if not prompt:
        raise InputError("the prompt is empty")
    # the target's feature at every committed row, for a draft that reads them: written in place, never regrown
    features = np.zeros((target.capacity, target.hidden_size), np.float32) if draft and draft.reads_features else None
    _prefill(target, target_cache, prompt[:-1], prefill_chunk, keep=features)
    if draft is not None:
        _prefill(draft, draft_cache, prompt[:-1], prefill_chunk, features)
    out, calls, length, last = [], 0, len(prompt) - 1, prompt[-1]  # length: rows in both caches
    while True:
        chain = [last] + (_draft_chain(draft, draft_cache, last, length, tree.size - 1, features) if draft else [])
        verified = target.run("verify", target_cache, chain, range(length, length + len(chain)), length)
        calls += 1
        choices = np.argmax(verified["logits"][0, : len(chain)], axis=-1)
        path, bonus = accept_greedy(np.array(chain), Topology(tuple(range(-1, len(chain) - 1))).children, choices)
        if features is not None:
            features[length: length + len(path)] = verified["features_out"][0, : len(path)]
        if draft is not None and len(path) == len(chain) > 1:  # the draft never ran the chain's last token
            _draft_step(draft, draft_cache, chain[-1], length + len(chain) - 1, features)
        length += len(path)
        for token in [chain[node] for node in path[1:]] + [bonus]:
            out.append(int(token))
            if token in eos_ids or len(out) >= max_new_tokens:
                return out, calls
        last = bonus


def _draft_step(draft: CoreMLModel, cache, token: int, position: int, features, own_feature=None) -> dict:
    feature = None
    if draft.reads_features:
        feature = own_feature if own_feature is not None or not position else features[position - 1: position]
    return draft.run("step", cache, [token], [position], position, feature)


def _draft_chain(draft: CoreMLModel, cache, last: int, length: int, count: int, features) -> list[int]:
    drafted, token, own = [], last, None
    for depth in range(count):
        step = _draft_step(draft, cache, token, length + depth, features, own)
        token = draft.greedy_token(step["logits"][0, 0])
        own = step["features_out"][0, :1].astype(np.float32) if "features_out" in step else None
        drafted.append(token)
    return drafted


def _prefill(model: CoreMLModel, cache, tokens: list[int], chunk: int, target_features=None, keep=None) -> None:
    """Runs `tokens` chunk by chunk from row 0. A draft that reads features gets `target_features`;
    `keep` (if given) receives the features the model returns for every row."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start: start + chunk]
        fed = draft_inputs(target_features, start, start + len(part)) if model.reads_features else None
        result = model.run("prefill", cache, part, range(start, start + len(part)), start, fed)
        if keep is not None:
            keep[start: start + len(part)] = result["features_out"][0, : len(part)]
