"""What each kind of step (off, speculating) really delivered against what its plans expected, for `--mode auto`.

The policy prices a choice from parts: clean step times (StepCalibration), accepted drafts
(TokenCalibration), what a prompt adds to a step of each kind (StepOverheads) and how full the
batch stays (occupancy). Each part is measured, but the sum can still miss: a step's prefill is
shared between groups admitted under different kinds, a drafter catches up on prompts the
verifier prefilled steps before, rows released on a switch travel in the next step. On the H100
(8B + EAGLE-3 head, a = 0.8, C = 64, closed loop) auto expected 4,600 tok/s of chain k=2 and 4,000
of off; its speculating spells delivered ~3,500 and mode off ran 4,400, so auto ran at 0.83x of off.

`RealizedRates` keeps, per kind and batch bucket, the tokens that steps committed against the
tokens their plans' expected rate promised over the same seconds (every step run under one plan,
admissions and prefills included: that is where the parts miss), and the policy scales each
plan's expected rate by that ratio. A switch from off is charged to the kind switched to: the
step that runs requests off while their held hidden states travel, and the drafter's catch-up on
them after (~250 ms together at 64 requests on the H100). So switches are priced over the spells
auto really runs: when it flaps, each short spell carries a whole switch, and speculation's ratio
falls until it stops (auto flapped at C = 64 between off and chain k=4, each kind's own steps
delivering more than expected, and ran at 0.81x of off). The evidence shrinks toward the model's
own figure (ratio 1) while it is thin, and its weight halves every `half_life` steps, so a kind
that lost at a batch size is tried there again, rarely, once the load or the costs may have
changed.
"""

from __future__ import annotations

from gateway.auto.costs import bucket


class RealizedRates:
    def __init__(self, half_life: int = 512, prior_seconds: float = 0.25) -> None:
        """half_life: steps (all kinds) over which a sample's weight halves; prior_seconds: measured
        seconds that count as much as the model's own figure (with less, the ratio moves partway)."""
        self.half_life, self.prior_seconds = half_life, prior_seconds
        self.steps = 0
        self.sums: dict[tuple[bool, int], list[float]] = {}   # (speculating, bucket) -> [step, tokens, expected, s]

    def tick(self) -> None:
        """One step of any kind has run."""
        self.steps += 1

    def observe(self, speculating: bool, batch: int, expected_rate: float, seconds: float, tokens: float) -> None:
        """A step run under one plan of this kind at this batch size: the plan's expected tokens a
        second, what the step took and what it committed."""
        if expected_rate <= 0 or seconds <= 0:
            return
        sums = self._decayed((speculating, bucket(batch)))
        sums[1] += tokens
        sums[2] += expected_rate * seconds
        sums[3] += seconds

    def ratio(self, speculating: bool, batch: int) -> float:
        """Delivered over expected tokens for this kind at this batch size (1: nothing measured)."""
        key = (speculating, bucket(batch))
        if key not in self.sums:
            return 1.0
        _, tokens, expected, seconds = self._decayed(key)
        weight = seconds / (seconds + self.prior_seconds)
        return 1.0 + weight * (tokens / expected - 1.0)   # expected > 0: observe takes no rate of 0

    def _decayed(self, key: tuple[bool, int]) -> list[float]:
        sums = self.sums.setdefault(key, [self.steps, 0.0, 0.0, 0.0])
        keep = 0.5 ** ((self.steps - sums[0]) / self.half_life)
        sums[0] = self.steps
        for i in (1, 2, 3):
            sums[i] *= keep
        return sums
