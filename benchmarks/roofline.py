"""The memory-traffic limit of a decode step: the bytes a step must read (weights, and the KV of
its context) over the device's copy bandwidth, measured in the same run with a large copy."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.model.spec import ModelSpec

COPY_BYTES = 4 << 30  # large enough that launch overheads vanish, small next to an H200's memory


def copy_bandwidth(device: str, repeats: int = 10) -> float | None:
    """Bytes per second moved by a device-to-device copy, read and write both counted (the
    memory system's throughput); None off the GPU."""
    if device != "cuda":
        return None
    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES * repeats / seconds


@dataclass
class StepTraffic:
    weight_bytes: int   # every weight a decode step reads (the embedding table only row-wise)
    kv_bytes: int       # keys and values of the context, all layers
    bandwidth: float    # bytes per second
    limit_ms: float     # (weights + KV) / bandwidth

    def to_json(self) -> dict:
        return asdict(self)


def step_traffic(checkpoint: Path, dtype_bytes: int, context: int, bandwidth: float) -> StepTraffic:
    """Bytes of one batch-1 decode step of `checkpoint` at `context` tokens of KV."""
    s = ModelSpec.from_pretrained(checkpoint)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    per_layer = s.hidden_size * (2 * q + 2 * kv) + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size
    params = s.num_layers * per_layer + s.hidden_size + s.vocab_size * s.hidden_size  # + final norm, LM head
    weights = params * dtype_bytes
    kv_bytes = 2 * s.num_layers * kv * context * dtype_bytes
    return StepTraffic(weights, kv_bytes, bandwidth, 1e3 * (weights + kv_bytes) / bandwidth)
