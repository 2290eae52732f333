"""A decoder layer's attention in the graph: the N tokens' q/k/v placed in their lanes' slots, then one fused
GroupQueryAttention node (or, for a static draft, the same in standard operators), and the distill engine's
per-sequence form. A mixin of the graph builder (exporters/llama.py: its module docstring says why lanes):
it reads the builder's `facts`, `lanes`, `pads_slots`, `portable_attention`, `attention_attributes`,
`rotary_dims` and `qkv_projection`, which the families override."""
from __future__ import annotations

import numpy as np

from .onnx_builder import INT64


class LayerAttention:
    def attention(self, g, h, w, past, placement, attend):
        """Attention of the N new tokens, each in its slot of one of B lanes (exporters/llama.py says why):
        one fused GroupQueryAttention node over the layer's KV buffer, rotary embedding included.
        `placement`: (qkv_rows, out_rows), or (N, the pads of the slots past them) for a target's one lane."""
        f, lane_count = self.facts, self.lanes
        heads, kv_heads, d = f.num_heads, f.num_kv_heads, f.head_dim
        qkv = self.qkv_projection(g, h, w)
        attention = self.standard_attention if self.portable_attention else self.fused_attention
        if self.pads_slots:  # token k in slot k, the padding slots after them
            tokens, pads = placement
            out, present_k, present_v = attention(g, g.op("Pad", [qkv, pads]), past, attend, 1)  # [1, L, H * D]
            out = g.op("Slice", [out, g.const([0]), tokens, g.const([1])])  # [1, N, H * D]
            return g.op("MatMul", [out, w["o"]], "o_proj"), present_k, present_v
        qkv_rows, out_rows = placement
        # one Gather lays the heads out as the op takes them: lanes folded into heads, q, k, v packed
        heads_of_tokens = g.op("Reshape", [qkv, g.const([-1, d])])  # [N * (H + 2 kvH), D]
        units = lane_count * (heads + 2 * kv_heads)
        packed = g.op("Reshape", [g.op("Gather", [heads_of_tokens, qkv_rows], axis=0),
                                  g.const([1, -1, units * d])])  # [L, units, D] -> [1, L, units * D]
        out, present_k, present_v = attention(g, packed, past, attend, lane_count)  # [1, L, B * H * D]
        out = g.op("Gather", [g.op("Reshape", [out, g.const([-1, d])]), out_rows], axis=0)  # [N, H, D]
        out = g.op("Reshape", [out, g.const([1, -1, heads * d])])
        return g.op("MatMul", [out, w["o"]], "o_proj"), present_k, present_v

    def fused_attention(self, g, packed, past, attend, lane_count: int):
        """One GroupQueryAttention node over the layer's KV buffer, rotary embedding included: `lane_count`
        lanes folded into its heads, `attend["bias"]` added to the scores when the graph has one."""
        f = self.facts
        rotary = attend["cos"] is not None
        inputs = [packed, "", "", past[0], past[1], attend["seqlens"], attend["total"],
                  *((attend["cos"], attend["sin"]) if rotary else ("", "")),
                  attend["pos"]] + ([attend["bias"]] if "bias" in attend else [])
        extra = dict(self.attention_attributes, **({"local_window_size": attend["window"]} if attend["window"] else {}))
        return g.op("GroupQueryAttention", inputs, "attn", n_out=3, domain="com.microsoft",
                    num_heads=lane_count * f.num_heads, kv_num_heads=lane_count * f.num_kv_heads,
                    do_rotary=int(rotary), **extra)

    def standard_attention(self, g, packed, past, attend, lane_count: int):
        """What the fused node computes, in standard operators over a static graph's whole buffer: rotary
        embedding (half-split), the L new keys/values written at past .. past + L - 1 (ScatterElements into
        the buffer bound as past and present), scores over every column with `attend["bias"]` masking what a
        row may not see (the runtime masks the future and the unwritten columns explicitly for such a
        graph), softmax, values. Query head h reads kv head h // (H / kvH), as the fused op. A sliding
        window is not applied: only drafts take this form, and a draft's rows need only be good guesses."""
        f = self.facts
        heads, kv_heads, d = lane_count * f.num_heads, lane_count * f.num_kv_heads, f.head_dim
        q, k, v = g.op("Split", [packed, g.const([heads * d, kv_heads * d, kv_heads * d])], n_out=3, axis=-1)
        half = self.rotary_dims // 2

        def rotary(x, count):  # [1, L, count * D] -> [1, count, L, D]: the first rotary_dims of each head turned
            x = g.op("Reshape", [x, g.const([1, -1, count, d])])
            if attend["cos"] is not None:
                cos = g.op("Unsqueeze", [g.op("Gather", [attend["cos"], attend["pos"]], axis=0), g.const([2])])
                sin = g.op("Unsqueeze", [g.op("Gather", [attend["sin"], attend["pos"]], axis=0), g.const([2])])
                # no empty third part where every dimension turns: OpenVINO cannot bind a tensor of size 0
                parts = [half, half] + ([d - 2 * half] if d > 2 * half else [])
                first, second, *rest = g.op("Split", [x, g.const(parts)], n_out=len(parts), axis=-1)
                x = g.op("Concat", [g.op("Sub", [g.op("Mul", [first, cos]), g.op("Mul", [second, sin])]),
                                    g.op("Add", [g.op("Mul", [second, cos]), g.op("Mul", [first, sin])]), *rest], axis=-1)
            return g.op("Transpose", [x], perm=[0, 2, 1, 3])

        q, k = rotary(q, heads), rotary(k, kv_heads)
        v = g.op("Transpose", [g.op("Reshape", [v, g.const([1, -1, kv_heads, d])])], perm=[0, 2, 1, 3])
        slots = g.op("Slice", [g.op("Shape", [packed]), g.const([1]), g.const([2])])  # [L]
        total = g.op("Cast", [g.op("Add", [attend["seqlens"], g.const([1], np.int32)])], to=INT64)
        start = g.op("Sub", [total, slots])
        rows = g.op("Range", [g.op("Squeeze", [start]), g.op("Squeeze", [total]), g.const(1)])  # past .. past + L - 1
        where = g.op("Expand", [g.op("Reshape", [rows, g.const([1, 1, -1, 1])]), g.op("Shape", [k])])
        present_k = g.op("ScatterElements", [past[0], where, k], axis=2)
        present_v = g.op("ScatterElements", [past[1], where, v], axis=2)
        scale = self.attention_attributes.get("scale", 1 / np.sqrt(d))
        grouped = g.op("Reshape", [g.op("Mul", [q, g.const(scale, np.float32)]),
                                   g.const([1, kv_heads, -1, d])])  # [1, kvH, G * L, D]: h = kv * G + g
        scores = g.op("MatMul", [grouped, g.op("Transpose", [present_k], perm=[0, 1, 3, 2])])  # [1, kvH, G * L, C]
        if "softcap" in self.attention_attributes:
            cap = g.const(self.attention_attributes["softcap"], np.float32)
            scores = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])]), cap])
        scores = g.op("Add", [g.op("Reshape", [scores, g.const([1, heads, -1, 0])]), attend["bias"]])
        probs = g.op("Reshape", [g.op("Softmax", [scores], axis=-1), g.const([1, kv_heads, -1, 0])])
        out = g.op("Reshape", [g.op("MatMul", [probs, present_v]), g.const([1, heads, -1, d])])  # [1, H, L, D]
        out = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.const([1, -1, heads * d])])
        return out, present_k, present_v

    def sequence_attention(self, g, h, w, past, attend):
        """Attention of B independent sequences' S new tokens each (a `sequences` graph): the op's packed
        q/k/v as [B, S, ...], the batch read from seqlens_k."""
        f = self.facts
        width = (f.num_heads + 2 * f.num_kv_heads) * f.head_dim
        by_sequence = g.op("Concat", [g.op("Shape", [attend["seqlens"]]), g.const([-1, width])], axis=0)
        packed = g.op("Reshape", [self.qkv_projection(g, h, w), by_sequence])  # [B, S, (H + 2 kvH) * D]
        out, present_k, present_v = self.fused_attention(g, packed, past, attend, 1)  # [B, S, H * D]
        out = g.op("Reshape", [out, g.const([1, -1, f.num_heads * f.head_dim])])
        return g.op("MatMul", [out, w["o"]], "o_proj"), present_k, present_v
