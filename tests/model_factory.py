"""Random-weight checkpoints of several shapes, plus a small byte-level BPE tokenizer, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

VOCAB = 384
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them.",
    "Grüße aus Köln! Ça va? 東京は晴れです。 Emojis: 🙂🚀",
    "def add(a, b):\n    return a + b\n",
] * 20

SHAPES = {
    # grouped-query attention, untied head
    "llama-gqa": lambda: LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    ),
    # tied embeddings, multi-head attention, llama3 rope scaling
    "llama-tied": lambda: LlamaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
    ),
    # Qwen2 with q/k/v biases
    "qwen2-bias": lambda: Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, tie_word_embeddings=False,
    ),
    "mistral": lambda: MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False,
    ),
}


def make_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out_dir)
    return fast


def make_checkpoint(out_dir: Path, shape: str, seed: int, num_layers: int | None = None) -> Path:
    """A random model of `shape` saved as a HF checkpoint dir with the test tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out_dir)
    cfg = SHAPES[shape]()
    cfg.vocab_size = VOCAB
    cfg.max_position_embeddings = 256
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    cfg.initializer_range = 0.2  # peaked logits: greedy argmax far from ties
    if num_layers is not None:
        cfg.num_hidden_layers = num_layers
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return out_dir


def hf_greedy(checkpoint: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The external reference: transformers generate(do_sample=False), float64, EOS ignored."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


def make_layer_subset_draft(target_dir: Path, out_dir: Path, layers: list[int]) -> Path:
    """A draft that keeps some of the target's layers (shares embeddings, norm, head, tokenizer)."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.model.layers = torch.nn.ModuleList(model.model.layers[i] for i in layers)
    model.config.num_hidden_layers = len(layers)
    for new_idx, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_idx
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    model.save_pretrained(out_dir)
    PreTrainedTokenizerFast.from_pretrained(target_dir).save_pretrained(out_dir)
    return out_dir


def make_tiny_vocab_checkpoint(out_dir: Path, seed: int, vocab: int = 6) -> Path:
    """A random Llama over a handful of tokens with spread-out distributions (sampling tests)."""
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=vocab, max_position_embeddings=64,
                      tie_word_embeddings=False, initializer_range=0.15)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir
