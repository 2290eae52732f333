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
               tie: bool = True, random_norms: bool = False, **config_extra):
    """A random decoder of the given architecture with make_tokenizer's vocabulary, saved to `folder`.
    Heads are 16 wide, the narrowest onnxruntime's fused attention takes. `config_extra`: more config fields."""
    import torch
    import transformers

    folder = Path(folder)
    tokenizer = make_tokenizer(folder)
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=hidden // 16, num_key_value_heads=max(1, hidden // 32),
                  head_dim=16, max_position_embeddings=512, tie_word_embeddings=tie,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    extra = {"sliding_window": 512} if arch == "mistral" else {}
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(arch, **{**common, **extra, **config_extra})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # random weights large enough that outputs vary and argmax ties never occur
        for param in model.parameters():
            param.normal_(0, 0.3) if param.dim() > 1 else None
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
            elif random_norms and name.endswith("norm.weight"):  # so a norm read wrongly shows
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    return model


# Per family (its transformers model_type), a tiny config that exercises what the family adds: windows
# shorter than the tests' prompts, per-layer rope tables, NoPE layers, multipliers, soft-capping.
WINDOW = 48
FAMILY_CONFIGS = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}},
    "mistral": {"sliding_window": WINDOW},
    "ministral": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "qwen3": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "phi3": {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,  # a rotary half of 8 (the op's unit)
             "sliding_window": WINDOW, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5}},
    "gemma": {"hidden_activation": "gelu_pytorch_tanh"},
    "gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24, "attn_logit_softcapping": 5.0,
               "final_logit_softcapping": 3.0},
    "gemma3_text": {"sliding_window": WINDOW, "query_pre_attn_scalar": 24,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "smollm3": {"no_rope_layers": [1, 0]},
    "granite": {"embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5,
                "logits_scaling": 4.0},
    "olmo2": {},
    "olmo3": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
}
