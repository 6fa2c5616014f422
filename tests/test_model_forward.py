"""Our batched forward over the KV cache equals HF transformers' forward, for every shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.model.batch import ForwardBatch, causal_region
from specdec.model.kv_cache import KVCache
from specdec.model.loader import load_model


def with_random_norms(path: Path, out: Path) -> Path:
    """A copy of the checkpoint whose RMSNorm weights differ from one another (HF initialises
    them all to ones, which would hide a norm applied in the wrong place)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("fuse, invariant", [(False, False), (True, False), (True, True)],
                         ids=["reference", "fused", "fused-invariant"])
@pytest.mark.parametrize("shape", ["llama-gqa", "llama-tied", "qwen2-bias", "mistral"])
def test_prefill_then_incremental_equals_hf(shape, fuse, invariant, checkpoints, tmp_path):
    """fused: the GPU's forward structure (merged projections, residual adds fused with the norms,
    RoPE fused with the KV write) run with the kernels' torch references; invariant: with the
    batch-invariant layers swapped in (their references on the CPU)."""
    path = with_random_norms(checkpoints[shape], tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    ours = load_model(path, torch.float64, torch.device("cpu"), fuse=fuse, batch_invariant=invariant)
    assert ours.fused == fuse
    s = ours.spec
    cache = KVCache(s.num_layers, 3, 64, s.num_kv_heads, s.head_dim, torch.float64, torch.device("cpu"))
    torch.manual_seed(0)
    ids = torch.randint(0, s.vocab_size, (2, 20))
    ref = hf(ids).logits
    slots = torch.tensor([2, 0])

    def run(lo: int, hi: int) -> torch.Tensor:
        pos = torch.arange(lo, hi).expand(2, -1)
        batch = ForwardBatch.build(ids[:, lo:hi], pos, slots, pos, torch.full((2,), lo),
                                   causal_region(torch.full((2,), hi - lo), hi - lo))
        return ours(batch, cache)

    torch.testing.assert_close(run(0, 12), ref[:, :12], rtol=0, atol=1e-5)
    torch.testing.assert_close(run(12, 20), ref[:, 12:], rtol=0, atol=1e-5)  # reads the cached prefix


def test_ragged_batch_padding_does_not_leak(checkpoints):
    """A short prompt batched with a long one gets the same logits as alone."""
    ours = load_model(checkpoints["llama-gqa"], torch.float64, torch.device("cpu"))
    s = ours.spec
    cache = KVCache(s.num_layers, 2, 32, s.num_kv_heads, s.head_dim, torch.float64, torch.device("cpu"))
    short, long_ = torch.tensor([5, 6, 7]), torch.arange(10, 22)
    tokens = torch.zeros(2, 12, dtype=torch.long)
    tokens[0, :3], tokens[1] = short, long_
    pos = torch.arange(12).expand(2, -1)
    lengths = torch.tensor([3, 12])
    batch = ForwardBatch.build(tokens, pos, torch.tensor([0, 1]), pos, torch.zeros(2, dtype=torch.long),
                               causal_region(lengths, 12))
    together = ours(batch, cache)[0, :3]
    alone_batch = ForwardBatch.build(short[None], pos[:1, :3], torch.tensor([0]), pos[:1, :3],
                                     torch.zeros(1, dtype=torch.long), causal_region(lengths[:1], 3))
    torch.testing.assert_close(together, ours(alone_batch, cache)[0], rtol=0, atol=1e-9)


@pytest.mark.parametrize("fuse", [False, True], ids=["reference", "fused"])
def test_aux_hidden_states_equal_hf_hidden_states(fuse, checkpoints, tmp_path):
    """forward_with_aux captures, in the same pass, what HF's output_hidden_states calls the
    input of each layer (index L: after the last layer, before the final norm), and its logits
    are forward's."""
    path = checkpoints["llama-gqa"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    ours = load_model(path, torch.float64, torch.device("cpu"), fuse=fuse)
    s = ours.spec
    cache = KVCache(s.num_layers, 1, 32, s.num_kv_heads, s.head_dim, torch.float64, torch.device("cpu"))
    ids = torch.randint(0, s.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    pos = torch.arange(10)[None]
    batch = ForwardBatch.build(ids, pos, torch.tensor([0]), pos, torch.tensor([0]), causal_region(torch.tensor([10]), 10))
    layers = (0, 2, s.num_layers)
    logits, aux = ours.forward_with_aux(batch, cache, layers)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=1e-5)
    h = s.hidden_size
    for j, i in enumerate(layers):
        want = ref.hidden_states[i] if i < s.num_layers else None
        if want is not None:
            torch.testing.assert_close(aux[..., j * h:(j + 1) * h], want, rtol=0, atol=1e-9)
    # HF's last entry is after the final norm; ours is the stream before it: norm(ours) == HF's
    torch.testing.assert_close(ours.model.norm(aux[..., 2 * h:]), ref.hidden_states[-1], rtol=0, atol=1e-9)


def test_skinny_linear_equals_linear_at_every_row_count(checkpoints, monkeypatch):
    """The CPU's weight @ x^T path for 1-5 float32 rows (one row as two) computes the same Linear
    (bias included, any leading shape), other row counts and dtypes take F.linear, and load_model
    puts it on every projection on the CPU, tied weights still tied."""
    from torch.nn import functional as F

    from specdec.model.layers import SKINNY_ROWS, SkinnyLinear, replace_linears

    torch.manual_seed(0)
    real_mm, transposed = torch.mm, []
    monkeypatch.setattr(torch, "mm", lambda a, b: transposed.append(a.shape[0] == 40) or real_mm(a, b))
    for bias in (False, True):
        plain = torch.nn.Linear(24, 40, bias=bias)
        module = torch.nn.Sequential(plain)
        replace_linears(module, SkinnyLinear)
        skinny = module[0]
        assert type(skinny) is SkinnyLinear and skinny.weight is plain.weight
        for shape in [(1, 1), (1, 2), (1, 5), (2, 2), (3, 1), (1, 6), (4, 4), (7, 9)]:
            x = torch.randn(*shape, 24)
            transposed.clear()
            torch.testing.assert_close(skinny(x), F.linear(x, plain.weight, plain.bias), rtol=1e-5, atol=1e-5)
            assert transposed == ([True] if shape[0] * shape[1] in SKINNY_ROWS else []), shape
            transposed.clear()
            skinny.to(torch.bfloat16)(x.to(torch.bfloat16))   # bfloat16: F.linear at every row count
            assert transposed == [], shape
            skinny.float()
    assert list(SKINNY_ROWS) == [1, 2, 3, 4, 5]
    model = load_model(checkpoints["llama-tied"], torch.float32, torch.device("cpu"))
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
