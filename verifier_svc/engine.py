"""Verifier engine: prefill new sequences and verify every active sequence's draft in one forward.

Runs on one worker thread (never on the event loop). Invariant per sequence: the KV cache holds
every committed token but the last one, which is fed as the root of the next step's draft tree.
Prompts are prefilled in chunks (verifier_svc/prefill.py), in a forward of their own before the
step's verification; a sequence still prefilling has no verdict yet and cannot be verified.
"""

from __future__ import annotations

import torch

from kernels.greedy_accept import greedy_accept
from kernels.spec_sampling import child_table, spec_sample
from specdec.errors import ErrorCode, SequenceError
from specdec.model.batch import ForwardBatch, causal_region, rows_of, upload, upload_feeds, upload_list
from specdec.model.cuda_graphs import DEFAULT_QUERY_LENS, verify_query_lens
from specdec.model.fp8_rows import quantize_rows
from specdec.model.hidden_projection import HiddenProjection
from specdec.model.runner import ModelRunner
from specdec.sampling import ACCEPT, RESIDUAL, processed_probs, sample_from, seed_tensor, uniforms
from specdec.sequence_table import SequenceState, SequenceTable
from specdec.tree import pack_proposals, pack_trees
from verifier_svc.held_rows import HeldRows
from verifier_svc.prefill import Chunk, PrefillQueue, chunk_rows
from verifier_svc.types import Verdict, VerifierStep, VerifierStepResult, VerifyItem


