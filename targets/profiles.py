"""Device profiles: which processor runs which role, as data.

A profile names an ordered list of onnxruntime execution providers for each role (the draft and the
verifying target), so a device with an NPU or GPU can draft there and verify on the CPU. The runtime
asks the profile, never the file names.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    draft_providers: tuple[str, ...]
    verify_providers: tuple[str, ...]
    static_shapes: bool  # NPUs and the Apple Neural Engine need fixed tensor shapes
    description: str

    def to_dict(self) -> dict:
        return {"name": self.name, "draft_providers": list(self.draft_providers),
                "verify_providers": list(self.verify_providers), "static_shapes": self.static_shapes}

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        """A profile as a manifest records it (the description is the registry's, if it knows the name)."""
        known = PROFILES.get(data["name"])
        return cls(name=data["name"], draft_providers=tuple(data["draft_providers"]),
                   verify_providers=tuple(data["verify_providers"]), static_shapes=bool(data["static_shapes"]),
                   description=known.description if known is not None else "")


PROFILES: dict[str, DeviceProfile] = {
    "cpu": DeviceProfile(
        name="cpu",
        draft_providers=("CPUExecutionProvider",),
        verify_providers=("CPUExecutionProvider",),
        static_shapes=False,
        description="any x86-64 or arm64 CPU; dynamic KV length",
    ),
}


def get_profile(name: str) -> DeviceProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown device profile {name!r}; known: {', '.join(sorted(PROFILES))}") from None


def usable_providers(wanted: tuple[str, ...]) -> list[str]:
    """The wanted providers this onnxruntime build offers, in order; the CPU is always last resort."""
    available = set(ort.get_available_providers())
    chosen = [p for p in wanted if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen
