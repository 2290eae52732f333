"""The target as distill's data engine: its quantized ONNX graph, the weights a bundle's target runs,
over many independent sequences per pass.

Training data is worth most when it is what the deployed target does: its greedy answers, its top-k,
and (for a feature-reading draft) the hidden states its graph hands the draft at run time. So the
engine quantizes the target as the default bundle does (`data_policy`) and runs it on onnxruntime's
fused CPU operators, in a graph built for independent sequences (exporters/llama.py, `sequences`):

- `answers`: greedy continuations of many prompts, `slots` of them at a time in one KV buffer per layer;
  a slot whose answer ends takes the next prompt at once (continuous batching), across shards, so
  every step runs `slots` rows of matmuls instead of one.
- `teacher_forced` and `features`: one prefill pass per sequence (hundreds of rows: already matmul-bound).

The data has the layout data.py documents, whichever engine made it.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
from edgespec.exporters.architectures import builder_for
from edgespec.exporters.bundle_writer import save_graph
from edgespec.quant.schemes import HEAD_INT8_POLICY, QuantPolicy, QuantScheme
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.facts import ModelFacts
from edgespec.runtime.contract.graph import FEATURES_OUT
from edgespec.runtime.execution.sessions import make_session

DATA_QUANTS = ("int4", "int8", "fp32")
FACTS_FILE = "facts.json"  # written last: its presence says the graph is complete
FEATURE_WIDTH = "feature_width"  # beside the facts: how wide the graph's features_out is


def data_policy(quant: str) -> QuantPolicy:
    """The default bundle's weights for int4 (exact per-block offsets, the head in int8: defaults.py);
    int8 and fp32 as `export --quant` writes them."""
    if quant not in DATA_QUANTS:
        raise ExportError(f"--data-quant takes {', '.join(DATA_QUANTS)} (got {quant!r})")
    if quant == "int4":
        return QuantPolicy.load(HEAD_INT8_POLICY, QuantScheme("int4", symmetric=False))
    return QuantPolicy(QuantScheme(quant))


def engine_graph(model, folder: Path, quant: str, context: int, taps=None) -> tuple[Path, ModelFacts]:
    """The target's `sequences` graph, quantized by `data_policy(quant)`, as folder/target.onnx with its
    facts beside it (`engine_feature_width`: how wide its features are); it also returns the final hidden states (a
    feature-reading draft learns from them), or with `taps` (exporters/eagle3.py: FeatureTaps without fc)
    those residual streams concatenated (an EAGLE-3 head learns its fc over them).
    Written once, whole or not at all: a folder that holds it already is read, not rewritten."""
    if not (folder / FACTS_FILE).is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        builder = builder_for(model, context, features_out=True, feature_taps=taps)
        save_graph(partial, "target", builder, data_policy(quant), parts=dict(sequences=True))
        width = builder.facts.hidden_size if taps is None else taps.width(builder.facts.hidden_size)
        (partial / FACTS_FILE).write_text(json.dumps({**builder.facts.to_dict(), FEATURE_WIDTH: width}))
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)
    saved = json.loads((folder / FACTS_FILE).read_text())
    saved.pop(FEATURE_WIDTH, None)
    return folder / "target.onnx", ModelFacts.from_dict(saved)


def engine_feature_width(graph: Path) -> int:
    """How wide the features of an `engine_graph` graph are (an engine from before EAGLE-3 heads: the final
    hidden states)."""
    saved = json.loads((graph.parent / FACTS_FILE).read_text())
    return int(saved.get(FEATURE_WIDTH, saved["hidden_size"]))


def top_k_logp(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely ids of each row, most likely first, with their full-vocabulary log-probabilities."""
    peak = logits.max(axis=1, keepdims=True)
    log_total = peak + np.log(np.exp(logits - peak).sum(axis=1, keepdims=True))
    ids = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    values = np.take_along_axis(logits, ids, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    # the greedy token first even on a tie: it is the token the answer continues with
    top = logits.argmax(axis=1)
    tied = ids[:, 0] != top
    if tied.any():
        ids[tied, 0], values[tied, 0] = top[tied], logits[tied, top[tied]]
    return ids.astype(np.int32), (values - log_total).astype(np.float32)


class SequenceEngine:
    """KV buffers for `slots` sequences of up to `capacity` tokens, bound once per layout (all slots
    for a decoding step, one slot for a prefill)."""

    def __init__(self, session: ort.InferenceSession, facts: ModelFacts, slots: int, capacity: int,
                 feature_width: int | None = None):
        self.session, self.facts, self.slots, self.capacity = session, facts, slots, capacity
        self.feature_width = facts.hidden_size if feature_width is None else feature_width
        self.kv = np.zeros((facts.num_layers, 2, slots, facts.num_kv_heads, capacity, facts.head_dim), np.float32)
        self._bindings: dict[int | None, ort.IOBinding] = {}

    def _binding(self, slot: int | None) -> ort.IOBinding:
        if slot not in self._bindings:
            binding = self.session.io_binding()
            for layer in range(self.facts.num_layers):
                for kind, name in enumerate(("key", "value")):
                    buffer = self.kv[layer, kind] if slot is None else self.kv[layer, kind, slot:slot + 1]
                    value = ort.OrtValue.ortvalue_from_numpy(buffer)  # a view: the op writes the slot in place
                    binding.bind_ortvalue_input(f"past_{name}_{layer}", value)
                    binding.bind_ortvalue_output(f"present_{name}_{layer}", value)
            self._bindings[slot] = binding
        return self._bindings[slot]

    def run(self, ids: np.ndarray, past: np.ndarray, logit_rows: np.ndarray, slot: int | None = None,
            features: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """S new tokens `ids` [B, S] of B sequences after `past` [B] cached tokens each: every slot
        (slot None, B = slots) or one slot (B = 1). Returns logits [R, V] of `logit_rows` (indices into
        the B * S tokens, batch-major) and, with `features`, the graph's features [B * S, feature width]."""
        batch, new = ids.shape
        if int(past.max()) + new > self.capacity:
            raise ExportError(f"a sequence of {int(past.max()) + new} tokens does not fit the engine's "
                              f"{self.capacity}-token buffers")
        binding = self._binding(slot)
        positions = past[:, None] + np.arange(new)[None, :]
        feed = {"input_ids": np.ascontiguousarray(ids.reshape(1, -1), dtype=np.int64),
                "position_ids": positions.astype(np.int64),
                "seqlens_k": (past + new - 1).astype(np.int32),
                "total_sequence_length": np.array(int(past.max()) + new, np.int32),
                "logit_rows": np.asarray(logit_rows, np.int64)}
        for name, value in feed.items():
            binding.bind_cpu_input(name, value)
        logits = np.empty((len(feed["logit_rows"]), self.facts.vocab_size), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, [1, *logits.shape], logits.ctypes.data)
        hidden = np.empty((batch * new, self.feature_width), np.float32)
        if features:
            binding.bind_output(FEATURES_OUT, "cpu", 0, np.float32, [1, *hidden.shape], hidden.ctypes.data)
        else:  # onnxruntime allocates it; nothing reads it
            binding.bind_output(FEATURES_OUT, "cpu")
        self.session.run_with_iobinding(binding)
        return logits, hidden if features else None


class OnnxTarget:
    """data.py's target operations on a SequenceEngine graph (see the module's docstring)."""

    def __init__(self, graph: Path, facts: ModelFacts, slots: int, threads: int, feature_width: int | None = None):
        self.session = make_session(graph, ("CPUExecutionProvider",), threads)
        self.facts, self.slots = facts, slots
        self.feature_width = facts.hidden_size if feature_width is None else feature_width
        self._engine_now: SequenceEngine | None = None

    def _engine(self, capacity: int) -> SequenceEngine:
        """The buffers, kept while they are long enough: binding them is a pass's worth of work."""
        if self._engine_now is None or self._engine_now.capacity < capacity:
            self._engine_now = None  # the old buffers go before the new ones come
            self._engine_now = SequenceEngine(self.session, self.facts, self.slots, capacity, self.feature_width)
        return self._engine_now

    def answers(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: set[int],
                admit=lambda index: True):
        """Greedy continuations of `prompts`, each with its top-k at every generated token, yielded as
        (index, (tokens, first supervised position, top-k ids, top-k log-probabilities)) as they end, in
        about the prompts' order. A prompt starts only while `admit(index)` says so; then what has started
        finishes. One stream over many shards keeps every slot busy: shard by shard, a third of the
        slots' rows went idle while a shard's last answers ran out."""
        engine = self._engine(max(len(p) for p in prompts) + max_new_tokens)
        waiting = list(range(len(prompts)))[::-1]
        finished: list[tuple[int, tuple]] = []
        slot_of: list[int | None] = [None] * engine.slots  # the prompt index each slot answers
        made = [[] for _ in range(engine.slots)]  # per slot: (token, top-k ids, top-k logp) so far
        past = np.zeros(engine.slots, np.int64)

        def record(slot: int, ids: np.ndarray, logp: np.ndarray) -> None:
            index, token = slot_of[slot], int(ids[0])
            made[slot].append((token, ids, logp))
            if token in eos_ids or len(made[slot]) == max_new_tokens:  # the end of turn is supervised too
                prompt = prompts[index]
                finished.append((index, (np.array(prompt + [t for t, _, _ in made[slot]]), len(prompt),
                                         np.stack([i for _, i, _ in made[slot]]),
                                         np.stack([p for _, _, p in made[slot]]))))
                start(slot)

        def start(slot: int) -> None:
            slot_of[slot], made[slot], past[slot] = None, [], 0
            if not waiting or not admit(waiting[-1]):
                waiting.clear()
                return
            index = waiting.pop()
            prompt = np.array(prompts[index], np.int64)
            slot_of[slot] = index
            logits, _ = engine.run(prompt[None, :], np.zeros(1, np.int64), [len(prompt) - 1], slot=slot)
            past[slot] = len(prompt)
            ids, logp = top_k_logp(logits, top_k)
            record(slot, ids[0], logp[0])

        for slot in range(engine.slots):
            start(slot)
        while any(index is not None for index in slot_of):
            yield from finished
            finished.clear()
            # an idle slot runs a dummy token at position 0: cheaper than a graph per batch size
            last = np.array([[made[s][-1][0] if slot_of[s] is not None else 0] for s in range(engine.slots)])
            feed_past = np.where([index is not None for index in slot_of], past, 0)
            logits, _ = engine.run(last, feed_past, np.arange(engine.slots))
            past += 1
            ids, logp = top_k_logp(logits, top_k)
            for slot in range(engine.slots):
                if slot_of[slot] is not None:
                    record(slot, ids[slot], logp[slot])
        yield from finished

    def teacher_forced(self, rows: list[np.ndarray], top_k: int) -> list:
        """The target's top-k at every position of each token row but the last (position j predicts token
        j + 1), one prefill pass per row."""
        engine = self._engine(max(len(r) for r in rows))
        out = []
        for row in rows:
            logits, _ = engine.run(np.asarray(row, np.int64)[None, :], np.zeros(1, np.int64),
                                   np.arange(len(row) - 1), slot=0)
            ids, logp = top_k_logp(logits, top_k)
            out.append((np.asarray(row), 1, ids, logp))
        return out

    def features(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """The graph's features [len, feature width] at every token of each row, one prefill pass per row."""
        engine = self._engine(max(len(r) for r in rows))
        return [engine.run(np.asarray(row, np.int64)[None, :], np.zeros(1, np.int64), [len(row) - 1], slot=0,
                           features=True)[1] for row in rows]
