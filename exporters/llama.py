"""ONNX graphs for Llama-family decoders, built node by node from the checkpoint's weights.

One builder writes every graph of a model (schema 3): a graph takes N new tokens (N static, or
symbolic for CPU profiles), how they sit in B sequences ("lanes", B fixed at export) of L slots, and
one KV buffer per layer that onnxruntime's fused GroupQueryAttention reads and writes in place; it
returns logits.

    inputs:  input_ids [1, N] int64
             qkv_rows [L, B * (H + 2 kvH)] int64 (a draft's graph, and a target's of B > 1 lanes: for each
                                         slot, which row of the N tokens' q/k/v heads, viewed as
                                         [N * (H + 2 kvH), head_dim], fills each head of each lane, in the
                                         op's packed order: all lanes' q, then k, then v)
             out_rows [N, H] int64      (the same graphs: which row of the op's output [L * B * H, head_dim]
                                         is each of a token's heads: its slot in the first lane that holds it)
             position_ids [1, L] int64  (the rotary position of each slot, the same in every lane)
             attention_bias [1, 1, L, T] float32 (a draft's graph only: added to the scores, 0 or -inf;
                                         T = past + L)
             seqlens_k [1] int32, total_sequence_length [] int32   (past + L - 1, past + L)
             past_key_{l}, past_value_{l} [1, B * kv_heads, capacity, head_dim] float32: the runtime's
                                         cache buffers, lane-major, bound as these inputs and as the
                                         present outputs below through IOBinding (nothing is copied;
                                         the op writes the L new rows of every lane at past..past+L-1)
             logit_rows [R] int64       (which of the N rows need logits: the last for prefill)
    outputs: logits [1, R, V], present_key_{l}, present_value_{l} (the same buffers)

Why lanes: a token's attention sums over the columns it may see, and onnxruntime's softmax and
matmul kernels round those sums differently when the same values sit at other columns (an
attention_bias that masks a sibling still moves the columns: measured, 6e-8). In plain decoding a
token's path lies at columns past, past+1, ...; so the runtime gives each root-to-leaf path of a tree a
lane of its own in which every token sees exactly the columns plain decoding shows it, and its row has
the same bits (runtime/execution/model.py). The op takes several sequences with a past only as one, so the
lanes are folded into its heads: lane b's query heads are b * H .. b * H + H - 1 over its kv heads
b * kvH .., each head computed alone as in plain decoding. Every lane of a cache holds the same
committed rows; the runtime copies an accepted path's rows from its lane to the others (a few rows,
never the past). A chain or a prefill chunk is one lane; a graph of B lanes runs B lanes' attention
on every pass (unused lanes repeat lane 0), so a bundle whose trees are chains is exported with one.
The matmuls run on the N tokens, not on the lanes' slots: q/k/v are gathered into the lanes after
their projection (one Gather of head rows) and the attention output gathered back (another). In a
target's graph of one lane, token k sits in slot k and the slots past the N tokens (a one-token step's second
slot) come last, so a Pad of the N tokens' q/k/v and a Slice of the output do the same with four fewer
nodes a layer (history.md §54); the padding slot's zeros are never read.

The draft's passes (rows that need not match anything) use one lane and attention_bias for their
tree masks, with position_ids giving each row its depth. A target's passes are exact, every path in a
lane of its own, so the op's causal mask is their whole mask: its graph takes no attention_bias (adding
a zero bias cost time on every step, history.md §54).

A graph built with `sequences=True` runs S new tokens of each of B independent sequences, each at its
own past length (distill's data engine, distill/engine.py): the N = B * S tokens still go through the
matmuls as [1, N, H], batch-major, and only the attention sees them as [B, S]: position_ids [B, S],
seqlens_k [B], KV buffers [B, kv_heads, capacity, head_dim], no qkv_rows/out_rows/attention_bias
(the op's own causal mask). Plain decoding's exactness is not its concern: it makes training data.

A feature-reading draft (runtime/execution/features.py) also takes `features` [1, N, H] and mixes them into its
embeddings through a trained projection; a graph built with `features_out` also returns `features_out`
[1, N, H], the final-norm hidden state of every row.

Subclasses override only what differs from Llama (architectures.py).
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import FEATURES, FEATURES_OUT, KV_SLACK

from .attention import LayerAttention
from .onnx_builder import FLOAT, INT32, INT64, GraphBuilder
from .rotary import Rotary
from .slots import slot_layers

# Rows past the context a pass may write (a one-token step's padding row): the rotary tables cover them.
ROPE_SLACK = KV_SLACK
LAYER_PART_BYTES = 512 << 20  # float32 bytes of a layer above which it is written in two parts


class LlamaBuilder(LayerAttention, Rotary):
    architecture = "llama"
    qk_norm: str | None = None  # "head": an RMSNorm over each query/key head; "projection": over the whole projections
    norm_offset = 0.0  # norms scale by (norm_offset + weight): Gemma's are 1 + weight
    activations = ("silu",)  # the MLP activations the graph computes (`activation`)
    coreml_packages = True  # exporters/coreml.py computes this family (it knows Llama's layer and nothing more)
    # positions past the context the rotary tables cover: a static-shape graph's node count (its passes
    # write that far, and its op checks its tables against the whole buffer)
    rope_slack = ROPE_SLACK
    # attention in standard ONNX operators instead of the fused contrib op (a static draft for an NPU,
    # whose compiler takes no GroupQueryAttention): its arithmetic differs, which a draft may
    portable_attention = False
    attention_attributes: dict = {}  # GroupQueryAttention's own (scale, softcap) where a family sets them

    def __init__(self, model, max_context: int, head_tokens: np.ndarray | None = None,
                 feature_fc: tuple[np.ndarray, np.ndarray] | None = None, features_out: bool = False,
                 lanes: int = 1, exact_passes: bool = False, weights=None, feature_taps=None):
        """`model` is a transformers *ForCausalLM in float32, or its skeleton with `weights`, a mapping of its
        state's names to float32 arrays read when asked for (exporters/checkpoint.py). `head_tokens` (a draft's trimmed head):
        the graph's logits cover only these vocabulary ids, in this order. `feature_fc` (a draft that
        reads the target's features): (weight [H, 2H], bias [H]) of the projection of [embedding, feature]
        to the first layer's input. `features_out`: return the final hidden states too. `lanes`: the
        root-to-leaf paths a verifying pass can attend in (see the module's docstring). `exact_passes`: a
        target's graph, every pass of which is exact: it takes no attention bias, and in one lane pads its
        tokens into the slots instead of gathering them. A draft's graph keeps both (its tree masks; and
        OpenVINO's ONNX frontend, which runs drafts, cannot type that Pad and Slice: history.md §54).
        `feature_taps` (exporters/eagle3.py: FeatureTaps): the features returned are a projection of the
        residual stream entering some layers instead of the final hidden states (an EAGLE-3 head's target)."""
        if lanes < 1:
            raise ExportError(f"a graph needs at least one lane (got {lanes})")
        self.lanes = lanes
        self.exact_passes = exact_passes
        self.model = model
        cfg = model.config
        trained = getattr(cfg, "max_position_embeddings", None)
        if trained and max_context > trained:
            raise ExportError(f"--context {max_context} is longer than the {trained} positions this model was "
                              f"trained for; export with --context {trained} or less")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if head_dim % 16:
            raise ExportError(f"the model's attention heads are {head_dim} wide; onnxruntime's fused attention, "
                              "which edgespec's graphs run on, takes multiples of 16")
        rope = getattr(cfg, "rope_parameters", None) or {}
        self.facts = ModelFacts(
            architecture=self.architecture,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            max_context=max_context,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )
        self.windows = self.attention_windows(cfg)
        self.facts = replace(self.facts, sliding_window=min((w for w in self.windows if w), default=None))
        self.ropes = tuple(self.layer_rope(cfg, l) for l in range(cfg.num_hidden_layers))
        if set(self.ropes) == {""}:  # one rotary table for every layer: the cache can move keys (KV eviction)
            cos, sin = self.rope_tables("")
            half = cos.shape[1] // 2
            if half == head_dim // 2:
                self.facts = replace(self.facts, rope_frequencies=tuple(float(a) for a in np.arctan2(
                    sin[1, :half].astype(np.float64), cos[1, :half].astype(np.float64))))
        self.weights = weights  # None: the model holds its weights
        self.state = weights if weights is not None else \
            {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        # a bias on q, k and v (Qwen2, or any family's `attention_bias`) is read where the checkpoint has one
        self.qkv_bias = "model.layers.0.self_attn.q_proj.bias" in self.state
        self._refuse_what_the_graph_omits(cfg)
        self.head_tokens = head_tokens
        self.features_out = features_out or feature_taps is not None
        self.feature_fc = feature_fc
        self.feature_taps = feature_taps
        if feature_taps is not None:
            feature_taps.check(self.facts)
        hidden = cfg.hidden_size
        if feature_fc is not None and (feature_fc[0].shape != (hidden, 2 * hidden) or feature_fc[1].shape != (hidden,)):
            raise ExportError(f"the draft's feature projection must be [{hidden}, {2 * hidden}] with a bias of "
                              f"[{hidden}], got {list(feature_fc[0].shape)} and {list(feature_fc[1].shape)}")
        if head_tokens is not None and (len(head_tokens) < 2 or len(np.unique(head_tokens)) != len(head_tokens)
                                        or head_tokens.min() < 0 or head_tokens.max() >= cfg.vocab_size):
            raise ExportError(f"head tokens must be at least 2 distinct ids below the vocabulary size {cfg.vocab_size}")

    def _refuse_what_the_graph_omits(self, cfg) -> None:
        """A config the graph would silently get wrong (an activation it does not compute, a bias it does
        not add) is refused here, not exported into wrong logits."""
        act = self.activation_name(cfg)
        if act not in self.activations:
            raise ExportError(f"the model's MLP uses {act!r}; edgespec's {self.architecture} graph computes "
                              f"{' or '.join(self.activations)} only")
        if self.rotary_dims < self.facts.head_dim and (self.rotary_dims // 2) % 8:
            raise ExportError(f"the model turns {self.rotary_dims} of each head's {self.facts.head_dim} dimensions "
                              "by its rotary embedding; onnxruntime's fused attention takes a partial rotation in "
                              "multiples of 16 dimensions")
        rope = getattr(cfg, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope) if "rope_type" not in rope else rope
        if rope.get("rope_type") in ("dynamic", "longrope"):
            # these tables change with the length of the sequence transformers sees; one table is exact only
            # while every sequence stays within the length they were made for
            limit = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
            if limit and self.facts.max_context > limit:
                raise ExportError(f"the model's {rope['rope_type']} rotary embedding changes past {limit} tokens, "
                                  f"which one exported table cannot follow: export with --context {limit} or less")
        read = ("q_proj.bias", "k_proj.bias", "v_proj.bias") if self.qkv_bias else ()
        unread = sorted({k.split("layers.")[-1].split(".", 1)[-1] for k in self.state
                         if k.endswith(".bias") and not k.endswith(read)})
        if unread:
            raise ExportError(f"the model has biases edgespec's {self.architecture} graph does not add "
                              f"({', '.join(unread)}): attention_bias / mlp_bias models are not supported")

    def activation_name(self, cfg) -> str:
        return getattr(cfg, "hidden_act", "silu")

    @property
    def reads_features(self) -> bool:
        """Whether the graph takes the target's `features` (a feature-reading draft's)."""
        return self.feature_fc is not None

    @property
    def pads_slots(self) -> bool:
        """A target's graph of one lane pads its tokens into the attention's slots; others gather them."""
        return self.exact_passes and self.lanes == 1

    @property
    def flushes_attention(self) -> bool:
        """Whether a layer goes to the weight sink as two parts (attention, then MLP): a large layer's float32
        weights, held IN_FLIGHT times over while the next is read, would not fit (8B: history.md §80)."""
        return 4 * self.facts.layer_parameters() > LAYER_PART_BYTES

    def parameter_count(self) -> int:
        tied = self.facts.tie_word_embeddings
        size = getattr(self.state, "size_of", None) or (lambda k: self.state[k].size)  # without reading a tensor
        return sum(size(k) for k in self.state if not (tied and k == "lm_head.weight"))

    # --- what subclasses may override -------------------------------------------------------
    def attention_windows(self, cfg) -> tuple[int | None, ...]:
        """Per layer, how many of the latest positions (its own included) a query attends to; None where
        the context fits inside it. Read as transformers reads it: `layer_types` where the config has them,
        else `sliding_window` for every layer (Mistral)."""
        window = getattr(cfg, "sliding_window", None)
        types = getattr(cfg, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ExportError(f"the model has {', '.join(unknown)} layers, which edgespec's {self.architecture} "
                              "graph does not compute")
        reach = self.facts.max_context + self.rope_slack  # a pass never sees further back than this
        return tuple(window if t == "sliding_attention" and window and window < reach else None for t in types)

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        s, p, one = self.state, f"model.layers.{i}.", np.float32(self.norm_offset)
        qkv = np.concatenate([s[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=0).T
        out = {
            "input_norm": s[p + "input_layernorm.weight"] + one,
            "qkv": qkv,
            "o": s[p + "self_attn.o_proj.weight"].T,
            "post_norm": s[p + "post_attention_layernorm.weight"] + one,
            "gate_up": np.concatenate([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]], axis=0).T,
            "down": s[p + "mlp.down_proj.weight"].T,
        }
        if self.qkv_bias:
            out["qkv_bias"] = np.concatenate([s[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        if self.qk_norm:
            out["q_norm"], out["k_norm"] = (s[p + f"self_attn.{n}_norm.weight"] + one for n in "qk")
        return out

    def matmul_sources(self) -> dict[str, list[str]]:
        """Each matmul weight of the graph that is checkpoint tensors side by side as they are (unscaled),
        with those tensors' names in order: what a GGUF's blocks can stand for (exporters/gguf_weights.py)."""
        out = {}
        for i in range(self.facts.num_layers):
            p = f"model.layers.{i}."
            out |= {f"layers.{i}.qkv": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
                    f"layers.{i}.o": [p + "self_attn.o_proj.weight"],
                    f"layers.{i}.gate_up": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                    f"layers.{i}.down": [p + "mlp.down_proj.weight"]}
        if self.head_tokens is None:
            out["lm_head"] = ["model.embed_tokens.weight" if self.facts.tie_word_embeddings else "lm_head.weight"]
        return out

    # --- the graph ---------------------------------------------------------------------------
    def build(self, name: str, nodes: int | str = "nodes", layers: range | None = None,
              embed: bool = True, head: bool = True, sequences: bool = False, slots: int = 0,
              sink=None) -> GraphBuilder:
        """The whole model, or one stage of it: the embedding, `layers`, and the head, each optional.

        A stage that starts after the embedding takes the residual stream as `hidden` and the last
        block's output not yet added to it as `branch` ([1, N, H] each); a stage that ends before the
        head returns them as `hidden_out` and `branch_out`. Handing both over keeps the fused add-and-norm of the
        single graph, so the stages compute what the single graph computes. `slots` > 0: the whole
        model as a slots graph of that many conversations per pass (exporters/slots.py). `sink`: where the
        weights go as each layer is built (exporters/weight_stream.py); without one they stay inline.
        """
        f = self.facts
        layers = range(f.num_layers) if layers is None else layers
        g = GraphBuilder(name, sink)
        if embed:
            ids = g.input("input_ids", INT64, [1, nodes])
            # a tied head reads the table again at the end: read it then, not held through every layer
            table = g.weight("embed_tokens", lambda: self.state["model.embed_tokens.weight"],
                             last=head and f.tie_word_embeddings and self.head_tokens is None)
            x, branch = g.op("Gather", [table, ids], "embed", axis=0), None  # [1, N, H]
            if self.embedding_scale() is not None:
                x = g.op("Mul", [x, g.const(self.embedding_scale(), np.float32)])
            if self.feature_fc is not None:
                features = g.input(FEATURES, FLOAT, [1, nodes, f.hidden_size])
                mixed = g.op("MatMul", [g.op("Concat", [x, features], axis=-1),
                                        g.weight("feature_fc", self.feature_fc[0].T)], "feature_fc")
                x = g.op("Add", [mixed, g.weight("feature_fc_bias", self.feature_fc[1])])
            if self.flushes_attention:  # a large table is quantized alone: nothing else read meanwhile (§80)
                g.flush(wait=True)
        else:
            table = None
            x = g.input("hidden", FLOAT, [1, nodes, f.hidden_size])
            branch = g.input("branch", FLOAT, [1, nodes, f.hidden_size]) if layers.start > 0 else None
        if slots:  # several conversations in one pass (exporters/slots.py)
            x, branch = slot_layers(self, g, x, branch, layers, nodes, slots)
        elif len(layers):
            x, branch = self.decoder_layers(g, x, branch, layers, nodes, sequences)
        if head:
            if self.flushes_attention:  # the layers' parts are written before the large head is read (§80)
                g.flush(wait=True)
            logit_rows = g.input("logit_rows", INT64, ["rows"])
            final_norm = self.state["model.norm.weight"] + np.float32(self.norm_offset)
            x, _ = self.add_and_norm(g, x, branch, g.weight("final_norm", final_norm))
            if self.features_out and self.feature_taps is None:  # else decoder_layers returned the taps'
                g.output(x, FEATURES_OUT, FLOAT, [1, nodes, f.hidden_size])
            x = g.op("Gather", [x, logit_rows], axis=1)  # [1, R, H]: the head is the costliest matmul
            g.output(self.lm_head(g, x, table), "logits", FLOAT, [1, "rows", self.head_size])
        else:
            g.output(x, "hidden_out", FLOAT, [1, nodes, f.hidden_size])
            if branch is not None:
                g.output(branch, "branch_out", FLOAT, [1, nodes, f.hidden_size])
        return g

    def decoder_layers(self, g: GraphBuilder, x: str, branch: str | None, layers: range, nodes,
                       sequences: bool = False):
        f = self.facts
        if sequences:
            placement, batch = None, "batch"
            attend = dict(pos=g.input("position_ids", INT64, ["batch", "slots"]),
                          seqlens=g.input("seqlens_k", INT32, ["batch"]))
        else:
            attend = dict(pos=g.input("position_ids", INT64, [1, "slots"]), seqlens=g.input("seqlens_k", INT32, [1]))
            if not self.pads_slots:
                units = self.lanes * (f.num_heads + 2 * f.num_kv_heads)
                placement = (g.input("qkv_rows", INT64, ["slots", units]),
                             g.input("out_rows", INT64, [nodes, f.num_heads]))
            else:  # the slots past the tokens, padded once for every layer: [0, 0, 0, 0, L - N, 0]
                tokens = g.op("Slice", [g.op("Shape", [x]), g.const([1]), g.const([2])])  # [N]
                slots = g.op("Slice", [g.op("Shape", [attend["pos"]]), g.const([1]), g.const([2])])  # [L]
                placement = (tokens, g.op("Concat", [g.const([0, 0, 0, 0]), g.op("Sub", [slots, tokens]),
                                                     g.const([0])], axis=0))
            batch = 1
            if not self.exact_passes or self.portable_attention:  # standard operators mask through the bias alone
                attend["bias"] = g.input("attention_bias", FLOAT, [1, 1, "slots", "total"])
        attend["total"] = g.input("total_sequence_length", INT32, [])
        tables = self.rotary_inputs(g, layers)
        buffer = [batch, (1 if sequences else self.lanes) * f.num_kv_heads, "capacity", f.head_dim]
        taps = self.feature_taps
        tapped = {}  # the residual stream entering each tapped layer
        for l in layers:  # branch: the last block's output, not yet added to the residual stream x
            g.mark_boundary(l, x, branch)
            if taps is not None and l in taps.layers:
                tapped[l] = x if branch is None else g.op("Add", [x, branch])
            past = (g.input(f"past_key_{l}", FLOAT, buffer), g.input(f"past_value_{l}", FLOAT, buffer))
            w = {k: g.weight(f"layers.{l}.{k}", v) for k, v in self.layer_weights(l).items()}
            rope = tables.get(self.ropes[l], (None, None))
            layer_attend = dict(attend, window=self.windows[l], cos=rope[0], sin=rope[1])

            def attention(h, w=w, past=past, layer_attend=layer_attend, l=l):
                if sequences:
                    out, present_k, present_v = self.sequence_attention(g, h, w, past, layer_attend)
                else:
                    out, present_k, present_v = self.attention(g, h, w, past, placement, layer_attend)
                g.output(present_k, f"present_key_{l}", FLOAT, buffer)
                g.output(present_v, f"present_value_{l}", FLOAT, buffer)
                if self.flushes_attention:
                    g.flush()
                return out

            x, branch = self.decoder_layer(g, x, branch, w, attention)
            g.flush()
        if len(layers):
            g.mark_boundary(layers.stop, x, branch)
        if taps is not None:
            if layers.stop in taps.layers:  # the residual stream after the last layer, before the final norm
                tapped[layers.stop] = x if branch is None else g.op("Add", [x, branch])
            g.output(taps.project(g, [tapped[l] for l in taps.layers]), FEATURES_OUT, FLOAT,
                     [1, nodes, taps.width(f.hidden_size)])
        return x, branch

    def decoder_layer(self, g: GraphBuilder, x: str, branch: str | None, w: dict, attention) -> tuple[str, str]:
        """One block: (residual stream, the block's output not yet added to it); `attention(h)` is the
        layer's attention of its normed input (pre-norm, as Llama)."""
        h, x = self.add_and_norm(g, x, branch, w["input_norm"])
        h, x = self.add_and_norm(g, x, attention(h), w["post_norm"])
        return x, self.mlp(g, h, w)

    def add_and_norm(self, g: GraphBuilder, x: str, branch: str | None, weight: str) -> tuple[str, str]:
        """(rms_norm(x + branch), x + branch) in one fused kernel (one node instead of two)."""
        if branch is None:
            return self.rms_norm(g, x, weight), x
        normed, _, _, total = g.op("SkipSimplifiedLayerNormalization", [x, branch, weight], "norm", n_out=4,
                                   domain="com.microsoft", epsilon=self.facts.rms_norm_eps)
        return normed, total

    def rms_norm(self, g: GraphBuilder, x: str, weight: str) -> str:
        # Written out so onnxruntime fuses it into SimplifiedLayerNormalization.
        var = g.op("ReduceMean", [g.op("Pow", [x, g.const(2.0, np.float32)]), g.const([-1])], keepdims=1)
        std = g.op("Sqrt", [g.op("Add", [var, g.const(self.facts.rms_norm_eps, np.float32)])])
        return g.op("Mul", [g.op("Div", [x, std]), weight], "norm")

    def qkv_projection(self, g, h, w):
        qkv = g.op("MatMul", [h, w["qkv"]], "qkv")
        qkv = g.op("Add", [qkv, w["qkv_bias"]], "qkv") if "qkv_bias" in w else qkv
        if not self.qk_norm:
            return qkv
        f = self.facts
        q, k, v = g.op("Split", [qkv, g.const([f.num_heads * f.head_dim, f.num_kv_heads * f.head_dim,
                                               f.num_kv_heads * f.head_dim])], n_out=3, axis=-1)
        if self.qk_norm == "head":  # [1, N, heads * D] normed per head of D
            q, k = (g.op("Reshape", [self.rms_norm(g, g.op("Reshape", [t, g.const([0, 0, -1, f.head_dim])]), w[n]),
                                     g.const([0, 0, -1])]) for t, n in ((q, "q_norm"), (k, "k_norm")))
        else:
            q, k = self.rms_norm(g, q, w["q_norm"]), self.rms_norm(g, k, w["k_norm"])
        return g.op("Concat", [q, k, v], axis=-1)

    def mlp(self, g, h, w):
        gate_up = g.op("MatMul", [h, w["gate_up"]], "gate_up")
        size = self.facts.intermediate_size
        gate, up = g.op("Split", [gate_up, g.const([size, size])], n_out=2, axis=-1)
        return g.op("MatMul", [g.op("Mul", [self.activation(g, gate), up]), w["down"]], "down")

    def activation(self, g, x: str) -> str:
        if self.activation_name(self.model.config) == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])], "silu")
        # GeLU with tanh (gelu_pytorch_tanh; Gemma's "gelu" is the same in transformers), written out
        inner = g.op("Mul", [g.op("Add", [x, g.op("Mul", [g.op("Mul", [g.op("Mul", [x, x]), x]),
                                                         g.const(0.044715, np.float32)])]),
                             g.const(math.sqrt(2 / math.pi), np.float32)])
        return g.op("Mul", [g.op("Mul", [x, g.const(0.5, np.float32)]),
                            g.op("Add", [g.op("Tanh", [inner]), g.const(1.0, np.float32)])], "gelu")

    def embedding_scale(self) -> float | None:
        """A factor the embeddings are multiplied by (Gemma, Granite); None: none."""
        return None

    def final_logits(self, g, logits: str) -> str:
        """What a family does to the logits after the head (scaling, soft-capping)."""
        return logits

    @property
    def head_size(self) -> int:
        return self.facts.vocab_size if self.head_tokens is None else len(self.head_tokens)

    def lm_head(self, g, x, table: str | None):
        """`table`: the embedding table's name when this graph holds it (a tied head then reads it)."""
        f = self.facts
        source = "model.embed_tokens.weight" if f.tie_word_embeddings else "lm_head.weight"
        if self.head_tokens is not None:
            name = g.weight("lm_head", lambda: self.state[source][self.head_tokens])
        elif f.tie_word_embeddings:
            name = table or g.weight("embed_tokens", lambda: self.state[source])
        else:
            name = g.weight("lm_head", lambda: self.state[source])
        flat = g.op("Reshape", [x, g.const([-1, f.hidden_size])])
        logits = self.final_logits(g, g.op("Gemm", [flat, name], transB=1))
        return g.op("Reshape", [logits, g.const([1, -1, self.head_size])])
