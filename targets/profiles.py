"""Device profiles: which processor runs which role, as data (targets/data/NAME.json, one per device kind).

A profile names, for each role (the draft and the verifying target), an ordered list of onnxruntime
execution providers with their options, whether the device needs static shapes, the weight scheme
it prefers, the largest tree worth verifying and a thread count. The runtime asks the profile, never
file names. A provider this onnxruntime build lacks is skipped with a warning that names what runs
instead (strict: an error); the CPU provider is always the last resort.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from edgespec.runtime.contract.errors import InputError

WEIGHT_SCHEMES = ("any", "int4-asymmetric", "int4-symmetric", "int8-symmetric")
CPU = "CPUExecutionProvider"


@dataclass(frozen=True)
class Provider:
    name: str
    options: tuple[tuple[str, str], ...] = ()  # provider options, as onnxruntime takes them (strings)

    def to_dict(self) -> dict:
        return {"name": self.name, **({"options": dict(self.options)} if self.options else {})}

    @classmethod
    def from_dict(cls, data) -> "Provider":
        if isinstance(data, str):  # the manifests of schema 3 before profiles were files: names only
            return cls(data)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"].endswith(
                "ExecutionProvider"):
            raise InputError(f"a provider is {{\"name\": \"...ExecutionProvider\", \"options\": {{...}}}} (got {data!r})")
        options = data.get("options", {})
        if not isinstance(options, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
            raise InputError(f"{data['name']}: options are strings by name (got {options!r})")
        return cls(data["name"], tuple(sorted(options.items())))


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    draft: tuple[Provider, ...]
    verify: tuple[Provider, ...]
    # per role, whether its processor needs fixed tensor shapes (NPUs, the Apple Neural Engine); the
    # verifying target stays dynamic where it runs on the CPU, where every padded row costs compute
    static_draft: bool
    static_verify: bool
    description: str = ""
    weights: str = "any"  # the weight scheme the device runs best (NPUs: symmetric)
    max_tree_nodes: int = 12  # the largest tree worth verifying there
    threads: int | None = None  # None: every core

    def __post_init__(self):
        if not self.draft or not self.verify:
            raise InputError(f"profile {self.name}: each role needs at least one provider")
        if self.weights not in WEIGHT_SCHEMES:
            raise InputError(f"profile {self.name}: weights {self.weights!r} is not one of {', '.join(WEIGHT_SCHEMES)}")
        if isinstance(self.max_tree_nodes, bool) or not isinstance(self.max_tree_nodes, int) or \
                not 1 <= self.max_tree_nodes <= 64:
            raise InputError(f"profile {self.name}: max_tree_nodes must be 1..64")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or not 1 <= self.threads <= 256):
            raise InputError(f"profile {self.name}: threads must be 1..256 or null")

    @property
    def static_shapes(self) -> bool:
        """Whether either role needs static shapes."""
        return self.static_draft or self.static_verify

    def static_for(self, role: str) -> bool:
        """`role`: "draft" or "verify"."""
        return self.static_draft if role == "draft" else self.static_verify

    @property
    def draft_providers(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.draft)

    @property
    def verify_providers(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.verify)

    def to_dict(self) -> dict:
        return {"name": self.name, "draft": [p.to_dict() for p in self.draft],
                "verify": [p.to_dict() for p in self.verify],
                "static_shapes": {"draft": self.static_draft, "verify": self.static_verify},
                "weights": self.weights, "max_tree_nodes": self.max_tree_nodes, "threads": self.threads}

    @classmethod
    def from_dict(cls, data: dict) -> "DeviceProfile":
        """A profile file, or a profile as a manifest records it (older manifests: provider names in
        `draft_providers` / `verify_providers`)."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise InputError(f"a profile is an object with a name (got {type(data).__name__})")
        draft, verify = data.get("draft", data.get("draft_providers")), data.get("verify", data.get("verify_providers"))
        static = data.get("static_shapes")
        if isinstance(static, bool):  # both roles (profiles and manifests written before it was per role)
            static = {"draft": static, "verify": static}
        if not isinstance(draft, list) or not isinstance(verify, list) or not isinstance(static, dict) \
                or set(static) != {"draft", "verify"} or not all(isinstance(v, bool) for v in static.values()):
            raise InputError(f"profile {data['name']}: draft and verify provider lists and static_shapes (true, false, "
                             "or {\"draft\": bool, \"verify\": bool}) are required")
        known = profiles().get(data["name"]) if data.get("description") is None else None
        return cls(name=data["name"], draft=tuple(Provider.from_dict(p) for p in draft),
                   verify=tuple(Provider.from_dict(p) for p in verify),
                   static_draft=static["draft"], static_verify=static["verify"],
                   description=data.get("description") or (known.description if known else ""),
                   weights=data.get("weights", "any"), max_tree_nodes=data.get("max_tree_nodes", 12),
                   threads=data.get("threads"))


@cache
def profiles() -> dict[str, DeviceProfile]:
    """Every profile edgespec ships (targets/data/*.json), validated."""
    found = {}
    for entry in sorted(resources.files("edgespec.targets").joinpath("data").iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".json"):
            continue
        try:
            profile = DeviceProfile.from_dict(json.loads(entry.read_text(encoding="utf-8")))
        except (ValueError, TypeError) as err:
            raise InputError(f"targets/data/{entry.name}: {err}") from err
        if profile.name != entry.name.removesuffix(".json"):
            raise InputError(f"targets/data/{entry.name} names itself {profile.name!r}")
        found[profile.name] = profile
    return found


def get_profile(name: str) -> DeviceProfile:
    try:
        return profiles()[name]
    except KeyError:
        raise InputError(f"unknown device profile {name!r}; known: {', '.join(sorted(profiles()))}") from None
