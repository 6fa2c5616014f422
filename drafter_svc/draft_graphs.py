"""A drafter's repeating draft loops, each captured as one CUDA graph.

A greedy chain of s tokens is s argmaxes and s - 1 single-token forwards, each fed the token
before it; a tree is the EAGLE-2 expansion (depth - 1 forwards of the frontier, top-k and the
final selection, drafter_svc/tree_draft.py). Eagerly each forward is a launch storm with Python
between them; here the whole loop is captured once per (batch bucket, chain length or tree
shape) and replayed as one graph. Padding rows draft into the runner's scratch slot. Sampled
chains (processed distributions, per-row seeds) and shapes not captured stay eager.
"""

from __future__ import annotations

import time

import torch

from drafter_svc.tree_draft import expand
from drafter_svc.types import TreeShape
from specdec.model.batch import ForwardBatch
from specdec.model.cuda_graphs import batch_buckets, wide_step_tokens
from specdec.model.runner import ModelRunner

# Chain lengths captured: k up to 6, plus the overlap pre-draft's extra token.
DEFAULT_CHAIN_LENGTHS = (2, 3, 4, 5, 6, 7)
# Tree shapes captured: the gateway's default (topk 4, depth 4, budget 16) and two neighbours, and
# two wide trees for low load, captured only for the batches whose trees (root included) fit in the
# verifier's cap for a captured step, wide_step_tokens (so they add no memory to the pool).
DEFAULT_TREE_SHAPES = (TreeShape(4, 4, 16), TreeShape(2, 4, 8), TreeShape(4, 5, 16),
                       TreeShape(8, 6, 32), TreeShape(8, 7, 64))


def graph_fits(max_batch: int):
    """(b, key) -> whether a graph of that batch bucket and chain length or tree shape is captured."""
    cap = wide_step_tokens(max_batch)
    return lambda b, key: not isinstance(key, TreeShape) or b * (key.budget + 1) <= cap


class _Captured:
    """Static inputs and outputs of one graph (padding rows: scratch slot, position 0)."""

    def __init__(self, key, b: int, vocab: int, device: torch.device, scratch_slot: int,
                 dtype: torch.dtype) -> None:
        self.key = key                    # chain length (int) or TreeShape
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits = torch.zeros(b, vocab, dtype=dtype, device=device)  # [b, V] after the context
        self.pos = torch.zeros(b, dtype=torch.long, device=device)        # context length = next write position
        self.slots = torch.full((b,), scratch_slot, dtype=torch.long, device=device)
        self.outputs: tuple[torch.Tensor, ...] = ()


def capture_loops(batch_sizes, keys, new, body, scratch_slot: int, device: torch.device, log=None,
                  fits=lambda b, key: True) -> dict:
    """One graph per (batch bucket, key) that `fits`, largest first so one shared memory pool fits
    them all: new(b, key) -> the statics (with .graph and .slots), body(c) -> what the graph runs."""
    t0 = time.perf_counter()
    captured, pool = {}, None
    for b in reversed(batch_sizes):
        for key in reversed(keys):
            if not fits(b, key):
                continue
            c = new(b, key)
            body(c)  # eager once: compiles, warms the allocator
            torch.cuda.synchronize(device)
            c.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(c.graph, pool=pool):
                body(c)
            pool = c.graph.pool()
            c.slots.fill_(scratch_slot)
            captured[(b, key)] = c
    torch.cuda.synchronize(device)
    if log is not None:
        log.info("draft graphs captured", graphs=len(captured), keys=[str(k) for k in keys],
                 seconds=round(time.perf_counter() - t0, 1))
    return captured


class DraftGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, chain_lengths=DEFAULT_CHAIN_LENGTHS,
                 tree_shapes=DEFAULT_TREE_SHAPES) -> None:
        self.runner = runner
        self.batch_sizes = batch_buckets(max_batch)
        self.keys = tuple(sorted(chain_lengths)) + tuple(tree_shapes)
        self.slot_len = runner.cache.slot_len
        self.scratch_slot = runner.cache.num_slots - 1
        self.captured: dict[tuple[int, object], _Captured] = {}

    def capture(self, log=None) -> None:
        self.captured = capture_loops(self.batch_sizes, self.keys, self._new, self._body, self.scratch_slot,
                                      self.runner.device, log, graph_fits(max(self.batch_sizes)))

    def _new(self, b: int, key) -> _Captured:
        logits_dtype = torch.promote_types(self.runner.dtype, torch.float32)  # what the model returns
        return _Captured(key, b, self.runner.spec.vocab_size, self.runner.device, self.scratch_slot, logits_dtype)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.runner.model(batch, self.runner.cache)  # eager model: no graph replay inside a capture

    def _body(self, c: _Captured) -> None:
        """What the graph runs: the draft loop from the static inputs into c.outputs."""
        if isinstance(c.key, TreeShape):
            # keys read: the whole slot (the Triton attention reads each row's own length anyway)
            c.outputs = expand(lambda batch, _parents: self._forward(batch), c.logits, c.pos, c.slots, c.key, self.slot_len - c.key.fed_nodes)
        else:
            c.outputs = self._chain(c.logits, c.pos, c.slots, c.key)

    def _chain(self, logits: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, s: int):
        b = logits.shape[0]
        region = torch.ones(b, 1, 1, dtype=torch.bool, device=logits.device)
        tokens, logps = [], []
        for t in range(s):
            logp = torch.log_softmax(logits, dim=-1)
            best = logp.argmax(-1)                                             # [b]
            tokens.append(best)
            logps.append(logp.gather(1, best[:, None])[:, 0])
            if t == s - 1:
                break
            p = (pos + t).clamp(max=self.slot_len - 1)[:, None]                # see DrafterEngine._in_slot
            logits = self._forward(ForwardBatch(best[:, None], p, slots, p, p[:, 0], region, self.slot_len))[:, 0]
        return torch.stack(tokens, 1), torch.stack(logps, 1)                   # [b, s] each

    def _replay_into(self, key, logits: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor):
        b = logits.shape[0]
        gb = next((x for x in self.batch_sizes if x >= b), None)
        c = self.captured.get((gb, key))
        if c is None:
            return None
        c.logits[:b] = logits
        c.pos[:b] = pos
        c.slots[:b] = slots
        c.slots[b:] = self.scratch_slot
        self._replay(c)
        return tuple(out[:b] for out in c.outputs)

    def _replay(self, c: _Captured) -> None:
        c.graph.replay()

    def chain(self, logits: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
              steps: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """logits [B, V], pos (next write position), slots [B] -> (tokens, logps) [B, steps] of the
        greedy chains, or None when no captured graph fits (the caller drafts eagerly)."""
        return self._replay_into(steps, logits, pos, slots)

    def tree(self, logits: torch.Tensor, ctx_len: torch.Tensor, slots: torch.Tensor, shape: TreeShape):
        """-> (tokens, parents, logps) [B, budget] as tree_draft.expand, or None (expand eagerly)."""
        return self._replay_into(shape, logits, ctx_len, slots)
