"""Sampling: logits processing, and statistical proof that speculative sampling keeps the target's
distribution. Significance: every goodness-of-fit test must not reject at alpha = 0.001 (seeds are
fixed, so each test is deterministic); a deliberately wrong verifier must be rejected at 1e-6."""
import itertools

import numpy as np
import pytest
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.decoding.accept import _residual, accept_sampled
from edgespec.runtime.decoding.lookup import graft_chain
from edgespec.runtime.decoding.sampling import SamplingConfig, probabilities, sample, sample_without_replacement
from edgespec.runtime.decoding.tree import Tree
from scipy.stats import chisquare

ALPHA = 1e-3
V = 4


def test_probabilities_follow_temperature_top_k_top_p_min_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.allclose(probabilities(logits, SamplingConfig(temperature=1.0)), [[0.5, 0.3, 0.15, 0.05]])
    hot = probabilities(logits, SamplingConfig(temperature=2.0))[0]
    assert hot[0] < 0.5 and hot[3] > 0.05
    assert np.allclose(probabilities(logits, SamplingConfig(temperature=1.0, top_k=2)), [[0.625, 0.375, 0, 0]])
    # top-p keeps the smallest prefix reaching p: 0.5 + 0.3 >= 0.7
    assert np.allclose(probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7)), [[0.625, 0.375, 0, 0]])
    assert np.allclose(probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.1)), [[1, 0, 0, 0]])
    # min-p drops tokens below min_p * the top probability
    assert np.allclose(probabilities(logits, SamplingConfig(temperature=1.0, min_p=0.25)),
                       [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]])


def test_repetition_penalty_lowers_seen_tokens():
    logits = np.array([[2.0, 2.0, -1.0, -1.0]])
    seen = np.array([[True, False, True, False]])
    probs = probabilities(logits, SamplingConfig(temperature=1.0, repetition_penalty=2.0), seen)[0]
    assert probs[0] < probs[1] and probs[2] < probs[3]


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5),
                                 dict(min_p=1.0), dict(repetition_penalty=0), dict(temperature=float("nan")),
                                 dict(repetition_penalty=float("inf")), dict(temperature=1e-320), dict(seed=-1),
                                 dict(repetition_penalty=1.2)])  # greedy would ignore it
def test_bad_sampling_settings(bad):
    with pytest.raises(ValueError):
        SamplingConfig(**bad)


def test_sampling_without_replacement_is_distinct_and_follows_q():
    rng = np.random.default_rng(0)
    q = np.array([0.6, 0.3, 0.1, 0.0])
    firsts = [sample_without_replacement(q, 2, rng) for _ in range(20000)]
    assert all(len(set(f)) == 2 and 3 not in f for f in firsts)
    counts = np.bincount([f[0] for f in firsts], minlength=4)[:3]
    assert chisquare(counts, 20000 * q[:3]).pvalue > ALPHA
    assert sample_without_replacement(q, 5, rng).__len__() == 3  # the support has three tokens


# --- a synthetic Markov target and draft: p(next | last) = P[last], q(next | last) = Q[last] ---

def markov(seed, alpha=1.0):
    return np.random.default_rng(seed).dirichlet(np.full(V, alpha), size=V)


P = markov(1)
Q_CLOSE = 0.7 * P + 0.3 * markov(2)
Q_FAR = markov(3, alpha=0.3)


def draft_tree(topology, root, q_table, rng, deterministic):
    tokens = np.zeros(topology.size, dtype=np.int64)
    tokens[0] = root
    q_draft = None if deterministic else np.zeros((topology.size, V))
    for node in range(topology.size):
        kids = list(topology.children[node])
        if not kids:
            continue
        q = q_table[tokens[node]]
        if deterministic:  # an n-gram-like proposer: the most likely tokens, no distribution
            drawn = list(np.argsort(-q, kind="stable")[: len(kids)])
        else:
            q_draft[node] = q
            drawn = sample_without_replacement(q, len(kids), rng)
            drawn += [drawn[-1]] * (len(kids) - len(drawn))
        tokens[kids] = drawn
    return tokens, q_draft


def speculative_tokens(spec, q_table, count, rng, deterministic=False, verifier=accept_sampled):
    """The first `count` tokens after root 0, produced by speculative steps on the Markov target."""
    topology = parse_tree_spec(spec)
    out, last = [], 0
    while len(out) < count:
        tokens, q_draft = draft_tree(topology, last, q_table, rng, deterministic)
        p_target = P[tokens]  # the target's distribution at every node
        path, bonus = verifier(tokens, topology.children, p_target, q_draft, rng)
        out += [int(t) for t in tokens[path[1:]]] + [bonus]
        last = out[-1]
    return tuple(out[:count])


def exact_joint(count):
    cells = list(itertools.product(range(V), repeat=count))
    probs = []
    for cell in cells:
        prob, last = 1.0, 0
        for token in cell:
            prob *= P[last, token]
            last = token
        probs.append(prob)
    return cells, np.array(probs)


def fit_pvalue(samples, count):
    cells, probs = exact_joint(count)
    index = {c: i for i, c in enumerate(cells)}
    observed = np.bincount([index[s] for s in samples], minlength=len(cells))
    return chisquare(observed, probs * len(samples)).pvalue


TRIALS = 12000


