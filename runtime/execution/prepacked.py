"""Stage weights packed once per machine, then memory-mapped: fast kernels without holding the weights.

A float matmul runs fastest from the packed layout onnxruntime makes when a session is created (measured:
a pass of one token twice as fast as from unpacked weights, history.md §20). That layout depends on the
CPU and on onnxruntime's version, so the exporter cannot write it. The first time a bundle's stage is
used on a machine, onnxruntime saves the stage's optimized graph with its packed weights in an external
file (`session.save_external_prepacked_constant_initializers`), kept under the cache, keyed by the
stage's checksum, onnxruntime's version and the CPU. Every later session maps that file instead of
packing: the pages are read on demand and belong to the file, so they can be dropped and read again.

onnxruntime makes that mapping itself, so releasing it needs its addresses, which Linux lists in
/proc/self/maps; `available()` is False elsewhere and the caller reads unpacked weights instead.
The prepared copy costs disk: the stage's weights twice (unpacked and packed). Quantized stages pack
too (MatMulNBits' blocks, exact offsets included), and their packed form is larger than the bundle's:
what a stage holds when fetched is measured once, when it is prepared, and kept beside it (RESIDENT),
so a memory budget counts what is mapped, not the file.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import onnxruntime as ort

from ..contract.errors import BundleError
from .device import machine_key
from .sessions import make_session

PROC_MAPS = Path("/proc/self/maps")
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux's value; Python 3.11's mmap lacks it
GRAPH, WEIGHTS, RESIDENT = "graph.onnx", "graph.weights", "resident.json"


def available() -> bool:
    return PROC_MAPS.exists() and hasattr(mmap, "MADV_DONTNEED")


def _place(checksum: str, root: Path) -> Path:
    return Path(root) / machine_key() / checksum[:32]


def stage_checksum(files: dict[str, str], spec) -> str:
    """What names a stage's packed copy: the manifest's checksums of its graph and weight files."""
    return hashlib.sha256("".join(files[name] for name in (spec.file, *spec.weights)).encode()).hexdigest()


def prepared_bytes(checksum: str, root: Path) -> int | None:
    """Disk the packed copy of a stage takes on this machine, None while it has not been written."""
    place = _place(checksum, root)
    if not (place / GRAPH).is_file():
        return None
    return sum(path.stat().st_size for path in place.iterdir())


def resident_bytes(checksum: str, root: Path) -> int | None:
    """What the stage's session maps of its packed copy (resident while fetched), None while not prepared."""
    path = _place(checksum, root) / RESIDENT
    if not path.is_file():
        return None
    try:
        return int(json.loads(path.read_text())["mapped_bytes"])
    except (ValueError, KeyError, TypeError) as err:
        raise BundleError(f"{path} is damaged ({err}): delete its folder and it is prepared again") from err


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
            raise BundleError(f"cannot pack the weights of {missing[0][0].parent} for this machine: {reason}")
        written = sum(prepared_bytes(checksum, root) or 0 for _, checksum in missing)
        print(f"edgespec: packed {len(missing)} stage(s) of {missing[0][0].parent.name} for this machine once: "
              f"{written / 2**20:.0f} MiB in {Path(root) / machine_key()} (EDGESPEC_PACKED moves them)",
              file=sys.stderr)
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
        (work / RESIDENT).write_text(json.dumps({"mapped_bytes": _mapped_by_session(work)}))
        for name in (GRAPH, WEIGHTS, RESIDENT):  # on disk before the rename publishes them, not only in the page cache
            with open(work / name, "rb") as file:
                os.fsync(file.fileno())
        try:
            os.rename(work, done)
        except OSError:
            if not (done / GRAPH).is_file():  # another process may have finished first; anything else is ours
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mapped_by_session(folder: Path) -> int:
    """Bytes a session of the packed graph in `folder` maps of its weights: the packed buffers; the
    originals they were packed from are not kept (this process maps nothing else of that file)."""
    session = make_session(folder / GRAPH, ("CPUExecutionProvider",), 1, optimize=False, spin=False)
    mapped = sum(r.high - r.low for r in _mapped_ranges(folder / WEIGHTS))
    del session
    return mapped


