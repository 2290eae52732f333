"""Model facts: what the runtime needs to know about a decoder, as recorded in the manifest."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


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

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize
