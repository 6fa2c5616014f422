"""The input of one batched forward: new tokens of many sequences with their KV placement.

Every query sees (a) all KV entries of its sequence below `prefix_len`, and (b) inside the
"region" of KV positions [prefix_len, prefix_len + R) exactly the entries `region_mask` allows.
A chain is a causal region, a tree an ancestor mask; padding queries see only themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    tokens: torch.Tensor       # [B, n] int64
    positions: torch.Tensor    # [B, n] int64, RoPE positions
    slots: torch.Tensor        # [B] int64, KV slot per sequence
    write_pos: torch.Tensor    # [B, n] int64, KV position each new token is stored at
    prefix_len: torch.Tensor   # [B] int64
    region_mask: torch.Tensor  # [B, n, R] bool
    kv_len: int                # keys read per sequence: max over the batch of the highest position + 1

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, n, kv_len] bool: True where a query may attend to a key."""
        return visibility_mask(self.prefix_len, self.region_mask, self.kv_len)

    @classmethod
    def build(
        cls,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        write_pos: torch.Tensor,
        prefix_len: torch.Tensor,
        region_mask: torch.Tensor,
        kv_len: int | None = None,
    ) -> ForwardBatch:
        """kv_len: the engines pass it from host-side lengths; left out, it is read back from the
        device (a synchronisation: tests and tools only)."""
        if kv_len is None:
            kv_len = int(torch.maximum(write_pos.max(), (prefix_len - 1).max()).item()) + 1
        return cls(tokens, positions, slots, write_pos, prefix_len, region_mask, kv_len)


def visibility_mask(prefix_len: torch.Tensor, region_mask: torch.Tensor, kv_len: int) -> torch.Tensor:
    """prefix_len [B], region_mask [B, n, R] -> [B, 1, n, kv_len] bool (see the module docstring)."""
    key_pos = torch.arange(kv_len, device=region_mask.device)  # [T]
    prefix = prefix_len[:, None]                                # [B, 1]
    rel = key_pos[None, :] - prefix                              # [B, T]
    region_size = region_mask.shape[-1]
    in_region = (rel >= 0) & (rel < region_size)
    idx = rel.clamp(0, region_size - 1)[:, None, :].expand(-1, region_mask.shape[1], -1)
    region_ok = torch.gather(region_mask, 2, idx) & in_region[:, None, :]
    visible = (key_pos[None, None, :] < prefix[:, :, None]) | region_ok
    return visible[:, None]


def causal_region(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[B, n, n] causal mask for ragged chains of `lengths` tokens; padding rows see only themselves."""
    idx = torch.arange(n, device=lengths.device)
    causal = idx[None, :, None] >= idx[None, None, :]
    real = idx[None, :] < lengths[:, None]                     # [B, n]
    eye = torch.eye(n, dtype=torch.bool, device=lengths.device)
    return torch.where(real[:, :, None], causal & real[:, None, :], eye[None])


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: pinned memory, non-blocking copy
    (a plain copy from pageable memory synchronises the stream)."""
    if device.type != "cuda":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def upload_list(values: list[int], device: torch.device) -> torch.Tensor:
    """[len(values)] int64 on `device`, see upload."""
    return upload(torch.tensor(values, dtype=torch.long), device)


def upload_feeds(feeds: list[list[int]], starts: list[int], slots: list[int], device: torch.device,
                 width: int = 0) -> tuple[torch.Tensor, ...]:
    """A forward's ragged token feeds, their KV start positions and slots, in one host-to-device
    copy -> (tokens [B, n] zero-padded to the longest feed or `width`, lengths [B], starts [B], slots [B])."""
    n = max(width, *(len(f) for f in feeds))
    return tuple(upload_packed([torch.tensor([f + [0] * (n - len(f)) for f in feeds], dtype=torch.long),
                                torch.tensor([len(f) for f in feeds], dtype=torch.long),
                                torch.tensor(starts, dtype=torch.long), torch.tensor(slots, dtype=torch.long)],
                               device))


def rows_of(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for a host list of row indices: no copy where the rows are all of t, else one
    non-blocking upload (indexing with a Python list copies from pageable memory and so waits for
    the stream: 0.5 ms of a drafter's batch-32 step on an H100)."""
    return t if rows == list(range(t.shape[0])) else t[upload_list(rows, t.device)]


def upload_packed(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors -> the same on `device`, moved in one copy (views of one device buffer):
    a step's small inputs cost one transfer, not one each."""
    flat = upload(torch.cat([p.reshape(-1) for p in parts]), device)
    return [v.view(p.shape) for v, p in zip(flat.split([p.numel() for p in parts]), parts)]


class PinnedStaging:
    """Host buffers a step fills for its uploads, kept from step to step: allocating pinned memory
    costs far more than the copy it serves. Reuse is safe because every step of the engines that use
    them ends with a read-back on the same stream, which waits for the step's copies."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor of `shape` (the same memory as the last call with `name`)."""
        n = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(max(n, 2 * (0 if buf is None else buf.numel())), dtype=dtype,
                                                   pin_memory=self.pinned)
        return buf[:n].view(shape)


class PackedStatics:
    """A CUDA graph's int64 inputs as views of one device buffer, loaded from the host in one copy
    (through a pinned buffer of its own, see PinnedStaging).
    fills: (shape, value) per input, the value it holds at capture and in padding rows."""

    def __init__(self, fills: list[tuple[tuple[int, ...], int]], device: torch.device) -> None:
        sizes = [math.prod(shape) for shape, _ in fills]
        self.fills = fills
        self.buffer = torch.empty(sum(sizes), dtype=torch.long, device=device)
        self.host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
        # the last upload from `host`: a second load before a read-back (one graph replayed for
        # several chunks of a step) must not refill it while that copy may still be pending
        self.uploaded = torch.cuda.Event() if device.type == "cuda" else None
        self.views = [v.view(shape) for v, (shape, _) in zip(self.buffer.split(sizes), fills)]
        for v, (_, value) in zip(self.views, fills):
            v.fill_(value)

    def load(self, parts: list[torch.Tensor]) -> None:
        """parts: host tensors [B, ...] in the views' order, B up to the views' rows; the rows past
        B get each view's fill value."""
        padded = [p if p.shape[0] == shape[0] else torch.cat([p, p.new_full((shape[0] - p.shape[0], *shape[1:]), value)])
                  for p, (shape, value) in zip(parts, self.fills)]
        if self.uploaded is not None:
            self.uploaded.synchronize()   # at once unless this step loaded these statics before
        torch.cat([p.reshape(-1) for p in padded], out=self.host)
        self.buffer.copy_(self.host, non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record()
