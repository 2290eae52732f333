"""A caller-owned KV cache: one preallocated buffer per model that the graph writes in place.

Layout [layers, 2 (key/value), lanes, kv_heads, rows + KV_SLACK, head_dim]: `data[l, 0]` is the
contiguous buffer, viewed as [1, lanes * kv_heads, rows, head_dim], that onnxruntime's
GroupQueryAttention takes as both past and present key of layer l (exporters/llama.py). It reads the
valid prefix only and writes a pass's new rows after it, so nothing is copied per step. Rollback is a
pointer move.

The buffer grows with the conversation, doubling up to `capacity` (`reserve`, which the pass layout
calls): onnxruntime's attention writes the whole buffer on a pass with no past (measured: a 2048-token
cache became resident on the first prefill), so a cache allocated whole would cost its full size at
once. Growing copies the valid rows, a few times per conversation, and rebinds.

Lanes: a tree pass gives each root-to-leaf path a lane of its own (exact rows, runtime/execution/model.py); a
cache has as many lanes as the graph it serves was exported with.
Between passes every lane holds the same committed rows; `commit` copies the accepted path's rows
from the lane that computed them to the others. The cache owns exactly one number, `length`: how many
rows (tokens) are valid in every lane. Rows past it hold whatever the last pass wrote there.

A cache may also keep one feature row per token ([capacity, feature_size]): the model's final hidden
state there, which a draft that reads the target's features (EAGLE-style) consumes. Features follow
their token through commit, trim and evict, so they always describe the cached rows.

The cache also memoizes, per onnxruntime session, an IOBinding with its buffers bound (`binding`):
binding sixty buffers costs more than some passes' arithmetic. The pass's other inputs stay bound to
arrays of their own, written in place while their shape holds (`BoundSession.bind`): a plain step binds
nothing. Growing the buffer forgets them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from ..contract.errors import ContextOverflowError, InputError
from ..contract.facts import ModelFacts
from ..contract.graph import KV_SLACK

INITIAL_ROWS = 256  # rows first allocated; `reserve` doubles them as the conversation grows


@dataclass
class BoundSession:
    """An IOBinding of one session with a cache's buffers bound, and what its other inputs are bound to."""
    binding: ort.IOBinding
    inputs: tuple[str, ...]  # the session's inputs besides the KV buffers, which the caller binds per pass
    held: dict[str, np.ndarray] = field(default_factory=dict)  # the array each input is bound to

    def bind(self, name: str, value: np.ndarray) -> None:
        """Binds input `name` to `value`'s contents: written into the array bound before when the shape and type
        are the same (a one-token step's every input, step after step), else bound to a copy of its own. After
        onnxruntime has evicted the caches, a new OrtValue and its binding cost Python time every pass (history.md §55)."""
        held = self.held.get(name)
        if held is not None and held.shape == value.shape and held.dtype == value.dtype:
            held[...] = value
            return
        held = np.array(value, order="C")  # the OrtValue reads this memory, not a copy of it, on every run
        self.binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(held))
        self.held[name] = held


def kv_input_layers(names) -> list[int]:
    """The layers whose KV buffers a graph with these input names reads."""
    return sorted(int(name[len("past_key_"):]) for name in names if name.startswith("past_key_"))


