"""What a bundle's graphs promise the runtime beyond their inputs' names: the names of the feature tensors
a feature-reading draft exchanges with its target, the metadata keys the exporter writes, and the rows
every pass must hold, and one graph's signature read from what it declares."""
from __future__ import annotations

from dataclasses import dataclass

from .errors import BundleError, InputError
from .facts import ModelFacts

FEATURES = "features"  # the draft graph's input, in the manifest's graph specs
FEATURES_OUT = "features_out"  # the output of a graph that returns its final hidden states

# onnxruntime's CPU matmuls (MLAS sgemm, and MatMulNBits at every accuracy level) take a separate
# single-row (GEMV) path whose rounding differs from the multi-row kernel (measured: up to ~8e-5 in
# SmolLM2's fp32 logits, more in int4). Every matmul therefore sees at least two rows — a one-token
# step gets one masked padding row, a one-row logits request a duplicate row for the head — so a
# token's logits are the same bits alone, in a prefill chunk or inside a verified tree.
# A draft's passes need no such care: their rows need not match anything, and one row is the fastest.
# A graph whose matmuls all accumulate in integers (quant/integer.py) has the same bits at one row; the
# exporter records that in the graph's metadata under EXACT_ROWS_KEY. (Its attention still takes two
# slots: pass_feed.) Which kernels a CPU takes differs by instruction set: where the device's one-row
# kernels round as its multi-row ones, runtime/decoding/exactness.py's check proves it and the runner's
# `min_rows` drops to 1 for plain and speculative decoding alike (history.md §49).
MIN_ROWS = 2
EXACT_ROWS_KEY = "edgespec.exact_min_rows"
# a graph whose attention is written in standard operators (a static draft for an NPU) masks nothing by
# itself: its passes' attention bias carries the causal mask and hides the buffer's unwritten columns
ATTENTION_KEY = "edgespec.attention"
STANDARD_ATTENTION = "standard"
ATTENTION_BIAS = "attention_bias"

# Rows a pass may write past `capacity`: a one-token step's padding row (the runner, MIN_ROWS).
KV_SLACK = 2

# every input a pass may build (runtime/execution/model.py pass_feed): a graph takes a subset of them
PASS_INPUTS = frozenset({"input_ids", "position_ids", "logit_rows", "seqlens_k", "total_sequence_length",
                         ATTENTION_BIAS, "qkv_rows", "out_rows"})


@dataclass(frozen=True)
class StaticShape:
    """A static-shape graph's fixed sizes (NPU profiles): every pass runs `nodes` rows in `nodes` slots per lane,
    asks for `nodes` logit rows, and attends over a KV buffer of `capacity` rows, the context plus `nodes`
    rows a pass may write past it. Read from the graph's own input shapes."""
    nodes: int
    capacity: int

    @property
    def context(self) -> int:
        return self.capacity - self.nodes

    def buffer(self) -> dict:
        """KVCache's arguments for the graph's buffer: whole from the start, its node count as slack."""
        return {"initial_rows": self.context, "slack": self.nodes}

    @classmethod
    def of(cls, shapes: dict[str, list]) -> "StaticShape | None":
        """From the graph's input shapes (name -> dims, a dim a name or None where it is not fixed)."""
        nodes = shapes.get("input_ids", shapes.get("hidden", [None, None]))[1]
        capacity = next((shape[2] for name, shape in shapes.items() if name.startswith("past_key_")), None)
        if not isinstance(nodes, int) or not isinstance(capacity, int):  # a fixed N alone still runs unpadded
            return None
        if capacity <= nodes:
            raise InputError(f"a static-shape graph needs a KV buffer longer than its {nodes} nodes (got {capacity})")
        return cls(nodes, capacity)


@dataclass(frozen=True)
class GraphSignature:
    """What one graph takes and gives, read once from it: every pass is laid out from this alone."""
    heads: tuple[int, int]  # the model's (query, kv) heads
    inputs: frozenset[str]  # the pass inputs it takes (a subset of PASS_INPUTS; KV buffers aside)
    lanes: int  # the root-to-leaf paths it attends in at once
    static: StaticShape | None = None  # fixed sizes every pass is padded to (None: dynamic shapes)
    explicit_mask: bool = False  # attention in standard operators: the bias carries the causal mask
    min_rows: int = MIN_ROWS  # the fewest rows an exact pass needs on any device (EXACT_ROWS_KEY)
    reads_features: bool = False  # a feature-reading draft's (FEATURES)
    gives_features: bool = False  # it returns its final hidden states (FEATURES_OUT)

    @property
    def attention_bias(self) -> bool:
        return ATTENTION_BIAS in self.inputs

    @property
    def head_gathers(self) -> bool:
        return "qkv_rows" in self.inputs

    @property
    def pass_limit(self) -> int | None:
        """The most tokens one pass takes (a static graph's nodes), None without a limit."""
        return None if self.static is None else self.static.nodes

    @classmethod
    def read(cls, facts: ModelFacts, inputs: dict[str, list], outputs, metadata: dict[str, str]) -> "GraphSignature":
        """From what a graph declares: its inputs' shapes (name -> dims), its output names, its metadata."""
        min_rows = metadata.get(EXACT_ROWS_KEY, str(MIN_ROWS))
        if min_rows not in ("1", "2"):
            raise BundleError(f"the graph's {EXACT_ROWS_KEY} is {min_rows!r}: re-export the bundle")
        kv_heads = next((shape[1] for name, shape in inputs.items() if name.startswith("past_key_")), None)
        return cls(heads=(facts.num_heads, facts.num_kv_heads), inputs=PASS_INPUTS & set(inputs),
                   lanes=kv_heads // facts.num_kv_heads if isinstance(kv_heads, int) else 1,
                   static=StaticShape.of(inputs), explicit_mask=metadata.get(ATTENTION_KEY) == STANDARD_ATTENTION,
                   min_rows=int(min_rows), reads_features=FEATURES in inputs, gives_features=FEATURES_OUT in outputs)

    @classmethod
    def every_input(cls, facts: ModelFacts, lanes: int = 1) -> "GraphSignature":
        """A pass laid out for any graph of this model (a staged target's stages take different subsets, a
        probe built from a graph's parts): what a graph does not take is left out when it runs."""
        return cls(heads=(facts.num_heads, facts.num_kv_heads), inputs=PASS_INPUTS, lanes=lanes)
