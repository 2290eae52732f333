"""Tiny random models and a tiny tokenizer, built from a config: no network, seconds to make."""
from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Speculative decoding drafts tokens and verifies them in one pass of the target model.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt.",
    "{\"name\": \"edgespec\", \"tokens\": [1, 2, 3], \"ok\": true}",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 320


def make_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def make_model(folder: Path, arch: str = "llama", seed: int = 0, layers: int = 2, hidden: int = 64,
               tie: bool = True, **config_extra):
    """A random decoder of the given architecture with make_tokenizer's vocabulary, saved to `folder`.
    Heads are 16 wide, the narrowest onnxruntime's fused attention takes. `config_extra`: more config fields."""
    import torch
    import transformers

    folder = Path(folder)
    tokenizer = make_tokenizer(folder)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=hidden // 16, num_key_value_heads=max(1, hidden // 32),
                  max_position_embeddings=512, tie_word_embeddings=tie,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    config, cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    extra = {"sliding_window": 512} if arch == "mistral" else {}
    torch.manual_seed(seed)
    model = cls(config(**common, **extra, **config_extra)).eval()
    with torch.no_grad():  # random weights large enough that outputs vary and argmax ties never occur
        for param in model.parameters():
            param.normal_(0, 0.3) if param.dim() > 1 else None
        if arch == "qwen2":
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model
