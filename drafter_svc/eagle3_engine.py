"""EAGLE-3 drafter engine: chains drafted by a one-layer head from the target's hidden states.

Pairing (as SGLang has it): head position q holds token x_{q+1} with the target's hidden state
h_q, so the head's output at the last committed position predicts the next token. The verifier's
verdicts carry h for exactly the positions they commit (prompt at prefill, root + accepted nodes
after each verify: positions 0..len-2 over a sequence's life), and each DraftItem brings the
rows for its appended tokens. Draft positions past the committed ones -- overlap's assumed
tokens, then the chain itself -- have no target state yet, so the head feeds its own output
there; they are overwritten from the real states when the next verdict's rows arrive (the
head's KV of real pairs is tracked separately from that of drafted ones).

Drafts are the head's argmax (no proposal distributions): the verifier treats them as point
masses, which keeps sampled requests lossless too. Trees are EAGLE-2 style (tree_draft.expand)
over the draft vocabulary, each node fed with its parent's hidden output.
"""

from __future__ import annotations

import torch

from drafter_svc.engine import DRAFT_SLACK, admit, apply_item, prompts_apart, split_by_shape
from drafter_svc.tree_draft import expand, to_trees
from drafter_svc.types import Draft, DrafterStep, DrafterStepResult, DraftItem, TreeShape
from specdec.errors import ErrorCode, SequenceError
from specdec.model.batch import ForwardBatch, PinnedStaging, causal_region, upload, upload_packed
from specdec.model.eagle3 import Eagle3Head
from specdec.model.fp8_rows import dequantize_rows
from specdec.model.kv_cache import KVCache
from specdec.sequence_table import SequenceState, SequenceTable
from specdec.tree import DraftTree


# Real pairs per sequence in a step once its prompt is in: a verdict's accepted drafts and bonus (a
# chain of up to 6, a tree of depth up to 7), and the last pair again when nothing new was committed.
# eagle3_graphs captures 1 .. this; a prompt's longer feed runs in a forward of its own.
CATCH_UP_PAIRS = 8


