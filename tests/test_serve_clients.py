"""What `edgespec serve` keeps per client beyond the KV caches: the store of earlier outputs suffix drafting
quotes (edgespec/serve_clients.py), so that one client's outputs never speed up another's requests; and
a prompt encoded once, for its length check and its generation alike."""
from types import SimpleNamespace

import numpy as np
import pytest
from edgespec.runtime.pipeline import Pipeline
from test_serve import MODEL, Server

from edgespec.serve_clients import KeptConversations

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def pipeline(bundle_factory):
    return Pipeline(bundle_factory(draft="suffix", tree=None, suffix=True), threads=1)


def passes(server, key: str | None = None, **labels) -> float:
    """Tokens per target pass of one greedy request (the `edgespec` extension field)."""
    status, _, reply = server.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": PROMPT}], "max_tokens": 40, "temperature": 0, **labels}, key=key)
    assert status == 200, reply
    return reply["edgespec"]["tokens_per_target_pass"]


def test_a_clients_outputs_speed_up_its_own_requests_only(pipeline):
    server = Server(pipeline, api_keys=("sk-a", "sk-b"))
    try:
        alone = passes(server, key="sk-a")
        guess = passes(server, key="sk-b")
        quoted = passes(server, key="sk-a")
        # A's answer, in A's store, is quoted for A's request and not for B's (the step controller's choices
        # follow measured times, so B's may differ a little from A's first)
        assert quoted > max(alone, guess)
        kept = server.app.state.generations.conversations.kept
        lengths = sorted(c.suffix_store.array.length for c in kept.values())
        assert lengths[0] > 0 and lengths[1] == 2 * lengths[0]  # B's store: B's answer; A's: its two
        assert pipeline.suffix_store.array.length == 0  # the pipeline's shared store is never used
    finally:
        server.stop()


def test_requests_that_are_no_ones_learn_nothing_from_each_other(pipeline):
    server = Server(pipeline)
    try:
        passes(server)
        conversation = server.app.state.generations.conversations.new()
        assert conversation.suffix_store.array.length == 0  # each is made empty
        assert pipeline.suffix_store.array.length == 0 and len(server.app.state.generations.conversations) == 0
    finally:
        server.stop()


def test_a_prompt_is_encoded_once(pipeline, monkeypatch):
    encoded = []
    encode_chat = pipeline.codec.encode_chat
    monkeypatch.setattr(pipeline.codec, "encode_chat",
                        lambda *args, **kwargs: encoded.append(1) or encode_chat(*args, **kwargs))
    server = Server(pipeline)
    try:
        passes(server)
        assert len(encoded) == 1
    finally:
        server.stop()


def test_a_kept_conversations_store_and_table_count_against_the_budgets_room():
    def new_session(**learned):
        return SimpleNamespace(cache=SimpleNamespace(data=np.zeros(100, np.uint8), features=None), committed=[],
                               drafter=learned)

    fake = SimpleNamespace(memory=SimpleNamespace(budget=5000, total=4000, draft_kv_per_token=0),
                           new_session=new_session,
                           new_suffix_store=lambda: SimpleNamespace(nbytes=300),
                           new_recycling_table=lambda: np.zeros(100, np.uint8))
    kept = KeptConversations(fake, bound=4)
    conversation = kept.take("a")
    assert conversation.session.drafter == {"suffix_store": conversation.suffix_store,
                                    "recycling_table": conversation.recycling_table}  # the drafter learns into them
    kept.keep("a", conversation)
    assert kept.held() == 100 + 300 + 100
    kept.keep("b", kept.take("b"))
    kept.take("c")  # 1000 bytes held by a and b: a room of 1000 is not exceeded, both stay
    assert list(kept.kept) == ["a", "b"]
    kept.keep("c", kept.new())
    kept.take("d")  # 1500 > 1000: the least recently used go until it fits
    assert list(kept.kept) == ["b", "c"]
