"""What arriving prompts add to the steps of each `--mode auto` choice.

A step that admits prompts costs more than a clean one: the verifier prefills them in an eager
forward of their own (no CUDA graph fits a prompt), and a speculating request's first draft has
its drafter take in the whole prompt (the catch-up). Those steps are left out of the calibration
(StepCalibration measures clean steps), so without this the policy never sees them. On the H200
closed loop at a = 0.8, C = 32 auto measured chain k=4 at ~28 ms a clean step; every step it ran
averaged ~37 ms, because requests ending every ~19 steps brought a prompt into most steps; mode
off saw one in a third of its steps, at half the extra cost. Auto ran chain at 0.86x of off.

The model: prompts arrive at `rate` per committed token (measured: admissions over tokens,
decayed; 1/L in a closed loop of L-token requests, and about that in an open loop the server
keeps up with). A step expected to commit T tokens admits at least one prompt with probability
1 - exp(-rate * T) (arrivals as a Poisson stream over the tokens), and such a step costs the
measured extra of its kind: a prefill step's time over the calibrated clean time of its plan,
per kind (off, speculating), plus for speculating choices the drafter's catch-up over the
profile's price of the draft. Each extra is the median of its recent samples (a wave of 32
prompts prefilled at once is one sample, not the rule); a kind not yet measured borrows off's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

OFF_KIND, SPECULATING_KIND = "off", "speculating"


class AdmissionCosts:
    def __init__(self, decay: float = 0.99, window: int = 16) -> None:
        """decay: per step, of the admission and token counts; window: extra-time samples kept per kind."""
        self.decay = decay
        self.admitted = 0.0       # decayed prompts admitted
        self.tokens = 0.0         # decayed tokens committed
        self.prefill_extra = {OFF_KIND: deque(maxlen=window), SPECULATING_KIND: deque(maxlen=window)}
        self.catch_up_extra: deque = deque(maxlen=window)

    def observe_step(self, admitted: int, committed: int) -> None:
        """Every step: prompts it admitted, tokens it committed (all sequences)."""
        self.admitted = self.admitted * self.decay + admitted
        self.tokens = self.tokens * self.decay + committed

    def observe_prefill(self, speculating: bool, extra_seconds: float) -> None:
        """A step that prefilled took `extra_seconds` more than its plan's clean step."""
        self.prefill_extra[SPECULATING_KIND if speculating else OFF_KIND].append(max(0.0, extra_seconds))

    def observe_catch_up(self, extra_seconds: float) -> None:
        """A draft step whose drafter took in tokens it had not seen took this much over its price."""
        self.catch_up_extra.append(max(0.0, extra_seconds))

    @property
    def rate(self) -> float:
        """Prompts admitted per committed token."""
        return self.admitted / self.tokens if self.tokens > 0 else 0.0

    def extra(self, speculating: bool) -> float:
        """Seconds a step of this kind pays when it admits prompts."""
        off = self.prefill_extra[OFF_KIND]
        own = self.prefill_extra[SPECULATING_KIND] if speculating else off
        prefill = statistics.median(own) if own else statistics.median(off) if off else 0.0
        catch_up = statistics.median(self.catch_up_extra) if speculating and self.catch_up_extra else 0.0
        return prefill + catch_up

    def surcharge(self, tokens: float, speculating: bool) -> float:
        """Expected seconds a step committing `tokens` adds for the prompts arriving meanwhile."""
        rate = self.rate
        if rate <= 0.0:
            return 0.0
        return -math.expm1(-rate * tokens) * self.extra(speculating)
