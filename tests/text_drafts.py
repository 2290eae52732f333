"""Tiny drafts whose tokenizer differs from tests/tiny.py's: built from a config or from the target itself."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tiny import CHAT_TEMPLATE, CORPUS, make_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(folder: Path, vocab: int, byte_level: bool = True, corpus=CORPUS):
    """A BPE of `vocab` tokens trained on `corpus`, saved as a Hugging Face tokenizer in `folder` (replacing one
    there). Not byte-level: whitespace-split words and [UNK] for what it never saw (it cannot give text back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if byte_level:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS + ([] if byte_level else ["[UNK]"]),
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>" if byte_level else "[UNK]", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_other_draft(folder: Path, vocab: int = 400, byte_level: bool = True, seed: int = 1):
    """A random one-layer draft whose tokenizer is trained anew (other merges, other ids)."""
    make_model(folder, "llama", seed=seed, layers=1, hidden=32, vocab_size=vocab)
    train_tokenizer(folder, vocab, byte_level, corpus=[text.upper() + text for text in CORPUS])
    return folder


def make_bytes_model(folder: Path, seed: int = 0):
    """A target whose tokenizer is bytes alone (no merges: every text has one tokenization), whose greedy choice is
    always a printable ASCII byte (the rows of other bytes are zero in its tied embedding)."""
    import torch
    from transformers import AutoModelForCausalLM

    make_model(folder, "llama", seed=seed, vocab_size=len(SPECIALS) + 256)
    train_tokenizer(folder, len(SPECIALS) + 256, corpus=["a"])
    model = AutoModelForCausalLM.from_pretrained(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    printable = {chr(b) for b in range(32, 127)} | {"\n"}
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        for token, i in vocab.items():
            if i >= len(SPECIALS) and _text(token) not in printable:
                embed[i] = 0
    model.save_pretrained(folder)
    return folder


def permuted_copy(source: Path, folder: Path, seed: int = 0):
    """The model at `source` with its vocabulary's ids shuffled (special tokens kept): the same model over text,
    a tokenizer that differs id for id. Its embedding (tied) rows follow the ids."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    ids = sorted(i for i in vocab.values() if i >= len(SPECIALS))
    perm = dict(zip(ids, np.random.default_rng(seed).permutation(ids).tolist()))
    data["model"]["vocab"] = {t: perm.get(i, i) for t, i in vocab.items()}
    (folder / "tokenizer.json").write_text(json.dumps(data))
    model = AutoModelForCausalLM.from_pretrained(source)
    with torch.no_grad():
        embed = model.get_input_embeddings().weight
        moved = embed.clone()
        for old, new in perm.items():
            moved[new] = embed[old]
        embed.copy_(moved)
    model.save_pretrained(folder)
    return folder


def _text(token: str) -> str:
    """A byte-level token's text (its characters are bytes in GPT-2's printable mapping)."""
    from tokenizers import decoders

    return decoders.ByteLevel().decode([token])
