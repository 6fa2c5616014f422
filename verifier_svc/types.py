"""Plain dataclasses for one verifier step (the servicer converts them from/to protobuf)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import SequenceError
from specdec.sampling import GREEDY, SamplingParams
from specdec.tree import DraftTree


@dataclass
class OpenSequence:
    seq_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = GREEDY
    share_prefill_with: str = ""  # a sequence opened in the same step with the same prompt


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


@dataclass
class Verdict:
    seq_id: str
    committed_len: int
    accepted_ids: list[int]  # accepted draft tokens, then the bonus token
    accepted_drafts: int


@dataclass
class VerifierStepResult:
    step: int
    verdicts: list[Verdict] = field(default_factory=list)
    errors: list[SequenceError] = field(default_factory=list)
