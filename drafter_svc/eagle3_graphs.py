"""The EAGLE-3 head's forwards as CUDA graphs: a step is two replays, the real pairs, then the
greedy chain or tree.

The real pairs (the tokens a verdict committed, with the target's hidden states) are captured per
(batch bucket, pairs per sequence up to 8), and prompts' feeds per (batch bucket, padded length
PROMPT_PAIRS) up to PREFILL_MAX_TOKENS pairs a graph; feeds are padded to the next captured length,
and all these graphs read the states from one shared buffer. A step feeding more pairs than one
graph holds (a switch from mode off catches up every running sequence's history at once) replays
one graph per chunk of rows; a feed longer than the longest captured one runs eagerly. The
draft loops are as drafter_svc/draft_graphs.py has them for draft models, with the head's extra
static inputs: the hidden output after the last committed token (each drafted
position feeds the head's own output) and, for chains, overlap's forced (assumed) tokens: one
graph per (batch bucket, chain steps) and per (batch bucket, tree shape). Padding rows write
into the scratch slot. A graph's int64 inputs are views of one buffer that one copy fills from
the host (padding included). A drafter that hedges (--hedge-predrafts) also captures the hedge
loop per (row bucket, steps), its masks spanning a fixed HEDGE_WIDTH positions (wider hedges run
eagerly).
"""

from __future__ import annotations

import torch

from drafter_svc.draft_graphs import DEFAULT_TREE_SHAPES, capture_loops, graph_fits
from drafter_svc.eagle3_engine import (
    CATCH_UP_PAIRS,
    Eagle3DrafterEngine,
    greedy_chain,
    head_tree,
    hedge_chains,
    real_pairs_forward,
)
from drafter_svc.types import TreeShape
from specdec.model.batch import PackedStatics
from specdec.model.cuda_graphs import PREFILL_MAX_TOKENS, PREFILL_QUERY_LENS, batch_buckets

# Chain steps = assumed tokens + k: chains of up to 6 drafts, after up to 7 assumed ones.
DEFAULT_CHAIN_STEPS = tuple(range(1, 14))
REAL_PAIRS = tuple(range(1, CATCH_UP_PAIRS + 1))
# Prompts' feeds (a head forward costs little more for a few hundred pairs than for one: the
# graph saves its launches, paid by every step that admits a prompt).
PROMPT_PAIRS = (16, *PREFILL_QUERY_LENS)
# Hedges: drafts of k <= 4 after their guesses, up to 4 hedges a sequence (pre-drafts after chains
# of k <= 4); their masks span 128 positions (a chain of k = 4 needs 25).
HEDGE_STEPS = (1, 2, 3, 4)
HEDGES_PER_SEQUENCE = 4
HEDGE_WIDTH = 128


class _Captured:
    def __init__(self, key, b: int, engine: Eagle3DrafterEngine) -> None:
        head, dev = engine.head, engine.device
        scratch = engine.cache.num_slots - 1
        self.key = key                   # chain steps (int) or TreeShape
        self.graph: torch.cuda.CUDAGraph | None = None
        logits_dtype = torch.promote_types(engine.dtype, torch.float32)
        self.logits = torch.zeros(b, head.spec.draft_vocab_size, dtype=logits_dtype, device=dev)
        self.hidden = torch.zeros(b, head.spec.layer.hidden_size, dtype=engine.dtype, device=dev)
        # next head position (= real pairs held), slots, and overlap's forced tokens (-1: draft)
        self.ints = PackedStatics([((b,), 0), ((b,), scratch), ((b, key if isinstance(key, int) else 1), -1)], dev)
        self.pos, self.slots, self.forced = self.ints.views
        self.outputs: tuple[torch.Tensor, ...] = ()


class _CapturedPairs:
    def __init__(self, n: int, b: int, engine: Eagle3DrafterEngine, hidden: torch.Tensor) -> None:
        self.key = n
        self.graph: torch.cuda.CUDAGraph | None = None
        scratch = engine.cache.num_slots - 1
        # tokens [b, n], first head position, real pairs (>= 1), slots
        self.ints = PackedStatics([((b, n), 0), ((b,), 0), ((b,), 1), ((b,), scratch)], engine.device)
        self.tokens, self.start, self.lengths, self.slots = self.ints.views
        self.hidden = hidden[: b * n * engine.aux_width].view(b, n, engine.aux_width)   # of the shared buffer
        self.outputs: tuple[torch.Tensor, ...] = ()


