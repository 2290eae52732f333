"""onnxruntime sessions, one per role, placed by the device profile."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort

from edgespec.targets.profiles import usable_providers

from .errors import BundleError


def make_session(path: Path, providers: tuple, threads: int,
                 initializers: dict[str, ort.OrtValue] | None = None, prepack: bool = True,
                 optimize: bool = True, spin: bool = True, role: str = "", strict: bool = False) -> ort.InferenceSession:
    """`initializers`: weights the caller holds (memory-mapped), used in place of the graph's external
    data; the caller keeps them alive as long as the session. `prepack=False` makes the kernels read
    weights where they lie instead of copying them into packed buffers (which would make them resident).
    `optimize=False` for a graph onnxruntime already optimized for this machine. `spin=False` while
    another thread needs the cores during a run (a streamed target's stage loader). `providers`: the
    profile's for the role (targets/profiles.py: Provider, or names); a missing one falls back with a
    warning, or with `strict` is an error."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.log_severity_level = 3
    # The pool's threads spin between the nodes of a run (waking a sleeping thread for each of a graph's
    # thousand small nodes cost int4 decoding ~20%) and stop spinning when the run ends, so the draft
    # and target sessions, which take turns on the same cores, do not keep both busy for each other:
    # spinning past the run halved speculative decoding with a draft model (history.md §13, §31). While
    # a streamed target's loader thread faults the next stage in, spinning takes its core: no spinning.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    try:
        chosen = usable_providers(tuple(providers), role, strict)
        return ort.InferenceSession(str(path), options, providers=[name for name, _ in chosen],
                                    provider_options=[opts for _, opts in chosen])
    except (ort.capi.onnxruntime_pybind11_state.Fail, ort.capi.onnxruntime_pybind11_state.InvalidGraph,
            ort.capi.onnxruntime_pybind11_state.InvalidArgument, ort.capi.onnxruntime_pybind11_state.NoSuchFile,
            ort.capi.onnxruntime_pybind11_state.InvalidProtobuf) as err:
        # a graph that passed its checksum but onnxruntime refuses: written wrong, or for another onnxruntime
        raise BundleError(f"onnxruntime {ort.__version__} cannot load {Path(path).name}: {str(err)[:300]}; "
                          "re-export the bundle with this edgespec") from err
