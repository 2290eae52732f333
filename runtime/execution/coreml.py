"""A bundle's CoreML packages behind the `Runner` protocol (runner.py), so the one decode loop
(runtime/decoding/engine.py) runs them: on macOS through CoreML's prediction API (edgespec/coreml_backend.py,
behind the [coreml] extra), for checks anywhere with the saved programs run in numpy
(exporters/mil_reference.py). The runtime itself needs neither: it takes a predictor.

The packages' contract is exporters/coreml.py's: static N tokens per call, written at `write_pos`, each new
token seeing every row before it. A pass therefore takes a chain: the verify function's tree is the bundle's
chain, and a pass of n tokens runs the role's tree function (verify, or a draft's step) where n fits it, so a
one-token step and a verified chain share its bits, and the prefill function otherwise."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..contract.coreml_package import CoreMLPackage
from ..contract.errors import ContextOverflowError, InputError
from ..contract.facts import ModelFacts
from ..contract.graph import GraphSignature
from ..contract.manifest import read_head_tokens
from ..contract.topology import Topology
from .kvcache import rotated_back
from .model import Pass

# predict(function name, feed, cache) -> outputs; the cache is what make_cache returned
Predict = Callable[[str, dict, object], dict]
# predictor(folder, one role's packages of one KV form, facts) -> (predict, make_cache)
Predictor = Callable[[Path, list, ModelFacts], tuple]


@dataclass
class IOCache:
    """The KV cache of an "io" package, kept here: the function returns each call's new rows."""
    keys: np.ndarray  # [layers, kv_heads, capacity, head_dim] fp16
    values: np.ndarray


def io_cache(facts, capacity: int) -> IOCache:
    shape = (facts.num_layers, facts.num_kv_heads, capacity, facts.head_dim)
    return IOCache(np.zeros(shape, np.float16), np.zeros(shape, np.float16))


def open_coreml(folder: Path, manifest, kv: str, predictor: Predictor) -> tuple["CoreMLRunner", "CoreMLRunner | None",
                                                                                 Topology]:
    """The bundle's CoreML packages of KV form `kv` as runners, through `predictor` (which returns predict and
    make_cache): (target, draft or None, the chain the verify function takes). Needs a verified manifest
    (runtime/contract/manifest.open_bundle)."""
    chosen = {role: [p for p in manifest.coreml if p.role == role and p.kv == kv] for role in ("target", "draft")}
    if not chosen["target"]:
        forms = sorted({p.kv for p in manifest.coreml})
        raise InputError(f"the bundle has no CoreML target packages with KV as {kv}"
                         + (f" (it has {', '.join(forms)})" if forms else "; export it with --format onnx,coreml"))
    reads = manifest.draft is not None and manifest.draft.graph.inputs.get("features") is not None
    target = CoreMLRunner(*predictor(folder, chosen["target"], manifest.target.facts), merged_package(chosen["target"]),
                          manifest.target.facts)
    tree = Topology(next(p.parents["verify"] for p in chosen["target"] if "verify" in p.parents))
    draft = None
    if chosen["draft"]:
        draft = CoreMLRunner(*predictor(folder, chosen["draft"], manifest.draft.facts), merged_package(chosen["draft"]),
                             manifest.draft.facts, reads_features=reads, head_tokens=read_head_tokens(folder, manifest.draft))
    return target, draft, tree


def merged_package(packages: list[CoreMLPackage]) -> CoreMLPackage:
    """One role's io packages (one function each) seen as one."""
    functions = {name: nodes for p in packages for name, nodes in p.functions.items()}
    return CoreMLPackage(**{**packages[0].__dict__, "functions": functions})


class CoreMLModel:
    """One model's functions: run N static tokens at `write_pos`, keep the rows the caller accepts."""

    def __init__(self, predict: Predict, package: CoreMLPackage, hidden_size: int, reads_features: bool = False):
        self.predict = predict
        self.functions = package.functions
        self.kv = package.kv
        self.capacity = package.capacity
        self.hidden_size = hidden_size
        self.reads_features = reads_features

    def run(self, name: str, cache, tokens, positions, write_pos: int, features=None) -> dict:
        """Tokens beyond the function's N are an error; fewer are padded (their rows land after the real
        ones and are overwritten later)."""
        nodes = self.functions[name]
        if len(tokens) > nodes:
            raise InputError(f"{name} takes {nodes} tokens per call, got {len(tokens)}")
        if write_pos + nodes > self.capacity:
            raise ContextOverflowError(f"the context is full: {write_pos} rows and {nodes} more exceed the cache's "
                                       f"{self.capacity}")
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


