"""This device, as far as onnxruntime's kernels are concerned: its onnxruntime release, CPU architecture
and CPU features. Packed weights (prepacked.py) and the exactness verdict (exactness.py) hold per key."""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import onnxruntime as ort


def machine_key() -> str:
    """What kernels' layouts and rounding depend on: onnxruntime's version, the CPU architecture and its features."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        flags = platform.processor()
    identity = "\n".join([ort.__version__, platform.machine(), flags])
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def describe() -> str:
    return f"onnxruntime {ort.__version__} on {platform.machine()} ({machine_key()})"
