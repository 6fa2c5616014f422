"""Sampling: per-sequence parameters, the processed (temperature / top-k / top-p) distribution,
and counter-based random numbers.

Random numbers are a hash of (sequence seed, token position, purpose), not a stateful generator:
the same seed gives the same output whatever else shares the batch, and a draw is never reused
for a different decision. Greedy (temperature 0) is the one-hot distribution at the argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specdec.model.batch import upload, upload_list
from specdec.sampling_params import GREEDY, SamplingParams  # noqa: F401  (re-exported)

# Purposes ("salts") of a draw at one position.
DRAFT = 1       # the drafter samples a chain token
RESIDUAL = 2    # the verifier samples the bonus / corrected token (also plain decoding)
ACCEPT = 3      # the verifier's accept test of a draft node; + 16 * sibling rank
MASK32 = 0xFFFFFFFF




def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits [B, n, V] -> probabilities [B, n, V] (fp32+) under each row's sampling parameters."""
    b, _, v = logits.shape
    dev = logits.device
    greedy = upload(torch.tensor([p.greedy for p in params]), dev)
    temp = upload(torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=logits.dtype), dev)
    # Shifted by the row's max first (softmax and top-k are unchanged by it): a tiny temperature
    # (any float32 down to the subnormals passes validation) would otherwise overflow logits / t
    # to inf and the softmax to NaN; shifted, the largest stays 0 and the others only go down.
    x = (logits - logits.amax(-1, keepdim=True)) / temp.clamp(min=torch.finfo(logits.dtype).tiny)[:, None, None]
    if any(0 < p.top_k < v for p in params):  # decided on the host: no device read
        top_k = upload_list([p.top_k if 0 < p.top_k < v else v for p in params], dev)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, (top_k - 1)[:, None, None].expand(b, x.shape[1], 1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(0 < p.top_p < 1 for p in params):
        top_p = upload(torch.tensor([p.top_p if 0 < p.top_p < 1 else 1.0 for p in params], dtype=probs.dtype), dev)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p           # mass strictly above each token
        keep_sorted = before < top_p[:, None, None]       # always keeps the most likely token
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None, None], one_hot, probs)


def _mix(x):
    """A 32-bit integer hash (int64 tensors or numpy arrays holding values < 2**32)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def uniforms(seeds, positions, salt):
    """Uniform draws in (0, 1), float64: seeds [B] (int64 bit patterns), positions [B, m] -> [B, m].
    Torch tensors on any device, or int64 numpy arrays for host-only callers (the same draws)."""
    lo, hi = seeds & MASK32, (seeds >> 32) & MASK32
    key = _mix(_mix(lo ^ _mix(hi + 0x9E3779B9))[:, None] ^ (positions & MASK32)) ^ (salt * 0x85EBCA6B & MASK32)
    a = _mix(key ^ 0x68E31DA4) >> 5     # two 32-bit draws -> 53 bits
    c = _mix(key ^ 0xB5297A4D) >> 6
    a, c = (a.astype(np.float64), c.astype(np.float64)) if isinstance(a, np.ndarray) else (a.double(), c.double())
    return (a * 67108864.0 + c + 0.5) / 9007199254740992.0


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V] (any non-negative mass), u [B] -> tokens [B]."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp(max=probs.shape[-1] - 1)


def seed_tensor(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """uint64 seeds as int64 bit patterns [B]."""
    return upload_list([p.seed - (1 << 64) if p.seed >= (1 << 63) else p.seed for p in params], device)
