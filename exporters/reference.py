"""The float32 reference a quality report compares a quantized graph with, computed a stage at a time.

A model's float32 graph is as large as its checkpoint in float32 (4 bytes a parameter): at 1B-8B it
does not fit beside the export. So the reference runs layer-major: its stages (the embedding, groups of
layers, the head: exporters/bundle_writer.py's stage_plan) are written one at a time to a scratch
folder, each run over every sequence, chunk by chunk with its own rows of each sequence's KV cache, and
removed before the next. Between stages only each sequence's residual stream is kept ([tokens, hidden]
twice). Every row is teacher-forced: what the report needs of the reference is each row's choice, the
log-probability of the next token and, for a draft that reads them, the final hidden states.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.contract.graph import FEATURES_OUT, MIN_ROWS, GraphSignature
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import pass_feed, run_bound
from edgespec.runtime.execution.sessions import make_session

from .bundle_writer import save_graph, stage_plan
from .llama import LlamaBuilder

STAGE_BYTES = 512 << 20  # float32 weights of one stage at most (a layer more where one layer is larger)
CHUNK = 64


@dataclass(frozen=True)
class ReferenceRows:
    """Per row of a sequence: the reference's choice (argmax), the log-probability it gives the next token
    (the last row's is NaN), and the final hidden states where asked for."""
    argmax: np.ndarray  # [T] int64
    next_log_prob: np.ndarray  # [T] float64
    features: np.ndarray | None = None  # [T, hidden]


def stage_groups(builder: LlamaBuilder) -> int:
    """Groups of layers such that each group's float32 weights stay near STAGE_BYTES."""
    f = builder.facts
    attention = f.hidden_size * f.head_dim * (2 * f.num_heads + 2 * f.num_kv_heads)
    layer_bytes = 4 * (attention + 3 * f.hidden_size * f.intermediate_size)
    return max(1, min(f.num_layers, math.ceil(f.num_layers * layer_bytes / STAGE_BYTES)))


def reference_rows(builder: LlamaBuilder, sequences: list[list[int]], scratch: Path, threads: int,
                   features: bool = False) -> list[ReferenceRows]:
    """The float32 model's rows over `sequences`, stage by stage (the module's docstring). `features`: keep
    the final hidden states (the graph must return them: a builder with features_out)."""
    f = builder.facts
    signature = GraphSignature.every_input(f, builder.lanes)
    caches = [KVCache(f, len(ids) + MIN_ROWS, lanes=builder.lanes) for ids in sequences]
    streams = [{"hidden": None, "branch": None} for _ in sequences]
    found: list[dict] = [{} for _ in sequences]
    for i, (layers, embed, head) in enumerate(stage_plan(f.num_layers, stage_groups(builder))):
        folder = scratch / f"stage{i}"
        folder.mkdir(parents=True)
        save_graph(folder, "reference", builder, QuantPolicy(), dict(layers=layers, embed=embed, head=head),
                   strict=False)
        session = make_session(folder / "reference.onnx", ("CPUExecutionProvider",), threads)
        outputs = {o.name for o in session.get_outputs() if not o.name.startswith("present_")}
        for ids, cache, stream, rows in zip(sequences, caches, streams, found):
            cache.trim(0)
            produced = {name: [] for name in outputs}
            for start in range(0, len(ids), CHUNK):
                part = ids[start : start + CHUNK]
                n = len(part)
                layout = pass_feed(cache, signature, part, range(start, start + n), np.tril(np.ones((n, n), bool)),
                                   range(n), min_rows=MIN_ROWS)
                feed, width = dict(layout.feed), layout.feed["input_ids"].shape[1]
                for key, held in stream.items():
                    if held is not None:
                        feed[key] = np.zeros((1, width, f.hidden_size), np.float32)
                        feed[key][0, :n] = held[start : start + n]
                sizes = {"logits": (len(feed["logit_rows"]), f.vocab_size)}
                values = run_bound(session, cache, feed, {o: sizes.get(o, (width, f.hidden_size)) for o in outputs})
                cache.commit(0, n)
                for name, value in values.items():
                    produced[name].append(value[:n] if name != "logits" else _row_summary(value[:n], ids, start))
            for key in ("hidden", "branch"):
                if f"{key}_out" in produced:
                    stream[key] = np.concatenate(produced[f"{key}_out"])
            if "logits" in produced:
                rows["argmax"] = np.concatenate([p[0] for p in produced["logits"]])
                rows["next_log_prob"] = np.concatenate([p[1] for p in produced["logits"]])
                if features:
                    rows["features"] = np.concatenate(produced[FEATURES_OUT])
        del session
        shutil.rmtree(folder)
    return [ReferenceRows(**rows) for rows in found]


def _row_summary(logits: np.ndarray, ids: list[int], start: int) -> tuple[np.ndarray, np.ndarray]:
    """(argmax, log-probability of the next token) of each row of a chunk, so no [T, vocab] array is kept."""
    logits = logits.astype(np.float64)
    choice = np.argmax(logits, axis=-1)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=-1))
    following = np.asarray(ids[start + 1 : start + 1 + len(logits)], np.int64)
    log_prob = np.full(len(logits), np.nan)
    log_prob[: len(following)] = shifted[np.arange(len(following)), following] - log_norm[: len(following)]
    return choice, log_prob
