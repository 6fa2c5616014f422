"""How full the batch stays under a choice, for `--mode auto`: slots that requests leave empty.

When clients send their next request only after the last one ended (a closed loop: chat
sessions, agents, the sweep's clients), each request that ends leaves its slot empty for a few
steps: the client receives the last token and sends the next prompt, which waits for the step
under way and is then prefilled. A choice that commits t tokens a step per request ends requests
t times as often as mode off, so it keeps fewer slots filled: over the middle of the H200's waves
at C = 64 (8B), chain k=4's batch averaged 56.9 and mode off's 62.0, and auto, pricing both at the
batch in front of it, ran chain k=4 at 0.83 of off. Where a queue refills each slot at once the
gap is a step and costs little.

`Vacancies` measures the gap: each request that ends is matched, first come first served, with
the next admission. An ending that no admission follows within `expiry` steps, or before the batch
empties, is dropped: the load fell, and a prompt admitted into an empty batch refills no slot that
a running batch did without (the sweep's clients end their last requests along a wave's tail and
start the next wave together: matched, those endings made the median gap 4-6 steps at the H100's
C = 32 and 7 at 64, where it read 2-3 inside C = 16's waves). `occupancy` turns it into the share
of a full batch a choice keeps busy.
"""

from __future__ import annotations

import statistics
from collections import deque


class Vacancies:
    def __init__(self, window: int = 64, expiry: int = 64, min_samples: int = 8) -> None:
        self.open: deque = deque()                   # steps at which requests ended, not yet matched
        self.gaps: deque = deque(maxlen=window)      # steps from an ending to the admission that matched it
        self.expiry, self.min_samples = expiry, min_samples
        self.median: float | None = None             # of the gaps, until they change (a plan asks per choice)

    def ended(self, step: int) -> None:
        self._expire(step)
        self.open.append(step)

    def admitted(self, step: int, n: int, into_empty: bool = False) -> None:
        """n requests were admitted at `step` (each the first to fill a slot that an ending left);
        into_empty: no request was running (the endings before it are dropped)."""
        if into_empty:
            self.open.clear()
        self._expire(step)
        for _ in range(min(n, len(self.open))):
            self.gaps.append(step - self.open.popleft())
            self.median = None

    def _expire(self, step: int) -> None:
        while self.open and step - self.open[0] > self.expiry:
            self.open.popleft()

    def steps(self) -> float:
        """Steps from an ending to the admission that refilled its slot, the median of the last ones
        (a wave's end, whose slots wait for every client to finish, must not stand for the rest;
        0 until measured)."""
        if len(self.gaps) < self.min_samples:
            return 0.0
        if self.median is None:
            self.median = float(statistics.median(self.gaps))
        return self.median


def occupancy(tokens_per_request: float, gap_steps: float, length: float | None) -> float:
    """The share of a full batch kept busy by a choice committing `tokens_per_request` a step, when
    each ending leaves its slot `gap_steps` steps from the admission that refills it, for requests
    of `length` tokens: a slot cycles through length / t busy steps and the gap, where the admission
    step itself commits one token (a whole step's worth for mode off, 1 / t of one for a choice that
    commits t). Little's law over the slots: busy / (busy + empty)."""
    if not gap_steps or not length:
        return 1.0
    t = max(1.0, tokens_per_request)
    empty = max(0.0, gap_steps - 1.0) + (1.0 - 1.0 / t)
    return (length / t) / (length / t + empty)
