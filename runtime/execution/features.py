"""Feature-reading drafts (EAGLE): the target hands its final hidden states to the draft.

A target whose graph returns `features_out` ([1, N, hidden]: the final-norm hidden state of every row, the
vector its head reads) has them kept beside its KV rows; a draft whose graph reads `features` gets, with
each token i, the target's feature at i - 1 — the state from which the target predicted token i — and
returns (as `features_out`) its own prediction of the feature at i, which stands in for the target's while drafting deeper.
"""

import numpy as np


def draft_inputs(target_features: np.ndarray, start: int, stop: int) -> np.ndarray:
    """The features a feature-reading draft takes with tokens start..stop-1: the target's feature at
    i - 1 for token i, zeros for token 0. `target_features` covers positions 0..stop-2 at least."""
    out = np.zeros((stop - start, target_features.shape[1]), np.float32)
    known = target_features[max(start - 1, 0) : stop - 1]
    out[len(out) - len(known) :] = known
    return out
