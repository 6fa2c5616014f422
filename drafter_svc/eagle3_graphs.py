"""The EAGLE-3 head's draft loops as CUDA graphs: one replay per greedy chain or tree.

Like drafter_svc/draft_graphs.py for draft models, with the head's extra static inputs: the
hidden output after the last committed token (each drafted position feeds the head's own
output) and, for chains, overlap's forced (assumed) tokens. A graph is captured per (batch
bucket, chain steps) and per (batch bucket, tree shape); padding rows draft into the scratch
slot. The real pairs before the loop (their count varies) run eagerly.
"""

from __future__ import annotations

import torch

from drafter_svc.draft_graphs import DEFAULT_TREE_SHAPES, capture_loops
from drafter_svc.eagle3_engine import Eagle3DrafterEngine, greedy_chain, head_tree
from drafter_svc.types import TreeShape
from specdec.model.cuda_graphs import batch_buckets

# Chain steps = assumed tokens + k: chains of up to 6 drafts, after up to 7 assumed ones.
DEFAULT_CHAIN_STEPS = tuple(range(1, 14))


class _Captured:
    def __init__(self, key, b: int, engine: Eagle3DrafterEngine) -> None:
        head, dev = engine.head, engine.device
        scratch = engine.cache.num_slots - 1
        self.key = key                   # chain steps (int) or TreeShape
        self.graph: torch.cuda.CUDAGraph | None = None
        logits_dtype = torch.promote_types(engine.dtype, torch.float32)
        self.logits = torch.zeros(b, head.spec.draft_vocab_size, dtype=logits_dtype, device=dev)
        self.hidden = torch.zeros(b, head.spec.layer.hidden_size, dtype=engine.dtype, device=dev)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)      # next head position (= real pairs held)
        self.slots = torch.full((b,), scratch, dtype=torch.long, device=dev)
        self.forced = torch.full((b, key if isinstance(key, int) else 1), -1, dtype=torch.long, device=dev)
        self.outputs: tuple[torch.Tensor, ...] = ()


class Eagle3Graphs:
    def __init__(self, engine: Eagle3DrafterEngine, max_batch: int, chain_steps=DEFAULT_CHAIN_STEPS,
                 tree_shapes=DEFAULT_TREE_SHAPES) -> None:
        self.engine = engine
        self.batch_sizes = batch_buckets(max_batch)
        self.keys = tuple(sorted(chain_steps)) + tuple(tree_shapes)
        self.scratch_slot = engine.cache.num_slots - 1
        self.captured: dict[tuple[int, object], _Captured] = {}

    def capture(self, log=None) -> None:
        self.captured = capture_loops(self.batch_sizes, self.keys, lambda b, key: _Captured(key, b, self.engine),
                                      self._body, self.scratch_slot, self.engine.device, log)

    def _body(self, c: _Captured) -> None:
        e = self.engine
        if isinstance(c.key, TreeShape):
            # keys read: the whole slot but the tree's own nodes (the attention reads each row's own length)
            c.outputs = head_tree(e.head, e.embed, e.cache, c.logits, c.hidden, c.pos, c.slots, c.key,
                                  e.slot_len - c.key.fed_nodes)
        else:
            c.outputs = greedy_chain(e.head, e.embed, e.cache, c.logits, c.hidden, c.forced, c.pos, c.slots,
                                     e.slot_len)

    def _replay(self, key, logits, hidden, pos, slots, forced=None):
        b = logits.shape[0]
        gb = next((x for x in self.batch_sizes if x >= b), None)
        c = self.captured.get((gb, key))
        if c is None:
            return None
        c.logits[:b], c.hidden[:b], c.pos[:b], c.slots[:b] = logits, hidden, pos, slots
        c.slots[b:] = self.scratch_slot
        if forced is not None:
            c.forced[:b] = forced
            c.forced[b:] = -1
        c.graph.replay()
        return tuple(out[:b] for out in c.outputs)

    def chain(self, logits, hidden, forced, write, slots):
        """-> greedy_chain's outputs (target ids, logps, the hedges' alternatives), or None when no graph
        fits (run eagerly)."""
        return self._replay(forced.shape[1], logits, hidden, write, slots, forced)

    def tree(self, logits, hidden, ctx_len, slots, shape: TreeShape):
        """-> (target ids, parents, logps) [B, budget] as head_tree, or None."""
        return self._replay(shape, logits, hidden, ctx_len, slots)
