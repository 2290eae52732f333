"""Model facts: what the runtime needs to know about a decoder, as recorded in the manifest."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from .errors import InputError

# what a decoder this runtime can load may hold: beyond these a manifest is corrupt or hostile, and
# sizes derived from it (KV caches) must never be allocated
LIMITS = {"num_layers": (1, 1024), "hidden_size": (1, 1 << 16), "num_heads": (1, 1024), "num_kv_heads": (1, 1024),
          "head_dim": (1, 1024), "intermediate_size": (1, 1 << 18), "vocab_size": (2, 1 << 24),
          "max_context": (2, 1 << 22)}


@dataclass(frozen=True)
class ModelFacts:
    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    sliding_window: int | None = None
    # rotary angle per position for each of the head_dim / 2 frequency pairs (radians), read from the
    # exported tables; the cache needs it to move keys to new positions (the `sliding` KV policy)
    rope_frequencies: tuple[float, ...] | None = None

    def __post_init__(self):
        for name, (low, high) in LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InputError(f"model fact {name} = {value!r}: expected an integer in {low}..{high}")
        if self.num_heads % self.num_kv_heads:
            raise InputError(f"model facts: {self.num_heads} heads do not share {self.num_kv_heads} kv heads evenly")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InputError(f"model fact {name} = {value!r}: expected a positive number")
        if not isinstance(self.architecture, str) or not self.architecture:
            raise InputError(f"model fact architecture = {self.architecture!r}: expected a name")
        if not isinstance(self.tie_word_embeddings, bool):
            raise InputError(f"model fact tie_word_embeddings = {self.tie_word_embeddings!r}: expected true or false")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise InputError(f"model fact sliding_window = {self.sliding_window!r}: expected a positive integer or null")
        if self.rope_frequencies is not None and (
                len(self.rope_frequencies) != self.head_dim // 2
                or not all(isinstance(f, (int, float)) and math.isfinite(f) for f in self.rope_frequencies)):
            raise InputError(f"model fact rope_frequencies: expected {self.head_dim // 2} finite numbers")

    @classmethod
    def from_dict(cls, data: dict) -> "ModelFacts":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("rope_frequencies") is not None:
            values["rope_frequencies"] = tuple(values["rope_frequencies"])
        return cls(**values)

    def to_dict(self) -> dict:
        data = asdict(self)
        if data["rope_frequencies"] is not None:
            data["rope_frequencies"] = list(data["rope_frequencies"])
        return data

    def layer_parameters(self) -> int:
        """A decoder layer's matmul weights: attention's projections and a gated MLP's three matrices."""
        attention = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attention + 3 * self.hidden_size * self.intermediate_size

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize
