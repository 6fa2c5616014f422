"""Sequences an engine holds: id -> KV slot and committed tokens, with admission checks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import ErrorCode, SequenceError
from specdec.model.batch import upload_list
from specdec.sampling import GREEDY, SamplingParams


@dataclass
class SequenceState:
    seq_id: str
    slot: int
    tokens: list[int]           # committed tokens (prompt + generated)
    kv_tokens: list[int] = field(default_factory=list)  # tokens whose KV entries are stored, in order
    kv_synced: int = 0          # leading kv_tokens known to equal committed tokens (drafter catch-up)
    sampling: SamplingParams = GREEDY


class SequenceTable:
    def __init__(self, num_slots: int, vocab_size: int, max_context: int) -> None:
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.vocab_size = vocab_size
        self.opened = 0  # sequences opened since start
        self.max_context = max_context
        self._seqs: dict[str, SequenceState] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, seq_id: str) -> SequenceState | None:
        return self._seqs.get(seq_id)

    def open(self, seq_id: str, tokens: list[int]) -> SequenceState | SequenceError:
        if seq_id in self._seqs:
            return SequenceError(seq_id, ErrorCode.INVALID, f"sequence {seq_id!r} is already open")
        problem = self.token_problem(tokens)
        if problem:
            return SequenceError(seq_id, ErrorCode.INVALID, problem)
        if len(tokens) >= self.max_context:
            return SequenceError(
                seq_id, ErrorCode.OUT_OF_CAPACITY,
                f"prompt has {len(tokens)} tokens; the context holds {self.max_context} (prompt + output)",
            )
        if not self._free_slots:
            return SequenceError(seq_id, ErrorCode.OUT_OF_CAPACITY, f"all {self.num_slots} KV slots are busy")
        state = SequenceState(seq_id, self._free_slots.pop(), list(tokens))
        self.opened += 1
        self._seqs[seq_id] = state
        return state

    def close_all(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            self.close(sid)

    @staticmethod
    def slots(states: list[SequenceState], device: torch.device) -> torch.Tensor:
        """[B] int64 KV slots of the given sequences."""
        return upload_list([s.slot for s in states], device)

    def close(self, seq_id: str) -> bool:
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._free_slots.append(state.slot)
        return state is not None

    def token_problem(self, tokens: list[int]) -> str | None:
        if not tokens:
            return "the prompt is empty"
        bad = next((t for t in tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            return f"token id {bad} is outside the vocabulary [0, {self.vocab_size})"
        return None
