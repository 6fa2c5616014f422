"""Drafter engine: keeps each sequence's draft-model KV in step with the committed tokens and
drafts chains or trees for a whole batch at once.

KV reuse is by longest common prefix: the drafter remembers which tokens its KV holds
(`kv_tokens`) and feeds only what differs from committed + assumed tokens. That one rule covers
a first draft (feed the prompt), an overlap hit (its own pre-draft is already in the KV), a
partial acceptance and a miss (roll back to the divergence point and feed the corrections).
"""

from __future__ import annotations

import torch

from drafter_svc.draft_graphs import DraftGraphs
from drafter_svc.tree_draft import expand_trees
from drafter_svc.types import (
    ChainShape,
    Draft,
    DrafterStep,
    DrafterStepResult,
    DraftItem,
    TreeShape,
)
from specdec.errors import ErrorCode, SequenceError
from specdec.limits import MAX_CHAIN_K, MAX_DRAFTED_CHAIN, MAX_TREE_DEPTH, MAX_TREE_TOPK
from specdec.model.batch import ForwardBatch, causal_region, rows_of, upload, upload_feeds, upload_list, upload_packed
from specdec.model.cuda_graphs import DEFAULT_QUERY_LENS
from specdec.model.runner import ModelRunner
from specdec.sampling import DRAFT, SamplingParams, processed_probs, sample_from, seed_tensor, uniforms
from specdec.sequence_table import SequenceState, SequenceTable
from specdec.tree import DraftTree, Proposal

# Sampled chain tokens are drawn from the draft distribution truncated to its top PROPOSAL_K
# tokens: the exact proposal q, small enough to ship with the draft.
PROPOSAL_K = 16

# KV room past the context: assumed tokens plus a pre-draft chain (k + 1), or a tree's fed nodes.
DRAFT_SLACK = max(MAX_CHAIN_K + MAX_DRAFTED_CHAIN, (MAX_TREE_DEPTH - 1) * MAX_TREE_TOPK) + 1


