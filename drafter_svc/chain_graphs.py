"""Greedy draft chains as one CUDA-graph replay.

A chain of s tokens is s argmaxes and s - 1 single-token forwards, each fed the token before it.
Eagerly that is s - 1 graph replays with small launches and Python between them; here the whole
loop, argmax and log-probabilities included, is captured once per (batch bucket, s) and replayed
as one graph. Padding rows draft into the runner's scratch slot. Sampled chains (which draw
from processed distributions with per-row seeds) stay on the eager path.
"""

from __future__ import annotations

import time

import torch

from specdec.model.batch import ForwardBatch
from specdec.model.cuda_graphs import batch_buckets
from specdec.model.runner import ModelRunner

# Chain lengths captured: k up to 6, plus the overlap pre-draft's extra token.
DEFAULT_CHAIN_LENGTHS = (2, 3, 4, 5, 6, 7)


class _Chain:
    def __init__(self, b: int, s: int, vocab: int, device: torch.device, scratch_slot: int,
                 dtype: torch.dtype) -> None:
        self.steps = s
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = torch.zeros(b, vocab, dtype=dtype, device=device)  # [b, V] after the context
        self.pos = torch.zeros(b, dtype=torch.long, device=device)                # next KV write position
        self.slots = torch.full((b,), scratch_slot, dtype=torch.long, device=device)
        self.tokens = torch.zeros(b, s, dtype=torch.long, device=device)          # outputs
        self.logps = torch.zeros(b, s, dtype=dtype, device=device)


class GraphedChains:
    def __init__(self, runner: ModelRunner, max_batch: int, lengths: tuple[int, ...] = DEFAULT_CHAIN_LENGTHS) -> None:
        self.runner = runner
        self.batch_sizes = batch_buckets(max_batch)
        self.lengths = tuple(sorted(lengths))
        self.slot_len = runner.cache.slot_len
        self.scratch_slot = runner.cache.num_slots - 1
        self.chains: dict[tuple[int, int], _Chain] = {}
        self.pool = None

    def capture(self, log=None) -> None:
        t0 = time.perf_counter()
        for b in reversed(self.batch_sizes):       # largest first: the shared pool fits them all
            for s in reversed(self.lengths):
                self.chains[(b, s)] = self._capture_one(b, s)
        torch.cuda.synchronize(self.runner.device)
        if log is not None:
            log.info("draft chain graphs captured", graphs=len(self.chains), lengths=list(self.lengths),
                     seconds=round(time.perf_counter() - t0, 1))

    def _capture_one(self, b: int, s: int) -> _Chain:
        chain = self._new_chain(b, s)
        self._draft(chain)  # eager once: compiles, warms the allocator
        torch.cuda.synchronize(self.runner.device)
        chain.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(chain.graph, pool=self.pool):
            self._draft(chain)
        self.pool = chain.graph.pool()
        chain.slots.fill_(self.scratch_slot)
        return chain

    def _new_chain(self, b: int, s: int) -> _Chain:
        logits_dtype = torch.promote_types(self.runner.dtype, torch.float32)  # what the model returns
        return _Chain(b, s, self.runner.spec.vocab_size, self.runner.device, self.scratch_slot, logits_dtype)

    def _draft(self, chain: _Chain) -> None:
        """What the graph runs: the chain from the static inputs into the static outputs."""
        s = chain.steps
        logits = chain.logits
        b = logits.shape[0]
        region = torch.ones(b, 1, 1, dtype=torch.bool, device=logits.device)
        for t in range(s):
            logp = torch.log_softmax(logits, dim=-1)
            best = logp.argmax(-1)                                             # [b]
            chain.tokens[:, t] = best
            chain.logps[:, t] = logp.gather(1, best[:, None])[:, 0]
            if t == s - 1:
                break
            p = (chain.pos + t).clamp(max=self.slot_len - 1)[:, None]          # see DrafterEngine._in_slot
            batch = ForwardBatch(best[:, None], p, chain.slots, p, p[:, 0], region, self.slot_len)
            logits = self.runner.model(batch, self.runner.cache)[:, 0]

    def run(self, logits: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
            steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logits [B, V], pos, slots [B] -> (tokens, logps) [B, steps] of the greedy chains, or None
        when no captured graph fits (the caller drafts eagerly)."""
        b = logits.shape[0]
        gb = next((x for x in self.batch_sizes if x >= b), None)
        if gb is None or steps not in self.lengths:
            return None
        chain = self.chains[(gb, steps)]
        chain.logits[:b] = logits
        chain.pos[:b] = pos
        chain.slots[:b] = slots
        chain.slots[b:] = self.scratch_slot
        self._replay(chain)
        return chain.tokens[:b], chain.logps[:b]

    def _replay(self, chain: _Chain) -> None:
        chain.graph.replay()
