"""Where each role runs on this device: the draft's execution provider, each role's CPU threads, and
whether the draft drafts while the target verifies (runtime/decoding/overlap.py). edgespec/calibrate.py measures
the candidates and picks one; the choice is cached per device and bundle."""
from __future__ import annotations

from dataclasses import dataclass

from edgespec.targets.profiles import DeviceProfile, Provider

from ..contract.errors import InputError
from .providers import usable_providers


@dataclass(frozen=True)
class Placement:
    draft: Provider  # the verifying target runs on the profile's verify providers
    draft_threads: int
    target_threads: int
    overlap: bool  # draft the next tree while the target verifies (each role on its own threads)

    def __post_init__(self):
        for name in ("draft_threads", "target_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"placement: {name} must be a positive integer (got {value!r})")

    def draft_provider(self) -> Provider:
        """The draft's provider with its thread count where the provider keeps threads of its own
        (OpenVINO's plugins do not use onnxruntime's pool)."""
        if self.draft.name == "OpenVINOExecutionProvider":
            options = dict(self.draft.options) | {"num_of_threads": str(self.draft_threads)}
            return Provider(self.draft.name, tuple(sorted(options.items())))
        return self.draft

    def describe(self) -> str:
        options = ",".join(f"{k}={v}" for k, v in self.draft.options)
        where = self.draft.name.removesuffix("ExecutionProvider") + (f"({options})" if options else "")
        mode = "overlapped" if self.overlap else "sequential"
        return f"{mode}: draft on {where} x{self.draft_threads} threads, target x{self.target_threads}"

    def to_dict(self) -> dict:
        return {"draft": self.draft.to_dict(), "draft_threads": self.draft_threads,
                "target_threads": self.target_threads, "overlap": self.overlap}

    @classmethod
    def from_dict(cls, data: dict) -> "Placement":
        try:
            return cls(Provider.from_dict(data["draft"]), data["draft_threads"], data["target_threads"],
                       bool(data["overlap"]))
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"a placement is draft, draft_threads, target_threads, overlap (got {data!r}): {err}") from err


def candidates(profile: DeviceProfile, cores: int) -> list[Placement]:
    """What calibration measures: for every provider of the profile's draft role that this onnxruntime
    has (the CPU always), one role after the other with every core; and, with two cores or more, both
    roles at once, the draft on one thread of its own beside the target's on every core, and (for a draft
    on the CPU) the cores split between the two."""
    found, seen = [], set()
    for name, options in usable_providers(profile.draft, "the draft"):
        draft = Provider(name, tuple(sorted(options.items())))
        if draft in seen:
            continue
        seen.add(draft)
        found.append(Placement(draft, cores, cores, overlap=False))
        if cores >= 2:
            found.append(Placement(draft, 1, cores, overlap=True))
            if name == "CPUExecutionProvider":
                found.append(Placement(draft, cores // 2, cores - cores // 2, overlap=True))
    return found
