"""Interleaved generations in `edgespec serve` (edgespec/serve_turns.py): target passes taken in turn, first
come first served; a request that arrives while another generates is answered before that one ends; and
every answer is what it is alone, greedy or sampled, whatever runs beside it or is cancelled midway."""
import threading
import time
from types import SimpleNamespace

import pytest
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.serve import Generations, ServeConfig
from edgespec.serve_clients import KeptConversations, in_flight
from edgespec.serve_turns import Turn, Turns

LONG = GenerationConfig(max_new_tokens=150, stop_at_eos=False)


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="draft", tree="chain:3"), threads=1)


def wait_until(condition, seconds=20.0):
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def test_turns_are_served_in_the_order_they_were_asked_for():
    turns, order = Turns(), []
    first = Turn(turns).__enter__()

    def run(name):
        with Turn(turns):
            order.append(name)

    threads = []
    for name in "bc":
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
        wait_until(lambda n=len(threads): turns.waiting() == n)
    first.pass_on()  # b and c, waiting, go first
    order.append("a")
    first.__exit__(None, None, None)
    for t in threads:
        t.join(timeout=10)
    assert order == ["b", "c", "a"] and turns.waiting() == 0
    assert first.held_s > 0


def test_passing_on_with_no_one_waiting_keeps_the_turn():
    turns = Turns()
    with Turn(turns) as turn:
        since = turn.since
        turn.pass_on()
        assert turn.since == since and turns.waiting() == 0


def test_a_request_is_answered_while_a_longer_one_generates(pipeline):
    generations = Generations(pipeline, ServeConfig(model="tiny"))
    long_ids, short_ids = pipeline.encode("a b c d e f"), pipeline.encode("the quick brown fox")
    started, results = threading.Event(), {}
    long = threading.Thread(target=lambda: results.setdefault("long", generations._generate(
        long_ids, LONG, None, lambda text: started.set(), threading.Event())))
    long.start()
    assert started.wait(30)
    short = generations._generate(short_ids, GenerationConfig(max_new_tokens=4), None, None, threading.Event())
    assert long.is_alive()  # the short one did not wait for the long one's end
    long.join(timeout=120)
    assert short.token_ids == pipeline.generate(ids=short_ids, config=GenerationConfig(max_new_tokens=4)).token_ids
    assert results["long"].token_ids == pipeline.generate(ids=long_ids, config=LONG).token_ids
    assert len(results["long"].token_ids) == LONG.max_new_tokens


def test_interleaved_answers_are_what_each_gets_alone(pipeline):
    """Greedy requests of different lengths, a sampled one with a seed and one cancelled midway, all in
    flight at once, each with a conversation of its own or none."""
    generations = Generations(pipeline, ServeConfig(model="tiny", interleave=4))
    sampled = GenerationConfig(max_new_tokens=60, stop_at_eos=False,
                               sampling=SamplingConfig(temperature=0.9, top_p=0.95, seed=11))
    requests = {"greedy long": ("a b c d e f a b", LONG, "ann"),
                "greedy short": ("the quick brown fox", GenerationConfig(max_new_tokens=20), None),
                "sampled": ("one two three", sampled, "bob"),
                "cancelled": ("x y z x y z", LONG, None)}
    cancel, pieces, results = threading.Event(), [], {}

    def on_cancelled_text(text):
        pieces.append(text)
        if len(pieces) == 5:
            cancel.set()

    def run(name):
        prompt, config, client = requests[name]
        results[name] = generations._generate(pipeline.encode(prompt), config, client,
                                              on_cancelled_text if name == "cancelled" else None,
                                              cancel if name == "cancelled" else threading.Event())

    threads = [threading.Thread(target=run, args=(name,)) for name in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for name, (prompt, config, _) in requests.items():
        alone = pipeline.generate(prompt, config=config)
        if name == "cancelled":
            got = results[name]
            assert got.stop_reason == "cancelled" and 0 < len(got.token_ids) < len(alone.token_ids)
            assert got.token_ids == alone.token_ids[: len(got.token_ids)]
        else:
            assert results[name].token_ids == alone.token_ids, name
    assert generations.turns.waiting() == 0 and generations.mean_s > 0


def test_the_generations_in_flight_fit_the_memory_budget():
    planned = dict(target_kv=300, draft_kv=100, suffix_store=0, total=4000)
    assert in_flight(4, SimpleNamespace(budget=None, **planned)) == 4
    assert in_flight(4, SimpleNamespace(budget=4000, **planned)) == 1  # no room: one at a time
    assert in_flight(4, SimpleNamespace(budget=4900, **planned)) == 3  # room for two more at full context
    assert in_flight(2, SimpleNamespace(budget=9000, **planned)) == 2
    # kept conversations live on what those in flight leave of the room
    fake = SimpleNamespace(memory=SimpleNamespace(budget=4900, draft_kv_per_token=0, **planned))
    assert KeptConversations(fake, bound=4, in_flight=3).room == 900 - 2 * 400
    assert KeptConversations(fake, bound=4).room == 900


def test_serve_refuses_no_generation_in_flight():
    with pytest.raises(ValueError, match="--interleave"):
        ServeConfig(model="m", interleave=0)
