"""What the draft learns from: the target's own continuations and its top-k probabilities at each token.

Running the target is the expensive part, so it happens once: each shard holds token sequences and, for
every supervised position, the target's k most likely next tokens with their log-probabilities. Training
then runs several epochs over the shards without the target. Shards are written one at a time
(`shard-00012.npz`, plain arrays, no pickle), so an interrupted run resumes after the last complete one.

Layout of one shard:
    tokens      int32 [total]           sequences back to back
    starts      int64 [S+1]             offsets of the sequences in `tokens`
    first       int64 [S]               first supervised position of each sequence (the prompt is context only)
    topk_ids    int32 [sup, k]          target's top-k next tokens at each supervised position, in order
    topk_logp   float16 [sup, k]        their log-probabilities under the target (full-vocabulary softmax)
Position j of a sequence is supervised when j >= first: the target's distribution there is over token j
given tokens[:j].
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class DataConfig:
    batch: int = 32
    max_new_tokens: int = 256
    max_prompt_tokens: int = 384
    top_k: int = 16
    prompts_per_shard: int = 64


def shard_paths(folder: Path) -> list[Path]:
    return sorted(folder.glob("shard-*.npz"))


def load_shard(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as shard:
        return {name: shard[name] for name in shard.files}


def _write_shard(path: Path, sequences: list[tuple[np.ndarray, int, np.ndarray, np.ndarray]]) -> None:
    tokens = [s[0] for s in sequences]
    partial = path.with_name(path.stem + ".partial.npz")
    np.savez(partial, tokens=np.concatenate(tokens).astype(np.int32),
             starts=np.cumsum([0] + [len(t) for t in tokens]).astype(np.int64),
             first=np.array([s[1] for s in sequences], dtype=np.int64),
             topk_ids=np.concatenate([s[2] for s in sequences]).astype(np.int32),
             topk_logp=np.concatenate([s[3] for s in sequences]).astype(np.float16))
    partial.replace(path)


class TorchTarget:
    """data's target operations on the transformers model with torch, on `device` (a GPU where one is
    lent): batches of `batch` prompts through `generate`, left-padded; the whole model's float weights."""

    def __init__(self, model, device: str = "cpu", batch: int = 32, pad_id: int = 0, taps=None):
        self.model, self.device, self.batch, self.pad_id = model.to(device), device, batch, pad_id
        self.taps = taps  # exporters/eagle3.py: FeatureTaps without fc, or None: the final hidden state

    def answers(self, prompts: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: set[int],
                admit=lambda index: True):
        """Greedy continuations of `prompts` with the top-k at every generated token, yielded as
        (index, sequence) while `admit` admits each batch's first prompt (engine.OnnxTarget's contract)."""
        for at in range(0, len(prompts), self.batch):
            if not admit(at):
                return
            made = self._answer_batch(prompts[at:at + self.batch], max_new_tokens, top_k, eos_ids)
            yield from enumerate(made, start=at)

    def _answer_batch(self, prompt_ids: list[list[int]], max_new_tokens: int, top_k: int, eos_ids: set[int]):
        width = max(len(p) for p in prompt_ids)
        input_ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompt_ids), width), dtype=torch.long)
        for row, ids in enumerate(prompt_ids):  # left padding keeps every prompt's last token at the same column
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids.to(self.device), attention_mask=attention.to(self.device),
                                      do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=self.pad_id,
                                      eos_token_id=sorted(eos_ids), output_logits=True, return_dict_in_generate=True)
        logits = torch.stack(out.logits, dim=1)  # [B, steps, V]: step j predicts generated token j
        ids, logp = _topk(logits, top_k)
        generated = out.sequences[:, width:].cpu().numpy()
        sequences = []
        for row, prompt in enumerate(prompt_ids):
            length = len(generated[row])
            for j, token in enumerate(generated[row]):
                if int(token) in eos_ids:
                    length = j + 1  # the end of turn is a prediction the draft must make too
                    break
            tokens = np.concatenate([np.array(prompt), generated[row, :length]])
            sequences.append((tokens, len(prompt), ids[row, :length], logp[row, :length]))
        return sequences

    def teacher_forced(self, rows: list[np.ndarray], top_k: int, batch: int = 8) -> list:
        """The target's top-k at every position of each (equally long) row but the last."""
        out = []
        for at in range(0, len(rows), batch):
            chunk = torch.tensor(np.stack(rows[at:at + batch]), dtype=torch.long)
            with torch.inference_mode():
                logits = self.model(input_ids=chunk.to(self.device)).logits[:, :-1]  # position j predicts j + 1
            ids, logp = _topk(logits, top_k)
            out += [(row.numpy(), 1, ids[i], logp[i]) for i, row in enumerate(chunk)]
        return out

    def features(self, rows: list[np.ndarray], batch: int = 8) -> list[np.ndarray]:
        """The final hidden state [len, H] at every token of each row; with `taps`, the residual streams entering
        those layers, concatenated [len, 3H]."""
        out = []
        for at in range(0, len(rows), batch):
            chunk = rows[at:at + batch]
            width = max(len(r) for r in chunk)
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, row in enumerate(chunk):  # right padding: causal rows never see it
                ids[r, :len(row)] = torch.from_numpy(np.asarray(row, np.int64))
                mask[r, :len(row)] = 1
            with torch.inference_mode():
                hidden = self.model.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                          output_hidden_states=self.taps is not None)
            if self.taps is None:
                hidden = hidden.last_hidden_state.float().cpu().numpy()
            else:  # hidden_states[l] enters layer l (taps stop below the last layer: eagle3_head.target_taps)
                hidden = torch.cat([hidden.hidden_states[l] for l in self.taps.layers], dim=-1).float().cpu().numpy()
            out += [hidden[r, :len(row)] for r, row in enumerate(chunk)]
        return out


