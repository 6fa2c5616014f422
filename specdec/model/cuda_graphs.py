"""CUDA graphs for the forwards that repeat: verify steps, single-token draft steps and prefills.

A step of a small batch costs far more in host work (Python and ~1,000 kernel launches) than on
the GPU; replaying a captured graph launches the whole forward at once. Graphs are captured at
start-up for every (batch bucket, query length) pair within the family's token cap, largest first,
sharing one memory pool; a forward that fits a pair is copied into that graph's static inputs,
padded, and replayed:

- batch: padded up to the bucket with rows that write their KV into a scratch slot that no
  sequence owns (the runner allocates one slot more), so padding never touches real state;
- query length n (tokens per sequence): padded up to the captured length with tokens that see
  only themselves and write their KV into the slot's last position, which the engines keep free
  for padding (not past the row's real tokens: with --fold-prefill the next row of the forward
  may be the same prompt's next chunk, and its real KV lies there);
- the region mask must be the step's own tokens (R == n: chains, trees, single tokens, prompt
  chunks); tree-draft steps (whose region also covers earlier fed nodes) run eagerly.

A family graphs either all-position logits (verify and draft steps, `logit_index` None) or, with
`last_logit`, one position per row (prefill chunks: `logit_index` [B, 1], PREFILL_QUERY_LENS, at
most `max_tokens` padded tokens a graph). The logits land in one shared static buffer, so memory
is that buffer plus the pool of the largest capture. With `aux_width`, the forward also returns
captured hidden states of every position (EAGLE-3), kept in a second static buffer (`aux`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specdec.model.batch import ForwardBatch

DEFAULT_QUERY_LENS = (1, 2, 3, 5, 9, 17)
# Wide trees' verify steps (budgets 32 and 64 plus the root): captured only for the batches whose
# tokens fit in what the widest default length takes at the largest batch (`wide_step_tokens`), so
# the logits buffer and the memory pool do not grow. They pay at low load, where a step is bound
# by launches rather than by the tokens it carries.
WIDE_QUERY_LENS = (33, 65)

# Prompt chunks: on a GPU a forward of up to a few hundred tokens costs about what one token does
# (weights dominate), so padding to the next length wastes little; the graph saves the eager
# forward's launches (~15 ms for an 8B model), paid by every step that admits a prompt.
PREFILL_QUERY_LENS = (32, 64, 128, 256, 512)
PREFILL_MAX_TOKENS = 2048


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16, and max_batch itself: a batch pads by at most 15 rows."""
    sizes = {b for b in (1, 2, 4, 8, *range(16, max_batch, 16)) if b < max_batch}
    return tuple(sorted(sizes | {max_batch}))


def verify_query_lens(max_draft_tokens: int) -> tuple[int, ...]:
    """The verify graphs' query lengths: chains and trees of up to max_draft_tokens plus the root."""
    return tuple(n for n in DEFAULT_QUERY_LENS + WIDE_QUERY_LENS if n <= max_draft_tokens + 1)


def wide_step_tokens(max_batch: int) -> int:
    """Tokens a captured verify step may hold: what the widest default length takes at max_batch."""
    return max(batch_buckets(max_batch)) * max(DEFAULT_QUERY_LENS)


def prefill_buckets(max_batch: int) -> tuple[int, ...]:
    """Prompt chunks per prefill step: 1, 2, 4, ... up to max_batch."""
    return tuple(sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)}))


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph | None, inputs: ForwardBatch, padding: ForwardBatch,
                 logit_index: torch.Tensor | None, logits: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.graph = graph
        self.inputs = inputs    # the static tensors the graph reads
        self.padding = padding  # what padding rows and tokens hold (copied in before the real ones)
        self.logit_index = logit_index  # [b, 1] static input of a last_logit graph, else None
        self.logits = logits    # [b, n or 1, V] view of the shared buffer the graph writes
        self.aux = aux          # [b, n, aux_width] view, or None