class Range(NamedTuple):
    low: int  # first address
    high: int  # one past the last
    offset: int  # where in the file `low` maps


def _mapped_ranges(path: Path) -> list[Range]:
    """The address ranges at which this process maps `path`."""
    target, ranges = str(path.resolve()), []
    for line in PROC_MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append(Range(low, high, int(fields[2], 16)))
    return ranges


class PrepackedStage:
    """A stage whose session maps its packed weights: fetch maps them in, release drops them.

    The file is first read with read(), before the session exists: the read path fills the cache in
    large folios, which later fetches map and releases drop far faster than the small pages faults read
    in (history.md §22)."""

    def __init__(self, prepared: Path, providers: tuple, threads: int, evict: bool = False):
        """`evict`: release also drops the pages from the OS page cache, for a budget that must bound
        the cache too (a container whose limit counts it); otherwise they stay cached while memory is free."""
        self.weights = prepared.parent / WEIGHTS
        self.evict = evict
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        # before the session maps the file: making it touches some pages, which faults would read in
        with open(self.weights, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as whole:
            address = np.frombuffer(whole, np.uint8).ctypes.data
            self._cache_by_read(Range(address, address + len(whole), 0))
        # Only the mappings this session makes: another session of the same file (another pipeline's,
        # perhaps closed) maps it elsewhere, and its pages are not this stage's to touch or drop.
        # Sessions are made one at a time, so no other mapping of the file appears in between.
        before = set(_mapped_ranges(self.weights))
        # the graph is already optimized for this machine: optimizing again would only cost time
        # it streams; its passes take turns with the other stages': one arena for all (sessions.py)
        self.session = make_session(prepared, providers, threads, optimize=False, spin=False, shared_arena=True)
        self.ranges = [r for r in _mapped_ranges(self.weights) if r not in before]
        if not self.ranges:
            raise RuntimeError(f"onnxruntime did not map {self.weights}: its pages could not be released")

    def fetch(self) -> ort.InferenceSession:
        # One call per mapping maps every page, reading what the cache lacks (Linux 5.14+). At half the
        # reference target's weights this decodes 28.5-29 tokens/s against 22-25 for asking the cache
        # first (mincore) and faulting page by page (history.md §24); older kernels refuse the advice.
        if all(self.libc.madvise(r.low, r.high - r.low, MADV_POPULATE_READ) == 0 for r in self.ranges):
            return self.session
        for r in self.ranges:
            self._cache_by_read(r)
            pages = np.frombuffer((ctypes.c_uint8 * (r.high - r.low)).from_address(r.low), np.uint8)
            int(pages[:: mmap.PAGESIZE].max())  # one byte per page: the kernel maps them all in now
        return self.session

    def release(self) -> None:
        for r in self.ranges:
            if self.libc.madvise(r.low, r.high - r.low, mmap.MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), f"cannot release the pages of {self.weights}")
        if self.evict:  # the whole file: the cache holds it in folios that cross the mappings' edges
            with open(self.weights, "rb") as file:
                os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    def _cache_by_read(self, r: Range, chunk: int = 8 << 20) -> None:
        """Reads the file's bytes behind `r` unless the page cache holds all of them (mincore says)."""
        residency = np.empty(-(-(r.high - r.low) // mmap.PAGESIZE), np.uint8)
        if self.libc.mincore(r.low, r.high - r.low, residency.ctypes.data) != 0:
            raise OSError(ctypes.get_errno(), f"cannot ask which pages of {self.weights} are cached")
        if (residency & 1).all():
            return
        scratch = bytearray(min(chunk, r.high - r.low))
        with open(self.weights, "rb", buffering=0) as file:
            file.seek(r.offset)
            for _ in range(0, r.high - r.low, chunk):
                file.readinto(scratch)


if __name__ == "__main__":  # the child `prepare` starts: ROOT GRAPH CHECKSUM [GRAPH CHECKSUM ...]
    root, pairs = Path(sys.argv[1]), sys.argv[2:]
    for graph, checksum in zip(pairs[::2], pairs[1::2]):
        _prepare_one(Path(graph), checksum, root)
