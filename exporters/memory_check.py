"""Whether an export fits in this machine's memory, said before it starts.

A process the kernel kills for memory is the one failure a user cannot read, so the export estimates its
peak from the model's body and the recipe (the streamed writer holds one layer's float32 weights a few
times over; the quality report and the exactness check then hold the quantized graph in onnxruntime,
which packs its weights, and the float32 reference one matrix and a sample's logits)
and compares it with the memory available now.
"""
from __future__ import annotations

import os
from pathlib import Path

from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.facts import ModelFacts

from .check_target import CHECKS

GiB = 1 << 30
# python with torch, transformers and onnxruntime loaded, and the tokenizer (measured, history.md §78)
BASE_BYTES = 0.9 * GiB
BITS = {"fp32": 32, "fp16": 16, "int8": 8.5, "int4": 4.5}  # with the block scales
MEMINFO = Path("/proc/meminfo")


def estimated_peak(facts: ModelFacts, scheme: str, reference_rows: int = 512) -> int:
    """Bytes the export's peak needs: the larger of writing (a layer's or the vocabulary table's float32
    weights, three copies while they are quantized) and checking (the quantized graph as onnxruntime holds
    it, or the window of it they stream (exporters/check_target.py), the checks' caches, the reference's
    largest matrix and its logits)."""
    table = facts.vocab_size * facts.hidden_size
    largest = max(facts.layer_parameters(), table)
    writing = 3 * 4 * largest + (4 * table if facts.tie_word_embeddings else 0)
    parameters = facts.num_layers * facts.layer_parameters() + table * (1 if facts.tie_word_embeddings else 2)
    quantized = parameters * BITS.get(scheme, 32) / 8
    kv = 2 * facts.num_layers * facts.num_kv_heads * facts.head_dim * 4 * reference_rows  # the checks' short caches
    held = quantized if quantized <= CHECKS.stream_above else CHECKS.resident_bytes + 2 * CHECKS.stage_bytes
    # onnxruntime's packed blocks add about a quarter to the quantized weights (measured at 1B and 3B, §78)
    checking = 1.25 * held + kv + 4 * largest + 8 * reference_rows * facts.vocab_size
    return int(BASE_BYTES + max(writing, checking))


def available_bytes() -> int | None:
    """Memory the system can give now without swapping (Linux's MemAvailable, else the free pages); None
    where neither is known."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such name on this system
        return None


def check_memory(facts: ModelFacts, scheme: str, say) -> None:
    """Refuses an export that would not fit in the memory available, before any weight is read."""
    needed, available = estimated_peak(facts, scheme), available_bytes()
    if available is None:
        say(f"this export needs about {needed / GiB:.1f} GiB of memory (how much is free here is unknown)")
        return
    if needed > available:
        raise ExportError(f"this export needs about {needed / GiB:.1f} GiB of memory and {available / GiB:.1f} GiB "
                          "is available: close other programs, pass a smaller --context, or export on a machine "
                          "with more memory")
    say(f"memory: about {needed / GiB:.1f} GiB needed, {available / GiB:.1f} GiB available")
