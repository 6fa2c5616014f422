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
delivering more than expected, and ran at 0.81x of off). The evidence shrinks toward a prior
while it is thin (the model's own figure, or the other kind's ratio where that is above 1; see
`ratio`), and its weight halves every `half_life` steps, so a kind
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
        self.cached: dict[tuple[bool, int], float] = {}       # ratios since the last step (a plan asks per choice)

    def tick(self) -> None:
        """One step of any kind has run."""
        self.steps += 1
        self.cached.clear()

    def observe(self, speculating: bool, batch: int, expected_rate: float, seconds: float, tokens: float) -> None:
        """A step run under one plan of this kind at this batch size: the plan's expected tokens a
        second, what the step took and what it committed."""
        if expected_rate <= 0 or seconds <= 0:
            return
        sums = self._decayed((speculating, bucket(batch)))
        sums[1] += tokens
        sums[2] += expected_rate * seconds
        sums[3] += seconds
        self.cached.clear()

    def ratio(self, speculating: bool, batch: int) -> float:
        """Delivered over expected tokens for this kind at this batch size, its evidence shrunk toward
        a prior while thin: the other kind's ratio here where that is above 1, else 1 (the model's
        own figure). Errors the two kinds share (how full the batch stays, what a wave's prefill
        costs) then do not favour the kind that has run here over the one that has not: on the H100
        (a = 0.8) auto came to C = 48-64 speculating, chain k=4 delivered 1.29 times its plans there,
        off had never run there, its figure stayed 1, and auto speculated at 0.84-0.86x of off. Not
        below 1: a kind that delivered less than priced must not hold back the one not yet tried."""
        key = (speculating, bucket(batch))
        if key not in self.cached:
            other = self._own(not speculating, key[1])
            prior = max(1.0, 1.0 + other[1] * (other[0] - 1.0)) if other else 1.0
            own = self._own(*key)
            self.cached[key] = prior + own[1] * (own[0] - prior) if own else prior
        return self.cached[key]

    def _own(self, speculating: bool, b: int) -> tuple[float, float] | None:
        """(delivered / expected, the evidence's weight against the prior) of a kind at a bucket."""
        if (speculating, b) not in self.sums:
            return None
        _, tokens, expected, seconds = self._decayed((speculating, b))
        return tokens / expected, seconds / (seconds + self.prior_seconds)   # expected > 0: observe takes no rate of 0

    def _decayed(self, key: tuple[bool, int]) -> list[float]:
        sums = self.sums.setdefault(key, [self.steps, 0.0, 0.0, 0.0])
        keep = 0.5 ** ((self.steps - sums[0]) / self.half_life)
        sums[0] = self.steps
        for i in (1, 2, 3):
            sums[i] *= keep
        return sums
