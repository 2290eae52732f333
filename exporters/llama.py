"""ONNX graphs for Llama-family decoders, built node by node from the checkpoint's weights.

One builder writes every graph of a model: a graph takes N new tokens (N static, or symbolic for
CPU profiles), their position ids, how they attend (sequences and masks, below) and the past
keys/values, and returns logits and the keys/values of the N new tokens only. The runtime owns the cache.

    inputs:  input_ids [1, N] int64, position_ids [1, N] int64,
             path_nodes [B, L] int64    (the new tokens attend in B sequences of L slots: which token
                                         sits in each slot)
             node_slots [N] int64       (the slot b * L + k whose attention output each token takes)
             attention_mask [B, L, P + L] bool (True = may attend; columns: the P past rows, then the
                                         L slots of the same sequence)
             past_key_{l}, past_value_{l} [P, kv_heads, head_dim] float32   (token-major)
             logit_rows [R] int64       (which of the N rows need logits: the last for prefill)
    outputs: logits [1, R, V], new_kv [layers, 2, N, kv_heads, head_dim] float32

Why sequences: a token's attention sums over the columns it may see, and onnxruntime's softmax and
matmul kernels round those sums differently when the same values sit at other columns. In plain
decoding a token's path lies at columns P, P+1, ...; in a tree pass its siblings would sit in between.
So the runtime gives each root-to-leaf path of a tree its own sequence, in which every token sees
exactly the columns plain decoding shows it, and its row has the same bits (runtime/model.py). A chain
or a prefill chunk is one sequence. The past keys serve all sequences at once; the past values are
copied into each sequence, since a row's weighted sum is one matmul over [past, its slots].

A feature-reading draft (runtime/features.py) also takes `features` [1, N, H] and mixes them into its
embeddings through a trained projection; a graph built with `features_out` also returns `features_out`
[1, N, H], the final-norm hidden state of every row.

Token-major caches make the valid prefix of a preallocated cache a contiguous slice, so the runtime
hands ORT exactly the P valid rows without copying.

Subclasses override only what differs from Llama (architectures.py).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from edgespec.runtime.errors import ExportError
from edgespec.runtime.facts import ModelFacts
from edgespec.runtime.features import FEATURES, FEATURES_OUT

from .onnx_builder import BOOL, FLOAT, INT64, GraphBuilder


class LlamaBuilder:
    architecture = "llama"
    qkv_bias = False

    def __init__(self, model, max_context: int, head_tokens: np.ndarray | None = None,
                 feature_fc: tuple[np.ndarray, np.ndarray] | None = None, features_out: bool = False):
        """`model` is a transformers *ForCausalLM in float32. `head_tokens` (a draft's trimmed head):
        the graph's logits cover only these vocabulary ids, in this order. `feature_fc` (a draft that
        reads the target's features): (weight [H, 2H], bias [H]) of the projection of [embedding, feature]
        to the first layer's input. `features_out`: return the final hidden states too."""
        self.model = model
        cfg = model.config
        trained = getattr(cfg, "max_position_embeddings", None)
        if trained and max_context > trained:
            raise ExportError(f"--context {max_context} is longer than the {trained} positions this model was "
                              f"trained for; export with --context {trained} or less")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
            sliding_window=self.sliding_window(cfg, max_context),
        )
        cos, sin = self.rope_tables()
        half = head_dim // 2
        self.facts = replace(self.facts, rope_frequencies=tuple(
            float(a) for a in np.arctan2(sin[1, :half].astype(np.float64), cos[1, :half].astype(np.float64))))
        self.state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
        self.head_tokens = head_tokens
        self.features_out = features_out
        self.feature_fc = feature_fc
        hidden = cfg.hidden_size
        if feature_fc is not None and (feature_fc[0].shape != (hidden, 2 * hidden) or feature_fc[1].shape != (hidden,)):
            raise ExportError(f"the draft's feature projection must be [{hidden}, {2 * hidden}] with a bias of "
                              f"[{hidden}], got {list(feature_fc[0].shape)} and {list(feature_fc[1].shape)}")
        if head_tokens is not None and (len(head_tokens) < 2 or len(np.unique(head_tokens)) != len(head_tokens)
                                        or head_tokens.min() < 0 or head_tokens.max() >= cfg.vocab_size):
            raise ExportError(f"head tokens must be at least 2 distinct ids below the vocabulary size {cfg.vocab_size}")

    def parameter_count(self) -> int:
        tied = self.facts.tie_word_embeddings
        return sum(v.size for k, v in self.state.items() if not (tied and k == "lm_head.weight"))

    # --- what subclasses may override -------------------------------------------------------
    def sliding_window(self, cfg, max_context: int) -> int | None:
        return None

    def rope_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [max_context, head_dim], computed by the model's own rotary module so that every
        rope variant transformers knows (llama3, yarn, linear, ...) is reproduced exactly."""
        import torch

        positions = torch.arange(self.facts.max_context).unsqueeze(0)
        probe = torch.zeros(1, 1, self.facts.head_dim)
        with torch.no_grad():
            cos, sin = self.model.model.rotary_emb(probe, positions)
        return cos[0].float().numpy(), sin[0].float().numpy()

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        s, p = self.state, f"model.layers.{i}."
        qkv = np.concatenate([s[p + f"self_attn.{n}_proj.weight"] for n in "qkv"], axis=0).T
        out = {
            "input_norm": s[p + "input_layernorm.weight"],
            "qkv": qkv,
            "o": s[p + "self_attn.o_proj.weight"].T,
            "post_norm": s[p + "post_attention_layernorm.weight"],
            "gate_up": np.concatenate([s[p + "mlp.gate_proj.weight"], s[p + "mlp.up_proj.weight"]], axis=0).T,
            "down": s[p + "mlp.down_proj.weight"].T,
        }
        if self.qkv_bias:
            out["qkv_bias"] = np.concatenate([s[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
        return out

    # --- the graph ---------------------------------------------------------------------------
    def build(self, name: str, nodes: int | str = "nodes", layers: range | None = None,
              embed: bool = True, head: bool = True) -> GraphBuilder:
        """The whole model, or one stage of it: the embedding, `layers`, and the head, each optional.

        A stage that starts after the embedding takes the residual stream as `hidden` and the last
        block's output not yet added to it as `branch` ([1, N, H] each); a stage that ends before the
        head returns them as `hidden_out` and `branch_out`. Handing both over keeps the fused add-and-norm of the
        single graph, so the stages compute what the single graph computes.
        """
        f = self.facts
        layers = range(f.num_layers) if layers is None else layers
        g = GraphBuilder(name)
        if embed:
            ids = g.input("input_ids", INT64, [1, nodes])
            table = g.weight("embed_tokens", self.state["model.embed_tokens.weight"])
            x, branch = g.op("Gather", [table, ids], "embed", axis=0), None  # [1, N, H]
            if self.feature_fc is not None:
                features = g.input(FEATURES, FLOAT, [1, nodes, f.hidden_size])
                mixed = g.op("MatMul", [g.op("Concat", [x, features], axis=-1),
                                        g.weight("feature_fc", self.feature_fc[0].T)], "feature_fc")
                x = g.op("Add", [mixed, g.weight("feature_fc_bias", self.feature_fc[1])])
        else:
            table = None
            x = g.input("hidden", FLOAT, [1, nodes, f.hidden_size])
            branch = g.input("branch", FLOAT, [1, nodes, f.hidden_size]) if layers.start > 0 else None
        if len(layers):
            x, branch, new_kv = self.decoder_layers(g, x, branch, layers, nodes)
            stacked = g.op("Concat", new_kv, axis=0)  # [layers * 2 * N, kvH, D]
            stacked = g.op("Reshape", [stacked, g.const([len(layers), 2, -1, f.num_kv_heads, f.head_dim])])
            g.output(stacked, "new_kv", FLOAT, [len(layers), 2, nodes, f.num_kv_heads, f.head_dim])
        if head:
            logit_rows = g.input("logit_rows", INT64, ["rows"])
            x, _ = self.add_and_norm(g, x, branch, g.weight("final_norm", self.state["model.norm.weight"]))
            if self.features_out:
                g.output(x, FEATURES_OUT, FLOAT, [1, nodes, f.hidden_size])
            x = g.op("Gather", [x, logit_rows], axis=1)  # [1, R, H]: the head is the costliest matmul
            g.output(self.lm_head(g, x, table), "logits", FLOAT, [1, "rows", self.head_size])
        else:
            g.output(x, "hidden_out", FLOAT, [1, nodes, f.hidden_size])
            if branch is not None:
                g.output(branch, "branch_out", FLOAT, [1, nodes, f.hidden_size])
        return g

    def decoder_layers(self, g: GraphBuilder, x: str, branch: str | None, layers: range, nodes):
        f = self.facts
        pos = g.input("position_ids", INT64, [1, nodes])
        path_nodes = g.input("path_nodes", INT64, ["paths", "slots"])
        node_slots = g.input("node_slots", INT64, [nodes])
        mask = g.input("attention_mask", BOOL, ["paths", "slots", "total"])
        cos_table, sin_table = self.rope_tables()
        half = f.head_dim // 2  # HF's tables repeat their first half; the fused op takes one half
        rope = (g.weight("rope_cos", cos_table[:, :half]), g.weight("rope_sin", sin_table[:, :half]), pos)
        keep = g.op("Unsqueeze", [mask, g.const([1, 2])])  # [B, 1, 1, L, P+L]
        new_kv, past_per_path = [], None
        for l in layers:  # branch: the last block's output, not yet added to the residual stream x
            past = (g.input(f"past_key_{l}", FLOAT, ["past", f.num_kv_heads, f.head_dim]),
                    g.input(f"past_value_{l}", FLOAT, ["past", f.num_kv_heads, f.head_dim]))
            if past_per_path is None:  # [B, P, kvH, D]: every layer's past has the same shape
                past_per_path = g.op("Concat", [g.op("Shape", [path_nodes], start=0, end=1), g.op("Shape", [past[1]])],
                                     axis=0)
            w = {k: g.weight(f"layers.{l}.{k}", v) for k, v in self.layer_weights(l).items()}
            h, x = self.add_and_norm(g, x, branch, w["input_norm"])
            attn, k_new, v_new = self.attention(g, h, w, rope, keep, past, (path_nodes, node_slots, past_per_path))
            h, x = self.add_and_norm(g, x, attn, w["post_norm"])
            branch = self.mlp(g, h, w)
            new_kv += [k_new, v_new]
        return x, branch, new_kv

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

    def rotate(self, g: GraphBuilder, x: str, rope: tuple[str, str, str], heads: int) -> str:
        """HF's x * cos + rotate_half(x) * sin on [1, N, heads * D], as one fused kernel."""
        cos, sin, pos = rope
        return g.op("RotaryEmbedding", [x, pos, cos, sin], "rope", domain="com.microsoft", num_heads=heads)

    def attention(self, g, h, w, rope, keep, past, sequences):
        """Attention of the N new tokens, each in its slot of one of B sequences (see the module's docstring)."""
        f = self.facts
        heads, kv_heads, d = f.num_heads, f.num_kv_heads, f.head_dim
        group = heads // kv_heads
        path_nodes, node_slots, past_per_path = sequences
        qkv = g.op("MatMul", [h, w["qkv"]], "qkv")
        if "qkv_bias" in w:
            qkv = g.op("Add", [qkv, w["qkv_bias"]], "qkv")
        q, k, v = g.op("Split", [qkv, g.const([heads * d, kv_heads * d, kv_heads * d])], n_out=3, axis=-1)
        q = self.rotate(g, q, rope, heads)
        k_new = g.op("Reshape", [self.rotate(g, k, rope, kv_heads), g.const([-1, kv_heads, d])])  # [N, kvH, D]
        v_new = g.op("Reshape", [v, g.const([-1, kv_heads, d])])

        # Query heads h = kv * group + j share kv head `kv` (HF's repeat_kv order).
        q = g.op("Gather", [g.op("Reshape", [q, g.const([-1, kv_heads, group, d])]), path_nodes], axis=0)
        q = g.op("Transpose", [q], perm=[0, 2, 3, 1, 4])  # [B, kvH, group, L, D]
        q = g.op("Mul", [q, g.const(d ** -0.5, np.float32)])
        # Scores are dot products, the same bits in any layout: the past's are computed once for all
        # sequences (broadcast), the slots' per sequence, and joined.
        past_keys = g.op("Unsqueeze", [g.op("Transpose", [past[0]], perm=[1, 2, 0]), g.const([0, 2])])  # [1, kvH, 1, D, P]
        slot_keys = g.op("Transpose", [g.op("Gather", [k_new, path_nodes], axis=0)], perm=[0, 2, 3, 1])  # [B, kvH, D, L]
        scores = g.op("Concat", [g.op("MatMul", [q, past_keys], "scores"),
                                 g.op("MatMul", [q, g.op("Unsqueeze", [slot_keys, g.const([2])])], "scores")],
                      axis=-1)  # [B, kvH, group, L, P+L]
        scores = g.op("Where", [keep, scores, g.const(-np.inf, np.float32)])
        probs = g.op("Softmax", [scores], axis=-1)
        # The weighted sum is one matmul over [past, slots], as in plain decoding: each sequence gets its
        # own copy of the past values.
        values = g.op("Concat", [g.op("Expand", [g.op("Unsqueeze", [past[1], g.const([0])]), past_per_path]),
                                 g.op("Gather", [v_new, path_nodes], axis=0)], axis=1)  # [B, P+L, kvH, D]
        values = g.op("Unsqueeze", [g.op("Transpose", [values], perm=[0, 2, 1, 3]), g.const([2])])  # [B, kvH, 1, P+L, D]
        out = g.op("MatMul", [probs, values], "attn")  # [B, kvH, group, L, D]
        out = g.op("Transpose", [out], perm=[0, 3, 1, 2, 4])  # [B, L, kvH, group, D]
        out = g.op("Gather", [g.op("Reshape", [out, g.const([-1, heads * d])]), node_slots], axis=0)  # [N, H*D]
        out = g.op("Reshape", [out, g.const([1, -1, heads * d])])
        return g.op("MatMul", [out, w["o"]], "o_proj"), k_new, v_new

    def mlp(self, g, h, w):
        gate_up = g.op("MatMul", [h, w["gate_up"]], "gate_up")
        size = self.facts.intermediate_size
        gate, up = g.op("Split", [gate_up, g.const([size, size])], n_out=2, axis=-1)
        act = g.op("Mul", [gate, g.op("Sigmoid", [gate])], "silu")
        return g.op("MatMul", [g.op("Mul", [act, up]), w["down"]], "down")

    @property
    def head_size(self) -> int:
        return self.facts.vocab_size if self.head_tokens is None else len(self.head_tokens)

    def lm_head(self, g, x, table: str | None):
        """`table`: the embedding table's name when this graph holds it (a tied head then reads it)."""
        f = self.facts
        full = self.state["model.embed_tokens.weight" if f.tie_word_embeddings else "lm_head.weight"]
        if self.head_tokens is not None:
            name = g.weight("lm_head", full[self.head_tokens])
        elif f.tie_word_embeddings:
            name = table or g.weight("embed_tokens", full)
        else:
            name = g.weight("lm_head", full)
        flat = g.op("Reshape", [x, g.const([-1, f.hidden_size])])
        logits = g.op("Gemm", [flat, name], transB=1)
        return g.op("Reshape", [logits, g.const([1, -1, self.head_size])])
