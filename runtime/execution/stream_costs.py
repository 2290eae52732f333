"""What a staged target's pass costs on this device, by what streams: the planner's currency.

A pass runs the window's stages in order; a streamed stage is fetched on the loader thread while the
one before it computes (runtime/execution/staged.py), but on a small CPU the fetch takes the cores and memory
bandwidth the run needs, so a pass is priced at every run plus every streamed fetch, with no credit
for the overlap (history.md §59 measured the wait for a prefetched stage at about its whole fetch).
`StreamCosts` holds each stage's run and fetch seconds, measured once per device, bundle, thread count
and page-cache policy (`measure`) and cached; before that, `assumed` prices both by bytes at rates measured
on the reference target (history.md §59), which orders the splits the same way.

State: a StreamCosts is a frozen value; the cache file is the only thing written, by `save`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..contract.errors import InputError
from .device import machine_key

# seconds per byte of a packed int4 stage, history.md §59: one-token run, and a fetch from the page cache
ASSUMED_RUN_PER_BYTE = 1.0e-10
ASSUMED_FETCH_PER_BYTE = 0.6e-10
# a fetch from storage (the page cache evicted on release), history.md §24
ASSUMED_EVICTED_FETCH_PER_BYTE = 1.8e-9


@dataclass(frozen=True)
class StreamCosts:
    run_seconds: tuple[float, ...]  # each window stage's one-token exact pass, resident
    fetch_seconds: tuple[float, ...]  # each stage's fetch after a release
    measured: bool  # False: assumed from bytes

    @classmethod
    def assumed(cls, stage_bytes, evicted: bool = False) -> "StreamCosts":
        fetch = ASSUMED_EVICTED_FETCH_PER_BYTE if evicted else ASSUMED_FETCH_PER_BYTE
        return cls(tuple(b * ASSUMED_RUN_PER_BYTE for b in stage_bytes), tuple(b * fetch for b in stage_bytes), False)

    def pass_seconds(self, pinned) -> float:
        """A one-token pass with `pinned` resident: every run, plus each streamed stage's fetch."""
        pinned = set(pinned)
        return sum(self.run_seconds) + sum(f for i, f in enumerate(self.fetch_seconds) if i not in pinned)

    def to_dict(self) -> dict:
        return {"run_seconds": list(self.run_seconds), "fetch_seconds": list(self.fetch_seconds)}

    @classmethod
    def from_dict(cls, data: dict) -> "StreamCosts":
        try:
            run, fetch = tuple(map(float, data["run_seconds"])), tuple(map(float, data["fetch_seconds"]))
        except (KeyError, TypeError, ValueError) as err:
            raise InputError(f"stream costs are run_seconds and fetch_seconds per stage (got {data!r}): {err}") from err
        if len(run) != len(fetch) or not run:
            raise InputError(f"stream costs need one run and one fetch per stage (got {len(run)} and {len(fetch)})")
        return cls(run, fetch, True)


def cache_path(root: Path, bundle_checksum: str, evicted: bool, threads: int) -> Path:
    """A stage's run is timed on the threads its session has, so costs timed on others do not price it."""
    name = f"{bundle_checksum[:32]}-t{threads}{'-evicted' if evicted else ''}.json"
    return Path(root) / "stream-costs" / machine_key() / name


def load(root: Path, bundle_checksum: str, evicted: bool, threads: int, stages: int) -> StreamCosts | None:
    """This device's measured costs for the bundle on `threads`, None where not measured (or for another
    stage count)."""
    path = cache_path(root, bundle_checksum, evicted, threads)
    if not path.is_file():
        return None
    costs = StreamCosts.from_dict(json.loads(path.read_text()))
    return costs if len(costs.run_seconds) == stages else None


def save(root: Path, bundle_checksum: str, evicted: bool, threads: int, costs: StreamCosts) -> None:
    path = cache_path(root, bundle_checksum, evicted, threads)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(costs.to_dict()))


def measure(window, run_stage, repeats: int = 3) -> StreamCosts:
    """Times each stage of `window` (runtime/execution/staged.py StageWindow), before its first pass: a fetch after
    a release, and `run_stage(i, session)`, a one-token exact pass through it; the median of `repeats`.
    Streamed stages are given back afterwards and pinned ones kept, as the window would."""
    run, fetch = [], []
    for i, stage in enumerate(window.stages):
        fetches, runs = [], []
        for _ in range(repeats):
            stage.release()
            started = time.perf_counter()
            session = stage.fetch()
            fetches.append(time.perf_counter() - started)
            started = time.perf_counter()
            run_stage(i, session)
            runs.append(time.perf_counter() - started)
        if i not in window.pinned:
            stage.release()
        run.append(float(np.median(runs)))
        fetch.append(float(np.median(fetches)))
    return StreamCosts(tuple(run), tuple(fetch), True)
