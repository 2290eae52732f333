"""Medusa heads' graph behind one call (exporters/medusa.py): the target's final hidden state at one row in,
each head's logits out. No cache: the heads read nothing but that row."""
from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort

from ..contract.errors import BackendError
from ..contract.graph import FEATURES
from .sessions import ORT_ERRORS


class MedusaHeads:
    static = None  # one row in, K rows out: nothing to size
    reads_features = True

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self.heads = int(session.get_outputs()[0].shape[0])
        self.run_seconds = 0.0

    def logits(self, feature: np.ndarray) -> np.ndarray:
        """[K, V]: head k's logits for the token k + 2 places after the row `feature` [H] is the target's state at."""
        started = time.perf_counter()
        try:
            out = self.session.run(["logits"], {FEATURES: np.asarray(feature, np.float32).reshape(1, 1, -1)})[0]
        except ORT_ERRORS as err:
            raise BackendError(f"onnxruntime {ort.__version__} failed running the Medusa heads: {str(err)[:300]}") from err
        self.run_seconds += time.perf_counter() - started
        return out[:, 0]
