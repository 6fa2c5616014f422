"""Per-sequence errors reported inside a step (the rest of the step goes on), and the mark of a
step that failed as a whole."""

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


# Trailing metadata of a Step stream that a service ended because its step failed (a bug, not a
# lost process): the gateway fails that step's requests rather than resuming them elsewhere. A
# status code alone cannot tell: gRPC also reports INTERNAL when it cannot write to a process
# that just died ("Failed execute_batch").
STEP_FAILED_KEY = "specdec-step-failed"