class VerifierEngine:
    def __init__(self, runner: ModelRunner, max_sequences: int, max_context: int, max_draft_tokens: int,
                 aux_layers: tuple[int, ...] = (), prefill_chunk: int = 0, fold_prefill: bool = False,
                 hidden_fp8: bool = False, projection: HiddenProjection | None = None) -> None:
        """aux_layers: target layers (0..num_layers) whose input hidden states every verdict carries
        for the positions it committed (for an EAGLE-3 drafter); empty = none. prefill_chunk: prompt
        tokens prefilled per step over all sequences (0: whole prompts in the step they open).
        fold_prefill: a step's prompt chunks ride in its verify forward as extra rows, up to
        `graph_rows` rows in all, instead of a forward of their own (one pass over the weights).
        hidden_fp8: verdicts carry hidden states quantized on the device (quantize_rows: half the
        bytes of bf16 on every hop to the drafter). projection: an EAGLE-3 head's fc, applied to the
        rows before they leave (--project-hidden-states; aux_layers default to the head's)."""
        spec = runner.spec
        if projection is not None:
            aux_layers = aux_layers or projection.aux_layers
            if tuple(aux_layers) != projection.aux_layers:
                raise ValueError(f"--aux-hidden-layers {list(aux_layers)} differ from the layers "
                                 f"{list(projection.aux_layers)} of the head whose fc projects them")
        if not all(0 <= i <= spec.num_layers for i in aux_layers):
            raise ValueError(f"aux hidden-state layers {list(aux_layers)} must lie in 0..{spec.num_layers}")
        runner.aux_layers = tuple(aux_layers)
        self.hidden_wanted: set[str] = set()  # sequences whose verdicts carry hidden states
        self.held = HeldRows()   # rows kept back (hold_hidden)
        self.hidden_fp8 = hidden_fp8
        self.projection = projection
        self.runner = runner
        self.spec = spec
        self.device = runner.device
        self.max_context = min(max_context, spec.max_position_embeddings)
        self.max_draft_tokens = max_draft_tokens
        self.kv_capacity = self.max_context + max_draft_tokens + 1   # KV positions per slot
        runner.allocate_kv(max_sequences, self.kv_capacity)
        self.table = SequenceTable(max_sequences, spec.vocab_size, self.max_context)
        self.prefills = PrefillQueue(prefill_chunk)
        self.graph_rows = 2 * max_sequences if fold_prefill else max_sequences   # rows a verify forward may have
        self.fold_prefill = fold_prefill
        # Widths a verify forward may be widened to for a fold (those the graphs are captured for at
        # every batch: not the wide trees' lengths, captured for small batches only), and
        # what a forward's pass over the weights costs in tokens of compute (0: never widen; the cost
        # profile sets it, see fold_width)
        self.verify_widths = tuple(w for w in verify_query_lens(max_draft_tokens) if w in DEFAULT_QUERY_LENS)
        self.fold_pass_tokens = 0.0
        self.prefill_tokens_computed = 0  # prompt tokens fed by prefills since start (host count, no sync)

    def close(self, seq_ids: list[str]) -> None:
        self.table.close_all(seq_ids)
        self.hidden_wanted.difference_update(seq_ids)
        self.held.drop(seq_ids)
        for sid in seq_ids:
            if sid in self.prefills:
                self.prefills.drop(sid)

    def step(self, req: VerifierStep) -> VerifierStepResult:
        result = VerifierStepResult(req.step)
        self.close(req.close)
        self.hidden_wanted.difference_update(req.stop_hidden)
        self.held.drop(req.stop_hidden)
        opened: list[tuple[SequenceState, str]] = []
        for o in req.open:
            problem = o.sampling.problem()
            state = (SequenceError(o.seq_id, ErrorCode.INVALID, problem) if problem
                     else self.table.open(o.seq_id, o.prompt_ids))
            if isinstance(state, SequenceError):
                result.errors.append(state)
            else:
                state.sampling = o.sampling
                if o.want_hidden and self.runner.aux_layers:
                    self.hidden_wanted.add(o.seq_id)
                opened.append((state, o.share_prefill_with))
        self.prefills.add(opened)
        chunks = self.prefills.take() if self.prefills else []
        hold = set(req.hold_hidden)
        width = self.fold_width(chunks, req.verify) if chunks else 1
        if chunks and width is None:
            result.verdicts += self._prefill(chunks, hold)
            chunks, width = [], 1
        items: list[tuple[SequenceState, VerifyItem]] = []
        for item in req.verify:
            checked = self._check(item)
            if isinstance(checked, SequenceError):
                result.errors.append(checked)
            else:
                items.append((checked, item))
        if items:
            result.verdicts += self._verify(items, chunks, hold, width)
        elif chunks:   # every verify item was refused: nothing to ride on
            result.verdicts += self._prefill(chunks, hold)
        return result

    def fold_width(self, chunks: list[Chunk], verify: list[VerifyItem]) -> int | None:
        """The width of a verify forward that takes this step's prompt chunks as extra rows of that
        many tokens, within the rows its graphs were captured for: its widest draft tree's (root
        included), or where that needs too many rows (mode off: a row per prompt token), the
        narrowest wider verify width that fits, if the padding it adds costs less than the forward of
        their own it saves (fold_pass_tokens); None: the chunks run apart. (Off never folded: its
        steps that prefilled took two passes over the weights where a chain's took one.)"""
        if not (self.fold_prefill and verify):
            return None
        widest = 1 + max(len(it.draft) for it in verify)

        def rows(w: int) -> int:
            return len(verify) + sum(-(-(c.end - c.start) // w) for c in chunks)

        if rows(widest) <= self.graph_rows:
            return widest
        wider = next((w for w in self.verify_widths if w > widest and rows(w) <= self.graph_rows), None)
        if wider is None or self.fold_pass_tokens <= 0:
            return None
        apart = len(verify) * widest + len(chunks) * max(c.end - c.start for c in chunks)   # tokens, padded
        return wider if rows(wider) * wider <= apart + self.fold_pass_tokens else None

    def finish_prefills(self) -> list[Verdict]:
        """Start-up work and tools: run prefill chunks until no prompt is left half-prefilled."""
        verdicts = []
        while self.prefills:
            verdicts += self._prefill(self.prefills.take())
        return verdicts

    def _check(self, item: VerifyItem) -> SequenceState | SequenceError:
        state = self.table.get(item.seq_id)
        if state is None:
            return SequenceError(item.seq_id, ErrorCode.NOT_FOUND, f"sequence {item.seq_id!r} is not open")
        if item.seq_id in self.prefills:
            return SequenceError(item.seq_id, ErrorCode.STALE, f"sequence {item.seq_id!r} is still prefilling")
        if item.committed_len != len(state.tokens):
            return SequenceError(
                item.seq_id, ErrorCode.STALE,
                f"verify item for committed length {item.committed_len}, sequence has {len(state.tokens)}",
            )
        problem = item.draft.problem(self.spec.vocab_size, self.max_draft_tokens)
        if problem:
            return SequenceError(item.seq_id, ErrorCode.INVALID, problem)
        if len(state.tokens) >= self.max_context:
            return SequenceError(item.seq_id, ErrorCode.OUT_OF_CAPACITY,
                                 f"sequence reached the context limit {self.max_context}")
        return state

    def _prefill(self, chunks: list[Chunk], hold: set[str] = frozenset()) -> list[Verdict]:
        """This step's prompt chunks in a forward of their own; -> the first token of each prompt
        completed (and of the sequences sharing it, which get a copy of its KV). hold: as _verify's."""
        leaders = [c.entry.state for c in chunks]
        tokens, lengths, starts, slots = upload_feeds([s.tokens[c.start:c.end] for s, c in zip(leaders, chunks)],
                                                      [c.start for c in chunks], [s.slot for s in leaders], self.device)
        n = tokens.shape[1]                                                            # tokens [L, n]
        positions = starts[:, None] + torch.arange(n, device=self.device)             # [L, n]
        # Padding past a short chunk of a late prompt would land past the slot's end: park it in
        # the slot's last position, which no live query of this sequence reads.
        write_pos = positions.clamp(max=self.kv_capacity - 1)
        batch = ForwardBatch.build(
            tokens, positions, slots, write_pos, starts,
            causal_region(lengths, n), kv_len=min(max(c.start for c in chunks) + n, self.kv_capacity),
        )
        logits, aux = self._forward(batch, logit_index=(lengths - 1)[:, None])  # [L, 1, V], [L, n, A] or None
        return self._answer(chunks, logits[:, 0], None if aux is None else list(aux), hold)

    def _answer(self, chunks: list[Chunk], last_logits: torch.Tensor, aux: list[torch.Tensor] | None,
                hold: set[str] = frozenset()) -> list[Verdict]:
        """The chunks ran (last_logits [L, V]: after each chunk's last token; aux: each chunk's
        hidden-state rows, at least as many as its tokens): completed prompts are answered (their
        rows kept back for the seq ids in hold)."""
        self.prefill_tokens_computed += sum(c.end - c.start for c in chunks)
        self.prefills.advance(chunks)
        wants = lambda e: any(s.seq_id in self.hidden_wanted for s in (e.state, *e.followers))  # noqa: E731
        if aux is not None and any(wants(c.entry) for c in chunks):
            lengths = [c.end - c.start for c in chunks]
            wired = self._wire(torch.cat([rows[:n] for rows, n in zip(aux, lengths)]))   # [sum(lengths), .]
            # read once the step's read-back below (same stream) has waited for the copy
            for c, rows in zip(chunks, wired.to("cpu", non_blocking=True).split(lengths)):
                c.entry.hidden.append(rows)
        done = [(i, c.entry) for i, c in enumerate(chunks) if c.completes]
        if not done:
            return []
        # Answered now: each completed prompt's sequence, then those sharing its prompt (they copy its
        # KV first); each with its logits row and the prompt's hidden-state rows.
        shared = [(e.state, f) for _, e in done for f in e.followers]
        if shared:
            self.runner.copy_prefix(self.table.slots([lead for lead, _ in shared], self.device),
                                    self.table.slots([f for _, f in shared], self.device),
                                    max(len(lead.tokens) for lead, _ in shared))
        answered = [(e.state, i, e.hidden) for i, e in done] + [(f, i, e.hidden) for i, e in done for f in e.followers]
        rows = rows_of(last_logits, [i for _, i, _ in answered])   # [A, V]: a row per sequence answered
        first = self._sample_next([s for s, _, _ in answered], rows).tolist()
        out, prompt_rows = [], {}
        for (s, _, h), tok in zip(answered, first):
            s.tokens.append(tok)
            out.append(Verdict(s.seq_id, len(s.tokens), [tok], 0))
            if aux is not None and s.seq_id in self.hidden_wanted:
                prompt_rows[s.seq_id] = torch.cat(h)
        sent = self.held.carry(prompt_rows, hold)   # kept back for the seq ids in hold (HeldRows)
        for v in out:
            v.hidden = sent.get(v.seq_id)
        return out

    def _wire(self, rows: torch.Tensor) -> torch.Tensor:
        """Hidden-state rows [..., A] as verdicts carry them: as computed or projected by the head's
        fc ([..., h]), and packed to fp8 here or not."""
        if self.projection is not None:
            rows = self.projection(rows)
        return quantize_rows(rows) if self.hidden_fp8 else rows

    def _forward(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None):
        """-> (logits, aux hidden states [B, n, A] or None)."""
        if self.runner.aux_layers:
            return self.runner.forward_with_aux(batch, logit_index)
        return self.runner.forward(batch, logit_index), None

    def _sample_next(self, states: list[SequenceState], logits: torch.Tensor) -> torch.Tensor:
        """The next token after each sequence's committed tokens, from logits [B, V]."""
        params = [s.sampling for s in states]
        if all(p.greedy for p in params):
            return logits.argmax(-1)
        probs = processed_probs(logits[:, None], params)[:, 0]
        pos = upload_list([len(s.tokens) for s in states], self.device)[:, None]
        return sample_from(probs, uniforms(seed_tensor(params, self.device), pos, RESIDUAL)[:, 0])

    def _verify(self, items: list[tuple[SequenceState, VerifyItem]], chunks: list[Chunk],
                hold: set[str] = frozenset(), width: int = 1) -> list[Verdict]:
        """The items' draft trees in one forward, with this step's prompt chunks as extra rows
        when they ride along (fold_prefill); -> the prompts' verdicts, then the items'. hold: seq
        ids whose hidden-state rows stay here this step (HeldRows). width: at least this many
        tokens a row (fold_width)."""
        states = [s for s, _ in items]
        trees = pack_trees([s.tokens[-1] for s in states], [it.draft for _, it in items], self.device, width)
        n = trees.tokens.shape[1]
        starts = [len(s.tokens) - 1 for s in states]  # KV entries before the root
        kv_start = upload_list(starts, self.device)   # [B]
        slots = self.table.slots(states, self.device)
        batch = ForwardBatch.build(
            trees.tokens, kv_start[:, None] + trees.depth, slots,
            kv_start[:, None] + torch.arange(n, device=self.device), kv_start, trees.ancestors,
            kv_len=max(starts) + n,
        )
        prompt_rows = self._with_prompt_rows(batch, chunks) if chunks else None
        logits, aux = self._forward(batch if prompt_rows is None else prompt_rows[0])  # [B(+R), n, V], [.., A]
        answered = []
        if prompt_rows is not None:
            b = len(states)
            answered = self._answer(chunks, *self._prompt_outputs(logits[b:], None if aux is None else aux[b:],
                                                                  *prompt_rows[1:]), hold)
            logits, aux = logits[:b], None if aux is None else aux[:b]
        params = [s.sampling for s in states]
        if all(p.greedy for p in params):
            verdict = greedy_accept(trees.tokens, trees.parents, trees.depth, trees.ancestors, trees.num_nodes,
                                    logits.argmax(-1), trees.max_depth)
        else:
            q_ids, q_probs, sampled = pack_proposals([it.draft for _, it in items], n, self.device)
            seeds = seed_tensor(params, self.device)
            pos = kv_start[:, None] + trees.depth                       # each node's token position
            _, rank = child_table(trees.parents)
            verdict = spec_sample(
                processed_probs(logits, params), trees.tokens, trees.parents, trees.depth, q_ids, q_probs, sampled,
                uniforms(seeds, pos, ACCEPT + 16 * rank), uniforms(seeds, pos + 1, RESIDUAL),
                trees.max_depth, trees.max_children,
            )
        dense = torch.arange(verdict.path.shape[1], device=self.device)[None, :]
        on_path = verdict.path >= 0
        scattered = (on_path & (verdict.path != dense)).any(1)                      # [B]
        accepted = torch.gather(trees.tokens, 1, verdict.path.clamp(min=0))[:, 1:]  # [B, D]
        # Hidden states (root + accepted nodes, in order) of the sequences that want them, only those
        # rows gathered and copied (under auto most of a batch may not: parked requests)
        wanted = [i for i, s in enumerate(states) if s.seq_id in self.hidden_wanted] if aux is not None else []
        rows_out = None
        if wanted:
            path = verdict.path.clamp(min=0)
            if len(wanted) < len(states):
                index = upload(torch.tensor(wanted, dtype=torch.long), self.device)
                aux, path = aux[index], path[index]
            # queued before the read-back below, which waits for it too (same stream)
            rows_out = self._wire(torch.gather(aux, 1, path[:, :, None].expand(-1, -1, aux.shape[-1])))
            rows_out = rows_out.to("cpu", non_blocking=True)                       # [len(wanted), n, .]
        # The step's one read-back: accepted tokens, their count, the bonus, whether to compact.
        rows = torch.cat([accepted, torch.stack([verdict.accept_len, verdict.bonus, scattered.long()], 1)], 1)
        rows = rows.tolist()
        if any(row[-1] for row in rows):  # compact the accepted path's KV into a dense prefix
            src = kv_start[:, None] + torch.where(on_path, verdict.path, dense)
            self.runner.move(slots, src, kv_start[:, None] + dense)
        out = []
        for s, (*row, a, bonus, _) in zip(states, rows):
            new = row[:a] + [bonus]
            s.tokens += new
            out.append(Verdict(s.seq_id, len(s.tokens), new, a))
        if rows_out is not None:   # root + accepted rows
            sent = self.held.carry_block([states[i].seq_id for i in wanted], rows_out,
                                         [out[i].accepted_drafts + 1 for i in wanted], hold)
            for v in out:
                v.hidden = sent.get(v.seq_id)
        return answered + out

    def _with_prompt_rows(self, batch: ForwardBatch, chunks: list[Chunk]):
        """The verify batch [B, n] with the chunks' tokens appended as rows of n (chunk_rows)
        -> (the batch [B + R, n], each row's token count [R] (host), each chunk's last row)."""
        n = batch.tokens.shape[1]
        feeds, row_starts, row_slots, last = chunk_rows(chunks, n)
        tokens, lengths, starts, slots = upload_feeds(feeds, row_starts, row_slots, self.device, width=n)
        positions = starts[:, None] + torch.arange(n, device=self.device)             # [R, n]
        # Padding past a short row near the slot's end parks in its last position (see _prefill).
        combined = ForwardBatch.build(
            torch.cat([batch.tokens, tokens]), torch.cat([batch.positions, positions]),
            torch.cat([batch.slots, slots]), torch.cat([batch.write_pos, positions.clamp(max=self.kv_capacity - 1)]),
            torch.cat([batch.prefix_len, starts]), torch.cat([batch.region_mask, causal_region(lengths, n)]),
            kv_len=max(batch.kv_len, min(max(row_starts) + n, self.kv_capacity)))
        return combined, [len(f) for f in feeds], last

    def _prompt_outputs(self, logits: torch.Tensor, aux: torch.Tensor | None, lengths: list[int],
                        last: list[int]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The prompt rows' logits [R, n, V] and aux [R, n, A] -> each chunk's logits after its last
        token [L, V] and its hidden-state rows (its rows' positions in order)."""
        cols = [lengths[r] - 1 for r in last]
        last_logits = logits[upload_list(last, self.device), upload_list(cols, self.device)]
        if aux is None:
            return last_logits, None
        firsts = [0] + [r + 1 for r in last[:-1]]
        return last_logits, [aux[lo:hi + 1].flatten(0, 1) for lo, hi in zip(firsts, last)]
