"""onnxruntime sessions, one per role, placed by the device profile."""
from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
from edgespec.targets.profiles import CPU

from ..contract.errors import BundleError, InputError
from .providers import fall_back, provider_label, usable_providers

# what onnxruntime raises: its own classes derive from Exception alone
_STATE = ort.capi.onnxruntime_pybind11_state
ORT_ERRORS = (_STATE.Fail, _STATE.InvalidGraph, _STATE.InvalidArgument, _STATE.NoSuchFile, _STATE.InvalidProtobuf,
              _STATE.RuntimeException, _STATE.NotImplemented, _STATE.EPFail)

# whether the sessions' threads spin between the nodes of a run: "auto" (the target and the draft do, the draft
# not beside a streamed target's loader), "on" (both do), "off" (neither: a CPU other processes keep busy)
SPIN_SETTINGS = ("auto", "on", "off")
SPIN_ENTRY = "session.intra_op.allow_spinning"
# Sessions made with `shared_arena` take their activations from one arena, registered with onnxruntime's
# environment on first use, instead of each from its own. An arena keeps the most its session's passes
# ever held, so a target streamed as N stages (and a draft beside it) held N+1 sets of activations where
# the plan counts one; their passes run one after another, so one arena serves them all (issue 54: a
# 248 MiB budget peaked at 287-316 MiB RSS, per-stage arenas the largest part; measured with
# benchmarks/measure/budget_peak.py).
_SHARED_ARENA = {"registered": False}


def _register_shared_arena() -> None:
    if not _SHARED_ARENA["registered"]:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        # onnxruntime's defaults: no limit, chunks grown by powers of two (growing by each request instead
        # fragmented more: a higher peak, measured)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _SHARED_ARENA["registered"] = True


def check_spin(spin) -> None:
    if spin not in SPIN_SETTINGS:
        raise InputError(f"spin must be one of {', '.join(SPIN_SETTINGS)} (got {spin!r})")


def spins(setting: str, beside_loader: bool = False) -> bool:
    """Whether a resident session spins under `setting`; `beside_loader`: a streamed target's loader thread
    needs a core during its runs (auto then does not spin). A streamed target's own stages never spin."""
    check_spin(setting)
    return setting == "on" or (setting == "auto" and not beside_loader)


def spinning(session: ort.InferenceSession) -> bool:
    """Whether `session`'s threads spin (a session made beside it takes the same)."""
    return session.get_session_options().get_session_config_entry(SPIN_ENTRY) != "0"


def make_session(path: Path, providers: tuple, threads: int,
                 initializers: dict[str, ort.OrtValue] | None = None, prepack: bool = True,
                 optimize: bool = True, spin: bool = True, role: str = "", strict: bool = False,
                 shared_arena: bool = False) -> ort.InferenceSession:
    """`initializers`: weights the caller holds (memory-mapped), used in place of the graph's external
    data; the caller keeps them alive as long as the session. `prepack=False` makes the kernels read
    weights where they lie instead of copying them into packed buffers (which would make them resident).
    `optimize=False` for a graph onnxruntime already optimized for this machine. `spin=False` while
    another thread needs the cores during a run (a streamed target's stage loader). `providers`: the
    profile's for the role (targets/profiles.py: Provider, or names); a missing one falls back with a
    warning, or with `strict` is an error. `shared_arena`: activations from the one arena every such session
    shares (for sessions whose passes take turns: a staged target's stages and the draft under a budget)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    options.log_severity_level = 3
    # The pool's threads spin between the nodes of a run (waking a sleeping thread for each of a graph's
    # thousand small nodes slowed int4 decoding) and stop spinning when the run ends, so the draft
    # and target sessions, which take turns on the same cores, do not keep both busy for each other:
    # spinning past the run halved speculative decoding with a draft model (history.md §13, §31). While
    # a streamed target's loader thread faults the next stage in, spinning takes its core: no spinning. On
    # a CPU other processes keep busy, spinning threads fight them for the cores: the user's `spin` setting.
    options.add_session_config_entry(SPIN_ENTRY, "1" if spin else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if shared_arena:
        _register_shared_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    for name, value in (initializers or {}).items():
        options.add_initializer(name, value)
    try:
        return _first_that_starts(path, options, usable_providers(tuple(providers), role, strict), role, strict)
    except ORT_ERRORS as err:
        # a graph that passed its checksum but onnxruntime refuses: written wrong, or for another onnxruntime
        raise BundleError(f"onnxruntime {ort.__version__} cannot load {Path(path).name}: {str(err)[:300]}; "
                          "re-export the bundle with this edgespec") from err


def _first_that_starts(path: Path, options: ort.SessionOptions, chosen: list[tuple[str, dict]], role: str,
                       strict: bool) -> ort.InferenceSession:
    """A session on the first of `chosen` that starts here, with the CPU beside it for what it does not take. A
    provider in this build can still fail to start (OpenVINO asked for an NPU the machine lacks): onnxruntime
    then runs everything on the CPU and says little, so the next choice is tried and the fallback named."""
    for i, (name, provider_options) in enumerate(chosen):
        pair = [(name, provider_options)] + ([(CPU, {})] if name != CPU else [])
        session = ort.InferenceSession(str(path), options, providers=[n for n, _ in pair],
                                       provider_options=[o for _, o in pair])
        if name == CPU or name in session.get_providers():
            if i:
                fall_back(f"{provider_label(chosen[0])} did not start on this machine; {role or 'the model'} runs on "
                          f"{provider_label(chosen[i])} instead", strict, stacklevel=4)
            return session
    raise BundleError(f"no provider started for {Path(path).name}")  # the CPU always does
