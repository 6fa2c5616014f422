"""Tensors in protocol messages (TensorPayload: dtype name, shape, raw little-endian bytes): the
engines' side only (the gateway forwards payloads without decoding them, and imports no torch).
A step carries one payload per sequence, so both directions keep the per-payload work to a few
calls: encoding views the rows as raw integers without copies, and decoding a step's payloads
copies their bytes once into one tensor and splits it. A uint8 tensor is rows packed by
specdec/model/fp8_rows.py (float8 values and a scale per row), sent as such and decoded as such: the drafter
dequantizes them on its device."""

from __future__ import annotations

import math

import torch

from specdec.rpc import common_pb2

# Rows packed by specdec/model/fp8_rows.py travel as uint8 [n, A + 4] under this dtype name.
FP8_ROWS = "float8_e4m3fn_rows"

# Raw little-endian bytes of each dtype a TensorPayload may carry, viewed as an integer type of the
# same width where numpy has no such float (bfloat16).
_PAYLOAD_DTYPES = {"bfloat16": (torch.bfloat16, torch.int16), "float16": (torch.float16, torch.float16),
                   "float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
                   FP8_ROWS: (torch.uint8, torch.uint8)}


def tensor_to_payload(t: torch.Tensor) -> common_pb2.TensorPayload:
    msg = common_pb2.TensorPayload()
    fill_payload(msg, t)
    return msg


def fill_payload(msg: common_pb2.TensorPayload, t: torch.Tensor) -> None:
    """msg := t, in place (a payload built apart and passed to its parent's constructor would be
    copied once more, bytes and all)."""
    name = FP8_ROWS if t.dtype == torch.uint8 else str(t.dtype).removeprefix("torch.")
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    msg.dtype = name
    msg.shape[:] = t.shape
    msg.data = t.view(_PAYLOAD_DTYPES[name][1]).numpy().tobytes()


def payload_to_tensor(msg: common_pb2.TensorPayload) -> torch.Tensor:
    return payloads_to_tensors([msg])[0]


def payloads_to_tensors(msgs: list[common_pb2.TensorPayload]) -> list[torch.Tensor]:
    """Decode a step's payloads: one copy of all their bytes when they share a dtype and a row
    width (the usual case: one verifier's hidden states), else one copy each."""
    datas = [m.data for m in msgs]
    for m, data in zip(msgs, datas):
        if m.dtype not in _PAYLOAD_DTYPES:
            raise ValueError(f"tensor payload dtype {m.dtype!r} is not one of {sorted(_PAYLOAD_DTYPES)}")
        need = math.prod(m.shape) * _PAYLOAD_DTYPES[m.dtype][1].itemsize
        if len(data) != need:
            raise ValueError(f"tensor payload of shape {list(m.shape)} and dtype {m.dtype} needs {need} bytes, "
                             f"it has {len(data)}")
    width = msgs[0].shape[1] if msgs and len(msgs[0].shape) == 2 else 0
    if len(msgs) > 1 and width and all(m.dtype == msgs[0].dtype and list(m.shape[1:]) == [width] for m in msgs):
        rows = _decode(msgs[0].dtype, bytearray().join(datas)).view(-1, width)
        return list(rows.split([m.shape[0] for m in msgs]))
    return [_decode(m.dtype, bytearray(data)).reshape(tuple(m.shape)) for m, data in zip(msgs, datas)]


def _decode(dtype: str, data: bytearray) -> torch.Tensor:
    """Flat tensor over `data` (no copy; empty data gives an empty tensor)."""
    real, raw = _PAYLOAD_DTYPES[dtype]
    flat = torch.frombuffer(data, dtype=raw) if data else torch.empty(0, dtype=raw)
    return flat.view(real)
