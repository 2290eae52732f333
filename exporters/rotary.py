"""A decoder's rotary embedding in the graph: which table each layer reads, the tables themselves (computed by
the model's own rotary module), and how they enter the graph. A mixin of the graph builder
(exporters/llama.py): it reads the builder's `model`, `facts`, `rope_slack` and `ropes`, and the families
override `rotary_dims` and `layer_rope`."""
from __future__ import annotations

import numpy as np
import torch

from .onnx_builder import GraphBuilder


class Rotary:
    @property
    def rotary_dims(self) -> int:
        """How many of a head's dimensions the rotary embedding turns (the rest pass through)."""
        return self.facts.head_dim

    def layer_rope(self, cfg, layer: int) -> str | None:
        """Which rotary table layer `layer` reads: "" the model's one table, a layer type's name where the
        model keeps a table per type (`rope_tables`), None for a layer without rotary embedding."""
        rotary = self.model.model.rotary_emb
        return cfg.layer_types[layer] if len(getattr(rotary, "layer_types", ())) > 1 else ""

    def rope_tables(self, kind: str = "") -> tuple[np.ndarray, np.ndarray]:
        """cos/sin [max_context + rope_slack, rotary dims] of table `kind` (`layer_rope`), computed by the model's
        own rotary module so that every rope variant transformers knows (llama3, yarn, linear, longrope's
        choice for the exported context, ...) is reproduced exactly."""
        rotary = self.model.model.rotary_emb
        types = getattr(rotary, "layer_types", ())
        # a module that keeps a table per layer type (Gemma 3, OLMo 3) takes the type even where every layer
        # is of one type (`layer_rope` then gives "": one table, which the sliding KV policy can move keys by)
        kind = kind or (types[0] if len(types) == 1 else "")
        probe = torch.zeros(1, 1, self.facts.head_dim)
        tables = []
        # the context's rows, then the slack rows (written by padding slots, never read): a rope that changes
        # with the sequence's length (longrope, dynamic) sees only lengths inside the context
        for span in (range(self.facts.max_context), range(self.facts.max_context, self.facts.max_context + self.rope_slack)):
            with torch.no_grad():
                cos, sin = rotary(probe, torch.tensor([list(span)]),
                                                       **({"layer_type": kind} if kind else {}))
            tables.append((cos[0].float().numpy(), sin[0].float().numpy()))
        return np.concatenate([t[0] for t in tables]), np.concatenate([t[1] for t in tables])

    def rotary_inputs(self, g: GraphBuilder, layers: range) -> dict:
        """The rotary tables `layers` read, as graph weights: {kind: (cos, sin)} (`layer_rope`)."""
        tables = {}
        for kind in sorted({self.ropes[l] for l in layers} - {None}):
            cos_table, sin_table = self.rope_tables(kind)
            half = cos_table.shape[1] // 2  # HF's tables repeat their first half; the fused op takes one half
            suffix = f"_{kind}" if kind else ""
            tables[kind] = (g.weight(f"rope_cos{suffix}", cos_table[:, :half]),
                            g.weight(f"rope_sin{suffix}", sin_table[:, :half]))
        return tables
