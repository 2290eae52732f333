"""The draft graph of an EAGLE-3 head (exporters/eagle3.py says what the head is and how it reads the target).

    inputs:  input_ids [1, N], features [1, N, H] (the target's projected feature before each token, or the
             draft's own output at the drafted token's parent), and a draft graph's attention inputs
             (exporters/llama.py) for its one layer
    outputs: logits [1, R, draft vocab] (the manifest's head_tokens say which target ids), features_out
             [1, N, H]: the layer's output before the final norm, what the head reads at the next depth
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import transformers
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.graph import FEATURES, FEATURES_OUT

from .checkpoint import skeleton
from .eagle3 import Eagle3Head
from .llama import LlamaBuilder
from .onnx_builder import FLOAT, INT64, GraphBuilder

# published name -> the name LlamaBuilder reads (one layer, index 0)
NAMES = {"norm.weight": "model.norm.weight", "lm_head.weight": "lm_head.weight",
         "embed_tokens.weight": "model.embed_tokens.weight"}


class Eagle3Builder(LlamaBuilder):
    def __init__(self, head: Eagle3Head, target_builder: LlamaBuilder, max_context: int):
        config = {k: v for k, v in head.config.items() if k not in ("architectures", "model_type", "auto_map")}
        config.update(num_hidden_layers=1, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        config.pop("layer_types", None)  # the target's, copied by some trainers: the head's one layer is full attention
        cfg = transformers.LlamaConfig.from_dict(config)
        weights = {NAMES.get(k, k.replace("midlayer.", "model.layers.0.")): v for k, v in head.tensors.items()
                   if k not in ("fc.weight", "fc.bias", "d2t", "t2d")}
        if "model.embed_tokens.weight" not in weights:
            weights["model.embed_tokens.weight"] = target_builder.state["model.embed_tokens.weight"]
        self.norm_before_residual = bool(head.config.get("norm_before_residual", False))
        super().__init__(skeleton(cfg), max_context, head.head_tokens, features_out=True, weights=weights)
        self.facts = replace(self.facts, vocab_size=target_builder.facts.vocab_size)

    @property
    def reads_features(self) -> bool:
        return True

    def layer_weights(self, i: int) -> dict[str, np.ndarray]:
        return dict(super().layer_weights(i), hidden_norm=self.state["model.layers.0.hidden_norm.weight"])

    def build(self, name: str, nodes="nodes", layers=None, embed: bool = True, head: bool = True,
              sequences: bool = False, slots: int = 0, sink=None) -> GraphBuilder:
        if not (embed and head) or sequences or slots or (layers is not None and layers != range(1)):
            raise ExportError("an EAGLE-3 head is exported whole, as one draft graph (no stages, slots or sequences)")
        f = self.facts
        g = GraphBuilder(name, sink)
        ids = g.input("input_ids", INT64, [1, nodes])
        embeds = g.op("Gather", [g.weight("embed_tokens", lambda: self.state["model.embed_tokens.weight"]), ids],
                      "embed", axis=0)
        features = g.input(FEATURES, FLOAT, [1, nodes, f.hidden_size])
        x, branch = self.decoder_layers(g, g.op("Concat", [embeds, features], axis=-1), None, range(1), nodes)
        normed, pre_norm = self.add_and_norm(g, x, branch, g.weight("final_norm", self.state["model.norm.weight"]))
        g.output(pre_norm, FEATURES_OUT, FLOAT, [1, nodes, f.hidden_size])
        rows = g.op("Gather", [normed, g.input("logit_rows", INT64, ["rows"])], axis=1)
        g.output(self.lm_head(g, rows, None), "logits", FLOAT, [1, "rows", self.head_size])
        return g

    def decoder_layer(self, g: GraphBuilder, x: str, branch, w: dict, attention) -> tuple[str, str]:
        """`x` is [embedding, feature]: attention over both normed, the feature (normed where the config says
        `norm_before_residual`) the residual."""
        hidden = self.facts.hidden_size
        embeds, feature = g.op("Split", [x, g.const([hidden, hidden])], n_out=2, axis=-1)
        normed = self.rms_norm(g, feature, w["hidden_norm"])
        h = g.op("Concat", [self.rms_norm(g, embeds, w["input_norm"]), normed], axis=-1)
        h, x = self.add_and_norm(g, normed if self.norm_before_residual else feature, attention(h), w["post_norm"])
        return x, self.mlp(g, h, w)

    def lm_head(self, g, x, table):
        """The head's own rows (already the draft vocabulary: nothing to slice)."""
        f = self.facts
        flat = g.op("Reshape", [x, g.const([-1, f.hidden_size])])
        logits = g.op("Gemm", [flat, g.weight("lm_head", lambda: self.state["lm_head.weight"])], transB=1)
        return g.op("Reshape", [logits, g.const([1, -1, self.head_size])])

    def matmul_sources(self) -> dict[str, list[str]]:
        return {}  # no GGUF blocks to keep: a head is float

    def parameter_count(self) -> int:
        return sum(v.size for k, v in self.state.items() if k != "model.embed_tokens.weight")
