"""What a switch from off to speculation costs per token the drafter has to catch up.

While auto runs a request off, its drafter takes in nothing of it (with an EAGLE-3 drafter the
verifier holds its hidden states: gateway/release_budget.py). The step before it drafts again
releases them (one verdict carrying every held row) and its first draft step feeds them all to the
drafter: costs no steady step shows. On the H100 at C = 64 (run 7, BENCHMARKS.md) a switch of 64
requests ~100 tokens behind took ~250 ms (a release step of up to 124 ms and a catch-up step of 154
against ~28 ms), and auto, comparing steady rates only, switched for spells too short to win that
back. SwitchCost learns the seconds per token caught up from those steps' excess over what they
would have taken without it; the policy charges each request that would switch its lag at that
price, spread over the steps it has left (AutoPolicy._score).
"""

from __future__ import annotations


class SwitchCost:
    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight      # of the newest sample in the running estimate
        self.per_token = 0.0      # seconds per token caught up (0: no switch measured yet)

    def observe(self, excess_seconds: float, tokens: int) -> None:
        """A release or catch-up step took `excess_seconds` over its clean price for `tokens` tokens
        the drafter had not taken in."""
        if tokens <= 0:
            return
        sample = max(0.0, excess_seconds) / tokens
        self.per_token = sample if self.per_token == 0 else (1 - self.weight) * self.per_token + self.weight * sample
