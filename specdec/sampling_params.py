"""A sequence's sampling parameters and their validation (no torch here: the gateway imports it;
specdec/sampling.py computes with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def problem(self) -> str | None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            return f"temperature={self.temperature} must be a finite number >= 0"
        if not 0.0 <= self.top_p <= 1.0:
            return f"top_p={self.top_p} must be in [0, 1]"
        if self.top_k < 0:
            return f"top_k={self.top_k} must be >= 0"
        return None


GREEDY = SamplingParams()
