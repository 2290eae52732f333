"""The draft's shape: a two-layer decoder of the target's own architecture that shares its embeddings and head.

Designs (compared in benchmarks/RESULTS.md):
    cut    the target's first layer, then an adapter layer initialised from the target's last layer
           (Kangaroo: a shallow sub-network of the target plus a trained adapter)
    small  two new layers with half the target's MLP width, randomly initialised
Both keep the target's embedding table and final norm, and predict only `head_tokens`, a subset of the
vocabulary chosen from the target's outputs (vocab.py): the head is most of a tiny draft's cost.
The embedding and head stay frozen: they are the target's, and the data is too small to improve them.
"""
from __future__ import annotations

import copy

DESIGNS = ("cut", "small")
DRAFT_LAYERS = 2


def draft_config(target_config, design: str):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = DRAFT_LAYERS
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:DRAFT_LAYERS])
    if design == "small":
        config.intermediate_size = target_config.intermediate_size // 2
    config.tie_word_embeddings = True  # the head is the (target's) embedding table, sliced at export
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF target's config says how its file was stored; the draft is float
    return config


def build_draft(target, design: str):
    """A *ForCausalLM of the target's class; returns (draft, names of the parameters to train)."""
    import torch

    if design not in DESIGNS:
        raise ValueError(f"unknown draft design {design!r}; choose one of {', '.join(DESIGNS)}")
    draft = type(target)(draft_config(target.config, design)).float()
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        draft.get_input_embeddings().weight.copy_(head)  # tied: one table serves as embedding and head
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        if design == "cut":
            draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
            draft.model.layers[1].load_state_dict(target.model.layers[-1].state_dict())
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    trainable = []
    for name, parameter in draft.named_parameters():
        parameter.requires_grad_(name not in frozen)
        if name not in frozen:
            trainable.append(name)
    return draft, trainable