def _topk(logits, k: int):
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, k, dim=-1)
    return ids.cpu().numpy(), values.cpu().numpy()


def _fill_shards(folder: Path, items: list, per_shard: int, deadline: float, run_shard, progress=None) -> int:
    """Writes shards of `per_shard` items each, after those already in `folder`, until the items or the
    time run out; `run_shard(items)` returns their sequences. Returns how many shards were written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for shard_index in range(len(shard_paths(folder)), len(items) // per_shard):
        if time.time() >= deadline:
            break
        sequences = run_shard(items[shard_index * per_shard:(shard_index + 1) * per_shard])
        if progress is not None:
            progress(sum(len(s[2]) for s in sequences))
        _write_shard(folder / f"shard-{shard_index:05d}.npz", sequences)
        written += 1
    return written


def end_of_turn_ids(tokenizer) -> set[int]:
    return {int(tokenizer.eos_token_id)} | {int(i) for i in tokenizer.convert_tokens_to_ids(["<|im_end|>"])
                                           if i is not None and i >= 0}


def generate_shards(target, tokenizer, prompts: list[str], folder: Path, config: DataConfig,
                    deadline: float, progress=None) -> int:
    """Greedy answers of `target` (TorchTarget or engine.OnnxTarget) to `prompts`, written shard after
    shard, in order, as each shard's answers are all in; a shard starts only before `deadline`, and one
    that started is finished. Returns shards written."""
    eos_ids = end_of_turn_ids(tokenizer)
    per_shard = config.prompts_per_shard
    folder.mkdir(parents=True, exist_ok=True)
    done_before = len(shard_paths(folder))
    encoded = []
    for start in range(done_before * per_shard, len(prompts) - per_shard + 1, per_shard):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=False) for p in prompts[start:start + per_shard]]
        # sorted by length within a shard: similar lengths in a batch waste less on padding
        # (the template supplies every special token itself: no extra BOS)
        encoded += sorted((tokenizer.encode(t, add_special_tokens=False)[-config.max_prompt_tokens:] for t in texts),
                          key=len)
    if not encoded or time.time() >= deadline:
        return 0
    pending: dict[int, dict[int, tuple]] = {}
    written = 0
    admit = lambda index: index % per_shard != 0 or time.time() < deadline  # noqa: E731
    for index, sequence in target.answers(encoded, config.max_new_tokens, config.top_k, eos_ids, admit):
        pending.setdefault(index // per_shard, {})[index % per_shard] = sequence
        while len(pending.get(written, ())) == per_shard:
            sequences = [pending[written][i] for i in range(per_shard)]
            _write_shard(folder / f"shard-{done_before + written:05d}.npz", sequences)
            if progress is not None:
                progress(sum(len(s[2]) for s in sequences))
            del pending[written]
            written += 1
    return written


def corpus_windows(tokenizer, files: list[Path], window: int, limit: int, seed: int) -> list[np.ndarray]:
    """Token windows of local text (code, prose): the target is run over them teacher-forced."""
    rng = np.random.default_rng(seed)
    windows = []
    for path in [files[i] for i in rng.permutation(len(files))]:
        if len(windows) >= limit:
            break
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # binary or non-UTF-8 files carry no usable text
        ids = tokenizer.encode(text, add_special_tokens=False)
        windows.extend(np.array(ids[i:i + window]) for i in range(0, len(ids) - window + 1, window))
    return windows[:limit]


def teacher_forced_shards(target, windows: list[np.ndarray], folder: Path, config: DataConfig, deadline: float,
                          progress=None) -> int:
    """The target's top-k at every position of each window (a prefill, no generation)."""
    return _fill_shards(folder, windows, config.prompts_per_shard, deadline,
                        lambda shard: target.teacher_forced(shard, config.top_k), progress)


