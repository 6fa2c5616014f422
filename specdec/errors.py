"""Per-sequence errors reported inside a step (the rest of the step goes on)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ErrorCode(enum.IntEnum):  # values match specdec.v1.SequenceError.Code
    UNKNOWN = 0
    STALE = 1
    NOT_FOUND = 2
    INVALID = 3
    OUT_OF_CAPACITY = 4


@dataclass
class SequenceError:
    seq_id: str
    code: ErrorCode
    message: str
