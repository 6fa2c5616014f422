"""Write a random-weight checkpoint of a named real model's shape (for cost measurements: the
step time of a model does not depend on its weights), with the embedded tokenizer when asked.

    python scripts/random_checkpoint.py --shape llama-3.1-8b --out /tmp/llama8b --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
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


def write_eagle3_head(target_dir: Path, out: Path, fmt: str = "safetensors", aux=(0, 1, 2), seed: int = 0,
                      draft_vocab: int = 100) -> dict:
    """A random EAGLE-3 head for the target at target_dir, saved like the published ones (config with
    draft_vocab_size and aux layer ids; fc, midlayer, norm, lm_head, d2t, t2d); -> its weights."""
    cfg = json.loads((target_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    cfg.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
               eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux)})
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    targets = torch.randperm(cfg["vocab_size"], generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[targets] = True
    state = {
        "fc.weight": w(h, 3 * h),
        "midlayer.input_layernorm.weight": 1 + w(h), "midlayer.hidden_norm.weight": 1 + w(h),
        "midlayer.post_attention_layernorm.weight": 1 + w(h),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": w(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": 1 + w(h), "lm_head.weight": w(draft_vocab, h),
        "d2t": targets - torch.arange(draft_vocab), "t2d": t2d,
    }
    if fmt == "safetensors":
        save_file(state, str(out / "model.safetensors"))
    else:
        torch.save(state, out / "pytorch_model.bin")
    return state


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
