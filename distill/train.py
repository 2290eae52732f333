"""Distillation: the draft learns the target's next-token distribution from precomputed top-k shards.

Loss at each supervised position: cross-entropy of the draft's distribution over its head tokens against
the target's top-k probabilities restricted to those tokens and renormalised (KL up to a constant); a
feature design (EAGLE) also regresses the target's feature there (smooth L1). The learning rate follows
the elapsed share of the time budget (warm-up, then cosine), so a resumed run continues the same schedule. A held-out shard of target answers measures top-1 agreement with the target's greedy token.

State on disk: checkpoints/last.pt (trainable weights, optimizer, step, seconds used, head tokens),
replaced atomically; the finished draft is written next to it as a Hugging Face folder.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from edgespec.distill.data import feature_file, load_shard
from edgespec.distill.draft_model import (
    FEATURE_DESIGNS,
    LEARNING_RATE,
    build_draft,
    draft_hidden,
    draft_hidden_steps,
    head_rows,
    regresses_features,
)
from edgespec.distill.eagle3_head import Eagle3Draft, write_head
from edgespec.distill.vocab import choose_head_tokens, coverage
from edgespec.exporters.drafts import DRAFT_INFO
from edgespec.runtime.contract.errors import InputError
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class TrainConfig:
    design: str = "cut"
    seed: int = 0
    head_size: int = 8192
    window: int = 256
    batch: int = 16
    lr: float | None = None  # None: the design's (draft_model.LEARNING_RATE)
    warmup_share: float = 0.03
    weight_decay: float = 0.01
    checkpoint_s: float = 180.0
    eval_s: float = 300.0
    drafting_steps: int = 1  # a feature draft trained for this many drafting steps (draft_hidden_steps)
    # steps taken even past the deadline, the schedule spread over them when time runs short: a result
    # that does not depend on how busy the machine is (tests)
    min_steps: int = 0
    device: str = "cpu"  # where torch trains ("cuda" where a GPU is lent)
    # > 0: training stops after this many steps even before the deadline, its schedule spread over them;
    # with min_steps equal, a run whose draft does not depend on the machine's speed
    max_steps: int = 0


@dataclass(frozen=True)
class Sequence:
    tokens: np.ndarray  # [L] int
    first: int  # first supervised position
    topk_ids: np.ndarray  # [L - first, k]: target's top-k for positions first..L-1
    topk_logp: np.ndarray
    features: np.ndarray | None = None  # [L, H] float16: the target's final hidden state at every position


def read_sequences(paths: list[Path], features_dir: Path | None = None) -> list[Sequence]:
    sequences = []
    for path in paths:
        shard = load_shard(path)
        features = None if features_dir is None else np.load(feature_file(features_dir, path), mmap_mode="r")
        sup = 0
        for i in range(len(shard["first"])):
            start, stop = shard["starts"][i], shard["starts"][i + 1]
            first = int(shard["first"][i])
            count = stop - start - first
            sequences.append(Sequence(shard["tokens"][start:stop], first, shard["topk_ids"][sup:sup + count],
                                      shard["topk_logp"][sup:sup + count].astype(np.float32),
                                      None if features is None else features[start:stop]))
            sup += count
    return sequences


@dataclass
class Batch:
    """Windows right-padded to [B, T], and for every supervised row: where it is (batch, row), the
    target's top-k as head indices with their renormalised probabilities (all zero when none of them is
    in the head: such a row only counts for agreement), and the target's greedy token. With features:
    features_in [B, T, H] (the target's feature before each token, zeros at position 0) and
    features_out [M, H] (the target's feature at each supervised row, what a feature draft predicts)."""
    ids: object
    mask: object
    where: object
    idx: object
    p: object
    greedy: np.ndarray
    features_in: object = None
    features_out: object = None

    def to(self, device: str) -> "Batch":
        moved = {name: getattr(self, name) for name in ("ids", "mask", "where", "idx", "p", "features_in", "features_out")}
        return replace(self, **{name: None if value is None else value.to(device) for name, value in moved.items()})


def make_batch(sequences: list[Sequence], window: int, rng: np.random.Generator, kept_index: np.ndarray) -> Batch:
    rows_in, starts, where, target_idx, target_logp = [], [], [], [], []
    for b, seq in enumerate(sequences):
        length = len(seq.tokens)
        if length <= window:
            start = 0
        else:  # a window that ends inside the supervised part, with some context before it
            lo = min(max(0, seq.first - window // 2), length - window)
            start = int(rng.integers(lo, length - window + 1))
        stop = min(length, start + window)
        rows_in.append(seq.tokens[start:stop])
        starts.append(start)
        for r in range(stop - start):
            position = start + r + 1  # draft row r predicts the token at this position
            if seq.first <= position < length:
                where.append((b, r))
                target_idx.append(seq.topk_ids[position - seq.first])
                target_logp.append(seq.topk_logp[position - seq.first])
    width = max(len(r) for r in rows_in)
    ids = np.zeros((len(rows_in), width), dtype=np.int64)
    mask = np.zeros((len(rows_in), width), dtype=np.int64)
    for b, row in enumerate(rows_in):
        ids[b, :len(row)] = row
        mask[b, :len(row)] = 1
    target_idx = np.array(target_idx)
    idx = kept_index[target_idx]  # [M, k], -1 where the head does not hold the token
    p = np.exp(np.array(target_logp)) * (idx >= 0)
    mass = p.sum(axis=1, keepdims=True)
    p = np.divide(p, mass, out=np.zeros_like(p), where=mass > 0)
    where = np.array(where)
    batch = Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(where),
                  torch.from_numpy(np.maximum(idx, 0)), torch.from_numpy(p.astype(np.float32)), target_idx[:, 0])
    if sequences[0].features is not None:
        hidden = sequences[0].features.shape[1]
        features = np.zeros((len(rows_in), width + 1, hidden), np.float32)  # column c: the feature at start + c - 1
        for b, (seq, start) in enumerate(zip(sequences, starts)):
            lo = max(start - 1, 0)
            features[b, 1 + lo - start : 1 + len(rows_in[b])] = seq.features[lo : start + len(rows_in[b])]
        batch.features_in = torch.from_numpy(features[:, :width])
        batch.features_out = torch.from_numpy(features[where[:, 0], where[:, 1] + 1])
    return batch


def draft_outputs(draft, head, batch: Batch, steps: int = 1) -> list:
    """Per drafting step: (hidden [M, H], logits [M, head tokens]) at the supervised rows."""
    if steps == 1:
        all_hidden = [draft_hidden(draft, batch.ids, batch.mask, batch.features_in)]
    else:
        all_hidden = draft_hidden_steps(draft, batch.ids, batch.mask, batch.features_in, steps)
    outputs = []
    for hidden in all_hidden:
        rows = hidden[batch.where[:, 0], batch.where[:, 1]]
        outputs.append((rows, rows @ head.T))
    return outputs


def distill_loss(logits, idx, p):
    logq = torch.log_softmax(logits, dim=-1)
    per_row = -(p * logq.gather(1, idx)).sum(dim=1)
    return per_row.sum() / (p.sum(dim=1) > 0).sum().clamp(min=1)


# A later drafting step only counts when the earlier ones were accepted, so it weighs less.
LATER_STEP_WEIGHT = 0.5


def batch_loss(draft, head, batch: Batch, steps: int = 1):
    """Distillation on the target's top-k; a feature draft also regresses the target's feature (EAGLE), at
    every drafting step it is trained for. A drafting step s reads its own step s-1 output at the row before,
    so that row must exist in the window: rows before s - 1 do not count for it."""

    loss = 0.0
    for step, (rows, logits) in enumerate(draft_outputs(draft, head, batch, steps), start=1):
        keep = batch.where[:, 1] >= step - 1
        step_loss = distill_loss(logits[keep], batch.idx[keep], batch.p[keep])
        if batch.features_in is not None and regresses_features(draft):
            step_loss = step_loss + torch.nn.functional.smooth_l1_loss(rows[keep], batch.features_out[keep])
        loss = loss + LATER_STEP_WEIGHT ** (step - 1) * step_loss
    return loss


def agreement(draft, head, head_tokens: np.ndarray, kept_index, sequences: list[Sequence], window: int,
              steps: int = 1) -> tuple[float, list[float]]:
    """On held-out target answers: (expected tokens a chain of `steps` drafted tokens gets accepted per
    target pass, not counting the target's own token; each step's top-1 agreement with the target's greedy
    token). Step s at row t is accepted when steps 1..s-1 were accepted at rows t-s+1..t-1 and it agrees
    too; with one step the first number is the first step's agreement."""

    accepted = np.zeros(steps)
    hits_by_step = np.zeros(steps)
    total = 0
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for start in range(0, len(sequences), 8):
            batch = make_batch(sequences[start:start + 8], window, rng, kept_index)
            rows, cols = batch.where[:, 0].numpy(), batch.where[:, 1].numpy()
            batch = batch.to(head.device)
            hit = np.zeros((steps, *batch.ids.shape), dtype=bool)  # hit[s, b, t]: step s + 1 agrees at row t
            for s, (_, logits) in enumerate(draft_outputs(draft, head, batch, steps)):
                hit[s, rows, cols] = head_tokens[logits.argmax(-1).cpu().numpy()] == batch.greedy
                hits_by_step[s] += hit[s, rows, cols].sum()
            accepted += chain_acceptance(hit, rows, cols)
            total += len(rows)
    total = max(total, 1)
    return float(accepted.sum() / total), [round(float(h / total), 4) for h in hits_by_step]


def chain_acceptance(hit: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """How many chains reach each drafting step. `hit[s, b, t]`: step s + 1 agrees with the target at row t
    of window b; a chain starts at each supervised (rows[i], cols[i]) and reaches step s + 1 at row t + s
    when every step before it agreed too (a rejected token ends the chain)."""
    steps, _, width = hit.shape
    reached = np.zeros(steps)
    chain = hit[0, rows, cols]
    reached[0] = chain.sum()
    for s in range(1, steps):
        inside = cols + s < width
        chain = chain & inside & hit[s, rows, np.where(inside, cols + s, 0)]
        reached[s] = chain.sum()
    return reached


def learning_rate(config: TrainConfig, progress: float) -> float:
    if progress < config.warmup_share:
        return peak_learning_rate(config) * progress / config.warmup_share
    done = (progress - config.warmup_share) / (1 - config.warmup_share)
    return peak_learning_rate(config) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def peak_learning_rate(config: TrainConfig) -> float:
    return LEARNING_RATE[config.design] if config.lr is None else config.lr


def _save_checkpoint(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(payload, partial)
    partial.replace(path)


def train(target, tokenizer, shards: list[Path], held_out: list[Path], out: Path, config: TrainConfig,
          deadline: float, log, features_dir: Path | None = None, init: Path | None = None) -> dict:
    """Trains on `shards` until `deadline` (resuming checkpoints/last.pt), measures agreement on
    `held_out`, then writes the draft folder into `out`. A feature design reads the shards' target
    features from `features_dir` (see `feature_file`). Without a checkpoint, `init` (a draft folder
    that `write_draft` wrote) gives the starting weights and head tokens. (One function on purpose: the
    loop's step, evaluation and checkpoint share the state a resumed run must restore, all in view.)"""
    _check(config, features_dir)
    steps = config.drafting_steps
    features_dir = features_dir if config.design in FEATURE_DESIGNS else None
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    sequences, validation = read_sequences(shards, features_dir), read_sequences(held_out, features_dir)
    vocab = target.config.vocab_size
    checkpoint, best_file = out / "checkpoints" / "last.pt", out / "checkpoints" / "best.pt"
    draft, trainable = build_draft(target, config.design)
    saved = torch.load(checkpoint, weights_only=True) if checkpoint.is_file() else None
    head_tokens = _head_tokens(saved, init, draft, config, sequences, tokenizer, vocab)
    kept_index = np.full(vocab, -1, dtype=np.int64)
    kept_index[head_tokens] = np.arange(len(head_tokens))
    held_top1 = np.concatenate([s.topk_ids[:, 0] for s in validation])
    draft.to(config.device)
    head = head_rows(draft, torch.from_numpy(head_tokens).to(config.device))
    parameters = [p for n, p in draft.named_parameters() if n in trainable]
    optimizer = torch.optim.AdamW(parameters, lr=peak_learning_rate(config), weight_decay=config.weight_decay)
    step, used_s = 0, 0.0
    if saved is not None:
        draft.load_state_dict(saved["draft"], strict=False)
        optimizer.load_state_dict(saved["optimizer"])
        step, used_s = saved["step"], saved["used_s"]
    # the draft that agreed best on held-out data so far: with little target data, later steps can overfit
    best = torch.load(best_file, weights_only=True) if best_file.is_file() else {"score": -1.0, "step": 0}
    total_s = used_s + max(0.0, deadline - time.time())
    tokens = sum(len(s.topk_ids) for s in sequences)
    log(f"train: design {config.design}, {len(sequences)} sequences ({tokens} supervised tokens), "
        f"head {len(head_tokens)} tokens covering {coverage(head_tokens, held_top1):.3f} of held-out greedy tokens, "
        f"{sum(p.numel() for p in parameters) / 1e6:.1f}M trained parameters, resuming at step {step}")
    started, last_checkpoint, last_eval = time.time(), time.time(), time.time()
    draft.train()
    while (time.time() < deadline or step < config.min_steps) and not (config.max_steps and step >= config.max_steps):
        progress = (used_s + time.time() - started) / max(total_s, 1.0)
        if config.min_steps:
            progress = min(progress, step / config.min_steps)
        if config.max_steps:
            progress = step / config.max_steps
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, progress)
        picks = rng.integers(0, len(sequences), config.batch)
        batch = make_batch([sequences[i] for i in picks], config.window, rng, kept_index).to(config.device)
        loss = batch_loss(draft, head, batch, steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        step += 1
        now = time.time()
        if now - last_eval >= config.eval_s:
            draft.eval()
            score, by_step = agreement(draft, head, head_tokens, kept_index, validation, config.window, steps)
            log(f"train: step {step}, loss {loss.item():.3f}, held-out {_describe(score, by_step)}")
            if score > best["score"]:
                best = {"score": score, "by_step": by_step, "step": step, "draft": _trained_state(draft, trainable)}
                _save_checkpoint(best_file, best)
            draft.train()
            last_eval = time.time()
        if now - last_checkpoint >= config.checkpoint_s:
            _save_checkpoint(checkpoint, {"draft": _trained_state(draft, trainable),
                                          "optimizer": optimizer.state_dict(), "step": step,
                                          "used_s": used_s + now - started,
                                          "head_tokens": torch.from_numpy(head_tokens)})
            last_checkpoint = now
    draft.eval()
    score, by_step = agreement(draft, head, head_tokens, kept_index, validation, config.window, steps)
    seconds = round(used_s + time.time() - started)
    _save_checkpoint(checkpoint, {"draft": _trained_state(draft, trainable), "optimizer": optimizer.state_dict(),
                                  "step": step, "used_s": seconds, "head_tokens": torch.from_numpy(head_tokens)})
    kept_step = step
    if best["score"] > score:
        draft.load_state_dict(best["draft"], strict=False)
        score, by_step, kept_step = best["score"], best["by_step"], best["step"]
    draft.to("cpu")
    report = {"design": config.design, "steps": step, "kept_step": kept_step, "train_seconds": seconds,
              "supervised_tokens": tokens, "head_tokens": len(head_tokens),
              "head_coverage": round(coverage(head_tokens, held_top1), 4),
              "held_out_agreement": by_step[0], "held_out_agreement_by_step": by_step,
              "held_out_chain_tokens": round(score, 4), "train_config": asdict(config)}
    write_draft(draft, tokenizer, head_tokens, report, out)
    log(f"train: finished at step {step}, keeping step {kept_step}: held-out {_describe(score, by_step)}")
    return report


def _check(config: TrainConfig, features_dir: Path | None) -> None:
    if config.design in FEATURE_DESIGNS and features_dir is None:
        raise InputError(f"the {config.design} design learns from the target's features: give features_dir")
    if config.max_steps and config.min_steps > config.max_steps:
        raise InputError(f"min_steps ({config.min_steps}) is above max_steps ({config.max_steps})")
    if config.drafting_steps < 1:
        raise InputError(f"drafting_steps must be at least 1, got {config.drafting_steps}")
    if config.drafting_steps > 1 and config.design not in FEATURE_DESIGNS:
        raise InputError(f"training for later drafting steps is for drafts that read features; "
                         f"the {config.design} design drafts every step alike")


def _head_tokens(saved: dict | None, init: Path | None, draft, config: TrainConfig, sequences, tokenizer,
                 vocab: int) -> np.ndarray:
    """The vocabulary the draft's head predicts: the checkpoint's, the initial draft's, or the tokens the
    target chose most often (with end-of-turn tokens always kept)."""
    if saved is not None:
        return saved["head_tokens"].numpy()
    if init is not None:
        return read_draft(draft, init, config.design)
    top1 = np.concatenate([s.topk_ids[:, 0] for s in sequences])
    always = {int(t) for t in (tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(["<|im_end|>"]))
              if t is not None and 0 <= int(t) < vocab}
    return choose_head_tokens(top1, vocab, config.head_size, always)


def _describe(score: float, by_step: list[float]) -> str:
    if len(by_step) == 1:
        return f"agreement {by_step[0]:.3f}"
    return f"agreement by drafting step {by_step}, {score:.3f} drafted tokens accepted per chain"


def _trained_state(draft, trainable: list[str]) -> dict:
    state = draft.state_dict()
    return {name: state[name].detach().cpu().clone() for name in trainable}


FEATURE_FC_FILE = "feature_fc.safetensors"
EAGLE3_FIXED = ("lm_head.weight", "d2t", "t2d")  # an eagle3 head's tensors that follow from its head tokens


def draft_state(folder: Path) -> tuple[dict, dict]:
    """A draft folder as `write_draft` wrote it: its info (head tokens, training report) and every tensor,
    the projection of a feature design included (as `feature_fc.*`)."""

    info = json.loads((folder / DRAFT_INFO).read_text())
    state = {}
    for file in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(file))
    if info.get("training", {}).get("design") == "eagle3":  # the published layout: keep what training made
        state = {k: v for k, v in state.items() if k not in EAGLE3_FIXED}
    if info.get("features") is not None:
        state.update({f"feature_fc.{k}": v for k, v in load_file(folder / info["features"]["file"]).items()})
    return info, state


def read_draft(draft, folder: Path, design: str) -> np.ndarray:
    """Loads a draft folder's weights (as `write_draft` wrote them) into `draft`; returns its head tokens."""
    info, state = draft_state(folder)
    trained_as = info.get("training", {}).get("design")
    if trained_as != design:
        raise InputError(f"{folder} holds a {trained_as} draft; it cannot start a {design} one")
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or [name for name in missing if name != "lm_head.weight"]:  # the head is tied to the embedding
        raise InputError(f"{folder} does not fit the {design} draft of this target "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    return np.array(info["head_tokens"], dtype=np.int64)


def write_draft(draft, tokenizer, head_tokens: np.ndarray, report: dict, out: Path) -> None:
    """A Hugging Face folder (transformers loads it as is) plus what the exporter needs beyond it: the
    head tokens and, for a feature design, the projection of [embedding, feature] in its own file."""
    info = {"head_tokens": [int(t) for t in head_tokens], "training": report}
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(draft, Eagle3Draft):  # the published layout, a head without a tokenizer of its own
        write_head(draft, head_tokens, out)
        (out / DRAFT_INFO).write_text(json.dumps(info))
        return
    state = draft.state_dict()
    if hasattr(draft, "feature_fc"):

        save_file({"weight": draft.feature_fc.weight.detach().contiguous(),
                   "bias": draft.feature_fc.bias.detach().contiguous()}, str(out / FEATURE_FC_FILE))
        info["features"] = {"file": FEATURE_FC_FILE, "reads": "the target's final hidden state at the previous token"}
        state = {k: v for k, v in state.items() if not k.startswith("feature_fc.")}
    draft.save_pretrained(out, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / DRAFT_INFO).write_text(json.dumps(info))
