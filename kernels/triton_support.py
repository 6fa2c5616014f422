"""Whether the Triton kernels run: on CUDA tensors with Triton installed; the torch references
run everywhere else. (Tests call the kernels on CPU through TRITON_INTERPRET=1, see conftest.)

The kernels mark their size arguments (tree sizes, layer index, lengths) `do_not_specialize`:
Triton would otherwise compile a variant per value class (== 1, divisible by 16) of each, which
a serving process meets one by one as batches change.
"""

from __future__ import annotations

import torch

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - e.g. macOS
    HAVE_TRITON = False


def use_triton(*tensors: torch.Tensor) -> bool:
    return HAVE_TRITON and all(t.is_cuda for t in tensors)
