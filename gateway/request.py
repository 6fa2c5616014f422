"""A validated generation request and the live state the scheduler keeps for it."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from specdec.tree import DraftTree


class Mode(str, enum.Enum):
    CHAIN = "chain"
    TREE = "tree"
    OFF = "off"


@dataclass(frozen=True)
class SpecSettings:
    mode: Mode
    k: int = 4
    overlap: bool = True
    topk: int = 4
    depth: int = 4
    budget: int = 16


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop: list[str]
    stop_at_eos: bool
    spec: SpecSettings


class InvalidRequest(ValueError):
    """Bad input: the message says what to fix (mapped to INVALID_ARGUMENT)."""


@dataclass
class Stats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    committed_by_steps: int = 0
    overlap_hits: int = 0
    overlap_misses: int = 0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_by_steps / self.steps if self.steps else 0.0


@dataclass
class Event:
    """What the scheduler tells a request's RPC handler."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None          # set on the last event
    error: tuple[str, str] | None = None      # (grpc status name, message)


@dataclass
class ActiveRequest:
    req: GenerationRequest
    seq_id: str
    mode: Mode
    detok: object                              # IncrementalDetokenizer
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated
    verifier: str = ""                          # replica address this request is pinned to
    drafter: str | None = None                  # drafter replica address (None: no speculation)
    drafter_len: int = 0                        # committed tokens the drafter has been sent
    draft: DraftTree | None = None              # ready for the next verify, made from len(tokens)
    predraft: DraftTree | None = None           # chain overlap: made assuming the in-flight draft passes
    stats: Stats = field(default_factory=Stats)
    cancelled: bool = False
    finished: bool = False

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)
