"""Building blocks of the Llama family: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kernels.fused_norm import silu_and_mul
from kernels.invariant_matmul import invariant_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the reference implementation, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by explicit positions (tree nodes share positions by depth)."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [B, n] -> cos, sin: [B, n, head_dim]
        freqs = positions[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, n, H, D]; cos/sin: [B, n, D]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def fuse_projections(self) -> None:
        """gate and up projections as one matmul (forward_fused); the separate ones are dropped."""
        self.gate_up_proj = concat_linear([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the parts' outputs concatenated (same input)."""
    weight = torch.cat([p.weight.data for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=parts[0].bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias.data for p in parts]), requires_grad=False)
    return fused


class InvariantLinear(nn.Linear):
    """A Linear computed by the batch-invariant matmul (same parameters, same outputs up to rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)


SKINNY_ROWS = range(1, 6)


class SkinnyLinear(nn.Linear):
    """A Linear for the CPU that multiplies 1-5 float32 rows (a decode step, or a verify step's
    root and drafts, at batch 1) as weight @ x^T, one row as two. MKL on the 2-core AVX-512 dev VM
    multiplies so few rows badly the usual way: x @ weight^T at 2-5 rows costs 1.3-2x one row
    (about as if it read the weight once per row), and one row (its gemv) streams the weight at
    two thirds of the speed of weight @ x^T with two columns (SmolLM2's 30 layers + lm_head, cold
    weights: 45 ms as one row, 30 ms as two). SmolLM2's verify step of one token: 55 ms the usual
    way, 43 ms this way; of 2 / 3 / 5 tokens: 100 / 117 / 75 ms the usual way, 50 / 55 / 61 ms this
    way (two threads, when it was measured). From 9 rows F.linear is faster again.
    Same parameters; rounding may differ in the last bits. Float32 only: in bfloat16 (AVX-512 BF16)
    F.linear reads the weight once whatever the rows and weight @ x^T is the slower one (SmolLM2's
    3- / 5-token verify step 65 / 67 ms with it, 49 / 54 ms without; one token 48 ms)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in SKINNY_ROWS or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1:   # as two columns: MKL's two-column gemm outruns its gemv (see above)
            flat = flat.expand(2, -1).contiguous()
        y = torch.mm(self.weight, flat.t())[:, :rows].t().contiguous()   # [rows, out]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def replace_linears(model: nn.Module, cls: type[nn.Linear]) -> None:
    """Every plain nn.Linear in `model` becomes a `cls` over the same parameters (tied weights stay tied)."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                out = cls(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
                out.weight, out.bias = child.weight, child.bias
                setattr(module, name, out)
