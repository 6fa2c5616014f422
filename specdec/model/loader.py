"""Load a Llama-family checkpoint directory (config.json + *.safetensors) into our model.

With tensor parallelism each rank reads only its own slices of the sharded tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from kernels.triton_support import use_triton

from specdec.model.layers import SkinnyLinear, replace_linears
from specdec.model.llama import LlamaForCausalLM
from specdec.model.parallel import TPLayout
from specdec.model.spec import ModelSpec

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,  # exact comparisons in tests
}


def load_model(
    checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device, rank: int = 0, world: int = 1,
    fuse: bool | None = None, batch_invariant: bool = False,
) -> LlamaForCausalLM:
    """fuse: the fused forward (merged projections, fused kernels); None = on CUDA with Triton,
    where its kernels run. Elsewhere the reference forward stays as it was.
    batch_invariant: batch-invariant matmuls and attention (LlamaForCausalLM.make_batch_invariant)."""
    checkpoint_dir = Path(checkpoint_dir)
    spec = ModelSpec.from_pretrained(checkpoint_dir)
    layout = TPLayout.for_rank(spec, rank, world)
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {checkpoint_dir}")
    with torch.device("meta"):
        model = LlamaForCausalLM(spec, layout)
    expected = model.state_dict().keys()
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                if "rotary_emb" in name:
                    continue
                state[name] = _read(st, name, layout, spec.head_dim).to(dtype)
                if name == "model.embed_tokens.weight" and spec.tie_word_embeddings and world > 1:
                    state["lm_head.weight"] = _read(st, name, layout, spec.head_dim, as_name="lm_head.weight").to(dtype)
    tied = spec.tie_word_embeddings and world == 1
    if tied:
        state.pop("lm_head.weight", None)
    wanted = {k for k in expected if not (tied and k == "lm_head.weight")}
    missing = sorted(wanted - state.keys())
    if missing:
        raise ValueError(f"checkpoint {checkpoint_dir} lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    unexpected = sorted(state.keys() - wanted)
    if unexpected:
        raise ValueError(f"checkpoint {checkpoint_dir} has unknown weights: {unexpected[:5]}")
    for name in wanted:
        if layout.reduces_bias(name) and rank != 0:
            state[name] = torch.zeros_like(state[name])
    model.load_state_dict({k: state[k] for k in wanted}, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary.inv_freq = spec.rope_inv_freq()[0]  # buffers are not in the checkpoint
    model = model.to(device).eval()
    if fuse if fuse is not None else use_triton(next(model.parameters())):
        model.fuse_projections()
    if batch_invariant:
        model.make_batch_invariant()
    elif device.type == "cpu":
        replace_linears(model, SkinnyLinear)
    return model


def _read(st, name: str, layout: TPLayout, head_dim: int, as_name: str | None = None) -> torch.Tensor:
    """The full tensor, or this rank's slice of it (the vocabulary's tail zero-padded)."""
    sharding = layout.shard(as_name or name, head_dim)
    if sharding is None:
        return st.get_tensor(name)
    dim, sl = sharding
    view = st.get_slice(name)
    size = view.get_shape()[dim]
    stop = min(sl.stop, size)
    part = view[sl.start:stop] if dim == 0 else view[:, sl.start:stop]
    pad = (sl.stop - sl.start) - (stop - sl.start)
    if pad:  # only the LM head's last shard: rows past the vocabulary
        part = torch.cat([part, part.new_zeros((pad, *part.shape[1:]))], dim=0)
    return part


def load_embeddings(checkpoint_dir: str | Path, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The token embedding table [V, h] alone (an EAGLE-3 drafter shares the target's)."""
    name = "model.embed_tokens.weight"
    for f in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            if name in st.keys():
                return st.get_tensor(name).to(dtype).to(device)
    raise FileNotFoundError(f"no {name} in the *.safetensors of {checkpoint_dir}")
