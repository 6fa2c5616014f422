"""Write a random-weight checkpoint of a named real model's shape (for cost measurements: the
step time of a model does not depend on its weights), with the embedded tokenizer when asked.

    python scripts/random_checkpoint.py --shape llama-3.1-8b --out /tmp/llama8b --device cuda
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

SHAPES = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
}


def write_checkpoint(shape: dict, out: str | Path, device: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                     initializer_range: float = 0.02, max_position_embeddings: int = 8192,
                     edit: Callable[[torch.nn.Module], None] | None = None) -> int:
    """A random-weight Llama checkpoint of `shape` (LlamaConfig fields) in `out`, after `edit` (which
    may change weight values in place); -> parameter count."""
    cfg = LlamaConfig(max_position_embeddings=max_position_embeddings, initializer_range=initializer_range, **shape)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise on the GPU: minutes faster than on the CPU for 8B
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if edit is not None:
        with torch.no_grad():
            edit(model)
    model.save_pretrained(out)
    return sum(x.numel() for x in model.parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.perf_counter()
    params = write_checkpoint(SHAPES[a.shape], a.out, a.device, a.seed)
    print(f"{a.shape}: {params / 1e9:.2f}B parameters -> {a.out} ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
