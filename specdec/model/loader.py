"""Load a Llama-family checkpoint directory (config.json + *.safetensors) into our model."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from specdec.model.llama import LlamaForCausalLM
from specdec.model.spec import ModelSpec

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # exact comparisons in tests
}


def load_model(checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    checkpoint_dir = Path(checkpoint_dir)
    spec = ModelSpec.from_pretrained(checkpoint_dir)
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir}")
    with torch.device("meta"):
        model = LlamaForCausalLM(spec)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                state[name] = st.get_tensor(name).to(dtype)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(k for k in state.keys() - expected if "rotary_emb" not in k)
    if unexpected:
        raise ValueError(f"checkpoint {checkpoint_dir} has unknown weights: {unexpected[:5]}")
    model.load_state_dict({k: state[k] for k in expected}, strict=False, assign=True)
    if spec.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.inv_freq = spec.rope_inv_freq()[0]  # buffers are not in the checkpoint
    return model.to(device).eval()
