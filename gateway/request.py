"""A validated generation request and the live state the scheduler keeps for it."""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.draft_tree import DraftTree
from specdec.sampling_params import SamplingParams

GOLDEN = 0x9E3779B97F4A7C15  # spreads the seeds of a request's samples over 64 bits


class Mode(str, enum.Enum):
    CHAIN = "chain"
    TREE = "tree"
    OFF = "off"
    AUTO = "auto"    # a request's mode only: each step the policy picks one of the others


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
    sampling: SamplingParams  # seed = the request's seed; sample i uses sample_seed(i)
    n: int = 1

    def sample_seed(self, index: int) -> int:
        return (self.sampling.seed + index * GOLDEN) % (1 << 64)


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
    steps_by_mode: Counter = field(default_factory=Counter)   # auto: verify steps per choice name

    @property
    def mean_accepted_length(self) -> float:
        return self.committed_by_steps / self.steps if self.steps else 0.0


@dataclass
class Event:
    """What the scheduler tells a request's RPC handler."""

    sample_index: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str | None = ""                     # None: not decoded yet (the handler decodes token_ids)
    finish_reason: str | None = None          # set on the last event
    error: tuple[str, str] | None = None      # (grpc status name, message)


@dataclass
class PreDraft:
    """Chain overlap's pre-draft, made while the draft is verified: `tree` assumes the whole draft
    passes (its first token guesses the bonus token); `hedges`, from a drafter that hedges, assume
    that only the first j draft tokens pass (first token: the guessed correction). Hedges stay as
    received (anything with `token_ids`, e.g. protobuf) until one is used: `convert` makes that one a
    DraftTree, so a step does not convert the k hedges of every request to use at most one."""
    tree: DraftTree
    hedges: dict[int, Any] = field(default_factory=dict)
    convert: Callable[[Any], DraftTree] = lambda tree: tree

    def next_draft(self, accepted_drafts: int, drafted: int, last: int) -> DraftTree | None:
        """The next step's draft if the verdict (accepted_drafts of drafted tokens, then `last`, the
        bonus or correction token) is one the pre-draft foresaw, else None."""
        guess = self.tree if accepted_drafts == drafted else self.hedges.get(accepted_drafts)
        if guess is None or len(guess.token_ids) < 2 or guess.token_ids[0] != last:
            return None
        return (guess if guess is self.tree else self.convert(guess)).suffix(1)


@dataclass
class ActiveRequest:
    req: GenerationRequest
    seq_id: str
    mode: Mode
    detok: object                              # IncrementalDetokenizer
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # shared by a request's samples
    sample_index: int = 0
    sampling: SamplingParams | None = None     # this sample's parameters (its own seed)
    prefill_leader: str = ""                   # seq id of sample 0: share its prefill
    tokens: list[int] = field(default_factory=list)  # committed: prompt + generated
    verifier: str = ""                          # replica address this request is pinned to
    drafter: str | None = None                  # drafter replica address (None: no speculation)
    drafter_len: int = 0                        # committed tokens the drafter has been sent
    # The shape drafts are made with: the request's own, or what `--mode auto` chose this step.
    settings: SpecSettings | None = None
    auto: bool = False                          # mode auto: `mode` and `settings` change per step
    # auto, admitted while auto had settled on off with a drafter that needs the verifier's hidden
    # states: it runs as mode off for life, without them and without drafter state (cost: see
    # AutoController.admit)
    parked: bool = False
    scout: bool = False                         # auto kept it ready to draft while settled off (probes use it)
    choice: str = ""                            # auto: the name of this step's choice
    draft_family: str = ""                      # acceptance family of `draft` ("chain" or a tree shape)
    draft: DraftTree | None = None              # ready for the next verify, made from len(tokens)
    predraft: PreDraft | None = None            # chain overlap: made while the draft is verified
    # EAGLE-3: the verifier's hidden-state rows (TensorPayload) of committed tokens not yet sent to
    # the drafter -- they travel with the next item's append_ids.
    hidden_rows: list = field(default_factory=list)
    rows_held: bool = False                     # the verifier keeps its hidden states (auto ran it off)
    stats: Stats = field(default_factory=Stats)
    cancelled: bool = False
    finished: bool = False
    opening: bool = False                       # admitted; the verdict of its prefill is due
    queued_at_step: int = 0                     # the scheduler's step number when it joined the queue
    resumes: int = 0                            # times it moved to a new verifier after losing one

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = self.req.spec
        if self.mode == Mode.AUTO:
            self.auto = True

    @property
    def speculates(self) -> bool:
        """It drafts now or may later (auto): it keeps its drafter state and hidden states."""
        return (self.auto and not self.parked) or self.mode != Mode.OFF

    @property
    def drafter_lag(self) -> int:
        """Committed tokens the drafter has not been sent yet (with an EAGLE-3 drafter, also the most
        hidden-state rows the verifier may hold for this request)."""
        return len(self.tokens) - self.drafter_len

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt_ids)
