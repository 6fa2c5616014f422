"""CUDA graphs for the forwards that repeat: verify steps and single-token draft steps.

A step of a small batch costs far more in host work (Python and ~1,000 kernel launches) than on
the GPU; replaying a captured graph launches the whole forward at once. Graphs are captured at
start-up for every (batch bucket, query length) pair, largest first, sharing one memory pool;
a forward that fits a pair is copied into that graph's static inputs, padded, and replayed:

- batch: padded up to the bucket with rows that write their KV into a scratch slot that no
  sequence owns (the runner allocates one slot more), so padding never touches real state;
- query length n (tokens per sequence): padded up to the captured length with tokens that see
  only themselves and write KV past the sequence's real entries (room the slot keeps for drafts,
  overwritten before it is ever read);
- the region mask must be the step's own tokens (R == n: chains, trees, single tokens); prefill
  and tree-draft steps (whose region also covers earlier fed nodes) run eagerly.

Only all-position logits are graphed (`logit_index` None); the logits land in one shared static
buffer, so memory is that buffer plus the pool of the largest capture. With `aux_width`, the
forward also returns captured hidden states (EAGLE-3), kept in a second static buffer (`aux`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec.model.batch import ForwardBatch

DEFAULT_QUERY_LENS = (1, 2, 3, 5, 9, 17)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16, and max_batch itself: a batch pads by at most 15 rows."""
    sizes = {b for b in (1, 2, 4, 8, *range(16, max_batch, 16)) if b < max_batch}
    return tuple(sorted(sizes | {max_batch}))


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: ForwardBatch, padding: ForwardBatch) -> None:
        self.graph = graph
        self.inputs = inputs    # the static tensors the graph reads
        self.padding = padding  # what padding rows and tokens hold (copied in before the real ones)


class GraphedForward:
    """Captured forwards of one model + KV cache; `run` replays one or returns None (run eagerly)."""

    def __init__(self, forward: Callable[[ForwardBatch], torch.Tensor], vocab: int, scratch_slot: int,
                 slot_len: int, device: torch.device, batch_sizes: tuple[int, ...],
                 query_lens: tuple[int, ...], logits_dtype: torch.dtype = torch.float32, aux_width: int = 0,
                 aux_dtype: torch.dtype = torch.float32) -> None:
        self.forward = forward
        self.scratch_slot = scratch_slot
        self.slot_len = slot_len
        self.device = device
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.query_lens = tuple(sorted(n for n in query_lens if n <= slot_len))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.logits = torch.empty(max(self.batch_sizes), max(self.query_lens), vocab, dtype=logits_dtype,
                                  device=device)  # [B, n, V] shared by every graph
        # [B, n, aux_width]: forward returns (logits, aux) when aux_width > 0
        self.aux = torch.empty(max(self.batch_sizes), max(self.query_lens), aux_width, dtype=aux_dtype,
                               device=device) if aux_width else None
        self.pool = None

    def capture(self, log=None) -> None:
        """Capture every (batch, query length) pair, largest first so the pool fits them all."""
        t0 = time.perf_counter()
        pairs = [(b, n) for b in reversed(self.batch_sizes) for n in reversed(self.query_lens)]
        for i, (b, n) in enumerate(pairs):
            self.graphs[(b, n)] = self._capture_one(b, n)
            if log is not None and (i + 1) % 10 == 0:
                log.info("capturing CUDA graphs", done=i + 1, total=len(pairs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if log is not None:
            log.info("CUDA graphs captured", graphs=len(pairs), seconds=round(time.perf_counter() - t0, 1),
                     batch_sizes=list(self.batch_sizes), query_lens=list(self.query_lens),
                     memory_reserved_mib=round(torch.cuda.memory_reserved(self.device) / 2**20))

    def _capture_one(self, b: int, n: int) -> _Graph:
        inputs = self._padding(b, n)
        self._write_logits(inputs)             # eager once: compiles kernels, warms the allocator
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._write_logits(inputs)
        self.pool = graph.pool()
        return _Graph(graph, inputs, self._padding(b, n))

    def _replay(self, g: _Graph) -> None:
        g.graph.replay()

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits [B, n, V] for every position of `batch` by graph replay, or None if no graph fits."""
        b, n = batch.tokens.shape
        if batch.region_mask.shape[-1] != n:
            return None
        gb = next((x for x in self.batch_sizes if x >= b), None)
        gn = next((x for x in self.query_lens if x >= n), None)
        if gb is None or gn is None:
            return None
        g = self.graphs[(gb, gn)]
        s, pad = g.inputs, g.padding
        for name in ("tokens", "positions", "slots", "write_pos", "prefix_len", "region_mask"):
            getattr(s, name).copy_(getattr(pad, name))  # padding first, then the real rows over it
        s.tokens[:b, :n] = batch.tokens
        s.slots[:b] = batch.slots
        s.prefix_len[:b] = batch.prefix_len
        s.positions[:b, :n] = batch.positions
        s.write_pos[:b, :n] = batch.write_pos
        s.region_mask[:b, :n, :n] = batch.region_mask
        if gn > n:  # padded query tokens of real rows: past the real ones, seeing only themselves
            s.write_pos[:b, n:] = batch.write_pos[:, n - 1:n] + pad.write_pos[:b, 1:gn - n + 1]
            s.positions[:b, n:] = batch.positions[:, n - 1:n]
        self._replay(g)
        return self.logits[:b, :n]

    def _padding(self, b: int, n: int) -> ForwardBatch:
        """Inputs of b padding rows: scratch slot, tokens 0.., each seeing only itself."""
        pos = torch.arange(n, device=self.device).expand(b, n).contiguous()
        return ForwardBatch(
            tokens=torch.zeros(b, n, dtype=torch.long, device=self.device),
            positions=pos.clone(),
            slots=torch.full((b,), self.scratch_slot, dtype=torch.long, device=self.device),
            write_pos=pos.clone(),
            prefix_len=torch.zeros(b, dtype=torch.long, device=self.device),
            region_mask=torch.eye(n, dtype=torch.bool, device=self.device).expand(b, n, n).contiguous(),
            kv_len=self.slot_len,  # unused by the Triton attention, which reads each row's own length
        )

    def _write_logits(self, inputs: ForwardBatch) -> None:
        b, n = inputs.tokens.shape
        out = self.forward(inputs)
        if self.aux is not None:
            out, aux = out
            self.aux[:b, :n].copy_(aux)
        self.logits[:b, :n].copy_(out)
