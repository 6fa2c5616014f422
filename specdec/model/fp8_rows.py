"""Hidden-state rows packed to float8 for the wire: the verifier packs the rows a verdict carries
on its device, the drafter unpacks them on its own. Half of bf16's bytes on every hop between them
(verifier -> gateway -> drafter), which at high concurrency is most of what a step's transport
costs (BENCHMARKS.md); drafts only, so the output stays lossless."""

from __future__ import annotations

import torch

FP8_MAX = 448.0   # the largest float8_e4m3fn magnitude


def quantize_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., A] float -> [..., A + 4] uint8, on t's device: per row, A float8_e4m3fn values scaled
    so that the row's largest magnitude is FP8_MAX, then that float32 scale (value = fp8 x scale).
    Half of bf16's bytes; what a draft head reads changes by ~2^-4 relative, which left the shipped
    head's acceptance unchanged (BENCHMARKS.md). Drafts only: the output stays lossless."""
    x = t.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / FP8_MAX        # [..., 1]
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], -1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_rows' [..., A + 4] uint8 -> [..., A] in dtype, on packed's device."""
    width = packed.shape[-1] - 4
    scale = packed[..., width:].contiguous().view(torch.float32)               # [..., 1]
    return (packed[..., :width].view(torch.float8_e4m3fn).float() * scale).to(dtype)