class CoreMLCache:
    """A conversation's rows in a package's KV cache (a CoreML state, or an IOCache): `length` rows are valid,
    a pass writes its N rows at `length`, and what the caller accepts of a chain is its first rows, already in
    place, so commit and trim move the length only. One lane: the packages verify chains."""
    lanes = 1

    def __init__(self, kv, kv_form: str, capacity: int, feature_size: int = 0):
        self.kv, self.kv_form, self.capacity = kv, kv_form, capacity
        self.features = np.zeros((capacity, feature_size), np.float32) if feature_size else None
        self.length = 0

    def room(self) -> int:
        return self.capacity - self.length

    def feature_rows(self) -> np.ndarray | None:
        return None if self.features is None else self.features[: self.length]

    def commit(self, lane: int, count: int, features: np.ndarray | None = None) -> None:
        end = self.length + count
        if lane != 0 or end > self.capacity:
            raise ContextOverflowError(f"the CoreML cache holds {self.capacity} tokens in one lane; "
                                       f"{end} were needed in lane {lane}")
        if self.features is not None:
            if features is None:
                raise InputError("this cache keeps features, but the package returned none")
            self.features[self.length: end] = features
        self.length = end

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise InputError(f"cannot trim a cache of {self.length} rows to {length}")
        self.length = length

    def reserve(self, rows: int) -> None:
        """The package's cache is its whole context already."""

    def evict(self, start: int, count: int, rope_frequencies) -> None:
        """The sliding KV policy's eviction (kvcache.KVCache.evict): an "io" cache's rows are arrays here; a
        state lives inside CoreML, which cannot move its rows."""
        if self.kv_form != "io":
            raise InputError("the sliding KV policy moves cached rows, which CoreML keeps inside its states: use "
                             "--kv-policy error, or a bundle exported with --coreml-kv io")
        if not (0 <= start and count > 0 and start + count <= self.length):
            raise InputError(f"cannot evict rows {start}..{start + count} of a cache of {self.length}")
        moved, kept = slice(start + count, self.length), slice(start, self.length - count)
        keys = self.kv.keys[:, :, moved].astype(np.float32)
        self.kv.keys[:, :, kept] = rotated_back(keys, count, rope_frequencies)
        self.kv.values[:, :, kept] = self.kv.values[:, :, moved].copy()
        if self.features is not None:
            self.features[kept] = self.features[moved].copy()
        self.length -= count


class CoreMLRunner:
    """One model's CoreML functions as a `Runner`: a pass runs its tokens, a chain, through one function."""

    def __init__(self, predict: Predict, make_cache: Callable[[], object], package: CoreMLPackage, facts: ModelFacts,
                 reads_features: bool = False, head_tokens: np.ndarray | None = None):
        """`head_tokens`: the vocabulary ids a trimmed head's logits cover (a draft's); `forward` spreads them
        over the full vocabulary with -inf elsewhere, as the ONNX runner does."""
        self.model = CoreMLModel(predict, package, facts.hidden_size, reads_features)
        self.make_cache, self.facts, self.head_tokens = make_cache, facts, head_tokens
        functions = package.functions
        # the role's tree function (verify, a draft's step) first: every pass it can take runs through it
        self.order = sorted(functions, key=lambda name: (name == "prefill", functions[name]))
        self.context = package.capacity - max(functions.values())  # a pass may write its N rows past the context
        self.signature = GraphSignature(heads=(facts.num_heads, facts.num_kv_heads), inputs=frozenset(), lanes=1,
                                        min_rows=1, reads_features=reads_features)
        self.min_rows = 1  # rows of a function are its N, whatever a pass asks
        self.run_seconds = 0.0

    lanes = 1
    static = None  # the functions' shapes are fixed, but each pass picks one: `pass_limit`, `tree_limit`

    @property
    def pass_limit(self) -> int:
        return max(self.model.functions.values())

    @property
    def tree_limit(self) -> int:
        return self.model.functions[self.order[0]]

    @property
    def reads_features(self) -> bool:
        return self.model.reads_features

    def new_cache(self, capacity: int, feature_size: int = 0) -> CoreMLCache:
        if capacity > self.context:
            raise InputError(f"the CoreML packages hold a context of {self.context} tokens, fixed at export; "
                             f"{capacity} were asked for")
        return CoreMLCache(self.make_cache(), self.model.kv, capacity, feature_size)

    def forward(self, cache: CoreMLCache, tokens, positions, tree_mask: np.ndarray, logit_rows,
                past_mask: np.ndarray | None = None, features: np.ndarray | None = None,
                exact_rows: bool = True) -> Pass:
        """As model.ModelRunner.forward, for a chain after every cached row (what the functions compute)."""
        n = len(tokens)
        if not np.array_equal(np.asarray(tree_mask, bool), np.tri(n, dtype=bool)) or \
                (past_mask is not None and not np.asarray(past_mask, bool).all()):
            raise InputError("CoreML packages verify chains, each token after every cached row: this pass asks for "
                             "a branching tree or a mask over the past (export the bundle with a chain tree)")
        name = next((name for name in self.order if self.model.functions[name] >= n), None)
        if name is None:
            raise InputError(f"{n} tokens in one pass of CoreML functions that take at most {self.pass_limit}")
        started = time.perf_counter()
        outputs = self.model.run(name, cache.kv, list(tokens), list(positions), cache.length, features)
        self.run_seconds += time.perf_counter() - started
        logits = np.asarray(outputs["logits"][0], np.float32)[np.asarray(logit_rows, np.int64)]
        if self.head_tokens is not None:
            full = np.full((len(logits), self.facts.vocab_size), -np.inf, np.float32)
            full[:, self.head_tokens] = logits
            logits = full
        given = outputs.get("features_out")
        return Pass(logits=logits, path_nodes=np.arange(n)[None],
                    features=None if given is None else np.asarray(given[0, :n], np.float32))
