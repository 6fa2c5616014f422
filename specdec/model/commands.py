"""The tensor-parallel leader's per-call command to the other ranks, sent over the collective
backend as tensors: no pickling, and on the GPU the step's tensors never visit the host.

A command is a name and a few arguments (ints, tensors or None). It travels as one fixed-size
int64 header (the command, then per argument its kind and an int or a tensor's dtype and shape),
followed by one broadcast per tensor argument straight from the leader's device memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

COMMANDS = ("stop", "allocate_kv", "forward", "move", "copy_prefix", "capture_cuda_graphs")
DTYPES = (torch.int64, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
          torch.int8)
NONE, INT, TENSOR = 0, 1, 2
MAX_ARGS, MAX_DIMS = 8, 4
FIELDS = 3 + MAX_DIMS                    # kind, int value or dtype code, ndim, dims
HEADER = 2 + MAX_ARGS * FIELDS           # command, argument count, arguments


def send(device: torch.device, name: str, *args) -> None:
    """Rank 0: broadcast `name(*args)` to the other ranks."""
    header = [COMMANDS.index(name), len(args)] + [0] * (MAX_ARGS * FIELDS)
    tensors = []
    for i, arg in enumerate(args):
        at = 2 + i * FIELDS
        if arg is None:
            header[at] = NONE
        elif isinstance(arg, torch.Tensor):
            if arg.dim() > MAX_DIMS:
                raise ValueError(f"{name}: a {arg.dim()}-d argument; at most {MAX_DIMS} dims travel")
            header[at: at + 3 + arg.dim()] = [TENSOR, DTYPES.index(arg.dtype), arg.dim(), *arg.shape]
            tensors.append(arg)
        else:
            header[at: at + 2] = [INT, int(arg)]
    dist.broadcast(torch.tensor(header, dtype=torch.long, device=device), src=0)
    for t in tensors:
        dist.broadcast(_wire(t.to(device).contiguous()), src=0)


def receive(device: torch.device) -> tuple[str, list]:
    """Ranks > 0: the next command and its arguments (tensors on `device`)."""
    header = torch.empty(HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    h = header.tolist()
    args = []
    for i in range(h[1]):
        kind, value, ndim, *dims = h[2 + i * FIELDS: 2 + (i + 1) * FIELDS]
        if kind == NONE:
            args.append(None)
        elif kind == INT:
            args.append(value)
        else:
            dtype = DTYPES[value]
            buf = _wire(torch.empty(dims[:ndim], dtype=dtype, device=device))
            dist.broadcast(buf, src=0)
            args.append(buf.view(torch.bool) if dtype == torch.bool else buf)
    return COMMANDS[h[0]], args


def _wire(t: torch.Tensor) -> torch.Tensor:
    """Bool tensors travel as bytes (not every backend reduces or broadcasts bool)."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t