class DrafterEngine:
    def __init__(self, runner: ModelRunner, max_sequences: int, max_context: int) -> None:
        spec = runner.spec
        self.runner = runner
        self.device = runner.device
        self.max_context = min(max_context, spec.max_position_embeddings)
        self.slot_len = self.max_context + DRAFT_SLACK
        runner.allocate_kv(max_sequences, self.slot_len)
        self.table = SequenceTable(max_sequences, spec.vocab_size, self.max_context)
        self.draft_vocab_size = spec.vocab_size   # what a tree's top-k picks from
        self.max_sequences = max_sequences
        self.draft_graphs: DraftGraphs | None = None

    def capture_cuda_graphs(self, log=None) -> None:
        """Catch-up feeds of up to 17 tokens, whole greedy chains and whole trees as graph replays
        (CUDA, one rank)."""
        self.runner.capture_cuda_graphs(self.max_sequences, DEFAULT_QUERY_LENS, log)
        self.draft_graphs = DraftGraphs(self.runner, self.max_sequences)
        self.draft_graphs.capture(log)

    def close(self, seq_ids: list[str]) -> None:
        self.table.close_all(seq_ids)

    def step(self, req: DrafterStep) -> DrafterStepResult:
        result, ready = admit(req, self._apply, self.close)
        if not ready:
            return result
        last_logits = self._catch_up(ready)  # [B, V]
        chains, trees = split_by_shape(ready)
        drafted: dict[int, DraftTree] = {}
        if chains:
            drafted.update(zip(chains, self._draft_chains(
                [ready[i][0] for i in chains], [ready[i][1].shape.k for i in chains],
                [ready[i][1].sampling for i in chains], rows_of(last_logits, chains))))
        for shape, group in trees.items():  # one batched expansion per tree shape
            states = [ready[i][0] for i in group]
            expanded = expand_trees(self.runner, states, shape, rows_of(last_logits, group), self.draft_graphs)
            drafted.update(zip(group, expanded))
        for i, (s, it) in enumerate(ready):
            result.drafts.append(Draft(s.seq_id, len(s.tokens), len(it.assumed_ids), drafted[i]))
        return result

    def _apply(self, item: DraftItem) -> SequenceState | SequenceError:
        return apply_item(self.table, item, self.slot_len, self.max_context, self.draft_vocab_size)

    def _catch_up(self, ready: list[tuple[SequenceState, DraftItem]]) -> torch.Tensor:
        """Feed each context (committed + assumed tokens) where the KV lacks it, at least its last
        token; -> next-token logits [B, V]. Host work per sequence is O(tokens since the last
        step), not O(context): the KV's first `kv_synced` entries are known to be committed ones."""
        states, starts, feeds = [], [], []
        for s, it in ready:
            committed, assumed = s.tokens, it.assumed_ids
            limit = min(len(s.kv_tokens), len(committed) + len(assumed) - 1)
            common = min(s.kv_synced, limit)
            while common < limit and s.kv_tokens[common] == (
                    committed[common] if common < len(committed) else assumed[common - len(committed)]):
                common += 1
            feed = committed[common:] + assumed if common < len(committed) else assumed[common - len(committed):]
            del s.kv_tokens[common:]
            s.kv_tokens += feed            # after this feed the KV holds exactly the context
            s.kv_synced = len(committed)
            states.append(s)
            starts.append(common)
            feeds.append(feed)
        return prompts_apart([len(f) for f in feeds], max(DEFAULT_QUERY_LENS), self.device, lambda rows, _: (
            self._feed([states[i] for i in rows], [starts[i] for i in rows], [feeds[i] for i in rows]),))[0]

    def _feed(self, states: list[SequenceState], starts: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """One forward feeding feeds[i] at KV position starts[i] of states[i] -> logits after each
        feed's last token [B, V]: by graph replay (all positions) for short feeds, else the last
        position only (a prompt: a prefill graph where one fits)."""
        tokens, lengths, start, slots = upload_feeds(feeds, starts, [s.slot for s in states], self.device)
        n = tokens.shape[1]
        pos = self._in_slot(start[:, None] + torch.arange(n, device=self.device))
        kv_len = min(max(starts) + n, self.slot_len)
        batch = ForwardBatch.build(tokens, pos, slots, pos, start, causal_region(lengths, n), kv_len=kv_len)
        if self.draft_graphs is not None and n <= max(DEFAULT_QUERY_LENS):  # all positions, by graph replay
            rows = torch.arange(len(states), device=self.device)
            return self.runner.forward(batch)[rows, lengths - 1]
        return self.runner.forward(batch, logit_index=(lengths - 1)[:, None])[:, 0]

    def _in_slot(self, write_pos: torch.Tensor) -> torch.Tensor:
        """Write positions clamped into the KV slot. Only padding goes past it (a short feed
        batched with a long one, a short chain with a long one). _apply keeps context + k within
        slot_len, so catch-up and chains never write a real token at slot_len - 1: that position is
        free for padding's garbage (a tree may use it later, writing over it first)."""
        return write_pos.clamp(max=self.slot_len - 1)

    def _draft_chains(self, states: list[SequenceState], ks: list[int], params: list[SamplingParams],
                      logits: torch.Tensor) -> list[DraftTree]:
        """Chains of ks[i] tokens, one batched single-token forward per extra token: greedy, or
        sampled from each row's top-PROPOSAL_K draft distribution (returned as proposals)."""
        steps = max(ks)
        written = [len(s.kv_tokens) for s in states]   # each chain's next KV write position
        slots, pos = upload_packed([torch.tensor([s.slot for s in states], dtype=torch.long),
                                    torch.tensor(written, dtype=torch.long)], self.device)
        sampling = not all(p.greedy for p in params)
        graphed = None if sampling or self.draft_graphs is None else self.draft_graphs.chain(logits, pos, slots, steps)
        if graphed is not None:
            tok_rows, lp_rows = graphed[0].tolist(), graphed[1].tolist()
            return self._chains(states, ks, steps, tok_rows, lp_rows, None, params)
        seeds = seed_tensor(params, self.device) if sampling else None
        greedy_rows = upload(torch.tensor([p.greedy for p in params]), self.device)
        toks, logps, props = [], [], []
        for t in range(steps):
            logp = torch.log_softmax(logits, dim=-1)
            best = logp.argmax(-1)                                     # [B]
            if sampling:
                q_probs, q_ids = processed_probs(logits[:, None], params)[:, 0].topk(
                    min(PROPOSAL_K, logits.shape[-1]), dim=-1)
                q_probs = q_probs / q_probs.sum(-1, keepdim=True)      # [B, K] the proposal q
                u = uniforms(seeds, (pos + t)[:, None], DRAFT)[:, 0]
                drawn = torch.gather(q_ids, 1, sample_from(q_probs, u)[:, None])[:, 0]
                best = torch.where(greedy_rows, best, drawn)
                props.append((q_ids, q_probs))
            toks.append(best)
            logps.append(logp.gather(1, best[:, None])[:, 0])
            if t == steps - 1:
                break
            p = self._in_slot(pos + t)[:, None]
            batch = ForwardBatch.build(best[:, None], p, slots, p, p[:, 0],
                                       torch.ones(len(states), 1, 1, dtype=torch.bool, device=self.device),
                                       kv_len=min(max(written) + t + 1, self.slot_len))
            logits = self.runner.forward(batch)[:, 0]
        tok_rows = torch.stack(toks, 1).tolist()
        lp_rows = torch.stack(logps, 1).tolist()
        proposal_rows = None
        if sampling:
            proposal_rows = (torch.stack([q for q, _ in props], 1).tolist(),   # [B][steps][K]
                             torch.stack([p for _, p in props], 1).tolist())
        return self._chains(states, ks, steps, tok_rows, lp_rows, proposal_rows, params)

    @staticmethod
    def _chains(states, ks, steps, tok_rows, lp_rows, proposal_rows, params) -> list[DraftTree]:
        """Host rows of the drafted tokens -> one chain per sequence; records what the KV now holds."""
        out = []
        for i, (s, k, row, lp) in enumerate(zip(states, ks, tok_rows, lp_rows)):
            s.kv_tokens += row[: min(k, steps) - 1]  # the KV now also holds the chain but its last token
            proposals = None
            if proposal_rows is not None and not params[i].greedy:
                id_rows, pr_rows = proposal_rows
                proposals = [Proposal(ids, probs) for ids, probs in zip(id_rows[i][:k], pr_rows[i][:k])]
            out.append(DraftTree.chain(row[:k], lp[:k], proposals))
        return out


def apply_item(table: SequenceTable, item: DraftItem, slot_len: int, max_context: int,
               draft_vocab_size: int) -> SequenceState | SequenceError:
    """Open or extend the item's sequence with its newly committed tokens, after checks (shared by
    the drafter engines)."""
    problem = item.shape.problem()
    if isinstance(item.shape, TreeShape) and item.shape.topk > draft_vocab_size:
        problem = f"tree topk={item.shape.topk} is more than the drafter's {draft_vocab_size}-token vocabulary"
    if problem:
        return SequenceError(item.seq_id, ErrorCode.INVALID, problem)
    state = table.get(item.seq_id)
    if state is None:
        if item.committed_len != len(item.append_ids):
            return SequenceError(item.seq_id, ErrorCode.NOT_FOUND,
                                 f"sequence {item.seq_id!r} is not open; send all its tokens to open it")
        state = table.open(item.seq_id, item.append_ids)
        if isinstance(state, SequenceError):
            return state
    else:
        if len(state.tokens) + len(item.append_ids) != item.committed_len:
            return SequenceError(
                item.seq_id, ErrorCode.STALE,
                f"drafter holds {len(state.tokens)} tokens; {len(item.append_ids)} appended "
                f"do not make {item.committed_len}",
            )
        problem = table.token_problem(item.append_ids) if item.append_ids else None
        if problem:
            return SequenceError(item.seq_id, ErrorCode.INVALID, problem)
        state.tokens += item.append_ids
    if table.token_problem(item.assumed_ids or [0]):
        return SequenceError(item.seq_id, ErrorCode.INVALID, "assumed token outside the vocabulary")
    fed = item.shape.k if isinstance(item.shape, ChainShape) else item.shape.fed_nodes
    if len(state.tokens) + len(item.assumed_ids) + fed > slot_len:
        return SequenceError(item.seq_id, ErrorCode.OUT_OF_CAPACITY,
                             f"sequence reached the drafter's context limit {max_context}")
    return state


def prompts_apart(lengths: list[int], limit: int, device: torch.device, forward) -> tuple[torch.Tensor, ...]:
    """Feeds of `lengths` tokens: forward(rows, group) -> per-row outputs ([len(rows), ...] each),
    once for all rows, or, when some feeds are prompts (longer than `limit`) and some are not, once
    for the short feeds (group 0) and once for the prompts (group 1), the outputs put back in row
    order. One padded forward of both would feed every sequence as many tokens as the longest prompt."""
    short = [i for i, n in enumerate(lengths) if n <= limit]
    if len(short) in (0, len(lengths)):
        return forward(list(range(len(lengths))), 0)
    outs = None
    for group, rows in enumerate((short, [i for i, n in enumerate(lengths) if n > limit])):
        parts = forward(rows, group)
        if outs is None:
            outs = tuple(p.new_empty(len(lengths), *p.shape[1:]) for p in parts)
        index = upload_list(rows, device)
        for out, part in zip(outs, parts):
            out[index] = part
    return outs


def split_by_shape(ready: list[tuple[SequenceState, DraftItem]]) -> tuple[list[int], dict[TreeShape, list[int]]]:
    """Indices of the chain items, and of the tree items grouped by tree shape."""
    chains: list[int] = []
    trees: dict[TreeShape, list[int]] = {}
    for i, (_, it) in enumerate(ready):
        if isinstance(it.shape, ChainShape):
            chains.append(i)
        else:
            trees.setdefault(it.shape, []).append(i)
    return chains, trees


def admit(req: DrafterStep, apply, close) -> tuple[DrafterStepResult, list[tuple[SequenceState, DraftItem]]]:
    """The start of a drafter step (shared by the drafter engines): close what the step closes,
    apply each item -> the step's result holding the refusals, and the (state, item) pairs to draft."""
    result = DrafterStepResult(req.step)
    close(req.close)
    ready = []
    for item in req.items:
        state = apply(item)
        if isinstance(state, SequenceError):
            result.errors.append(state)
        else:
            ready.append((state, item))
    return result, ready
