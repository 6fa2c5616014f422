"""Chunked prefill: which prompt tokens enter the KV cache in this engine step.

At most `chunk` prompt tokens are prefilled per step over all sequences (0: whole prompts), first
come first served, so a long prompt arriving delays the running streams' steps by at most one
chunk's forward each, instead of by its whole prefill. A sequence is answered (its first token)
in the step its last chunk runs. Sequences opened in the same step with the same prompt
(`share_prefill_with`) ride on their leader's prefill and get a copy of its KV when it completes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.sequence_table import SequenceState


@dataclass
class Prefilling:
    state: SequenceState
    done: int = 0                                                      # prompt tokens in the KV cache
    followers: list[SequenceState] = field(default_factory=list)       # same prompt: KV copied at the end
    hidden: list[torch.Tensor] = field(default_factory=list)           # EAGLE-3 rows of done chunks (host)

    @property
    def remaining(self) -> int:
        return len(self.state.tokens) - self.done


@dataclass(frozen=True)
class Chunk:
    entry: Prefilling
    start: int
    end: int

    @property
    def completes(self) -> bool:
        return self.end == len(self.entry.state.tokens)


class PrefillQueue:
    def __init__(self, chunk: int) -> None:
        if chunk < 0:
            raise ValueError(f"prefill chunk {chunk} must be >= 0 (0: whole prompts)")
        self.chunk = chunk
        self._entries: dict[str, Prefilling] = {}      # leader seq id -> its prefill, in arrival order
        self._follower_of: dict[str, str] = {}         # follower seq id -> leader seq id

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._entries or seq_id in self._follower_of

    def add(self, opened: list[tuple[SequenceState, str]]) -> None:
        """opened: (sequence, the id of the one opened in the same step it may share a prompt with)."""
        by_id = {s.seq_id: s for s, _ in opened}
        for s, share in opened:
            lead = by_id.get(share)
            if lead is not None and lead is not s and lead.tokens == s.tokens and lead.seq_id in self._entries:
                self._entries[lead.seq_id].followers.append(s)
                self._follower_of[s.seq_id] = lead.seq_id
            else:
                self._entries[s.seq_id] = Prefilling(s)

    def drop(self, seq_id: str) -> None:
        """A sequence closed mid-prefill; a leader's first follower takes over its prompt."""
        lead = self._follower_of.pop(seq_id, None)
        if lead is not None:
            entry = self._entries[lead]
            entry.followers = [f for f in entry.followers if f.seq_id != seq_id]
            return
        entry = self._entries.pop(seq_id, None)
        if entry is not None and entry.followers:
            heir, *rest = entry.followers
            del self._follower_of[heir.seq_id]
            self._entries[heir.seq_id] = Prefilling(heir, followers=rest)
            for f in rest:
                self._follower_of[f.seq_id] = heir.seq_id

    def take(self) -> list[Chunk]:
        """This step's chunks, oldest prompts first, `chunk` tokens in all (at least one token)."""
        budget = self.chunk or sum(e.remaining for e in self._entries.values())
        chunks = []
        for entry in self._entries.values():
            if budget <= 0:
                break
            size = min(entry.remaining, budget)
            chunks.append(Chunk(entry, entry.done, entry.done + size))
            budget -= size
        return chunks

    def advance(self, chunks: list[Chunk]) -> None:
        """The chunks ran: their tokens are in the KV cache; completed prompts leave the queue."""
        for c in chunks:
            c.entry.done = c.end
            if c.completes:
                del self._entries[c.entry.state.seq_id]
                for f in c.entry.followers:
                    del self._follower_of[f.seq_id]


def chunk_rows(chunks: list[Chunk], width: int) -> tuple[list[list[int]], list[int], list[int], list[int]]:
    """The chunks' tokens cut into rows of at most `width`, to ride in a verify forward whose rows are
    that wide (each row a causal region after the KV its earlier rows write in the same forward)
    -> (each row's tokens, its first KV position, its slot; each chunk's last row)."""
    tokens: list[list[int]] = []
    starts: list[int] = []
    slots: list[int] = []
    last: list[int] = []
    for c in chunks:
        state = c.entry.state
        for lo in range(c.start, c.end, width):
            tokens.append(state.tokens[lo:min(lo + width, c.end)])
            starts.append(lo)
            slots.append(state.slot)
        last.append(len(tokens) - 1)
    return tokens, starts, slots, last