def feature_file(features_dir: Path, shard: Path) -> Path:
    """Where the features of a shard's tokens live: one [tokens, H] float16 array per shard."""
    return features_dir / shard.parent.name / f"{shard.stem}.npy"


def link_features(source_dir: Path, shards: list[Path], features_dir: Path) -> int:
    """The feature files of `shards` that `source_dir` holds and `features_dir` lacks, hard-linked (copied
    where the file system cannot link); each appears whole or not at all. Returns how many."""
    linked = 0
    for shard in shards:
        source, out = feature_file(source_dir, shard), feature_file(features_dir, shard)
        if not source.is_file() or out.is_file():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.stem + ".partial.npy")
        partial.unlink(missing_ok=True)
        try:
            os.link(source, partial)
        except OSError:  # another file system, or one without hard links
            shutil.copyfile(source, partial)
        partial.replace(out)
        linked += 1
    return linked


def feature_shards(target, shards: list[Path], features_dir: Path, deadline: float, progress=None) -> int:
    """The target's final hidden state at every token of each shard (teacher-forced), for drafts that
    read the target's features: one float16 [tokens, H] array per shard, written after the shard's
    last sequence, so an interrupted run resumes with the next shard. Returns how many were written."""

    written = 0
    for shard_path in shards:
        out = feature_file(features_dir, shard_path)
        if out.is_file():
            continue
        if time.time() >= deadline:
            break
        shard = load_shard(shard_path)
        bounds = list(zip(shard["starts"][:-1], shard["starts"][1:]))
        by_length = sorted(range(len(bounds)), key=lambda i: bounds[i][1] - bounds[i][0])
        hidden = target.features([shard["tokens"][bounds[i][0]:bounds[i][1]] for i in by_length])
        features = np.zeros((len(shard["tokens"]), hidden[0].shape[1]), np.float16)
        for i, rows in zip(by_length, hidden):
            features[bounds[i][0]:bounds[i][1]] = rows
        if progress is not None:
            progress(len(shard["tokens"]))
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.stem + ".partial.npy")
        np.save(partial, features)
        partial.replace(out)
        written += 1
    return written