class Eagle3DrafterEngine:
    def __init__(self, head: Eagle3Head, embed_weight: torch.Tensor, max_sequences: int, max_context: int,
                 hedge_predrafts: bool = False) -> None:
        spec = head.spec.layer
        self.head = head
        self.hedge_predrafts = hedge_predrafts   # overlap pre-drafts also cover each earlier rejection
        self.embed = embed_weight                       # [V, h]: the target's token embeddings
        self.device, self.dtype = embed_weight.device, embed_weight.dtype
        # rows as the verifier sends them: the target's states concatenated, or projected by the
        # head's fc there (--projected-hidden-states: fc is the identity here)
        self.projected = isinstance(head.fc, torch.nn.Identity)
        self.aux_width = (spec.hidden_size if self.projected
                          else len(head.spec.aux_layers) * head.spec.target_hidden_size)
        self.max_context = min(max_context, spec.max_position_embeddings)
        self.slot_len = self.max_context + DRAFT_SLACK
        self.cache = KVCache(1, max_sequences + 1, self.slot_len, spec.num_kv_heads, spec.head_dim, self.dtype,
                             self.device)
        self.table = SequenceTable(max_sequences, spec.vocab_size, self.max_context)
        self.draft_vocab_size = head.spec.draft_vocab_size   # what a tree's top-k picks from
        # seq id -> blocks of target states [m, aux] of positions fed - 1 .., on the host: a step
        # uploads all sequences' rows in one copy (not one synchronous copy per sequence)
        self.rows: dict[str, list[torch.Tensor]] = {}
        self.fed: dict[str, int] = {}            # seq id -> head positions holding real pairs (q < fed)
        self.graphs = None   # Eagle3Graphs once captured
        self.staging = PinnedStaging(self.device)   # the target states' upload

    def capture_cuda_graphs(self, log=None) -> None:
        """Greedy chains (with overlap's assumed tokens) and the default tree shapes as graph replays."""
        from drafter_svc.eagle3_graphs import Eagle3Graphs

        self.graphs = Eagle3Graphs(self, self.cache.num_slots - 1)
        self.graphs.capture(log)

    def close(self, seq_ids: list[str]) -> None:
        self.table.close_all(seq_ids)
        for sid in seq_ids:
            self.rows.pop(sid, None)
            self.fed.pop(sid, None)

    def step(self, req: DrafterStep) -> DrafterStepResult:
        result, ready = admit(req, self._apply, self.close)
        if ready:
            for (s, it), (tree, hedges) in zip(ready, self._draft(ready)):
                result.drafts.append(Draft(s.seq_id, len(s.tokens), len(it.assumed_ids), tree, hedges))
        return result

    def _apply(self, item: DraftItem) -> SequenceState | SequenceError:
        rows = item.hidden
        if isinstance(item.shape, TreeShape) and item.assumed_ids:
            return SequenceError(item.seq_id, ErrorCode.INVALID, "tree drafts are synchronous: no assumed tokens")
        opening = self.table.get(item.seq_id) is None
        have = 0 if opening else len(self.table.get(item.seq_id).tokens) - 1
        want = item.committed_len - 1 - have  # target states of positions have .. committed_len - 2
        got = 0 if rows is None else rows.shape[0]
        packed = rows is not None and rows.dtype == torch.uint8   # fp8 rows (specdec/model/fp8_rows.py)
        if got != want or (rows is not None and rows.shape[-1] - 4 * packed != self.aux_width):
            return SequenceError(item.seq_id, ErrorCode.INVALID,
                                 f"the EAGLE-3 drafter needs the target's hidden states of layers "
                                 f"{list(self.head.spec.aux_layers)} for every committed token but the last: "
                                 f"expected {want} rows of {self.aux_width}, got {got} (start the verifier with "
                                 f"{self._verifier_flag()})")
        state = apply_item(self.table, item, self.slot_len, self.max_context, self.draft_vocab_size)
        if isinstance(state, SequenceError):
            return state
        if opening:
            self.fed[state.seq_id] = 0
            self.rows[state.seq_id] = []
        if got:   # kept as the blocks that came: a step joins every sequence's blocks in one copy
            self.rows[state.seq_id].append(rows if packed else rows.to("cpu", self.dtype))
        return state

    def _verifier_flag(self) -> str:
        if self.projected:
            return "--project-hidden-states set to this drafter's head"
        return f"--aux-hidden-layers {','.join(map(str, self.head.spec.aux_layers))} and no --project-hidden-states"

    @torch.inference_mode()
    def _draft(self, ready: list[tuple[SequenceState, DraftItem]]) -> list[tuple[DraftTree, dict[int, DraftTree]]]:
        """-> per item its draft and its hedges (overlap pre-drafts only). Inputs go to the device
        as host tensors packed into one copy each (graph statics or eager uploads)."""
        states = [s for s, _ in ready]
        slots = torch.tensor([s.slot for s in states], dtype=torch.long)              # [B] host
        logits, out = self._feed_real_pairs(states, slots)             # [B, Vd], [B, h]
        chains, trees = split_by_shape(ready)
        groups = [(rows, None) for rows in [chains] if rows] + [(rows, shape) for shape, rows in trees.items()]
        drafted: dict[int, tuple[DraftTree, dict[int, DraftTree]]] = {}
        for rows, shape in groups:
            if len(groups) > 1:   # one group (the usual step): no gather, no index upload
                index = upload(torch.tensor(rows, dtype=torch.long), self.device)
                inputs = slots[rows], logits[index], out[index]
            else:
                inputs = slots, logits, out
            if shape is None:
                drafted.update(zip(rows, self._chains([ready[i] for i in rows], *inputs)))
            else:
                drafted.update(zip(rows, ((t, {}) for t in self._trees([states[i] for i in rows], *inputs, shape))))
        return [drafted[i] for i in range(len(ready))]

    def _feed_real_pairs(self, states: list[SequenceState], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Real pairs at positions fed-1 .. len-2 (at least the last one, for its output) -> the
        draft logits [B, Vd] and hidden output [B, h] at each sequence's last committed token."""
        starts, feeds, rows = [], [], []
        for s in states:
            start = min(self.fed[s.seq_id], len(s.tokens) - 2)
            blocks = self.rows[s.seq_id]     # the states of positions start .. len - 2, in blocks
            starts.append(start)
            feeds.append(s.tokens[start + 1:])
            rows.append(blocks)
            self.fed[s.seq_id] = len(s.tokens) - 1
            # keep the last: the next step may need its output again
            self.rows[s.seq_id] = [blocks[-1][-1:]] if blocks else []
        # a staging buffer per group: both groups' uploads may be in flight at once
        return prompts_apart([len(f) for f in feeds], CATCH_UP_PAIRS, self.device, lambda some, group: (
            self._pairs_forward([starts[i] for i in some], [feeds[i] for i in some], [rows[i] for i in some],
                                slots[some], ("hidden", "prompt hidden")[group])))

    def _pairs_forward(self, starts: list[int], feeds: list[list[int]], rows: list[list[torch.Tensor]],
                       slots: torch.Tensor, staging: str = "hidden") -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of real pairs: feeds[i] with their target states (rows[i]: blocks, their last
        len(feeds[i]) rows) at head positions starts[i] + 1 .. -> the draft logits [B, Vd] and hidden
        output [B, h] after each feed."""
        n = max(len(f) for f in feeds)
        tokens = torch.tensor([f + [0] * (n - len(f)) for f in feeds], dtype=torch.long)      # [B, n] host
        lengths = torch.tensor([len(f) for f in feeds], dtype=torch.long)
        start = torch.tensor(starts, dtype=torch.long)
        taken = [last_rows(blocks, len(f)) for blocks, f in zip(rows, feeds)]   # per sequence, its blocks to stage
        packed = all(r.dtype == torch.uint8 for blocks in taken for r in blocks)   # fp8: uploaded as such
        width, dtype = (self.aux_width + 4, torch.uint8) if packed else (self.aux_width, self.dtype)
        hidden = self.staging.get(f"{staging} {dtype}", (len(feeds), n, width), dtype).zero_()
        staged = hidden.view(-1, width)
        # Each block straight to its rows: a cat and an index_copy moved every byte twice (the dev VM: 57
        # catch-ups of 120 fp8 rows 15 ms against 3; a step's 64 single rows the same either way).
        for i, blocks in enumerate(taken):
            at = i * n
            for r in blocks:
                staged[at:at + r.shape[0]].copy_(r if packed or r.dtype != torch.uint8 else dequantize_rows(r, dtype))
                at += r.shape[0]
        if packed:   # [B, n, aux] on the device
            hidden = dequantize_rows(upload(hidden, self.device), self.dtype)
        fed = None if self.graphs is None else self.graphs.real_pairs(tokens, hidden, start, lengths, slots)
        if fed is not None:
            return fed
        tokens, start, lengths, slots = upload_packed([tokens, start, lengths, slots], self.device)
        hidden = hidden if hidden.device == self.device else upload(hidden, self.device)
        return real_pairs_forward(self.head, self.embed, self.cache, tokens, hidden, start,
                                  lengths, slots, self.slot_len, kv_len=min(max(starts) + n, self.slot_len))

    def _chains(self, ready, slots, logits, out) -> list[tuple[DraftTree, dict[int, DraftTree]]]:
        """Assumed tokens (overlap), then the chain: each position fed the head's own previous output."""
        assumed = [it.assumed_ids for _, it in ready]
        ks = [it.shape.k for _, it in ready]
        steps = max(len(a) + k for a, k in zip(assumed, ks))
        forced = torch.tensor([a + [-1] * (steps - len(a)) for a in assumed], dtype=torch.long)    # [B, S] host
        written = [len(s.tokens) - 1 for s, _ in ready]
        write = torch.tensor(written, dtype=torch.long)   # next head position
        drafted = None if self.graphs is None else self.graphs.chain(logits, out, forced, write, slots)
        if drafted is None:
            forced, write, dev_slots = upload_packed([forced, write, slots], self.device)
            drafted = greedy_chain(self.head, self.embed, self.cache, logits, out, forced, write, dev_slots,
                                   self.slot_len, alternatives=self.hedge_predrafts,
                                   kv_len=min(max(written) + steps, self.slot_len))
        tok_rows, lp_rows = drafted[0].tolist(), drafted[1].tolist()
        chains = [DraftTree.chain(row[len(a):len(a) + k], lp[len(a):len(a) + k])
                  for row, lp, a, k in zip(tok_rows, lp_rows, assumed, ks)]
        hedges: list[dict[int, DraftTree]] = [{} for _ in ready]
        if self.hedge_predrafts:
            # Branches: (item, assumed tokens kept) for greedy pre-drafts whose branches fit in the slot.
            branches = [(i, j) for i, (_, it) in enumerate(ready)
                        if it.assumed_ids and it.sampling.greedy and ks[i] > 1
                        and written[i] + steps + len(it.assumed_ids) * ks[i] <= self.slot_len
                        for j in range(len(it.assumed_ids))]
            if branches:
                self._hedges(branches, hedges, ks, written, steps, slots, drafted[2:])
        return list(zip(chains, hedges))

    def _hedges(self, branches, hedges, ks, written, steps, slots, alternatives) -> None:
        """One chain per (item i, kept j): the guessed correction alt[i, j], then ks[i] - 1 drafted
        tokens, all branches batched. Branch j of item i stores its KV past the main chain (from
        written + steps + j * k), so every branch sees the context and the j assumed tokens it keeps."""
        alt, alt_logp, fed_out = alternatives                     # [B, S], [B, S], [B, S, h]
        ii = torch.tensor([i for i, _ in branches], dtype=torch.long)
        k = max(ks[i] for i, _ in branches)
        rope0 = [written[i] + j for i, j in branches]             # where the correction would sit
        base = [written[i] + steps + j * ks[i] for i, j in branches]
        width = max(b - r for b, r in zip(base, rope0)) + k - 1
        ii, jj, rope0_d, base_d, branch_slots = upload_packed(
            [ii, torch.tensor([j for _, j in branches], dtype=torch.long), torch.tensor(rope0, dtype=torch.long),
             torch.tensor(base, dtype=torch.long), slots[ii]], self.device)
        guesses = alt[ii, jj]
        inputs = (guesses, fed_out[ii, jj], rope0_d, base_d)
        drafted = None if self.graphs is None else self.graphs.hedges(*inputs, width, branch_slots, k - 1)
        if drafted is None:
            drafted = hedge_chains(self.head, self.embed, self.cache, *inputs, width, branch_slots, k - 1,
                                   self.slot_len, kv_len=min(max(base) + k, self.slot_len))
        toks, logps = drafted
        first, first_lp = guesses.tolist(), alt_logp[ii, jj].tolist()
        for n, ((i, j), row, lp) in enumerate(zip(branches, toks.tolist(), logps.tolist())):
            hedges[i][j] = DraftTree.chain([first[n]] + row[: ks[i] - 1], [first_lp[n]] + lp[: ks[i] - 1])

    def _trees(self, states, slots, root_logits, root_out, shape: TreeShape) -> list[DraftTree]:
        ctx_len = torch.tensor([len(s.tokens) - 1 for s in states], dtype=torch.long)   # head KV of real pairs
        out = None if self.graphs is None else self.graphs.tree(root_logits, root_out, ctx_len, slots, shape)
        if out is None:
            ctx_len, slots = upload_packed([ctx_len, slots], self.device)
            out = head_tree(self.head, self.embed, self.cache, root_logits, root_out, ctx_len, slots, shape,
                            max(len(s.tokens) - 1 for s in states))
        return to_trees(*out)


def last_rows(blocks: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    """The last k rows (fewer if there are fewer) of blocks of rows, as views, in order."""
    out = []
    for block in reversed(blocks):
        if k <= 0:
            break
        out.append(block[-k:] if block.shape[0] > k else block)
        k -= block.shape[0]
    return out[::-1]


def real_pairs_forward(head: Eagle3Head, embed: torch.Tensor, cache: KVCache, tokens: torch.Tensor,
                       hidden: torch.Tensor, start: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                       slot_len: int, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, n] paired with the target's states hidden [B, n, aux] (rows past lengths [B] are
    padding), stored from head position start [B] on -> the draft logits [B, Vd] and hidden output
    [B, h] at each row's last real pair. Tensor work only (CUDA graphs capture it)."""
    n = tokens.shape[1]
    pos = (start[:, None] + torch.arange(n, device=tokens.device)).clamp(max=slot_len - 1)
    batch = ForwardBatch(tokens, pos, slots, pos, start, causal_region(lengths, n), kv_len)
    return head(batch, cache, embed[tokens], hidden, from_target=True, last=lengths - 1)


def greedy_chain(head: Eagle3Head, embed: torch.Tensor, cache: KVCache, logits: torch.Tensor, out: torch.Tensor,
                 forced: torch.Tensor, write: torch.Tensor, slots: torch.Tensor,
                 slot_len: int, alternatives: bool = False, kv_len: int | None = None) -> tuple[torch.Tensor, ...]:
    """logits [B, Vd] and hidden out [B, h] after the last committed token; forced [B, S] (-1: draft)
    -> target ids and draft log-probabilities [B, S]; with `alternatives` (for hedges) also, per
    position, the head's best token other than the forced one (target ids) and its log-probability
    [B, S], and the hidden output each position was drafted from [B, S, h]. Tensor work only (CUDA
    graphs capture it). kv_len: keys read per row; left out, the whole slot (the fixed shape a graph
    captures); eager steps pass the longest context in use: reading whole 2,048-position slots made
    a CPU step of 16 chains of 2 take 73 ms, 21 ms with the context read."""
    b, steps = forced.shape
    region = torch.ones(b, 1, 1, dtype=torch.bool, device=logits.device)
    picked, logps, alts, alt_logps, fed_out = [], [], [], [], []
    for t in range(steps):
        logp = torch.log_softmax(logits, -1)
        best = logp.argmax(-1)
        target = torch.where(forced[:, t] >= 0, forced[:, t], head.to_target_ids(best))
        picked.append(target)
        logps.append(logp.gather(1, best[:, None])[:, 0])
        if alternatives:
            top_logp, top = logp.topk(2, -1)                                 # [B, 2]
            top = head.to_target_ids(top)
            other = (top[:, 0] == forced[:, t]).long()                       # the forced token is the best
            alts.append(top.gather(1, other[:, None])[:, 0])
            alt_logps.append(top_logp.gather(1, other[:, None])[:, 0])
            fed_out.append(out)
        if t == steps - 1:
            break
        p = (write + t).clamp(max=slot_len - 1)[:, None]
        batch = ForwardBatch(target[:, None], p, slots, p, p[:, 0], region, kv_len or slot_len)
        logits, out = head(batch, cache, embed[target[:, None]], out[:, None], from_target=False)
        logits, out = logits[:, 0], out[:, 0]
    chain = torch.stack(picked, 1), torch.stack(logps, 1)
    if not alternatives:
        return chain
    return *chain, torch.stack(alts, 1), torch.stack(alt_logps, 1), torch.stack(fed_out, 1)


def hedge_chains(head: Eagle3Head, embed: torch.Tensor, cache: KVCache, first: torch.Tensor, out: torch.Tensor,
                 rope0: torch.Tensor, base: torch.Tensor, width: int, slots: torch.Tensor, steps: int,
                 slot_len: int, kv_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Side branches in the sequences' own KV slots: row r feeds first[r] [R] with the hidden output
    out[r] [R, h] at RoPE position rope0[r] [R], seeing the slot's KV below rope0[r]; its nodes are
    stored from base[r] [R] on (past everything else written this step) and see each other causally;
    then `steps` greedy tokens -> target ids and log-probabilities [R, steps]. width: the region of
    KV positions from rope0 on that the masks span (at least base - rope0 + steps); kv_len as in
    greedy_chain. Tensor work only."""
    gap = (base - rope0)[:, None]                                  # [R, 1] offset of each branch's first node
    offsets = torch.arange(width, device=first.device)[None]       # [1, width]
    tok, picked, logps = first, [], []
    for m in range(steps):
        region = ((offsets >= gap) & (offsets <= gap + m))[:, None]  # [R, 1, width]: the branch's nodes so far
        p = (rope0 + m)[:, None]
        batch = ForwardBatch(tok[:, None], p, slots, (base + m).clamp(max=slot_len - 1)[:, None], rope0, region,
                             kv_len or slot_len)
        logits, out = head(batch, cache, embed[tok[:, None]], out[:, None], from_target=False)
        logits, out = logits[:, 0], out[:, 0]
        logp = torch.log_softmax(logits, -1)
        best = logp.argmax(-1)
        tok = head.to_target_ids(best)
        picked.append(tok)
        logps.append(logp.gather(1, best[:, None])[:, 0])
    return torch.stack(picked, 1), torch.stack(logps, 1)


def head_tree(head: Eagle3Head, embed: torch.Tensor, cache: KVCache, root_logits: torch.Tensor,
              root_out: torch.Tensor, ctx_len: torch.Tensor, slots: torch.Tensor, shape: TreeShape,
              max_ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2 trees over the draft vocabulary (tree_draft.expand): a node pairs its token with its
    parent's hidden output (the root's: the output at the last committed token) -> target ids,
    parents, log-probabilities [B, budget]. Tensor work only."""
    fed_out = root_out[:, None][:, :0]                                       # [B, fed nodes, h]

    def forward(batch: ForwardBatch, parents: torch.Tensor) -> torch.Tensor:
        nonlocal fed_out
        idx = parents.clamp(min=0)[:, :, None].expand(-1, -1, root_out.shape[-1])
        from_fed = torch.gather(fed_out, 1, idx) if fed_out.shape[1] else root_out[:, None].expand_as(idx)
        hidden = torch.where((parents >= 0)[:, :, None], from_fed, root_out[:, None])      # [B, k, h]
        logits, out = head(batch, cache, embed[head.to_target_ids(batch.tokens)], hidden, from_target=False)
        fed_out = torch.cat([fed_out, out], 1)
        return logits

    tokens, parents, logps = expand(forward, root_logits, ctx_len, slots, shape, max_ctx)
    return head.to_target_ids(tokens), parents, logps


def build_eagle3_drafter(target_dir, head_dir, dtype: torch.dtype, device: torch.device, max_sequences: int,
                         max_context: int, hedge_predrafts: bool = False, projected: bool = False,
                         engine_class: type | None = None, **extra) -> Eagle3DrafterEngine:
    """The head from head_dir (published layout) and the target's embeddings from target_dir;
    projected: the verifier applies the head's fc (--projected-hidden-states); engine_class: a
    subclass to build instead (the benchmarks' controlled drafter), given `extra`."""
    from specdec.model.eagle3 import load_eagle3
    from specdec.model.loader import load_embeddings
    from specdec.model.spec import ModelSpec

    head = load_eagle3(head_dir, ModelSpec.from_pretrained(target_dir), dtype, device, projected)
    return (engine_class or Eagle3DrafterEngine)(head, load_embeddings(target_dir, dtype, device), max_sequences,
                                                 max_context, hedge_predrafts, **extra)

