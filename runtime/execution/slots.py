"""One pass of a slots graph (exporters/slots.py): up to S conversations' passes at once, each with its bits alone.

Each conversation's pass is laid out as the single target graph would take it (model.pass_feed, with the
rows the device's `min_rows` asks: so every matmul of the shared pass has at least that many rows, the
exactness condition), then placed in a slot: its rows follow the earlier slots' rows, its head gathers
and logit rows are shifted by them, and its cache buffers are bound as that slot's past and present. A
slot without a conversation gets a scratch buffer of its own; nothing is read from it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ..contract.errors import BackendError, BundleError, InputError
from ..contract.graph import FEATURES_OUT
from .kvcache import KVCache, kv_input_layers
from .model import ModelRunner, Pass, PassLayout, head_rows_of, pass_feed
from .sessions import ORT_ERRORS

SCRATCH_SLOTS = 2  # an empty slot's pass: two attention slots at the start of its scratch buffer


@dataclass(frozen=True)
class SlotPass:
    """One conversation's part of a shared pass: its cache and its pass laid out for the single graph."""
    cache: KVCache
    layout: PassLayout


def slot_count(session: ort.InferenceSession) -> int:
    """The slots a slots graph was exported with (its per-slot `seqlens_k` inputs)."""
    return sum(1 for i in session.get_inputs() if i.name.startswith("seqlens_k_slot"))


class SlotRunner:
    """Runs the passes of several conversations of `single`'s graph in one pass of `session`, a slots graph
    exported from the same model with the same lanes and weights."""

    def __init__(self, session: ort.InferenceSession, single: ModelRunner):
        self.session = session
        self.single = single
        self.slots = slot_count(session)
        if not self.slots:
            raise BundleError("this graph has no slots: export the bundle with --slots")
        names = [i.name for i in session.get_inputs()]
        self.layers = kv_input_layers(n.removesuffix("_slot0") for n in names if n.endswith("_slot0"))
        if len(self.layers) != single.facts.num_layers:
            raise BundleError("the slots graph's KV inputs do not match the target's layers: re-export the bundle")
        self.gives_features = FEATURES_OUT in [o.name for o in session.get_outputs()]
        self.scratch = KVCache(single.facts, SCRATCH_SLOTS, lanes=single.lanes)
        self._binding = session.io_binding()
        self._bound: list[np.ndarray | None] = [None] * self.slots  # the cache array each slot's buffers are bound to
        self.run_seconds = 0.0

    def layout(self, cache: KVCache, tokens, positions, tree_mask, logit_rows) -> SlotPass:
        """A conversation's exact pass, laid out as the single graph takes it."""
        return SlotPass(cache, pass_feed(cache, self.single.signature, tokens, positions, tree_mask, logit_rows,
                                         min_rows=self.single.min_rows))

    def run(self, parts: list[SlotPass]) -> list[Pass]:
        """One pass of every part, each in a slot of its own; returns each part's Pass as the single graph's."""
        if not 1 <= len(parts) <= self.slots:
            raise InputError(f"{len(parts)} conversations in one pass of a graph of {self.slots} slots")
        if len({id(p.cache) for p in parts}) != len(parts):
            raise InputError("a conversation's cache can take one slot of a pass, not two")
        width = self._units() // self.single.lanes  # head rows per token in the graph's [N * (H + 2 kvH), D]
        ids, logit_rows, out_rows, starts = [], [], [], []
        row, out_row, binding = 0, 0, self._binding
        for s in range(self.slots):
            part = parts[s] if s < len(parts) else None
            feed, cache = (part.layout.feed, part.cache) if part else (self._scratch_feed(), self.scratch)
            self._bind_cache(s, cache)
            # an empty slot reads the first token's heads: any rows of this pass would do
            qkv, outs = self._head_rows(part.layout) if part else \
                (np.zeros((SCRATCH_SLOTS, self._units()), np.int64), None)
            slot_inputs = {"qkv_rows": qkv + row * width if part else qkv, "position_ids": feed["position_ids"],
                           "seqlens_k": feed["seqlens_k"], "total_sequence_length": feed["total_sequence_length"]}
            for name, value in slot_inputs.items():
                binding.bind_cpu_input(f"{name}_slot{s}", np.ascontiguousarray(value))
            if part:
                n = feed["input_ids"].shape[1]
                ids.append(feed["input_ids"][0])
                logit_rows.append(feed["logit_rows"] + row)
                out_rows.append(outs + out_row)
                starts.append(row)
                row += n
            out_row += len(qkv) * self.single.lanes * self.single.signature.heads[0]
        for name, value in (("input_ids", np.concatenate(ids)[None]), ("logit_rows", np.concatenate(logit_rows)),
                            ("out_rows", np.concatenate(out_rows))):
            binding.bind_cpu_input(name, value)
        logits = np.empty((1, sum(len(r) for r in logit_rows), self.single.head_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        features = None
        if self.gives_features:
            features = np.empty((1, row, self.single.facts.hidden_size), np.float32)
            binding.bind_output(FEATURES_OUT, "cpu", 0, np.float32, list(features.shape), features.ctypes.data)
        started = time.perf_counter()
        try:
            self.session.run_with_iobinding(binding)
        except ORT_ERRORS as err:
            raise BackendError(f"onnxruntime {ort.__version__} failed in a slots pass ({type(err).__name__}): "
                               f"{str(err)[:300]}") from err
        self.run_seconds += time.perf_counter() - started
        out, first = [], 0
        for part, start, rows in zip(parts, starts, logit_rows):
            wanted = len(part.layout.wanted)
            out.append(Pass(logits=logits[0, first : first + wanted], path_nodes=part.layout.path_nodes,
                            features=None if features is None else features[0, start : start + part.layout.rows]))
            first += len(rows)
        return out

    def _units(self) -> int:
        heads, kv_heads = self.single.signature.heads
        return self.single.lanes * (heads + 2 * kv_heads)

    def _head_rows(self, layout: PassLayout) -> tuple[np.ndarray, np.ndarray]:
        """The single graph's head gathers for this pass: its own where it takes them, else those of its one
        lane with token k in slot k (what its Pad and Slice do)."""
        feed = layout.feed
        if "qkv_rows" in feed:
            return feed["qkv_rows"], feed["out_rows"]
        return head_rows_of(layout.path_nodes, np.arange(feed["input_ids"].shape[1]), self.single.signature.heads)

    def _scratch_feed(self) -> dict:
        return dict(position_ids=np.arange(SCRATCH_SLOTS, dtype=np.int64)[None],
                    seqlens_k=np.array([SCRATCH_SLOTS - 1], np.int32),
                    total_sequence_length=np.array(SCRATCH_SLOTS, np.int32))

    def _bind_cache(self, slot: int, cache: KVCache) -> None:
        """Binds `cache`'s buffers as slot `slot`'s past and present, unless they are bound there already
        (binding a model's buffers costs more than a small pass's arithmetic: kvcache.py)."""
        if self._bound[slot] is cache.data:
            return
        shape = cache.data.shape
        for layer in self.layers:
            for kind, name in ((0, "key"), (1, "value")):
                value = ort.OrtValue.ortvalue_from_numpy(
                    cache.data[layer, kind].reshape(1, shape[2] * shape[3], shape[4], shape[5]))
                self._binding.bind_ortvalue_input(f"past_{name}_{layer}_slot{slot}", value)
                self._binding.bind_ortvalue_output(f"present_{name}_{layer}_slot{slot}", value)
        self._bound[slot] = cache.data