class _CapturedHedges:
    def __init__(self, steps: int, r: int, engine: Eagle3DrafterEngine) -> None:
        dev = engine.device
        self.key = steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.first = torch.zeros(r, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(r, engine.head.spec.layer.hidden_size, dtype=engine.dtype, device=dev)
        self.rope0 = torch.zeros(r, dtype=torch.long, device=dev)
        self.base = torch.zeros(r, dtype=torch.long, device=dev)
        self.slots = torch.full((r,), engine.cache.num_slots - 1, dtype=torch.long, device=dev)
        self.outputs: tuple[torch.Tensor, ...] = ()


class Eagle3Graphs:
    def __init__(self, engine: Eagle3DrafterEngine, max_batch: int, chain_steps=DEFAULT_CHAIN_STEPS,
                 tree_shapes=DEFAULT_TREE_SHAPES, max_pair_tokens: int = PREFILL_MAX_TOKENS) -> None:
        self.engine = engine
        self.batch_sizes = batch_buckets(max_batch)
        self.keys = tuple(sorted(chain_steps)) + tuple(tree_shapes)
        self.scratch_slot = engine.cache.num_slots - 1
        self.captured: dict[tuple[int, object], _Captured] = {}
        self.pairs_captured: dict[tuple[int, int], _CapturedPairs] = {}
        self.pair_lens = REAL_PAIRS + PROMPT_PAIRS
        # (the attention reads a feed's keys up to its start + padded length: within the slot)
        self.pairs_fit = lambda b, n: n <= engine.slot_len and (n in REAL_PAIRS or b * n <= max_pair_tokens)
        most = max(b * n for b in self.batch_sizes for n in self.pair_lens if self.pairs_fit(b, n))
        # the states every pairs graph reads: [b, n, aux] views of one buffer, filled before each replay
        self.pairs_hidden = torch.zeros(most * engine.aux_width, dtype=engine.dtype, device=engine.device)
        self.hedge_sizes = batch_buckets(HEDGES_PER_SEQUENCE * max_batch)
        self.hedges_captured: dict[tuple[int, int], _CapturedHedges] = {}

    def capture(self, log=None) -> None:
        self.pairs_captured = capture_loops(self.batch_sizes, self.pair_lens,
                                            lambda b, n: _CapturedPairs(n, b, self.engine, self.pairs_hidden),
                                            self._pairs_body, self.scratch_slot, self.engine.device, log,
                                            self.pairs_fit)
        self.captured = capture_loops(self.batch_sizes, self.keys, lambda b, key: _Captured(key, b, self.engine),
                                      self._body, self.scratch_slot, self.engine.device, log,
                                      graph_fits(max(self.batch_sizes)))
        if self.engine.hedge_predrafts:
            self.hedges_captured = capture_loops(self.hedge_sizes, HEDGE_STEPS,
                                                 lambda r, steps: _CapturedHedges(steps, r, self.engine),
                                                 self._hedge_body, self.scratch_slot, self.engine.device, log)

    def _pairs_body(self, c: _CapturedPairs) -> None:
        e = self.engine
        # keys read: the whole slot (the attention reads each row's own length anyway)
        c.outputs = real_pairs_forward(e.head, e.embed, e.cache, c.tokens, c.hidden, c.start, c.lengths, c.slots,
                                       e.slot_len, e.slot_len)

    def _hedge_body(self, c: _CapturedHedges) -> None:
        e = self.engine
        c.outputs = hedge_chains(e.head, e.embed, e.cache, c.first, c.hidden, c.rope0, c.base, HEDGE_WIDTH, c.slots,
                                 c.key, e.slot_len)

    def _body(self, c: _Captured) -> None:
        e = self.engine
        if isinstance(c.key, TreeShape):
            # keys read: the whole slot but the tree's own nodes (the attention reads each row's own length)
            c.outputs = head_tree(e.head, e.embed, e.cache, c.logits, c.hidden, c.pos, c.slots, c.key,
                                  e.slot_len - c.key.fed_nodes)
        else:
            c.outputs = greedy_chain(e.head, e.embed, e.cache, c.logits, c.hidden, c.forced, c.pos, c.slots,
                                     e.slot_len, alternatives=e.hedge_predrafts)

    def _bucket(self, b: int) -> int | None:
        return next((x for x in self.batch_sizes if x >= b), None)

    def real_pairs(self, tokens, hidden, start, lengths, slots):
        """tokens [B, n], start, lengths, slots [B] on the host; hidden [B, n, aux] pinned on the host or on
        the device
        -> real_pairs_forward's outputs, or None when no graph fits (run eagerly). Rows beyond the
        largest graph of the feed's padded length run in chunks, a replay each."""
        b, n = tokens.shape
        room = self.engine.slot_len - int(start.max())
        gn = next((x for x in self.pair_lens if n <= x <= room and (1, x) in self.pairs_captured), None)
        if gn is None:
            return None
        if (self._bucket(b), gn) in self.pairs_captured:   # the usual step: one graph holds it
            return self._replay_pairs(gn, tokens, hidden, start, lengths, slots)
        rows = max(bb for bb, x in self.pairs_captured if x == gn)
        # a chunk's outputs are the graph's static buffers, which the next chunk's replay may reuse
        parts = [tuple(o.clone() for o in self._replay_pairs(gn, *(t[i:i + rows] for t in
                                                                  (tokens, hidden, start, lengths, slots))))
                 for i in range(0, b, rows)]
        return tuple(torch.cat(outs) for outs in zip(*parts))

    def _replay_pairs(self, gn: int, tokens, hidden, start, lengths, slots):
        b, n = tokens.shape
        c = self.pairs_captured[(self._bucket(b), gn)]
        # padding rows: the capture's values; padded pairs of real rows lie past their lengths and
        # write KV past their real pairs, where the next real pairs or drafts overwrite it
        c.ints.load([tokens if gn == n else torch.nn.functional.pad(tokens, (0, gn - n)), start, lengths, slots])
        c.hidden[:b, :n].copy_(hidden, non_blocking=True)   # padding keeps old states: nothing real sees them
        c.graph.replay()
        return tuple(out[:b] for out in c.outputs)

    def _replay(self, key, logits, hidden, pos, slots, forced=None):
        """logits, hidden on the device; pos, slots [B] and forced [B, S] on the host."""
        b = logits.shape[0]
        gb = self._bucket(b)
        c = self.captured.get((gb, key))
        if c is None:
            return None
        c.logits[:b], c.hidden[:b] = logits, hidden
        forced = torch.full((b, 1), -1, dtype=torch.long) if forced is None else forced
        c.ints.load([pos, slots, forced])
        c.graph.replay()
        return tuple(out[:b] for out in c.outputs)

    def chain(self, logits, hidden, forced, write, slots):
        """-> greedy_chain's outputs (target ids, logps, the hedges' alternatives), or None when no graph
        fits (run eagerly). forced, write, slots: host tensors."""
        return self._replay(forced.shape[1], logits, hidden, write, slots, forced)

    def hedges(self, first, hidden, rope0, base, width: int, slots, steps: int):
        """-> hedge_chains' outputs [R, steps], or None when no graph fits (run eagerly). Padding rows
        draft into the scratch slot."""
        r = first.shape[0]
        rb = next((x for x in self.hedge_sizes if x >= r), None)
        c = self.hedges_captured.get((rb, steps))
        if c is None or width > HEDGE_WIDTH:
            return None
        c.first[:r], c.hidden[:r], c.rope0[:r], c.base[:r], c.slots[:r] = first, hidden, rope0, base, slots
        c.first[r:], c.rope0[r:], c.base[r:] = 0, 0, 0
        c.slots[r:] = self.scratch_slot
        c.graph.replay()
        return tuple(out[:r] for out in c.outputs)

    def tree(self, logits, hidden, ctx_len, slots, shape: TreeShape):
        """-> (target ids, parents, logps) [B, budget] as head_tree, or None. ctx_len, slots: host tensors."""
        return self._replay(shape, logits, hidden, ctx_len, slots)
