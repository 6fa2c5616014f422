"""glibc's malloc tuned for a server whose steps build and free messages of tens of MB.

Every speculative step carries hidden-state rows (EAGLE-3) from the verifier to the gateway and
on to the drafter, and each hop serializes, parses and copies them: a verdict message at batch 64
is ~1 MB (four fp8 rows of an 8B target a request), a wave of 32 prompts of 64 tokens 16.8 MB
(bf16, projected). By default glibc serves a large allocation with a fresh mmap, or gives the
heap's freed top back to the kernel, so such buffers are faulted in page by page at every step and
the copies cost far more than their bytes. On the dev VM: serializing that 1 MB verdict message
took 1.2 ms (batch 32, 0.5 MB: 0.58 ms; batch 16: 0.01 ms), 0.06 ms with the settings below; one
16 MB payload 7.0 ms (64 MB: 50 ms) where the same bytes copied in 0.7 ms; a 32-prompt wave's rows
42 ms of CPU over the three hops (verdict built, serialized, parsed, copied into the draft message,
serialized, parsed, decoded), 15 ms with them. The settings: no mmap for large blocks, the heap's
top trimmed only above 1 GiB.

Through the services on the GPU host the gain is smaller than those hops suggest (the services'
own allocations in between mostly keep the heap's top in use): chain k=4 / off 1.10x -> 1.12x at
C = 32 and 0.92x -> 0.94x at C = 64 (H100, fp8 rows, within the runs' noise; BENCHMARKS.md).

Applied when a service has loaded its model and turns to serving, so what start-up frees (a
checkpoint read through host memory) still goes back to the kernel. The cost: a process keeps
up to the trim threshold of freed memory on top of its peak, as an allocator that pools does.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4

TRIM_THRESHOLD = 1 << 30   # freed memory above this at the heap's top goes back to the kernel
TOP_PAD = 64 << 20         # the heap grows by at least this much at a time


def keep_freed_memory(log) -> bool:
    """Large blocks from the heap, reused once freed (see the module docstring). -> whether glibc
    took the settings (False on a C library without mallopt, e.g. musl, where nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    settings = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: TRIM_THRESHOLD, M_TOP_PAD: TOP_PAD}
    taken = all(mallopt(param, value) == 1 for param, value in settings.items())
    log.info("malloc keeps large freed blocks for reuse" if taken else "malloc settings not taken",
             trim_threshold_mb=TRIM_THRESHOLD >> 20)
    return taken
