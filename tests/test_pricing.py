"""The step controller's pricing (runtime/decoding/pricing.py, controller.py): given pass costs and acceptance it
takes plain steps where speculation is priced to lose and speculates where it pays; a ledger that finds
speculation losing makes steps plain, with no source asked, and probes now and then; output stays plain's."""
import numpy as np
import pytest
from edgespec.runtime.contract.drafting import SuffixConfig
from edgespec.runtime.decoding.controller import Controller, DecayedMean, Measurements
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.pricing import LEDGER_EVIDENCE, PROBE_FIRST, Ledger, Price, Probes, choose
from edgespec.runtime.decoding.suffix import SuffixDrafter
from edgespec.runtime.pipeline import Pipeline
from test_suffix import FixedCosts, FixedDrafter, step


def test_the_choice_is_plain_unless_speculation_beats_it_by_the_margin():
    plain = Price(1.0, 0.010)
    assert choose({"plain": plain, "draft": Price(1.3, 0.014)}, 0.02) == "plain"  # 92.9 against 100 tokens/s
    assert choose({"plain": plain, "draft": Price(1.5, 0.014)}, 0.02) == "draft"  # 107 against 100
    assert choose({"plain": plain, "draft": Price(1.41, 0.014)}, 0.02) == "plain"  # 100.7: within the margin
    assert choose({"plain": plain, "suffix": Price(3.0, 0.020), "draft": Price(1.5, 0.014)}, 0.02) == "suffix"


def priced(acceptance: float, draft_s: float, one_row: float = 0.010, per_row: float = 0.002) -> Controller:
    """A controller with a one-token chain draft whose measured tokens per pass are 1 + `acceptance` and whose
    drafting takes `draft_s` a step, on passes of `one_row` seconds plus `per_row` a row."""
    measured = Measurements.fresh(2)
    measured.costs = FixedCosts(one_row, per_row)
    measured.main_tokens = DecayedMean((1,), prior=1.0 + acceptance, weight=1000.0)
    measured.main_draft.record(1, draft_s)
    measured.main_draft.record(2, 2 * draft_s)
    return Controller(None, FixedDrafter([3]), lanes=1, measured=measured)


@pytest.mark.parametrize("acceptance,draft_s,speculates", [
    (0.41, 0.0014, False),  # §53's default bundle on chat: 1.41 tokens for 1.40 passes' time, within the margin
    (0.20, 0.0010, False),  # a draft that agrees less than its cost
    (0.80, 0.0014, True),  # 1.8 tokens for 1.45 passes' time
    (0.41, 0.0001, True),  # drafting nearly free and a cheap row: 1.41 for 1.21
])
def test_a_draft_is_verified_only_where_its_price_pays(acceptance, draft_s, speculates):
    controller = priced(acceptance, draft_s)
    assert (step(controller, [5, 6, 7], [3, 4]).size == 2) == speculates


def test_rows_that_cost_too_much_make_even_a_good_draft_plain():
    controller = priced(0.8, 0.0005, per_row=0.012)  # a second row costs more than a one-row pass
    assert step(controller, [5, 6, 7], [3, 4]).size == 1


def test_the_ledger_counts_what_speculation_gained_over_plain_steps():
    ledger = Ledger(floor=-1.0, decay=1.0, evidence=4)
    for _ in range(3):
        ledger.add(1, 0.013, 0.010)  # a draft step that yielded one token in 1.3 plain steps' time: -0.3 each
    assert ledger.gained == pytest.approx(-0.9) and not ledger.losing
    ledger.add(1, 0.013, 0.010)
    assert ledger.losing
    ledger.reset()
    for _ in range(8):
        ledger.add(2, 0.013, 0.010)  # +0.7 each
    assert not ledger.losing and ledger.peak == pytest.approx(5.6)
    few = Ledger(floor=-1.0, decay=1.0, evidence=4)
    few.add(0, 1.0, 0.010)  # one pass preempted for a second is not yet a verdict
    assert not few.losing


def test_probes_back_off_while_they_find_nothing_and_start_over_once_speculation_paid():
    probes = Probes(first=4, most=16)
    for expected in (8, 16, 16):
        probes.after_stretch(paid=False)
        assert probes.interval == expected
    probes.after_stretch(paid=True)
    assert probes.interval == 4


