"""The float32 reference a quality report compares a quantized graph with: the source model itself, run by
transformers, teacher-forced over whole sequences.

At 1B-8B the model does not fit in memory in float32 beside the export (4 bytes a parameter), so where it
is a skeleton whose weights are read a tensor at a time (exporters/checkpoint.py), each module's own
parameters are read just before transformers calls it and dropped as soon as it returns: one matrix at
a time is resident, and transformers' own forward (masks, rotary tables, every family's scalings and
caps) is what computes the reference. What the report needs of it is each row's choice, the
log-probability of the next token and, for a draft that reads them, the final hidden states.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ReferenceRows:
    """Per row of a sequence: the reference's choice (argmax), the log-probability it gives the next token
    (the last row's is NaN), and the final hidden states (after the final norm) where asked for."""
    argmax: np.ndarray  # [T] int64
    next_log_prob: np.ndarray  # [T] float64
    features: np.ndarray | None = None  # [T, hidden]


def reference_rows(model: torch.nn.Module, weights: Mapping | None, sequences: list[list[int]],
                   features: bool = False, taps=None) -> list[ReferenceRows]:
    """The float32 model's rows over each of `sequences`. `weights`: the state read a tensor at a time where
    `model` is a skeleton (exporters/checkpoint.py); None where the model holds its weights. `taps`
    (exporters/eagle3.py: FeatureTaps): the features are the projection of those layers' residual streams."""
    found: dict[int, ReferenceRows] = {}
    for batch in length_batches([len(ids) for ids in sequences]):
        rows = _batch_rows(model, weights, [sequences[i] for i in batch], features, taps)
        found.update(zip(batch, rows))
    return [found[i] for i in range(len(sequences))]


def length_batches(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` in forwards of similar lengths, longest first: a row padded to its batch's longest
    costs as much as a real one, and a further forward costs one more read of the weights, less than the
    rows padding a short sequence to more than twice its length (history.md §86)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and 2 * lengths[i] >= lengths[batches[-1][0]]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _batch_rows(model, weights, sequences: list[list[int]], features: bool, taps) -> list[ReferenceRows]:
    longest = max(len(ids) for ids in sequences)
    # one forward over the batch's sequences, right-padded (masked: a row sees only its own sequence's
    # earlier tokens), so each module's weights are read once a batch
    batch = torch.tensor([list(ids) + [0] * (longest - len(ids)) for ids in sequences])
    mask = torch.tensor([[1] * len(ids) + [0] * (longest - len(ids)) for ids in sequences])
    captured, streams = [], {}
    with _parameters_on_call(model, weights), torch.no_grad():
        hooks = []
        if features and taps is None:
            hooks.append(model.model.norm.register_forward_hook(lambda m, i, out: captured.append(out)))
        elif features:  # the residual stream entering each tapped layer; after the last, the final norm's input
            layers = list(model.model.layers) + [model.model.norm]

            def keep(module, args, kwargs, layer):
                streams[layer] = args[0] if args else kwargs["hidden_states"]

            for l in set(taps.layers):
                hooks.append(layers[l].register_forward_pre_hook(
                    lambda m, args, kwargs, l=l: keep(m, args, kwargs, l), with_kwargs=True))
        try:
            logits = model(input_ids=batch, attention_mask=mask).logits
        finally:
            for hook in hooks:
                hook.remove()
        if streams:
            concat = torch.cat([streams[l] for l in taps.layers], dim=-1).float()
            projected = concat @ torch.from_numpy(taps.fc)
            captured.append(projected if taps.bias is None else projected + torch.from_numpy(taps.bias))
    found = []
    for b, ids in enumerate(sequences):
        rows = logits[b, : len(ids)].double().numpy()
        shifted = rows - rows.max(axis=-1, keepdims=True)
        log_norm = np.log(np.exp(shifted).sum(axis=-1))
        next_log_prob = np.full(len(ids), np.nan)
        following = np.asarray(ids[1:], np.int64)
        next_log_prob[:-1] = shifted[np.arange(len(following)), following] - log_norm[:-1]
        found.append(ReferenceRows(np.argmax(rows, axis=-1), next_log_prob,
                                   captured[0][b, : len(ids)].float().numpy() if features else None))
    return found


@contextlib.contextmanager
def _parameters_on_call(model: torch.nn.Module, weights: Mapping | None):
    """Each module with parameters of its own gets them from `weights` for the length of its call."""
    if weights is None:
        yield
        return
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    handles = []

    def source(name: str) -> str:
        return "model.embed_tokens.weight" if tied and name == "lm_head.weight" and name not in weights else name

    for path, module in model.named_modules():
        own = {name: p for name, p in module.named_parameters(recurse=False)}
        if not own:
            continue

        def load(module, args, path=path, own=own):
            for name in own:
                array = weights[source(f"{path}.{name}")]
                module._parameters[name] = torch.nn.Parameter(torch.from_numpy(array), requires_grad=False)

        def drop(module, args, output, own=own):
            module._parameters.update(own)  # back to the skeleton's empty parameters

        handles += [module.register_forward_pre_hook(load), module.register_forward_hook(drop)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
