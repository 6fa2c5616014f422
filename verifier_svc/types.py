"""Plain dataclasses for one verifier step (the servicer converts them from/to protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.errors import SequenceError
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import DraftTree


@dataclass
class OpenSequence:
    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = GREEDY
    share_prefill_with: str = ""  # a sequence opened in the same step with the same prompt
    want_hidden: bool = False     # verdicts carry hidden states (when the engine has aux layers)


@dataclass
class VerifyItem:
    seq_id: str
    committed_len: int
    draft: DraftTree


@dataclass
class VerifierStep:
    step: int
    open: list[OpenSequence] = field(default_factory=list)
    verify: list[VerifyItem] = field(default_factory=list)
    close: list[str] = field(default_factory=list)
    stop_hidden: list[str] = field(default_factory=list)   # verdicts no longer carry their hidden states
    hold_hidden: list[str] = field(default_factory=list)   # this step's rows kept until a step without


@dataclass
class Verdict:
    seq_id: str
    committed_len: int
    accepted_ids: list[int]  # accepted draft tokens, then the bonus token
    accepted_drafts: int
    # With aux layers configured: the target's hidden states [tokens, layers * hidden] (host) of
    # the positions this step computed and committed -- a prefill's prompt, a verify step's root
    # and accepted draft nodes: the positions just before each new token (EAGLE-3 drafts from them).
    hidden: torch.Tensor | None = None


@dataclass
class VerifierStepResult:
    step: int
    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[SequenceError] = field(default_factory=list)
