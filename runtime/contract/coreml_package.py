"""A bundle's CoreML packages as the manifest lists them (runtime/execution/coreml.py runs them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .topology import Topology

COMPUTE_UNITS = ("CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE", "ALL")
KV_FORMS = ("state", "io")
# onnxruntime's CoreML provider names the same choices; a profile's provider options give the hint
_PROVIDER_UNITS = {"CPUOnly": "CPU_ONLY", "CPUAndGPU": "CPU_AND_GPU", "CPUAndNeuralEngine": "CPU_AND_NE", "ALL": "ALL"}


def compute_units_for(providers) -> str:
    """The compute units a role's first provider asks for: the CoreML provider's MLComputeUnits, else the CPU."""
    first = providers[0] if providers else None
    if first is not None and first.name == "CoreMLExecutionProvider":
        return _PROVIDER_UNITS.get(dict(first.options).get("MLComputeUnits", "ALL"), "ALL")
    return "CPU_ONLY"


@dataclass(frozen=True)
class CoreMLPackage:
    """One .mlpackage of a bundle: which model it holds, its functions and their static token counts."""
    role: str  # target or draft
    file: str  # a folder, relative to the bundle (its files are in the manifest's checksums)
    kv: str  # "state" (iOS 18 / macOS 15) or "io" (the cache passed in, new rows passed out)
    functions: dict[str, int]  # function name -> tokens per call
    compression: str
    compute_units: str
    capacity: int  # KV rows
    parents: dict[str, tuple[int, ...]] = field(default_factory=dict)  # a verify function's static tree

    def __post_init__(self):
        if self.role not in ("target", "draft") or self.kv not in KV_FORMS or self.compute_units not in COMPUTE_UNITS:
            raise ValueError(f"CoreML package {self.file!r}: role {self.role!r}, kv {self.kv!r}, "
                             f"compute units {self.compute_units!r} are not all known")
        if not self.functions or not all(isinstance(n, int) and n >= 1 for n in self.functions.values()):
            raise ValueError(f"CoreML package {self.file!r}: functions must map names to token counts")
        for name, parents in self.parents.items():
            Topology(tuple(parents))  # validates
            if self.functions.get(name) != len(parents):
                raise ValueError(f"CoreML package {self.file!r}: {name}'s tree has {len(parents)} nodes, "
                                 f"the function takes {self.functions.get(name)}")

    def to_dict(self) -> dict:
        return {"role": self.role, "file": self.file, "kv": self.kv, "functions": dict(self.functions),
                "compression": self.compression, "compute_units": self.compute_units, "capacity": self.capacity,
                **({"parents": {k: list(v) for k, v in self.parents.items()}} if self.parents else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "CoreMLPackage":
        return cls(role=data["role"], file=str(data["file"]), kv=data["kv"], functions=dict(data["functions"]),
                   compression=str(data["compression"]), compute_units=data["compute_units"],
                   capacity=int(data["capacity"]),
                   parents={k: tuple(int(p) for p in v) for k, v in data.get("parents", {}).items()})


def package_files(folder: Path, package: CoreMLPackage) -> list[str]:
    """The files inside a package folder, as the manifest names them."""
    root = Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in (root / package.file).rglob("*") if p.is_file())
