"""What quantization costs, measured: perplexity and greedy agreement against the fp32 export of the
same model, and the draft's agreement with the target before and after.

Runtime code (onnxruntime sessions, numpy) on the quantized side. The float32 side is the source model's
teacher-forced rows, handed in (exporters/reference.py computes them a module's weights at a time): its
perplexity, and its choice at every token of the quantized model's own greedy continuation, which gives
both the agreement and where the two greedy outputs part.
"""
from __future__ import annotations

import numpy as np
from edgespec.runtime.decoding.engine import Session, speculative_step
from edgespec.runtime.execution.features import draft_inputs
from edgespec.runtime.execution.model import ModelRunner, commit, prefill

DRAFT_RANKS = 4  # the draft's choices whose agreement is measured: as many siblings as a 4-lane graph verifies


def _passes(runner: ModelRunner, ids: list[int], chunk: int, features: np.ndarray | None = None):
    """Every position of `ids` teacher-forced, chunk by chunk: yields each chunk's Pass (logits [n, V]).
    `features` [len(ids), H]: the input features of a draft that reads them."""
    cache = runner.new_cache(len(ids) + 1)  # a static graph's own buffer
    chunk = min(chunk, runner.pass_limit or chunk)  # and at most its nodes a pass
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        n = len(part)
        out = runner.forward(cache, part, range(start, start + n), np.tril(np.ones((n, n), bool)), range(n),
                             features=None if features is None else features[start : start + n])
        commit(cache, out, range(n))
        yield out


def _row_logits(runner: ModelRunner, ids: list[int], chunk: int, features: np.ndarray | None = None) -> np.ndarray:
    return np.concatenate([out.logits for out in _passes(runner, ids, chunk, features)])


def draft_input_features(target: ModelRunner, ids: list[int], chunk: int = 64) -> np.ndarray:
    """What a feature-reading draft gets with each token of `ids`: the target's feature at the token
    before (zeros at the first)."""
    return draft_inputs(np.concatenate([out.features for out in _passes(target, ids, chunk)]), 0, len(ids))


def perplexity(runner: ModelRunner, ids: list[int], chunk: int = 64) -> float:
    return perplexity_of(_row_logits(runner, ids, chunk), ids)


def perplexity_of(logits: np.ndarray, ids: list[int]) -> float:
    """The perplexity of `ids` under `logits` [len(ids), V], row i predicting token i + 1."""
    logits = logits[:-1].astype(np.float64)
    targets = np.asarray(ids[1:])
    logits -= logits.max(axis=-1, keepdims=True)
    log_probs = logits[np.arange(len(targets)), targets] - np.log(np.exp(logits).sum(axis=-1))
    return float(np.exp(-log_probs.mean()))


def greedy_continuation(runner: ModelRunner, prompt: list[int], new_tokens: int, chunk: int = 64) -> list[int]:
    session = Session(cache=runner.new_cache(len(prompt) + new_tokens + 2))
    logits = prefill(runner, session.cache, prompt, chunk)
    session.begin(list(prompt) + [int(np.argmax(logits))])
    while len(session.committed) < len(prompt) + new_tokens:
        speculative_step(runner, session)
    return session.committed[len(prompt) : len(prompt) + new_tokens]


def agreement(runner: ModelRunner, prompt: list[int], continuation: list[int], chunk: int = 64,
              target: ModelRunner | None = None, target_features: np.ndarray | None = None) -> float:
    """How often `runner`'s greedy choice equals `continuation`'s next token, teacher-forced. A draft that
    reads features gets `target`'s (its first drafting step: every feature is the target's own), or
    `target_features` [tokens, hidden], the target's final hidden states over prompt + continuation."""
    return agreement_by_rank(runner, prompt, continuation, 1, chunk, target, target_features)[0]


