"""Tensors in protocol messages (TensorPayload: dtype name, shape, raw little-endian bytes): the
engines' side only (the gateway forwards payloads without decoding them, and imports no torch)."""

from __future__ import annotations

import torch

from specdec.rpc import common_pb2

# Raw little-endian bytes of each dtype a TensorPayload may carry, viewed as an integer type of the
# same width where numpy has no such float (bfloat16).
_PAYLOAD_DTYPES = {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.float16),
                   "float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64)}


def tensor_to_payload(t: torch.Tensor) -> common_pb2.TensorPayload:
    name = str(t.dtype).removeprefix("torch.")
    raw = t.detach().cpu().contiguous().view(_PAYLOAD_DTYPES[name][1]).numpy().tobytes()
    return common_pb2.TensorPayload(dtype=name, shape=list(t.shape), data=raw)


def payload_to_tensor(msg: common_pb2.TensorPayload) -> torch.Tensor:
    if msg.dtype not in _PAYLOAD_DTYPES:
        raise ValueError(f"tensor payload dtype {msg.dtype!r} is not one of {sorted(_PAYLOAD_DTYPES)}")
    dtype, raw = _PAYLOAD_DTYPES[msg.dtype]
    flat = torch.frombuffer(bytearray(msg.data), dtype=raw) if msg.data else torch.empty(0, dtype=raw)
    return flat.view(dtype).reshape(tuple(msg.shape))