@pytest.mark.parametrize("spec,q_table,deterministic", [
    ("chain:3", Q_CLOSE, False),
    ("chain:3", Q_FAR, False),
    ("topk:2x2", Q_CLOSE, False),
    ("topk:3x1", Q_FAR, False),
    ("parents:-1,0,0,0,1,1,2", Q_CLOSE, False),
    ("chain:3", Q_CLOSE, True),      # point-mass proposals
    ("topk:2x2", Q_FAR, True),
])
def test_speculative_sampling_matches_the_target_distribution(spec, q_table, deterministic):
    rng = np.random.default_rng(7)
    samples = [speculative_tokens(spec, q_table, 3, rng, deterministic) for _ in range(TRIALS)]
    assert fit_pvalue([s[:1] for s in samples], 1) > ALPHA
    assert fit_pvalue(samples, 3) > ALPHA  # the joint of the first three tokens: 64 cells


def buggy_verifier(use_residual: bool):
    """Two common bugs. use_residual=False: on rejection, keep sampling from the target's full
    distribution instead of the residual. use_residual=True: take residuals, but leave the rejected
    token in q although siblings were drawn without replacement."""

    def verify(tokens, children, p_target, q_draft, rng):
        path, node = [0], 0
        while True:
            p, q = p_target[node].copy(), q_draft[node]
            for child in children[node]:
                t = int(tokens[child])
                if rng.random() < min(1.0, p[t] / q[t]):
                    path.append(child)
                    node = child
                    break
                if use_residual:
                    p = _residual(p, q, t)
            else:
                return path, sample(p, rng)

    return verify


@pytest.mark.parametrize("use_residual,spec", [(False, "chain:3"), (False, "topk:2x2"), (True, "topk:3x1"),
                                               (True, "topk:2x2")])
def test_the_statistical_test_detects_a_wrong_verifier(use_residual, spec):
    rng = np.random.default_rng(7)
    samples = [speculative_tokens(spec, Q_FAR, 3, rng, verifier=buggy_verifier(use_residual)) for _ in range(TRIALS)]
    assert fit_pvalue(samples, 3) < 1e-6


def mixed_tokens(spec, lookup, count, rng, verifier=accept_sampled):
    """Like speculative_tokens, with a deterministic chain grafted onto a tree drawn from Q_CLOSE, so
    drawn and point-mass siblings mix. The chain follows the target's likeliest tokens, as a lookup that
    is often right would: it is accepted often, and sometimes it shares its first node with a drawn one."""
    topology = parse_tree_spec(spec)
    out, last = [], 0
    while len(out) < count:
        tokens, q_draft = draft_tree(topology, last, Q_CLOSE, rng, deterministic=False)
        chain, token = [], last
        for _ in range(lookup):
            token = int(np.argmax(P[token]))
            chain.append(token)
        tree = graft_chain(Tree(topology, tokens, q_draft), chain, max_nodes=64)
        path, bonus = verifier(tree.tokens, tree.topology.children, P[tree.tokens], tree.q_draft, rng, tree.drawn)
        out += [int(t) for t in tree.tokens[path[1:]]] + [bonus]
        last = out[-1]
    return tuple(out[:count])


@pytest.mark.parametrize("spec,lookup", [("chain:1", 3), ("topk:2x1", 2), ("chain:2", 2)])
def test_lookup_tokens_beside_drawn_siblings_keep_the_target_distribution(spec, lookup):
    rng = np.random.default_rng(11)
    samples = [mixed_tokens(spec, lookup, 3, rng) for _ in range(TRIALS)]
    assert fit_pvalue([s[:1] for s in samples], 1) > ALPHA
    assert fit_pvalue(samples, 3) > ALPHA


def test_the_statistical_test_detects_point_masses_taken_as_drawn():
    """The bug: checking a lookup token against the draft's q at its parent, as if drawn from it."""
    def as_if_drawn(tokens, children, p_target, q_draft, rng, drawn):
        return accept_sampled(tokens, children, p_target, Q_CLOSE[tokens], rng)

    rng = np.random.default_rng(11)
    samples = [mixed_tokens("chain:1", 2, 3, rng, verifier=as_if_drawn) for _ in range(TRIALS)]
    assert fit_pvalue(samples, 3) < 1e-6


def test_a_drawn_proposal_after_a_point_mass_of_its_token_is_refused():
    """Skipped as a repeat, its draw from q would go uncorrected: the tree builders put point masses last."""
    tokens, children = np.array([0, 1, 1]), ((1, 2), (), ())
    p, q = np.full((3, 4), 0.25), np.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="point mass"):
        for seed in range(50):  # until the point mass is rejected and its drawn twin comes up
            accept_sampled(tokens, children, p, q, np.random.default_rng(seed), drawn=np.array([False, False, True]))
    path, _ = accept_sampled(tokens, children, p, q, np.random.default_rng(0), drawn=np.array([False, True, False]))
    assert path[0] == 0  # drawn first, point mass after: fine


def test_residual_is_the_normalized_positive_part():
    p, q = np.array([0.5, 0.3, 0.2, 0.0]), np.array([0.2, 0.5, 0.3, 0.0])
    assert np.allclose(_residual(p, q, 1), [1.0, 0, 0, 0])
    assert np.allclose(_residual(p, None, 0), [0, 0.6, 0.4, 0])