def agreement_by_rank(runner: ModelRunner, prompt: list[int], continuation: list[int], ranks: int,
                      chunk: int = 64, target: ModelRunner | None = None,
                      target_features: np.ndarray | None = None) -> list[float]:
    """How often `continuation`'s next token is `runner`'s r-th choice, r = 0..ranks-1, teacher-forced as
    `agreement`: the rates a tree's siblings are accepted at (runtime/decoding/treeopt.py's accept row)."""
    ids = list(prompt) + list(continuation)
    features = None
    if runner.reads_features:
        features = draft_inputs(target_features, 0, len(ids)) if target_features is not None \
            else draft_input_features(target, ids, chunk)
    logits = _row_logits(runner, ids, chunk, features)[len(prompt) - 1 : len(ids) - 1]
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :ranks]
    return [float(np.mean(order[:, r] == np.asarray(continuation))) for r in range(ranks)]


def _quantized_side(open_quantized, heldout: list[int], prompts: list[list[int]], new_tokens: int, drafts,
                    chunk: int):
    """The quantized graph's perplexity and greedy continuations, and the draft's agreement with them; the
    graph is let go on return (a function's locals go with it, a `with` block's name would stay)."""
    with open_quantized() as quantized:
        ppl_q = perplexity(quantized, heldout, chunk)
        continuations = [greedy_continuation(quantized, p, new_tokens, chunk) for p in prompts]
        draft_quantized = by_rank = None
        if drafts is not None:
            draft_quantized = float(np.mean([agreement(drafts[1], p, c, target=quantized)
                                             for p, c in zip(prompts, continuations)]))
            # the quantized draft's agreement by rank: what a tree's second and later siblings add, for the
            # tree a budget's streamed pass pays for (runtime/decoding/streamed_tree.py, history.md §64)
            by_rank = np.mean([agreement_by_rank(drafts[1], p, c, DRAFT_RANKS, target=quantized)
                               for p, c in zip(prompts, continuations)], axis=0)
    return ppl_q, continuations, draft_quantized, by_rank


def quality_report(reference, open_quantized, heldout: list[int], prompts: list[list[int]],
                   new_tokens: int = 128, drafts: tuple[ModelRunner, ModelRunner] | None = None,
                   chunk: int = 64) -> dict:
    """`reference(sequences, features)`: the float32 model's teacher-forced rows over each sequence
    (exporters/reference.py: ReferenceRows), with its final hidden states when `features`;
    `open_quantized()`: a context manager giving the quantized graph's runner, closed before the reference
    runs so the two are never resident together; `drafts` is (fp32 draft, quantized draft) when the bundle
    has a draft model. `chunk`: the quantized graph's tokens per prefill pass."""
    ppl_q, continuations, draft_quantized, by_rank = _quantized_side(open_quantized, heldout, prompts, new_tokens,
                                                                     drafts, chunk)
    reads_features = drafts is not None and drafts[0].reads_features
    rows = reference([list(heldout)] + [list(p) + c for p, c in zip(prompts, continuations)], reads_features)
    ppl_ref = float(np.exp(-np.mean(rows[0].next_log_prob[: len(heldout) - 1])))
    # the float32 model's choice after each prefix of the quantized continuation: where the two greedy
    # outputs part is its first disagreement (before it, both saw the same prefix)
    choices = [r.argmax[len(p) - 1 : len(p) - 1 + len(c)] == np.asarray(c)
               for r, p, c in zip(rows[1:], prompts, continuations)]
    report = {
        "heldout_tokens": len(heldout),
        "perplexity": {"fp32": round(ppl_ref, 4), "quantized": round(ppl_q, 4),
                       "increase_percent": round(100 * (ppl_q / ppl_ref - 1), 2)},
        "greedy_agreement": {"tokens": new_tokens * len(prompts),
                             "top1_agreement": round(float(np.mean([c.mean() for c in choices])), 4),
                             "identical_prefix_tokens": [int(c.argmin()) if not c.all() else len(c) for c in choices]},
    }
    if drafts is not None:
        report["draft_agreement"] = {
            "fp32": round(float(np.mean([agreement(drafts[0], p, c, target_features=r.features)
                                         for p, c, r in zip(prompts, continuations, rows[1:])])), 4),
            "quantized": round(draft_quantized, 4),
        }
        report["draft_agreement_by_rank"] = {"quantized": [round(float(r), 4) for r in by_rank]}
    return report
