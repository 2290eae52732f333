"""The slots graph (exporters/slots.py, runtime/execution/slots.py): several conversations in one target pass,
each slot's logits and KV rows bit-identical to what the single graph computes for that conversation alone,
at different lengths and row counts (prefill chunks, one-token steps, trees), with an empty slot."""
import numpy as np
import pytest
from edgespec.exporters.architectures import builder_for
from edgespec.exporters.bundle_writer import save_graph
from edgespec.quant.schemes import HEAD_INT8_POLICY, QuantPolicy, QuantScheme
from edgespec.runtime.contract.errors import ExportError, InputError
from edgespec.runtime.execution.model import ModelRunner, commit
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.execution.slots import SlotRunner

SLOTS = 3


def graphs(models, folder, lanes: int, quant: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"]).float().eval()
    builder = builder_for(model, 128, lanes=lanes, exact_passes=True)
    policy = QuantPolicy(QuantScheme()) if quant == "fp32" else \
        QuantPolicy.load(HEAD_INT8_POLICY, QuantScheme(name="int4", symmetric=False))
    save_graph(folder, "single", builder, policy)
    save_graph(folder, "slots", builder, policy, parts=dict(slots=SLOTS))
    single = ModelRunner(make_session(folder / "single.onnx", ("CPUExecutionProvider",), 1), builder.facts)
    return single, SlotRunner(make_session(folder / "slots.onnx", ("CPUExecutionProvider",), 1), single), builder


def chain(n):
    return np.tril(np.ones((n, n), dtype=bool))


def fork():
    """A root and two children: two root-to-leaf paths (two lanes)."""
    return np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=bool)


def passes(lanes: int):
    """Per shared pass, each conversation's (tokens, tree mask, logit rows, rows kept), or None: not in it."""
    rng = np.random.default_rng(7)
    tokens = lambda n: rng.integers(3, 300, n).tolist()
    tree = (tokens(3), fork(), [0, 1, 2], [0, 2]) if lanes > 1 else (tokens(3), chain(3), [0, 1, 2], [0, 1])
    return [
        [(tokens(16), chain(16), [15], range(16)), (tokens(5), chain(5), [4], range(5)), None],
        [(tokens(21), chain(21), [20], range(21)), None, (tokens(1), chain(1), [0], [0])],
        [(tokens(1), chain(1), [0], [0]), tree, (tokens(9), chain(9), [8], range(9))],
        [None, (tokens(1), chain(1), [0], [0]), (tokens(1), chain(1), [0], [0])],
        [(tokens(2), chain(2), [0, 1], [0, 1]), (tokens(1), chain(1), [0], [0]), None],
    ]


@pytest.mark.parametrize("lanes,quant", [(1, "fp32"), (2, "fp32"), (2, "int4")])
def test_each_slot_has_the_bits_of_its_conversation_alone(models, tmp_path, lanes, quant):
    single, slots, _ = graphs(models, tmp_path, lanes, quant)
    alone = [single.new_cache(128) for _ in range(SLOTS)]
    shared = [single.new_cache(128) for _ in range(SLOTS)]
    for step, members in enumerate(passes(lanes)):
        parts, expected, order = [], [], []
        # conversation i sits in a slot that moves between passes: slots are not conversations
        for i in (range(SLOTS) if step % 2 == 0 else reversed(range(SLOTS))):
            if members[i] is None:
                continue
            ids, mask, rows, _ = members[i]
            positions = alone[i].length + np.arange(len(ids))
            expected.append(single.forward(alone[i], ids, positions, mask, rows))
            parts.append(slots.layout(shared[i], ids, positions, mask, rows))
            order.append(i)
        got = slots.run(parts)
        for i, mine, theirs in zip(order, got, expected):
            assert np.array_equal(mine.logits, theirs.logits), (step, i)
            assert np.array_equal(mine.path_nodes, theirs.path_nodes)
            kept = members[i][3]
            commit(alone[i], theirs, kept)
            commit(shared[i], mine, kept)
            assert shared[i].length == alone[i].length
            valid = alone[i].length
            assert np.array_equal(shared[i].data[..., :valid, :], alone[i].data[..., :valid, :]), (step, i)
    assert all(c.length > 0 for c in shared)


def test_a_pass_needs_between_one_and_the_graphs_slots_of_distinct_conversations(models, tmp_path):
    single, slots, _ = graphs(models, tmp_path, 1, "fp32")
    cache = single.new_cache(64)
    part = slots.layout(cache, [5, 6], [0, 1], chain(2), [1])
    with pytest.raises(InputError, match="one slot"):
        slots.run([part, part])
    with pytest.raises(InputError, match="conversations in one pass"):
        slots.run([])


def test_only_a_targets_exact_graph_takes_slots(models):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(models["target"]).float().eval()
    with pytest.raises(ExportError, match="only a target's graph"):
        builder_for(model, 64).build("draft_slots", slots=2)
