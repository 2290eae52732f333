"""The CoreML backend on macOS: coremltools' prediction API behind runtime/execution/coreml.py's predictor contract.

It lives at the front door because coremltools (the [coreml] extra) is no runtime dependency: the
runtime's CoreML runner takes any predictor (the Pipeline's `predictor`), and elsewhere the packages are
refused with what runs instead.
"""
from __future__ import annotations

import platform
from pathlib import Path

from edgespec.runtime.contract.coreml_package import CoreMLPackage
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.execution.coreml import Predict, io_cache


def coreml_refusal() -> str | None:
    """Why CoreML packages cannot run here, or None on macOS with coremltools' runtime."""
    if platform.system() != "Darwin":
        return (f"CoreML packages run only on macOS (this is {platform.system() or 'an unknown system'}); here the "
                "bundle's ONNX graphs run on onnxruntime instead: leave out --backend coreml")
    try:
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError:
        return "CoreML needs coremltools with its macOS runtime: pip install 'edgespec[coreml]'"
    return None


def preferred_kv() -> str:
    """KV caches as states from macOS 15 on; passed in and out before."""
    release = platform.mac_ver()[0]
    return "state" if release and int(release.split(".")[0]) >= 15 else "io"


def coreml_predictor(folder: Path, packages: list[CoreMLPackage], facts) -> tuple[Predict, object]:
    """coremltools' prediction API over one role's packages of one KV form: (predict, make_cache). macOS only."""
    reason = coreml_refusal()
    if reason is not None:
        raise InputError(reason)
    import coremltools as ct

    models = {}
    for package in packages:
        units = getattr(ct.ComputeUnit, package.compute_units)
        for name in package.functions:
            models[name] = ct.models.MLModel(str(Path(folder) / package.file), compute_units=units,
                                             **({"function_name": name} if package.kv == "state" else {}))
    if packages[0].kv == "state":
        return (lambda name, feed, state: models[name].predict(feed, state=state)), next(iter(models.values())).make_state
    return (lambda name, feed, cache: models[name].predict(feed)), lambda: io_cache(facts, packages[0].capacity)
