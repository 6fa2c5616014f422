"""What a switch from off to speculation costs before its first draft, for `--mode auto`.

While auto runs a request off, the drafter falls behind it: every token committed meanwhile (and
with an EAGLE-3 drafter, its hidden states, which the verifier holds until then) must reach the
drafter before it drafts again. A switch therefore pays once: the steps that release held rows run
slower than plain off steps, and the first drafting step waits for the drafter's catch-up. At 64
requests that is ~250 ms on the H100 (8B + EAGLE-3 head), against a gain of a few percent a step
where speculation barely pays: a spell shorter than a few seconds loses. On stand-ins with the
H100's costs (C = 64, a = 0.8) auto switched to chain k=2 with overlap on a predicted +10% (its
clean steps gave +4%), its catch-up took 138 ms, and the closed loop ran at 0.85x of off.

`SwitchCost` learns the seconds per row caught up from every catch-up it sees (probes, prompts
joining a speculating batch, switches), the release steps' excess over a plain off step counted
with the catch-up that follows them. The policy then prices a switch from off by how much of the
requests' remaining time it eats (AutoPolicy._switch_share). Until a catch-up is seen it prices
switches at nothing, as before.
"""

from __future__ import annotations


class SwitchCost:
    def __init__(self, decay: float = 0.8) -> None:
        """decay: the weight an earlier catch-up keeps at each new one (recent costs count most)."""
        self.decay = decay
        self.excess = 0.0    # decayed sum of catch-ups' extra seconds
        self.rows = 0.0      # decayed sum of the rows they took in
        self.pending = 0.0   # release steps' extra seconds, waiting for their catch-up

    def released(self, extra_seconds: float) -> None:
        """A step that ran requests off while their held rows travelled took this much over a plain off step."""
        self.pending += max(0.0, extra_seconds)

    def caught_up(self, rows: int, extra_seconds: float) -> None:
        """A step whose drafter took in `rows` tokens committed while their requests did not draft
        waited `extra_seconds` for them over what its drafts take without (with any release before it)."""
        if rows <= 0:
            return
        self.excess = self.decay * self.excess + self.pending + max(0.0, extra_seconds)
        self.rows = self.decay * self.rows + rows
        self.pending = 0.0

    @property
    def per_row(self) -> float:
        return self.excess / self.rows if self.rows else 0.0

    def seconds(self, rows: int) -> float:
        """The expected one-off cost of bringing the drafter up to date on `rows` tokens."""
        return self.per_row * rows
