"""The draft's shape: a two-layer decoder of the target's own architecture that shares its embeddings and head.

Designs (compared in benchmarks/history.md §17, §19):
    cut    the target's first layer, then an adapter layer initialised from the target's last layer
           (Kangaroo: a shallow sub-network of the target plus a trained adapter)
    small  two new layers with half the target's MLP width, randomly initialised
    eagle  reads the target's features (EAGLE): `feature_fc` projects [embedding of token i, the target's
           final hidden state at i - 1] to the input of one layer initialised from the target's last;
           the draft's output is trained to be the target's feature at i as well as its next token
    eagle3 the published EAGLE-3 layout over three of the target's layers (eagle3_head.py says where it differs)
All keep the target's embedding table and final norm, and predict only `head_tokens`, a subset of the
vocabulary chosen from the target's outputs (vocab.py): the head is most of a tiny draft's cost.
The embedding and head stay frozen: they are the target's, and the data is too small to improve them.
"""
from __future__ import annotations

import copy

import torch
from edgespec.distill.eagle3_head import Eagle3Draft
from edgespec.runtime.contract.errors import InputError

DESIGNS = ("cut", "small", "eagle", "eagle3")
FEATURE_DESIGNS = ("eagle", "eagle3")  # designs whose draft reads the target's features
TAPPED_DESIGNS = ("eagle3",)  # designs that read several of the target's layers, not its final hidden state
DRAFT_LAYERS = {"cut": 2, "small": 2, "eagle": 1, "eagle3": 1}
# Measured on the reference target (benchmarks/history.md §17, §19): one feature-reading layer learns twice as fast
# per minute as two, and takes a higher learning rate.
LEARNING_RATE = {"cut": 5e-4, "small": 5e-4, "eagle": 1e-3, "eagle3": 1e-3}


def draft_config(target_config, design: str):
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = DRAFT_LAYERS[design]
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:DRAFT_LAYERS[design]])
    if design == "small":
        config.intermediate_size = target_config.intermediate_size // 2
    config.tie_word_embeddings = True  # the head is the (target's) embedding table, sliced at export
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # a GGUF target's config says how its file was stored; the draft is float
    return config


def build_draft(target, design: str):
    """A *ForCausalLM of the target's class; returns (draft, names of the parameters to train)."""

    if design not in DESIGNS:
        raise InputError(f"unknown draft design {design!r}; choose one of {', '.join(DESIGNS)}")
    if design == "eagle3":
        draft = Eagle3Draft(target)
        return draft, [name for name, _ in draft.named_parameters()]  # its frozen tables are buffers
    draft = type(target)(draft_config(target.config, design)).float()
    with torch.no_grad():
        head = target.get_output_embeddings().weight
        draft.get_input_embeddings().weight.copy_(head)  # tied: one table serves as embedding and head
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        if design == "cut":
            draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
            draft.model.layers[1].load_state_dict(target.model.layers[-1].state_dict())
        if design in FEATURE_DESIGNS:
            for i, layer in enumerate(draft.model.layers):
                layer.load_state_dict(target.model.layers[i - DRAFT_LAYERS[design]].state_dict())
            hidden = target.config.hidden_size
            draft.feature_fc = torch.nn.Linear(2 * hidden, hidden)
            draft.feature_fc.weight.zero_()
            eye = torch.eye(hidden)
            draft.feature_fc.weight.copy_(torch.cat([eye, eye], dim=1))  # starts as embedding + feature
            draft.feature_fc.bias.zero_()
    frozen = {"model.embed_tokens.weight", "lm_head.weight"}
    trainable = []
    for name, parameter in draft.named_parameters():
        parameter.requires_grad_(name not in frozen)
        if name not in frozen:
            trainable.append(name)
    return draft, trainable


def head_rows(draft, head_tokens):
    """The frozen head the draft's final hidden states multiply: the target's rows of the head tokens."""
    if isinstance(draft, Eagle3Draft):
        return draft.head_rows(head_tokens)
    return draft.get_input_embeddings().weight[head_tokens]


def regresses_features(draft) -> bool:
    """Whether training also pulls the draft's output onto the target's feature (EAGLE; EAGLE-3 drops it)."""
    return not isinstance(draft, Eagle3Draft)


def draft_hidden(draft, ids, mask, features=None):
    """The draft's final hidden states [B, T, H]; a feature design mixes `features` [B, T, H] (the
    target's feature before each token; eagle3: [B, T, 3H], its streams) into its input embeddings."""

    if isinstance(draft, Eagle3Draft):
        return draft.hidden_steps(ids, mask, features, 1, _step_mask)[0]
    if not hasattr(draft, "feature_fc"):
        return draft.model(input_ids=ids, attention_mask=mask).last_hidden_state
    embedded = draft.get_input_embeddings()(ids)
    mixed = draft.feature_fc(torch.cat([embedded, features], dim=-1))
    return draft.model(inputs_embeds=mixed, attention_mask=mask).last_hidden_state


def draft_hidden_steps(draft, ids, mask, features, steps: int) -> list:
    """A feature draft's hidden states [B, T, H] for drafting steps 1..`steps` (training-time test, as in
    HASS): what each row would give if the runtime had drafted up to it.

    At step s the runtime drafts row t from [embedding of token t, the draft's own step s-1 output at row
    t - 1] and attends to the accepted rows (whose keys were made from the target's features) up to
    t - s + 1, then to the rows it drafted itself, one per earlier step. Here every step is one pass over
    all rows: its keys are appended to the cache and `_step_mask` lets each row see exactly those keys.
    """

    if isinstance(draft, Eagle3Draft):
        return draft.hidden_steps(ids, mask, features, steps, _step_mask)
    embedded = draft.get_input_embeddings()(ids)
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    out = draft.model(inputs_embeds=draft.feature_fc(torch.cat([embedded, features], dim=-1)),
                      attention_mask=mask, position_ids=positions, use_cache=True)
    hidden, cache = [out.last_hidden_state], out.past_key_values
    for step in range(2, steps + 1):
        previous = torch.nn.functional.pad(hidden[-1][:, :-1], (0, 0, 1, 0))  # row t reads row t - 1's output
        out = draft.model(inputs_embeds=draft.feature_fc(torch.cat([embedded, previous], dim=-1)),
                          attention_mask=_step_mask(mask, step, hidden[0].dtype), position_ids=positions,
                          past_key_values=cache, use_cache=True)
        hidden.append(out.last_hidden_state)
        cache = out.past_key_values
    return hidden


def _step_mask(mask, step: int, dtype):
    """Additive attention mask [B, 1, T, step * T] for drafting step `step` over the keys of steps 1..step:
    row t sees step-1 keys of rows <= t - step + 1 and, of each later step j, the key of row t - step + j."""

    rows = mask.shape[1]
    t = torch.arange(rows)
    blocks = [t[None, :] <= (t[:, None] - step + 1)]
    blocks += [t[None, :] == (t[:, None] - step + j) for j in range(2, step + 1)]
    allowed = torch.cat(blocks, dim=1)[None] & mask.bool().repeat(1, step)[:, None, :]
    own_key = torch.cat([torch.zeros(rows, (step - 1) * rows, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)],
                        dim=1)
    allowed = allowed | own_key  # a padded row sees at least itself: no row of the softmax is empty
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]
