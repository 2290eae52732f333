"""`edgespec doctor`: what this machine offers onnxruntime, and where each device profile (and a
bundle, if given) would run its draft and its verifying target here, and why."""
from __future__ import annotations

import os
import warnings

import onnxruntime as ort

from edgespec.calibrate import cached
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.execution.device import describe
from edgespec.runtime.execution.providers import provider_label, usable_providers
from edgespec.runtime.pipeline import default_threads
from edgespec.targets.profiles import DeviceProfile, profiles


def memory_mib() -> tuple[int | None, int | None]:
    """(total, available) from /proc/meminfo, None where there is none."""
    values = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                values[key] = int(rest.split()[0]) // 1024
    except (OSError, ValueError, IndexError):
        return None, None
    return values.get("MemTotal"), values.get("MemAvailable")


def placement(profile: DeviceProfile) -> tuple[str, str, list[str]]:
    """(draft's provider, target's provider, what falls back and why) for `profile` on this machine."""
    notes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        draft = usable_providers(profile.draft, "the draft")[0]
        verify = usable_providers(profile.verify, "the target")[0]
    notes += [str(w.message) for w in caught]
    return provider_label(draft), provider_label(verify), notes


def report(bundle=None, strict: bool = False) -> tuple[str, bool]:
    """The doctor's text, and whether everything a bundle (or, without one, the cpu profile) asks for is here."""
    total, available = memory_mib()
    lines = [f"edgespec doctor: {describe()}",
             f"  providers in this build: {', '.join(ort.get_available_providers())}",
             f"  cores: {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}",
             f"  memory: {total} MiB, {available} MiB available" if total else "  memory: unknown",
             "  profiles (draft -> target on this machine):"]
    for name, profile in profiles().items():
        draft, verify, notes = placement(profile)
        static = [role for role in ("draft", "verify") if profile.static_for(role)]
        lines.append(f"    {name:17s} {draft} -> {verify}" + (f" [static shapes: {', '.join(static)}]" if static else "")
                     + ("  (falls back)" if notes else ""))
    wanted = profiles()["cpu"]
    if bundle is not None:
        manifest = open_bundle(bundle)
        wanted = manifest.profile
        lines.append(f"  bundle {bundle}: exported for the {wanted.name} profile")
    draft, verify, notes = placement(wanted)
    lines.append(f"  would run: the draft on {draft}, the target on {verify}")
    if bundle is not None:
        measured = cached(bundle, default_threads())
        lines.append(f"  measured placement: {measured.chosen.placement.describe()} (of {len(measured.measured)} "
                     "measured; `--placement auto` uses it)" if measured else
                     "  measured placement: none yet (`edgespec calibrate` measures where each role runs fastest here)")
    lines += [f"  warning: {note}" for note in notes]
    ok = not notes
    if strict and not ok:
        lines.append("  --strict: a provider the profile names is missing")
    return "\n".join(lines), ok