def rotated_back(keys: np.ndarray, count: int, rope_frequencies) -> np.ndarray:
    """`keys` [..., rows, head_dim] with their rotary embedding turned back by `count` positions (a new array)."""
    freqs = np.asarray(rope_frequencies, dtype=np.float64)
    cos = np.cos(-count * freqs).astype(np.float32)
    sin = np.sin(-count * freqs).astype(np.float32)
    half = len(freqs)
    first, second = keys[..., :half], keys[..., half:]
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class KVCache:
    def __init__(self, facts: ModelFacts, capacity: int, feature_size: int = 0, lanes: int = 1,
                 initial_rows: int = INITIAL_ROWS, slack: int = KV_SLACK):
        """`slack`: rows past the capacity a pass may write (its padding); a static-shape graph's buffer
        is allocated whole (`initial_rows` = capacity) with its node count as slack."""
        if lanes < 1:
            raise InputError(f"a KV cache needs at least one lane (got {lanes})")
        self.capacity = capacity
        self.lanes = lanes
        self.slack = slack
        self.data = np.zeros((facts.num_layers, 2, lanes, facts.num_kv_heads, min(capacity, initial_rows) + slack,
                              facts.head_dim), np.float32)
        self.features = np.zeros((capacity, feature_size), np.float32) if feature_size else None
        self.length = 0
        self._bindings: dict[int, tuple[weakref.ref, BoundSession]] = {}

    def feature_rows(self) -> np.ndarray | None:
        """The features of the valid rows [length, feature_size], or None for a cache without them."""
        return None if self.features is None else self.features[: self.length]

    def room(self) -> int:
        return self.capacity - self.length

    def _grown_rows(self, rows: int) -> int | None:
        """The buffer's rows (slack included) once it holds `rows`, or None where it needs no growing."""
        held = self.data.shape[4] - self.slack
        if rows <= held or held >= self.capacity:  # the whole context held: the slack takes the rest
            return None
        return min(self.capacity, max(rows, 2 * held)) + self.slack

    def held_bytes(self, rows: int = 0) -> int:
        """Bytes this cache holds, and at most while it grows to hold `rows` rows: the old buffer and the
        new one both, until the copy is done."""
        grown = self._grown_rows(rows)
        extra = 0 if grown is None else self.data.nbytes // self.data.shape[4] * grown
        return self.data.nbytes + extra + (0 if self.features is None else self.features.nbytes)

    def reserve(self, rows: int) -> None:
        """Makes the buffer hold `rows` rows (a pass writes up to `slack` past the capacity): doubles it,
        keeping the valid rows of every lane, and forgets the bindings of the old one."""
        if rows > self.capacity + self.slack:
            raise ContextOverflowError(f"the KV cache holds {self.capacity} tokens; {rows} were needed")
        grown_rows = self._grown_rows(rows)
        if grown_rows is None:
            return
        shape = list(self.data.shape)
        shape[4] = grown_rows
        grown = np.zeros(shape, np.float32)
        grown[:, :, :, :, : self.length] = self.data[:, :, :, :, : self.length]
        self.data, self._bindings = grown, {}

    def binding(self, session: ort.InferenceSession) -> BoundSession:
        """An IOBinding of `session` with the buffers of every layer it reads bound as its past and
        present keys/values, with the names of its other inputs, which the caller binds per pass."""
        key = id(session)
        known = self._bindings.get(key)
        if known is not None and known[0]() is session:
            return known[1]
        binding = session.io_binding()
        names = [i.name for i in session.get_inputs()]
        layers = kv_input_layers(names)
        others = tuple(name for name in names if not name.startswith(("past_key_", "past_value_")))
        shape = self.data.shape
        for layer in layers:
            for kind, name in ((0, "key"), (1, "value")):
                buffer = self.data[layer, kind].reshape(1, shape[2] * shape[3], shape[4], shape[5])
                value = ort.OrtValue.ortvalue_from_numpy(buffer)
                binding.bind_ortvalue_input(f"past_{name}_{layer}", value)
                binding.bind_ortvalue_output(f"present_{name}_{layer}", value)
        # a streamed stage makes a new session per fetch: forget bindings of sessions that are gone
        self._bindings = {k: v for k, v in self._bindings.items() if v[0]() is not None}
        bound = BoundSession(binding, others)
        self._bindings[key] = (weakref.ref(session), bound)
        return bound

    def commit(self, lane: int, count: int, features: np.ndarray | None = None) -> None:
        """Keeps the first `count` rows a pass wrote into `lane` after the valid ones, in every lane, with
        their `features` [count, feature_size] when the cache keeps features.

        After a tree pass, the rows are the accepted path, which sits at the start of its lane."""
        end = self.length + count
        if end > self.capacity:
            raise ContextOverflowError(f"the KV cache holds {self.capacity} tokens; {end} were needed")
        if self.features is not None:
            if features is None:
                raise InputError("this cache keeps features, but the pass returned none")
            self.features[self.length : end] = features
        if self.lanes > 1 and count:
            written = self.data[:, :, lane : lane + 1, :, self.length : end]
            others = [b for b in range(self.lanes) if b != lane]
            self.data[:, :, others, :, self.length : end] = written
        self.length = end

    def evict(self, start: int, count: int, rope_frequencies) -> None:
        """Forgets rows [start, start + count) and moves the later rows down by `count`. Their keys carry
        rotary position embeddings, so they are rotated back by `count` positions: every row's position
        stays its index, as the graphs assume (StreamingLLM's positions within the cache)."""
        if not (0 <= start and count > 0 and start + count <= self.length):
            raise InputError(f"cannot evict rows {start}..{start + count} of a cache of {self.length}")
        moved = slice(start + count, self.length)
        kept = slice(start, self.length - count)
        self.data[:, 0, :, :, kept] = rotated_back(self.data[:, 0, :, :, moved], count, rope_frequencies)
        self.data[:, 1, :, :, kept] = self.data[:, 1, :, :, moved].copy()
        if self.features is not None:
            self.features[kept] = self.features[moved].copy()
        self.length -= count

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Keys and values of rows start..stop-1 (lane 0) [layers, 2, kv_heads, rows, head_dim]: for checks."""
        return self.data[:, :, 0, :, start:stop]

    def trim(self, length: int) -> None:
        """Forgets every row from `length` on."""
        if not 0 <= length <= self.length:
            raise InputError(f"cannot trim a cache of {self.length} rows to {length}")
        self.length = length
