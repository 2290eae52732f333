"""This device, as far as onnxruntime's kernels are concerned: its onnxruntime release, CPU architecture
and CPU features. Packed weights (prepacked.py) and the exactness verdict (exactness.py) hold per key."""
from __future__ import annotations

import hashlib
import platform
import subprocess
from functools import cache
from pathlib import Path

import onnxruntime as ort


@cache
def cpu_features() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo; macOS: sysctl's brand and hw.optional features);
    empty where they cannot be read."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    try:
        found = subprocess.run(["sysctl", "machdep.cpu.brand_string", "hw.optional"], capture_output=True,
                               text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


def features_known() -> bool:
    return bool(cpu_features())


def machine_key() -> str:
    """What kernels' layouts and rounding depend on: onnxruntime's version, the CPU architecture and its features."""
    identity = "\n".join([ort.__version__, platform.machine(), cpu_features() or platform.processor()])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def describe() -> str:
    return f"onnxruntime {ort.__version__} on {platform.machine()} ({machine_key()})"
