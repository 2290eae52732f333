"""Quantization schemes and the per-tensor policy, as data.

A scheme says how one weight is stored: fp32, fp16 (stored half, computed in fp32), int8 or int4
(block-wise, onnxruntime's MatMulNBits / GatherBlockQuantized). A policy maps the builder's canonical
weight names (`embed_tokens`, `lm_head`, `layers.3.qkv`, ... — names the builder gives, not file
names) to schemes, with a default for the rest.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from edgespec.runtime.contract.errors import InputError

SCHEMES = ("fp32", "fp16", "int8", "int4")
# the default bundle's policy over int4: the head in int8 (int4 there costs perplexity, history.md §49)
HEAD_INT8_POLICY = Path(__file__).resolve().parent / "policies" / "head-int8.json"
BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class QuantScheme:
    name: str = "fp32"
    block_size: int = 32
    symmetric: bool = True
    # MatMulNBits accuracy level: 4 = int8 activations (fast on AVX2/AVX512-VNNI/NEON dot), 1 = fp32
    # activations. Either keeps per-row results independent of the pass's shape (tested).
    accuracy_level: int = 4
    # asymmetric only: each block's zero point as MatMulNBits stores it (an integer: its fast kernels),
    # instead of an exact float offset beside it (offsets.py: reproduces a Q4_1 GGUF, costs a float matmul)
    integer_zero_points: bool = False
    # int8 only: MatMulInteger over activations quantized per row (integer.py), which gives every row the
    # same bits at any row count, so a one-token step needs no padding row
    integer_matmul: bool = False

    def __post_init__(self):
        if self.name not in SCHEMES:
            raise InputError(f"unknown quantization {self.name!r}: use one of {', '.join(SCHEMES)}")
        if self.block_size not in BLOCK_SIZES:
            raise InputError(f"block size {self.block_size} is not supported: use one of {BLOCK_SIZES}")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise InputError(f"accuracy level {self.accuracy_level} is not one of 0..4")

    @property
    def bits(self) -> int | None:
        return {"int8": 8, "int4": 4}.get(self.name)

    def to_dict(self, block_settings: bool = False) -> dict:
        """The scheme; block settings too when it, or a tensor under it, is int8/int4."""
        if self.bits is None and not block_settings:
            return {"scheme": self.name}
        return {"scheme": self.name, "block_size": self.block_size, "symmetric": self.symmetric,
                "accuracy_level": self.accuracy_level,
                **({"zero_points": "integer" if self.integer_zero_points else "float"} if not self.symmetric else {}),
                **({"kernel": "integer"} if self.integer_matmul else {})}


@dataclass(frozen=True)
class QuantPolicy:
    default: QuantScheme = QuantScheme()
    overrides: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # (glob over weight names, scheme)

    def scheme_for(self, weight: str) -> QuantScheme:
        for pattern, name in self.overrides:
            if fnmatch.fnmatchcase(weight, pattern):
                return replace(self.default, name=name)
        return self.default

    def quantizes(self) -> bool:
        """Whether any weight ends up in something other than fp32."""
        return self.default.name != "fp32" or any(name != "fp32" for _, name in self.overrides)

    @classmethod
    def load(cls, path: Path | None, default: QuantScheme) -> "QuantPolicy":
        """A policy file: {"tensors": {"lm_head": "int8", "layers.0.*": "fp32", ...}}."""
        if path is None:
            return cls(default=default)
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise InputError(f"cannot read the quantization policy {path}: {err}") from err
        tensors = data.get("tensors") if isinstance(data, dict) else None
        if not isinstance(tensors, dict):
            raise InputError(f"{path}: a policy holds {{\"tensors\": {{\"<weight name or glob>\": \"<scheme>\"}}}}")
        unknown = set(data) - {"tensors"}
        if unknown:
            raise InputError(f"{path}: unknown keys {sorted(unknown)}")
        for pattern, name in tensors.items():
            if name not in SCHEMES:
                raise InputError(f"{path}: {pattern!r} asks for {name!r}; schemes are {', '.join(SCHEMES)}")
        return cls(default=default, overrides=tuple(tensors.items()))
