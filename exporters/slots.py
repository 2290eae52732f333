"""The slots graph form: S conversations in one target pass, each computed with the bits it gets alone.

A target's graph of S slots (S fixed at export, `--slots`) runs the rows of up to S conversations, each at
its own past length, in its own KV buffers and lanes (issue 42). Why this form (history.md §62): onnxruntime's
GroupQueryAttention takes several sequences with a past only at one new token each, and that one-query path
rounds unlike an exact pass; but everything else in a decoder is row by row (embedding, norms, the matmuls,
the head), and a matmul row's bits do not depend on the other rows once a pass has the device's `min_rows`
(what the exactness check compares: chunks, steps, trees). So the rows of every slot go through the
projections, MLP and head at once, and only attention is split: one GroupQueryAttention node per slot and
layer, batch 1, over that slot's own buffer, `seqlens_k` and lanes, fed exactly what the single graph's node
is fed for that conversation (exporters/llama.py: the lanes' head gathers).

    inputs:  input_ids [1, N]            every slot's rows, slot after slot (each slot's padding rows included)
             logit_rows [R]              rows of the N whose logits are returned
             out_rows [N, H]             which row of all slots' attention outputs, concatenated in slot order
                                         and viewed as [sum of L_s * B * H, head_dim], is each head of each token
             per slot s: qkv_rows_slot{s} [L_s, B * (H + 2 kvH)] (rows of all N tokens' heads, viewed as
                         [N * (H + 2 kvH), head_dim]), position_ids_slot{s} [1, L_s], seqlens_k_slot{s} [1],
                         total_sequence_length_slot{s} [], past_key_{l}_slot{s} / past_value_{l}_slot{s}
                         [1, B * kvH, capacity_s, head_dim] (a conversation's cache buffers, bound in place)
    outputs: logits [1, R, V], present_key_{l}_slot{s} / present_value_{l}_slot{s} (the same buffers),
             and features_out [1, N, hidden] where the single graph returns them.

A slot with no conversation this pass still runs its node (the graph's shape is fixed): the runtime binds
it a scratch buffer and gathers nothing from it. The runtime's side: runtime/execution/slots.py.
"""
from __future__ import annotations

from edgespec.runtime.contract.errors import ExportError

from .onnx_builder import FLOAT, INT32, INT64, GraphBuilder

SLOT_SUFFIX = "_slot{}"


def slot_name(name: str, slot: int) -> str:
    """A per-slot input's or output's name: `past_key_3` of slot 1 is `past_key_3_slot1`."""
    return name + SLOT_SUFFIX.format(slot)


def slot_layers(builder, g: GraphBuilder, x: str, branch: str | None, layers: range, nodes, slots: int):
    """The decoder layers of a slots graph (the module's docstring): `builder` is the model's LlamaBuilder."""
    if slots < 1:
        raise ExportError(f"a slots graph needs at least one slot (got {slots})")
    if not builder.exact_passes or builder.portable_attention or builder.feature_fc is not None:
        raise ExportError("only a target's graph (exact passes, fused attention) can be exported with slots")
    f, lanes = builder.facts, builder.lanes
    units = lanes * (f.num_heads + 2 * f.num_kv_heads)
    out_rows = g.input("out_rows", INT64, [nodes, f.num_heads])
    per_slot = []
    for s in range(slots):
        length = f"slots_{s}"
        per_slot.append(dict(rows=g.input(slot_name("qkv_rows", s), INT64, [length, units]),
                             pos=g.input(slot_name("position_ids", s), INT64, [1, length]),
                             seqlens=g.input(slot_name("seqlens_k", s), INT32, [1]),
                             total=g.input(slot_name("total_sequence_length", s), INT32, [])))
    tables = builder.rotary_inputs(g, layers)
    buffer = [1, lanes * f.num_kv_heads, "capacity", f.head_dim]
    for l in layers:
        pasts = [(g.input(slot_name(f"past_key_{l}", s), FLOAT, buffer),
                  g.input(slot_name(f"past_value_{l}", s), FLOAT, buffer)) for s in range(slots)]
        w = {k: g.weight(f"layers.{l}.{k}", v) for k, v in builder.layer_weights(l).items()}
        rope = tables.get(builder.ropes[l], (None, None))

        def attention(h, w=w, pasts=pasts, rope=rope, l=l):
            heads_of_tokens = g.op("Reshape", [builder.qkv_projection(g, h, w), g.const([-1, f.head_dim])])
            outs = []
            for s, (attend, past) in enumerate(zip(per_slot, pasts)):
                packed = g.op("Reshape", [g.op("Gather", [heads_of_tokens, attend["rows"]], axis=0),
                                          g.const([1, -1, units * f.head_dim])])  # [1, L_s, units * D]
                layer_attend = dict(attend, window=builder.windows[l], cos=rope[0], sin=rope[1])
                out, present_k, present_v = builder.fused_attention(g, packed, past, layer_attend, lanes)
                g.output(present_k, slot_name(f"present_key_{l}", s), FLOAT, buffer)
                g.output(present_v, slot_name(f"present_value_{l}", s), FLOAT, buffer)
                outs.append(g.op("Reshape", [out, g.const([-1, f.head_dim])]))  # [L_s * B * H, D]
            joined = outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=0)
            out = g.op("Reshape", [g.op("Gather", [joined, out_rows], axis=0),
                                   g.const([1, -1, f.num_heads * f.head_dim])])  # [1, N, H * D]
            return g.op("MatMul", [out, w["o"]], "o_proj")

        x, branch = builder.decoder_layer(g, x, branch, w, attention)
        g.flush()
    return x, branch