class GraphedForward:
    """Captured forwards of one model + KV cache; `run` replays one or returns None (run eagerly)."""

    def __init__(self, forward: Callable[..., torch.Tensor], vocab: int, scratch_slot: int,
                 slot_len: int, device: torch.device, batch_sizes: tuple[int, ...],
                 query_lens: tuple[int, ...], logits_dtype: torch.dtype = torch.float32, aux_width: int = 0,
                 aux_dtype: torch.dtype = torch.float32, last_logit: bool = False,
                 max_tokens: int | None = None) -> None:
        """forward(batch) -> logits (, aux); with last_logit, forward(batch, logit_index [B, 1])."""
        self.forward = forward
        self.vocab = vocab
        self.scratch_slot = scratch_slot
        self.slot_len = slot_len
        self.device = device
        self.last_logit = last_logit
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.query_lens = tuple(sorted(n for n in query_lens if n <= slot_len))
        self.pairs = [(b, n) for b in self.batch_sizes for n in self.query_lens
                      if max_tokens is None or b * n <= max_tokens]
        self.graphs: dict[tuple[int, int], _Graph] = {}
        # one flat buffer each, every graph writing a [b, n or 1, ...] view of its start
        logit_rows = max((b * (1 if last_logit else n) for b, n in self.pairs), default=0)
        self.logits = torch.empty(logit_rows * vocab, dtype=logits_dtype, device=device)
        self.aux = torch.empty(max((b * n for b, n in self.pairs), default=0) * aux_width, dtype=aux_dtype,
                               device=device) if aux_width else None
        self.aux_width = aux_width
        self.pool = None

    def capture(self, log=None) -> None:
        """Capture every (batch, query length) pair, largest first so the pool fits them all."""
        t0 = time.perf_counter()
        pairs = sorted(self.pairs, key=lambda p: (p[0] * p[1], p), reverse=True)
        for i, (b, n) in enumerate(pairs):
            self.graphs[(b, n)] = self._capture_one(b, n)
            if log is not None and (i + 1) % 10 == 0:
                log.info("capturing CUDA graphs", done=i + 1, total=len(pairs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if log is not None:
            log.info("CUDA graphs captured", graphs=len(pairs), seconds=round(time.perf_counter() - t0, 1),
                     batch_sizes=list(self.batch_sizes), query_lens=list(self.query_lens),
                     last_logit=self.last_logit,
                     memory_reserved_mib=round(torch.cuda.memory_reserved(self.device) / 2**20))

    def _capture_one(self, b: int, n: int) -> _Graph:
        g = self._static(b, n)
        self._write_logits(g)             # eager once: compiles kernels, warms the allocator
        torch.cuda.synchronize(self.device)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            self._write_logits(g)
        self.pool = g.graph.pool()
        return g

    def _static(self, b: int, n: int) -> _Graph:
        """A graph's static inputs and output views (its CUDA graph not yet captured)."""
        m = 1 if self.last_logit else n
        logits = self.logits[: b * m * self.vocab].view(b, m, self.vocab)
        aux = self.aux[: b * n * self.aux_width].view(b, n, -1) if self.aux is not None else None
        index = torch.zeros(b, 1, dtype=torch.long, device=self.device) if self.last_logit else None
        return _Graph(None, self._padding(b, n), self._padding(b, n), index, logits, aux)

    def _replay(self, g: _Graph) -> None:
        g.graph.replay()

    def run(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, n, V] for every position of `batch` (or [B, 1, V] at logit_index [B, 1], for
        a last_logit family) by graph replay, or None if no graph fits."""
        b, n = batch.tokens.shape
        if batch.region_mask.shape[-1] != n or (logit_index is not None) != self.last_logit:
            return None
        if logit_index is not None and logit_index.shape[-1] != 1:
            return None
        g = self._fitting(b, n)
        if g is None:
            return None
        gn = g.inputs.tokens.shape[1]
        s, pad = g.inputs, g.padding
        for name in ("tokens", "positions", "slots", "write_pos", "prefix_len", "region_mask"):
            getattr(s, name).copy_(getattr(pad, name))  # padding first, then the real rows over it
        s.tokens[:b, :n] = batch.tokens
        s.slots[:b] = batch.slots
        s.prefix_len[:b] = batch.prefix_len
        s.positions[:b, :n] = batch.positions
        s.write_pos[:b, :n] = batch.write_pos
        s.region_mask[:b, :n, :n] = batch.region_mask
        if gn > n:  # padded query tokens of real rows: seeing only themselves, writing the slot's last position
            s.write_pos[:b, n:] = self.slot_len - 1
            s.positions[:b, n:] = batch.positions[:, n - 1:n]
        if g.logit_index is not None:
            g.logit_index.zero_()
            g.logit_index[:b] = logit_index
        self._replay(g)
        return g.logits[:b, : 1 if self.last_logit else n]

    def aux_rows(self, b: int, n: int) -> torch.Tensor:
        """The hidden states of the last run's real rows, [b, n, aux_width] (aux_width > 0)."""
        return self._fitting(b, n).aux[:b, :n]

    def _fitting(self, b: int, n: int) -> _Graph | None:
        """The graph of the smallest bucket pair that holds b rows of n tokens, if captured."""
        gb = next((x for x in self.batch_sizes if x >= b), None)
        gn = next((x for x in self.query_lens if x >= n), None)
        return self.graphs.get((gb, gn))

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

    def _write_logits(self, g: _Graph) -> None:
        out = self.forward(g.inputs, g.logit_index) if self.last_logit else self.forward(g.inputs)
        if self.aux is not None:
            out, aux = out
            g.aux.copy_(aux)
        g.logits.copy_(out)
