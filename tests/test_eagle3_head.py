"""EAGLE-3 heads in the layout their authors publish: a checkpoint written here with random
weights (config with draft_vocab_size and aux layer ids; fc, midlayer, norm, lm_head, d2t, t2d;
as model.safetensors or pytorch_model.bin) loads, and our head -- run through its KV cache in two
chunks -- computes what a plain full-sequence implementation of the published architecture
computes. Bad checkpoints are refused with what is wrong."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from specdec.model.batch import ForwardBatch, causal_region
from specdec.model.eagle3 import default_aux_layers, load_eagle3
from specdec.model.kv_cache import KVCache
from specdec.model.spec import ModelSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from random_checkpoint import write_eagle3_head  # noqa: E402

DRAFT_VOCAB = 100


def write_head(target_dir: Path, out: Path, fmt: str = "safetensors", aux=(0, 1, 2), seed: int = 0,
               draft_vocab: int = DRAFT_VOCAB) -> dict:
    """A random head for the target at target_dir (scripts/random_checkpoint.py); -> its weights."""
    return write_eagle3_head(target_dir, out, fmt, aux, seed, draft_vocab)


def reference(state: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor):
    """The published architecture over a whole sequence, plainly: embeds [n, h], hidden [n, 3h]."""
    eps, heads, kv = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    n, h = embeds.shape
    d = h // heads

    def rms(x, name):  # normalised in fp32, as Llama's RMSNorm does
        x32 = x.float()
        return state[name] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def lin(x, name):
        return x @ state[name].T

    hid = lin(hidden, "fc.weight")
    x = torch.cat([rms(embeds, "midlayer.input_layernorm.weight"), rms(hid, "midlayer.hidden_norm.weight")], -1)
    q = lin(x, "midlayer.self_attn.q_proj.weight").view(n, heads, d)
    k = lin(x, "midlayer.self_attn.k_proj.weight").view(n, kv, d)
    v = lin(x, "midlayer.self_attn.v_proj.weight").view(n, kv, d)
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # fp32 angles, as transformers has them
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = (torch.cat([f(ang)] * 2, -1)[:, None].double() for f in (torch.cos, torch.sin))

    def rope(t):
        return t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin

    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h)
    hh = hid + lin(attn, "midlayer.self_attn.o_proj.weight")
    m = rms(hh, "midlayer.post_attention_layernorm.weight")
    mlp = lin(torch.nn.functional.silu(lin(m, "midlayer.mlp.gate_proj.weight")) * lin(m, "midlayer.mlp.up_proj.weight"),
              "midlayer.mlp.down_proj.weight")
    out = hh + mlp
    return lin(rms(out, "norm.weight"), "lm_head.weight"), out


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_published_layout_loads_and_matches_the_architecture(fmt, checkpoints, tmp_path):
    target_dir = checkpoints["llama-gqa"]
    state = {k: v.double() if v.is_floating_point() else v for k, v in write_head(target_dir, tmp_path / "head", fmt).items()}
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    target = ModelSpec.from_pretrained(target_dir)
    head = load_eagle3(tmp_path / "head", target, torch.float64, torch.device("cpu"))
    assert head.spec.aux_layers == (1, 2, 3) and head.spec.draft_vocab_size == DRAFT_VOCAB  # outputs -> inputs

    torch.manual_seed(1)
    n, h = 9, target.hidden_size
    embeds, hidden = torch.randn(n, h, dtype=torch.float64), torch.randn(n, 3 * h, dtype=torch.float64)
    want_logits, want_out = reference(state, cfg, embeds, hidden)

    s = head.spec.layer
    cache = KVCache(1, 2, 32, s.num_kv_heads, s.head_dim, torch.float64, torch.device("cpu"))
    got_logits, got_out = [], []
    for lo, hi in ((0, 5), (5, 9)):  # the second chunk reads the first one's KV from the cache
        pos = torch.arange(lo, hi)[None]
        batch = ForwardBatch.build(torch.zeros_like(pos), pos, torch.tensor([1]), pos, torch.tensor([lo]),
                                   causal_region(torch.tensor([hi - lo]), hi - lo))
        logits, out = head(batch, cache, embeds[None, lo:hi], hidden[None, lo:hi], from_target=True)
        got_logits.append(logits[0])
        got_out.append(out[0])
    torch.testing.assert_close(torch.cat(got_logits), want_logits, rtol=0, atol=1e-9)
    torch.testing.assert_close(torch.cat(got_out), want_out, rtol=0, atol=1e-9)
    # drafting on from its own output: the hidden input is already the head's width (no fc)
    pos = torch.tensor([[9]])
    batch = ForwardBatch.build(pos, pos, torch.tensor([1]), pos, torch.tensor([9]), causal_region(torch.tensor([1]), 1))
    head(batch, cache, embeds[None, :1], got_out[-1][None, -1:], from_target=False)

    draft_ids = torch.tensor([0, 5, DRAFT_VOCAB - 1])
    assert head.to_target_ids(draft_ids).tolist() == state["t2d"].nonzero()[:, 0][draft_ids].tolist()


def test_default_aux_layers_and_bad_checkpoints(checkpoints, tmp_path):
    assert default_aux_layers(32) == (2, 16, 29)
    target_dir = checkpoints["llama-gqa"]
    target = ModelSpec.from_pretrained(target_dir)
    write_head(target_dir, tmp_path / "no-fc")
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "no-fc" / "model.safetensors"))
    del weights["fc.weight"]
    save_file(weights, str(tmp_path / "no-fc" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing.*fc.weight"):
        load_eagle3(tmp_path / "no-fc", target, torch.float32, torch.device("cpu"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "no-fc" / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_eagle3(tmp_path / "empty", target, torch.float32, torch.device("cpu"))
