"""Stage weights packed once per machine, then memory-mapped: fast kernels without holding the weights.

A float matmul runs fastest from the packed layout onnxruntime makes when a session is created (measured:
a pass of one token twice as fast as from unpacked weights, RESULTS.md §20). That layout depends on the
CPU and on onnxruntime's version, so the exporter cannot write it. The first time a bundle's stage is
used on a machine, onnxruntime saves the stage's optimized graph with its packed weights in an external
file (`session.save_external_prepacked_constant_initializers`), kept under the cache, keyed by the
stage's checksum, onnxruntime's version and the CPU. Every later session maps that file instead of
packing: the pages are read on demand and belong to the file, so they can be dropped and read again.

onnxruntime makes that mapping itself, so releasing it needs its addresses, which Linux lists in
/proc/self/maps; `available()` is False elsewhere and the caller reads unpacked weights instead.
The prepared copy costs disk: the stage's weights twice (unpacked and packed).
"""
from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .sessions import make_session

PROC_MAPS = Path("/proc/self/maps")
GRAPH, WEIGHTS = "graph.onnx", "graph.weights"


def available() -> bool:
    return PROC_MAPS.exists() and hasattr(mmap, "MADV_DONTNEED")


def machine_key() -> str:
    """What the packed layout depends on: onnxruntime's version, the CPU architecture and its features."""
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


def _place(checksum: str, root: Path) -> Path:
    return Path(root) / machine_key() / checksum[:32]


def prepare(graphs: list[tuple[Path, str]], root: Path) -> list[Path]:
    """The packed copies of `graphs` (each with the checksum of its files), written under `root` where
    missing. Packing holds a graph's weights twice, so it runs in a child process: that transient memory
    never counts against the caller's budget."""
    missing = [(graph, checksum) for graph, checksum in graphs if not (_place(checksum, root) / GRAPH).is_file()]
    if missing:
        command = [sys.executable, "-m", __name__, str(root)] + [str(x) for pair in missing for x in pair]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(f"cannot pack the weights of {missing[0][0].parent} for this machine: {reason}")
    return [_place(checksum, root) / GRAPH for _, checksum in graphs]


def _prepare_one(graph: Path, checksum: str, root: Path) -> None:
    """Written into a temporary folder and renamed into place, so an interrupted preparation leaves nothing
    a later run would mistake for a finished one."""
    done = _place(checksum, root)
    done.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=done.parent))
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.optimized_model_filepath = str(work / GRAPH)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", WEIGHTS)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        if not (work / WEIGHTS).is_file():
            raise RuntimeError(f"onnxruntime wrote no external weights for {graph}")
        try:
            os.rename(work, done)
        except OSError:
            if not (done / GRAPH).is_file():  # another process may have finished first; anything else is ours
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path`."""
    target, ranges = str(path.resolve()), []
    for line in PROC_MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


class PrepackedStage:
    """A stage whose session maps its packed weights: fetch faults them in, release drops them."""

    def __init__(self, prepared: Path, providers: tuple[str, ...], threads: int):
        # the graph is already optimized for this machine: optimizing again would only cost time
        self.weights = prepared.parent / WEIGHTS
        # Only the mappings this session makes: another session of the same file (another pipeline's,
        # perhaps closed) maps it elsewhere, and its pages are not this stage's to touch or drop.
        # Sessions are made one at a time, so no other mapping of the file appears in between.
        before = set(_mapped_ranges(self.weights))
        self.session = make_session(prepared, providers, threads, optimize=False)
        self.ranges = [r for r in _mapped_ranges(self.weights) if r not in before]
        if not self.ranges:
            raise RuntimeError(f"onnxruntime did not map {self.weights}: its pages could not be released")
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def fetch(self) -> ort.InferenceSession:
        for low, high in self.ranges:  # one byte per page: the kernel maps them in from the page cache
            pages = np.frombuffer((ctypes.c_uint8 * (high - low)).from_address(low), np.uint8)
            int(pages[:: mmap.PAGESIZE].max())
        return self.session

    def release(self) -> None:
        for low, high in self.ranges:
            if self.libc.madvise(low, high - low, mmap.MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"cannot release the pages of {self.weights}")


if __name__ == "__main__":  # the child `prepare` starts: ROOT GRAPH CHECKSUM [GRAPH CHECKSUM ...]
    root, pairs = Path(sys.argv[1]), sys.argv[2:]
    for graph, checksum in zip(pairs[::2], pairs[1::2]):
        _prepare_one(Path(graph), checksum, root)