class CountingSuffix(SuffixDrafter):
    def __init__(self):
        super().__init__(SuffixConfig(), None)
        self.calls = 0

    def proposal(self, committed, max_nodes):
        self.calls += 1
        return super().proposal(committed, max_nodes)


def test_a_losing_source_is_benched_and_probed_now_and_then_the_other_still_asked():
    suffix = CountingSuffix()
    controller = priced(0.8, 0.0014)  # priced to pay...
    controller.suffix = suffix
    measured = controller.measured
    measured.plain_step_s = 0.010
    for _ in range(LEDGER_EVIDENCE):  # ...but each of its steps took 1.5 plain steps' time for one token
        controller.account("draft", 1, 0.015, frozenset({"suffix", "draft"}))
    assert measured.benched == {"draft": 2 * PROBE_FIRST, "suffix": 0}  # nothing paid: backed off
    calls, looked = controller.main.calls, suffix.calls
    for _ in range(2 * PROBE_FIRST):
        assert step(controller, [5, 6, 7], [3, 4]).size == 1
    assert controller.main.calls == calls  # the draft is not asked while benched...
    assert suffix.calls == looked + 2 * PROBE_FIRST  # ...suffix drafting still is
    assert measured.probing["draft"]
    step(controller, [5, 6, 7], [3, 4])  # the probe: the draft is priced again, and pays by price
    assert controller.main.calls == calls + 1 and measured.benched["draft"] == 0


def test_with_every_source_benched_a_step_asks_nothing():
    suffix = CountingSuffix()
    controller = priced(0.8, 0.0014)
    controller.suffix = suffix
    controller.measured.benched.update(suffix=5, draft=5)
    for _ in range(4):
        assert step(controller, [1, 2, 3, 1, 2], [3, 4]).size == 1
    assert (controller.main.calls, suffix.calls) == (0, 0)
    assert controller.measured.plain_step_s is not None  # a plain step's own seconds, timed


def test_a_probe_that_finds_nothing_to_speculate_on_benches_the_source_again():
    controller = priced(0.1, 0.0014)  # priced to lose
    controller.measured.benched["draft"], controller.measured.probes["draft"].interval = 1, 8
    assert step(controller, [5, 6, 7], [3, 4]).size == 1  # the last benched step
    assert step(controller, [5, 6, 7], [3, 4]).size == 1  # the probe: plain by price
    assert controller.measured.benched["draft"] == 16


@pytest.mark.parametrize("draft,tree", [("suffix", None), ("draft", "topk:2x1")])
def test_output_stays_plain_decodings_while_the_controller_goes_plain_and_back(draft, tree, bundle_factory):
    pipeline = Pipeline(bundle_factory(draft=draft, tree=tree, suffix=True))
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    for prompt in ("a b c d e f a b c d e f a b c", "The quick brown fox"):
        plain = pipeline.generate(prompt, config=config, speculate=False)
        pipeline.generate(prompt, config=config)  # measurements made
        measured = pipeline.step_measurements
        measured.benched.update(suffix=7, draft=7)  # plain steps, then probes mid-answer
        spec = pipeline.generate(prompt, config=config)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.steps_by_choice["plain"]["steps"] >= 7
        assert np.sum([c["tokens"] for c in spec.stats.steps_by_choice.values()]) >= len(spec.token_ids) - 1


def test_a_step_another_process_preempted_is_charged_at_most_twice_its_price():
    controller = priced(0.8, 0.0014)
    controller.measured.plain_step_s = 0.010
    for _ in range(LEDGER_EVIDENCE - 1):
        controller.account("draft", 2, 0.014, frozenset({"draft"}), priced_s=0.0145)  # paying: +0.6 each
    controller.account("draft", 1, 2.0, frozenset({"draft"}), priced_s=0.0145)  # two seconds: charged 0.029, -1.9
    assert controller.measured.benched["draft"] == 0  # still asked
    controller.account("plain", 1, 5.0, frozenset())
    assert controller.measured.plain_step_s == pytest.approx(0.010 + 0.1 * 0.010)  # capped at twice its average
