"""`edgespec calibrate`: where a bundle's draft and target run fastest on this device, by measurement.

Every placement runtime/execution/placement.py lists for the bundle's profile (each provider of the draft role this
onnxruntime has; one role after the other with every core, or both at once with the cores split) decodes
a few short prompts, greedy, twice: the first round warms the sessions up (OpenVINO compiles its
subgraphs per input shape: without it the prediction was far too low, history.md §51), the second is
timed, and its decoding speed is the prediction for that placement; the fastest is chosen. The choice and every measurement are cached per device (onnxruntime release, CPU) and
bundle (its manifest's checksum), so a later `--placement auto` reads it instead of measuring again.
`benchmarks/measure/placement.py` checks the predictions against longer runs."""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

from edgespec.bench import prompt_kwargs
from edgespec.runtime.contract.drafting import DrafterKind
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.contract.manifest import Manifest, open_bundle
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.device import describe, machine_key
from edgespec.runtime.execution.paths import cache_dir
from edgespec.runtime.execution.placement import Placement, candidates
from edgespec.runtime.pipeline import Pipeline, default_threads

CALIBRATION_TOKENS = 48
CALIBRATION_PROMPTS = 3  # of the built-in prompts, unless the caller gives its own
SCHEMA = 1


@dataclass(frozen=True)
class Measured:
    placement: Placement
    tokens_per_s: float  # decoding speed over the calibration prompts: the prediction for this placement
    accepted_per_pass: float
    kept_ahead: float  # share of trees drafted ahead that were used (overlapped placements)

    def to_dict(self) -> dict:
        return {"placement": self.placement.to_dict(), "tokens_per_s": self.tokens_per_s,
                "accepted_per_pass": self.accepted_per_pass, "kept_ahead": self.kept_ahead}

    @classmethod
    def from_dict(cls, data: dict) -> "Measured":
        return cls(Placement.from_dict(data["placement"]), float(data["tokens_per_s"]),
                   float(data["accepted_per_pass"]), float(data["kept_ahead"]))


@dataclass(frozen=True)
class Calibration:
    measured: tuple[Measured, ...]
    cores: int
    device: str

    @property
    def chosen(self) -> Measured:
        return max(self.measured, key=lambda m: m.tokens_per_s)

    def report(self) -> str:
        lines = [f"placement on {self.device}, {self.cores} cores (decoding tokens/s, greedy):"]
        for m in self.measured:
            mark = "*" if m is self.chosen else " "
            kept = f", {m.kept_ahead:.0%} of trees drafted ahead kept" if m.placement.overlap else ""
            lines.append(f" {mark} {m.placement.describe():62s} {m.tokens_per_s:7.1f}  "
                         f"({m.accepted_per_pass:.2f} tokens per pass{kept})")
        lines.append(f"chosen: {self.chosen.placement.describe()}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "device": self.device, "cores": self.cores,
                "measured": [m.to_dict() for m in self.measured]}

    @classmethod
    def from_dict(cls, data: dict) -> "Calibration":
        if data.get("schema") != SCHEMA:
            raise InputError(f"placement cache schema {data.get('schema')!r}, expected {SCHEMA}")
        return cls(tuple(Measured.from_dict(m) for m in data["measured"]), int(data["cores"]), str(data["device"]))


def cache_file(folder: Path, cores: int, profile: str | None = None) -> Path:
    """Per device, bundle, core count and profile (None: the bundle's); the manifest's checksum names the
    bundle (its files' checksums are in it)."""
    bundle = hashlib.sha256((Path(folder) / "manifest.json").read_bytes()).hexdigest()[:16]
    return cache_dir() / "placement" / f"{machine_key()}-{bundle}-{cores}{'-' + profile if profile else ''}.json"


def cached(folder: Path, cores: int, profile: str | None = None) -> Calibration | None:
    path = cache_file(folder, cores, profile)
    if not path.is_file():
        return None
    try:
        return Calibration.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, InputError):
        return None  # unreadable or from another edgespec: measured again, and rewritten


def placeable(folder: Path, profile: str | None) -> Manifest:
    """The bundle's manifest as read for `profile`, if it has a draft model to place."""
    manifest = open_bundle(folder, profile)
    if manifest.draft is None:
        raise InputError("this bundle has no draft model: there is nothing to place but the target (its provider "
                         "is the profile's), and a training-free drafter costs too little to run beside it")
    if manifest.drafter is DrafterKind.MEDUSA:
        raise InputError("this bundle drafts with Medusa heads, one small pass on the draft provider per step: there "
                         "is no draft model to place")
    return manifest


def calibrate(folder: Path, prompts: list[dict], cores: int | None = None, max_new_tokens: int = CALIBRATION_TOKENS,
              say=lambda line: None, profile: str | None = None) -> Calibration:
    """Measures every candidate placement of the bundle in `folder` on `prompts` and caches the result.
    `profile`: which of the bundle's device profiles (its providers and graphs; Manifest.for_profile)."""
    cores = cores or default_threads()
    manifest = placeable(folder, profile)
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False)
    measured = []
    for placement in candidates(manifest.profile, cores):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said below, once
            pipeline = Pipeline(folder, placement=placement, profile=profile)
        if pipeline.draft.session.get_providers()[0] != placement.draft.name:
            say(f"  {placement.describe()}: the provider did not start here; not measured")
            continue
        # a round to warm up: a provider that compiles per input shape (OpenVINO) sees every shape once
        for item in prompts:
            pipeline.generate(**prompt_kwargs(item), config=config)
        stats = [pipeline.generate(**prompt_kwargs(item), config=config).stats for item in prompts]
        decoded, seconds = sum(s.new_tokens - 1 for s in stats), sum(s.decode_s for s in stats)
        if not decoded or not seconds:
            raise InputError("the calibration prompts decoded nothing (each stopped at its first token): give "
                             "prompts that leave room to answer (--prompts)")
        passes, accepted = sum(s.target_passes for s in stats), sum(s.accepted_drafts for s in stats)
        ahead, kept = sum(s.drafted_ahead for s in stats), sum(s.kept_ahead for s in stats)
        measured.append(Measured(placement, round(decoded / seconds, 2), round((accepted + passes) / passes, 3),
                                 round(kept / ahead, 3) if ahead else 0.0))
        say(f"  {placement.describe()}: {measured[-1].tokens_per_s:.1f} tokens/s")
        del pipeline
    if not measured:  # not cached: a later run, with the provider installed, measures again
        raise InputError(f"no placement of the {manifest.profile.name} profile could start here: its providers "
                         "are missing (see `edgespec doctor`)")
    result = Calibration(tuple(measured), cores, describe())
    _write(cache_file(folder, cores, profile), result)
    return result


def _write(path: Path, calibration: Calibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(calibration.to_dict(), indent=1), encoding="utf-8")
    partial.replace(path)  # whole or not at all, even with two processes calibrating at once


def auto_placement(folder: Path, prompts: list[dict], cores: int | None = None, say=lambda line: None,
                   profile: str | None = None) -> Placement:
    """The cached choice for this device, bundle and profile, measured first if there is none."""
    cores = cores or default_threads()
    found = cached(folder, cores, profile)
    if found is None:
        say(f"calibrating placement for {Path(folder).name} ({cores} cores; cached afterwards)")
        found = calibrate(folder, prompts, cores, say=say, profile=profile)
    say(f"placement: {found.chosen.placement.describe()}")
    return found.chosen.placement
