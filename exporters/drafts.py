"""What a draft model brings to an export beyond its Hugging Face folder (`edgespec distill`'s description:
a trimmed head, a feature projection), and its graph builder checked against the target it drafts for."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from edgespec.quant.calibrate import Calibration
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.execution.features import draft_inputs

from .architectures import builder_for
from .bundle_writer import calibrate, tokenizer_difference
from .text_draft import through_text

DRAFT_HEAD_FILE = "draft_head_tokens.json"
DRAFT_INFO = "edgespec_draft.json"  # written by `edgespec distill` next to the draft's config.json


@dataclass(frozen=True)
class DraftInfo:
    """What `edgespec distill` says about a draft beyond its Hugging Face folder."""
    head_tokens: np.ndarray | None = None  # the vocabulary ids its trimmed head predicts; None: the full head
    feature_fc: tuple[np.ndarray, np.ndarray] | None = None  # (weight, bias) when it reads the target's features


def read_draft_info(source) -> DraftInfo:
    info = Path(source.location) / DRAFT_INFO
    if source.kind != "hf_folder" or not info.is_file():
        return DraftInfo()
    try:
        data = json.loads(info.read_text())
        head_tokens = np.array(data["head_tokens"], dtype=np.int64)
        feature_fc = None
        if data.get("features") is not None:
            from safetensors.numpy import load_file

            tensors = load_file(Path(source.location) / data["features"]["file"])
            feature_fc = (tensors["weight"].astype(np.float32), tensors["bias"].astype(np.float32))
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ExportError(f"{info} is not a valid draft description: {err}") from err
    return DraftInfo(head_tokens, feature_fc)


def draft_builder_for(source, info: DraftInfo, tokenizer, target_builder, context: int):
    """The draft model's graph builder, checked against the target it will draft for, and how it drafts
    through text where its tokenizer differs from the target's (else None)."""
    draft, draft_tokenizer = source.load()
    difference = tokenizer_difference(tokenizer, draft_tokenizer)
    if difference is not None:  # its own vocabulary: its logits are laid out as its tokenizer's ids
        trained = info.head_tokens is not None or info.feature_fc is not None
        return builder_for(draft, context), through_text(draft, draft_tokenizer, tokenizer, difference, trained)
    head_tokens, vocab = info.head_tokens, target_builder.facts.vocab_size
    rows = draft.config.vocab_size
    if rows != vocab:
        # models of one family pad their embedding rows differently (Qwen2.5: 151,936 or 152,064): the draft
        # predicts only ids both have, its logits laid out as the target's
        usable = min(rows, vocab)
        if len(tokenizer) > usable:
            raise ExportError(f"the draft has {rows} vocabulary rows and the target {vocab}, fewer than the "
                              f"tokenizer's {len(tokenizer)} tokens: they cannot be the same vocabulary")
        head_tokens = np.arange(usable) if head_tokens is None else head_tokens[head_tokens < usable]
    builder = builder_for(draft, context, head_tokens, info.feature_fc, features_out=info.feature_fc is not None)
    builder.facts = replace(builder.facts, vocab_size=vocab)
    if info.feature_fc is not None and builder.facts.hidden_size != target_builder.facts.hidden_size:
        raise ExportError(f"the draft reads the target's features but its hidden size "
                          f"({builder.facts.hidden_size}) differs from the target's "
                          f"({target_builder.facts.hidden_size}): it was trained for another target")
    return builder, None


def draft_calibration_from(draft_builder, target_calibration: Calibration | None) -> Calibration | None:
    """The draft's activation ranges over the target's calibration tokens (with the target's features
    for a draft that reads them); None when the target was not calibrated (no integer matmuls)."""
    if target_calibration is None:
        return None
    features = None
    if draft_builder.reads_features:
        features = draft_inputs(target_calibration.features, 0, len(target_calibration.features))
    return calibrate(draft_builder, list(target_calibration.ids), features)
